"""ServerApp: FedAvg over all SuperNodes, central evaluation on the held-out digits after every
round (timestamped into ``<out-dir>/flower-rounds.jsonl``), no federated evaluation (the mesh
side has none either)."""

import json
import os
import time

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl.data import load_test_data
from fl.models import MLP
from fl.torch_support import evaluate_supervised, get_weights, set_weights

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    torch.set_num_threads(1)
    rc = context.run_config
    out_dir = str(rc.get("out-dir") or "")
    n_nodes = int(rc.get("num-nodes", 5))
    torch.manual_seed(int(rc["seed"]))
    model = MLP()
    X, y = load_test_data()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_weights(model, arrays.to_numpy_ndarrays())
        loss, acc = evaluate_supervised(model, X, y, device=torch.device("cpu"))
        if out_dir:
            with open(os.path.join(out_dir, "flower-rounds.jsonl"), "a") as fh:
                fh.write(json.dumps({"round": server_round, "t": time.time(), "loss": loss, "accuracy": acc}) + "\n")
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n_nodes, min_available_nodes=n_nodes)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(get_weights(model)), num_rounds=int(rc["num-server-rounds"]),
                   evaluate_fn=evaluate)
