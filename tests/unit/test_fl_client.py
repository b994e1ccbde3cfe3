"""What runs on an endpoint: the torch client app (shipped like any mesh function), the
function app, the gateway aggregator, task checks; and the driver's refusal of bad updates."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fl.client import FunctionClientApp, GatewayAggregator, TaskError, TrainerConfig
from fl.federation import Federation
from fl.strategies import ClientUpdate, FedAvg, weighted_average
from fl.wire import decode_weights, encode_weights
from mesh_agent.datasets import ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME, export_worker_env
from mesh_agent.protocol import deserialize, deserialize_function, serialize, serialize_function


@pytest.fixture
def on_endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """This process plays endpoint ep-1 holding digits partition 0 of 5."""
    from fl import datasets

    for k in (ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME):
        monkeypatch.setenv(k, "")
    datasets.clear_cache()
    export_worker_env("ep-1", "pi-1", {"digits": {"loader": "fl.datasets:digits", "kwargs": {"index": 0, "num_clients": 5}}}, tmp_path)
    yield
    datasets.clear_cache()


def _task(weights, kind="train", client="ep-1", **extra):
    t = {"v": 1, "kind": kind, "run_id": "flr-x", "round": 3, "client_id": client, "base_version": 2,
         "weights": encode_weights(weights), "dataset": "digits", "config": {"local_epochs": 1}}
    t.update(extra)
    return t


def test_torch_app_ships_without_weights_and_trains_on_the_endpoint(on_endpoint) -> None:
    torch = pytest.importorskip("torch")
    from fl.client import TorchClientApp
    from fl.models import MLP

    torch.manual_seed(0)
    app = TorchClientApp(MLP(), TrainerConfig(threads=1, lr=0.1))
    body = serialize_function(app)
    assert len(body) < 4000  # architecture and settings only: the weights travel per round
    remote = deserialize_function(body)  # what the agent's worker does
    w0 = app.initial_weights()
    ready = remote(_task(w0, kind="warmup"))
    assert ready["kind"] == "ready" and ready["num_samples"] > 0 and ready["device"] == "cpu"
    out = deserialize(serialize(remote(_task(w0))))  # and the result crosses the wire
    assert out["kind"] == "update" and out["client_id"] == "ep-1" and out["round"] == 3 and out["base_version"] == 2
    w1 = decode_weights(out["weights"])
    assert [a.shape for a in w1] == [a.shape for a in w0] and not np.allclose(w1[0], w0[0])
    assert out["num_samples"] == ready["num_samples"] and 0 <= out["metrics"]["accuracy"] <= 1
    # same task again: deterministic (seeded per run, round and client)
    again = decode_weights(remote(_task(w0))["weights"])
    assert all(np.array_equal(a, b) for a, b in zip(w1, again))
    # FedProx: the proximal term keeps the weights closer to the global model
    prox = decode_weights(remote(_task(w0, config={"local_epochs": 1, "proximal_mu": 10.0}))["weights"])
    assert np.linalg.norm(prox[0] - w0[0]) < np.linalg.norm(w1[0] - w0[0])
    loss, metrics = app.evaluate(w1, (np.zeros((4, 64), np.float32), np.zeros(4, np.int64)))
    assert loss > 0 and 0 <= metrics["accuracy"] <= 1


def test_device_auto_is_cuda_only_when_present() -> None:
    torch = pytest.importorskip("torch")
    from fl.torch_support import select_device

    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert select_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            select_device("cuda")


def test_tasks_for_another_endpoint_or_malformed_are_refused(on_endpoint) -> None:
    app = FunctionClientApp(lambda w, data, cfg: (w, len(data[1]), {}))
    w = [np.zeros(2)]
    with pytest.raises(TaskError, match="task for client 'ep-9' arrived at endpoint 'ep-1'"):
        app(_task(w, client="ep-9"))
    with pytest.raises(TaskError, match="expected an fl 'train' task"):
        app({"kind": "train", "v": 99})
    with pytest.raises(TaskError):
        app("not a task")  # type: ignore[arg-type]


def test_function_app_any_framework(on_endpoint) -> None:
    def train(weights, data, config):
        X, y = data
        return [weights[0] + X.mean()], len(y), {"seen_round": config["round"]}

    remote = deserialize_function(serialize_function(FunctionClientApp(train)))
    out = remote(_task([np.zeros(3)]))
    assert out["metrics"] == {"seen_round": 3} and decode_weights(out["weights"])[0][0] > 0


def test_gateway_aggregator_equals_fedavg_over_its_group_and_drops_bad_blobs() -> None:
    cur = [np.zeros(2, np.float32)]
    ups = [("a", [np.array([1.0, 2.0], np.float32)], 1), ("b", [np.array([3.0, 6.0], np.float32)], 3)]
    task = {"v": 1, "kind": "aggregate", "round": 1, "gateway_id": "gw", "current": encode_weights(cur),
            "updates": [{"client_id": c, "weights": encode_weights(w), "num_samples": n, "metrics": {"loss": n}} for c, w, n in ups]
            + [{"client_id": "junk", "weights": b"garbage", "num_samples": 5}]}
    remote = deserialize_function(serialize_function(GatewayAggregator(FedAvg())))
    out = remote(task)
    np.testing.assert_allclose(decode_weights(out["weights"])[0], [2.5, 5.0])  # (1*[1,2] + 3*[3,6]) / 4
    assert out["num_samples"] == 4 and out["accepted"] == ["a", "b"]
    assert out["rejected"][0][0] == "junk" and "undecodable" in out["rejected"][0][1]
    expect = weighted_average([w for _, w, _ in ups], [1, 3], cur)
    assert np.allclose(decode_weights(out["weights"])[0], expect[0])


@pytest.mark.parametrize("value, reason", [
    ("just a string", "not an fl update"),
    ({"v": 1, "kind": "update", "client_id": "ep-2", "weights": encode_weights([np.zeros(1)]), "num_samples": 1}, "claims client 'ep-2'"),
    ({"v": 1, "kind": "update", "client_id": "ep-1", "weights": b"FLW1junk", "num_samples": 1}, "undecodable weights"),
    ({"v": 1, "kind": "update", "client_id": "ep-1", "weights": encode_weights([np.zeros(1)]), "num_samples": "many"}, "not an integer"),
])
def test_driver_turns_bad_client_results_into_reasons(value, reason) -> None:
    upd, why, _ = Federation._to_update("ep-1", value, 0)
    assert upd is None and reason in why


def test_driver_accepts_a_good_update() -> None:
    value = {"v": 1, "kind": "update", "client_id": "ep-1", "weights": encode_weights([np.ones(2)]), "num_samples": 4,
             "base_version": 3, "metrics": {"loss": 0.5}, "train_time_s": 0.1}
    upd, why, info = Federation._to_update("ep-1", value, 0)
    assert why is None and isinstance(upd, ClientUpdate) and upd.num_samples == 4 and upd.base_version == 3
    assert info["train_time_s"] == 0.1 and "weights" not in info


def test_trainer_config_validation() -> None:
    for bad in ({"lr": 0}, {"batch_size": 0}, {"optimizer": "lbfgs"}, {"threads": 0}):
        with pytest.raises(ValueError):
            TrainerConfig.of(bad)
    with pytest.raises(TypeError):
        TrainerConfig.of({"learning_rate": 0.1})


def test_agent_and_plain_tasks_never_import_torch(tmp_path: Path) -> None:
    """The agent (and a worker running an ordinary task) stays light: torch only in FL paths."""
    code = textwrap.dedent("""
        import asyncio, sys
        import mesh_agent, mesh_agent.agent, mesh_agent.cli, mesh_agent.datasets, mesh_agent.engine
        import fl, fl.datasets, fl.client, fl.federation, fl.wire, fl.strategies, fl.flower
        assert "torch" not in sys.modules, "import"
        from mesh_agent.engine import EngineTask, LocalEngine
        from mesh_agent.protocol import deserialize, serialize, serialize_function, function_id

        def task():
            import sys
            return sorted(m for m in ("torch", "flwr", "sklearn") if m in sys.modules)

        async def main():
            got = []
            done = asyncio.Event()
            def on_results(rs):
                got.extend(rs); done.set()
            eng = LocalEngine(on_results, workers=1)
            await eng.start()
            body = serialize_function(task)
            eng.submit([EngineTask("t1", function_id(body), body, serialize(((), {})))])
            await asyncio.wait_for(done.wait(), 60)
            await eng.stop()
            return deserialize(got[0].data)
        print(asyncio.run(main()))
        assert "torch" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_fit_refuses_bad_arguments_before_touching_the_hub() -> None:
    from cloud_hub.client import Client
    from fl.strategies import FedBuff, Hierarchical

    with pytest.raises(ValueError, match="endpoints"):
        Federation(Client("http://127.0.0.1:9", "t"))
    with pytest.raises(ValueError, match="both a gateway"):
        Federation(Client("http://127.0.0.1:9", "t"), gateways={"gw": ["a", "gw"], "a": ["b"]})
    fed = Federation(Client("http://127.0.0.1:9", "t"), ["ep-1"], hub_wait_s=0)  # nothing listens there
    app = FunctionClientApp(lambda w, d, c: (w, 1, {}), initial_weights=[np.zeros(1)])
    for kw, text in [({"rounds": 0}, "rounds"), ({"deadline_s": 0}, "deadline_s"), ({"on_insufficient": "wait"}, "on_insufficient"),
                     ({"max_extensions": -1}, "max_extensions"), ({"local_epochs": 0}, "local_epochs"),
                     ({"min_clients": 0}, "min_clients"), ({"strategy": Hierarchical()}, "gateways"),
                     ({"strategy": FedBuff(), "min_clients": 0}, "min_clients")]:
        with pytest.raises(ValueError, match=text):
            fed.fit(app, "digits", **kw)


def test_records_are_made_json_safe_for_the_hub() -> None:
    from fl.federation import _json_safe

    out = _json_safe({"loss": float("nan"), "m": {"a": np.float32(0.5), "b": [np.int64(3), float("inf")]}, 1: (1, 2)})
    assert out == {"loss": None, "m": {"a": 0.5, "b": [3, None]}, "1": [1, 2]}


def test_function_app_ships_its_evaluate_for_federated_evaluation(on_endpoint) -> None:
    """Issue 17: the evaluate function travels with train; on the device it scores the global
    model on the local test part (the holdout), never on the training part."""
    from fl import datasets
    from fl.client import local_split

    def train(weights, data, config):
        return weights, len(data[1]), {}

    def evaluate(weights, data):
        X, y = data
        return float(weights[0][0]), {"accuracy": float(np.mean(y == 0)), "n": len(y)}

    remote = deserialize_function(serialize_function(FunctionClientApp(train, evaluate)))
    assert remote.evaluate_fn is not None and remote.evaluates_on_device()
    out = remote(_task([np.full(3, 0.75)], kind="evaluate", holdout=0.25))
    X, y = datasets.load("digits")
    _, (_, y_test) = local_split((X, y), 0.25, "ep-1")
    assert out["kind"] == "evaluation" and out["loss"] == 0.75
    assert out["num_examples"] == len(y_test) == out["metrics"]["n"] == round(0.25 * len(y))
    assert out["metrics"]["accuracy"] == pytest.approx(float(np.mean(y_test == 0)))
    # without an evaluate function the device says so
    bare = deserialize_function(serialize_function(FunctionClientApp(train)))
    assert not bare.evaluates_on_device()
    with pytest.raises(TaskError, match="has no evaluate"):
        bare(_task([np.zeros(3)], kind="evaluate"))
    with pytest.raises(TypeError, match="evaluate must be a function"):
        FunctionClientApp(train, evaluate="accuracy")  # type: ignore[arg-type]


def test_fit_refuses_federated_evaluation_an_app_cannot_do() -> None:
    from cloud_hub.client import Client

    fed = Federation(Client("http://127.0.0.1:9", "t"), ["ep-1"], hub_wait_s=0)  # nothing listens there
    train = lambda w, d, c: (w, 1, {})  # noqa: E731
    with pytest.raises(ValueError, match="fed_eval_every needs a client app that evaluates on the devices"):
        fed.fit(FunctionClientApp(train, initial_weights=[np.zeros(1)]), "digits", fed_eval_every=1)
    with pytest.raises(ValueError, match="or use fed_eval_every=k to run it on the devices"):
        fed.fit(FunctionClientApp(train, lambda w, d: (0.0, {}), initial_weights=[np.zeros(1)]), "digits")
    pytest.importorskip("flwr")
    from fl.flower import FlowerClientApp

    # a Flower app's evaluate_fn is central only: fed_eval_every is not offered as the way out
    with pytest.raises(ValueError, match=r"eval_data=\.\.\. \(the data it evaluates on\) \(FlowerClientApp's evaluate_fn runs on the driver only\)$"):
        fed.fit(FlowerClientApp(lambda ctx: None, evaluate_fn=lambda w: (0.0, {})), "digits", fed_eval_every=1)
    assert fed.run_id is None and fed.driver is None


def test_gateway_sends_a_top_k_site_update_with_error_feedback_in_its_own_store(tmp_path, monkeypatch) -> None:
    """A top-k run's site update goes up compressed like a device's: what one round leaves out
    (the residual) is kept in the gateway's durable store and goes up in the next round."""
    from fl import compression as fc
    from fl.client import _group_blob

    monkeypatch.setenv(fc.ENV_DATA_DIR, str(tmp_path))
    comp = fc.parse("topk:0.25")
    cur = [np.zeros(1000, np.float32)]
    new = [np.arange(1000, 0, -1).astype(np.float32)]  # 1000, 999, ..., 1: the top quarter is the first 250
    task = {"round": 1, "run_id": "run-k", "gateway_id": "gw-1", "current_ref": "0" * 64, "uplink": comp.spec()}
    blob, enc = _group_blob(task, new, cur)
    assert enc is not None and len(blob) < len(encode_weights(new)) / 2
    np.testing.assert_allclose(fc.decode_update(blob, enc, cur, expected=comp)[0], np.where(np.arange(1000) < 250, new[0], 0))
    assert list((tmp_path / "fl-state").iterdir()), "the residual is on the gateway's disk"
    blob, enc = _group_blob({**task, "round": 2}, cur, cur)  # nothing new: the next quarter of what was left out goes up
    np.testing.assert_allclose(fc.decode_update(blob, enc, cur, expected=comp)[0],
                               np.where((np.arange(1000) >= 250) & (np.arange(1000) < 500), new[0], 0))
