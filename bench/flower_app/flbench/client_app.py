"""ClientApp: the same local training as the mesh's TorchClientApp (fl.torch_support, same seeds).

Writes one JSON line per round to ``<out-dir>/flower-clients.jsonl`` with its local training
time, so the benchmark can subtract training from round time exactly as on the mesh side.
"""

import json
import os
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl.client import client_seed
from fl.data import load_client_data
from fl.models import MLP
from fl.torch_support import get_weights, set_weights, train_supervised

app = ClientApp()
torch.set_num_threads(1)


@app.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    rc = context.run_config
    X, y = load_client_data(pid, n, scheme="dirichlet", alpha=float(rc["alpha"]), seed=0)
    model = MLP()
    set_weights(model, msg.content["arrays"].to_numpy_ndarrays())
    rnd = int(msg.content["config"]["server-round"])
    # bench/fl.py passes each partition's mesh endpoint id, so both sides draw the same batches
    seed = client_seed(int(rc["seed"]), rnd, str(context.node_config.get("seed-key", f"partition-{pid}")))
    metrics = train_supervised(model, X, y, epochs=int(rc["local-epochs"]), batch_size=int(rc["batch-size"]),
                               lr=float(rc["lr"]), seed=seed, device=torch.device("cpu"))
    out_dir = str(rc.get("out-dir") or "")
    if out_dir:
        line = json.dumps({"round": rnd, "partition": pid, "train_s": metrics["train_time_s"],
                           "handler_s": time.perf_counter() - t0, "end": time.time()})
        with open(os.path.join(out_dir, "flower-clients.jsonl"), "a") as fh:
            fh.write(line + "\n")
    content = RecordDict({"arrays": ArrayRecord(get_weights(model)),
                          "metrics": MetricRecord({"num-examples": len(y), "train-loss": metrics["loss"]})})
    return Message(content=content, reply_to=msg)
