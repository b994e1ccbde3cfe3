"""Flower interop in-process: a Flower NumPyClient runs unchanged through FlowerClientApp (as
the mesh ships it), and Flower strategies (legacy and Message API) aggregate through
FlowerStrategy to the hand-computed sample-weighted mean."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from fl.flower import FlowerClientApp, FlowerStrategy, node_config_for  # noqa: E402
from fl.strategies import ClientUpdate  # noqa: E402
from fl.wire import decode_weights, encode_weights  # noqa: E402
from mesh_agent.datasets import ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME, export_worker_env  # noqa: E402
from mesh_agent.protocol import deserialize_function, serialize_function  # noqa: E402


class Doubler(flwr.client.NumPyClient):
    """A plain Flower client: 'training' doubles the parameters; reports its partition."""

    def __init__(self, pid: int, n: int) -> None:
        self.pid, self.n = pid, n

    def get_parameters(self, config):
        return [np.zeros(3)]

    def fit(self, parameters, config):
        return [p * 2 + config["server-round"] for p in parameters], 10 * (self.pid + 1), {"pid": self.pid, "parts": self.n}

    def evaluate(self, parameters, config):
        return 0.0, 1, {}


def client_fn(context):
    return Doubler(context.node_config["partition-id"], context.node_config["num-partitions"]).to_client()


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    for k in (ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME):
        monkeypatch.setenv(k, "")
    export_worker_env("ep-3", "pi-3", {"digits": {"loader": "fl.datasets:digits", "kwargs": {"index": 2, "num_clients": 4}}}, tmp_path)


def test_node_config_comes_from_the_endpoints_declaration(endpoint) -> None:
    cfg = node_config_for("digits")
    assert cfg["partition-id"] == 2 and cfg["num-partitions"] == 4 and cfg["dataset"] == "digits"


def test_numpyclient_runs_unchanged_as_the_client_function(endpoint) -> None:
    app = deserialize_function(serialize_function(FlowerClientApp(client_fn, initial_weights=[np.zeros(3)])))
    task = {"v": 1, "kind": "train", "round": 5, "client_id": "ep-3", "weights": encode_weights([np.ones(3)]),
            "dataset": "digits", "config": {"local_epochs": 2}}
    out = app(task)
    assert decode_weights(out["weights"])[0].tolist() == [7.0, 7.0, 7.0]  # 1*2 + server-round 5
    assert out["num_samples"] == 30 and out["metrics"]["pid"] == 2 and out["metrics"]["parts"] == 4
    assert app({**task, "kind": "warmup"})["kind"] == "ready"


@pytest.mark.parametrize("make", [lambda: flwr.server.strategy.FedAvg(), lambda: flwr.serverapp.strategy.FedAvg()],
                         ids=["legacy-aggregate_fit", "message-aggregate_train"])
def test_flower_strategies_aggregate_to_the_weighted_mean(make) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    cur = [np.zeros((2, 2), np.float32), np.zeros(1, np.float32)]
    a = [np.array([[1, 2], [3, 4]], np.float32), np.array([10], np.float32)]
    b = [np.array([[5, 6], [7, 8]], np.float32), np.array([20], np.float32)]
    bad = [np.full((2, 2), np.nan, np.float32), np.array([1], np.float32)]
    s = FlowerStrategy(make(), min_clients=2)
    out = s.aggregate(1, [ClientUpdate("a", a, 1, metrics={"loss": 1.0}), ClientUpdate("b", b, 3, metrics={"loss": 3.0}),
                          ClientUpdate("nan", bad, 5)], cur)
    # (1*a + 3*b) / 4, by hand
    np.testing.assert_allclose(out[0], [[4, 5], [6, 7]], rtol=1e-6)
    np.testing.assert_allclose(out[1], [17.5], rtol=1e-6)
    assert out[0].dtype == np.float32
    assert s.last_report.accepted == ["a", "b"] and s.last_report.rejected[0][0] == "nan"
    assert s.name == "flower:FedAvg"
    assert s.aggregate(2, [ClientUpdate("a", a, 1)], cur) is None and "min_clients=2" in s.last_report.reason


def test_not_a_strategy_is_refused() -> None:
    with pytest.raises(TypeError, match="neither aggregate_fit nor aggregate_train"):
        FlowerStrategy(object())
