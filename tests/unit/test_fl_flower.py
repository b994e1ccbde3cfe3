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


# ---------------------------------------------------------------- issue 17: warm-up and device evaluation


class Scorer(flwr.client.NumPyClient):
    """Evaluates on its own 'test set' (its partition decides the size); loss = sum of the parameters."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def fit(self, parameters, config):
        return parameters, 5, {}

    def evaluate(self, parameters, config):
        return float(sum(float(np.sum(p)) for p in parameters)), 7 + self.pid, {"accuracy": 0.25 * self.pid,
                                                                               "round": config["server-round"]}


class NoEvaluate(flwr.client.NumPyClient):
    def fit(self, parameters, config):
        return parameters, 5, {}


def scorer_fn(context):
    return Scorer(context.node_config["partition-id"])


def broken_client_fn(context):
    raise RuntimeError("partition file missing on this device")


def not_a_client_fn(context):
    return {"not": "a client"}


def _remote(app):
    return deserialize_function(serialize_function(app))


def test_a_message_api_clientapp_is_refused_at_construction() -> None:
    app = flwr.clientapp.ClientApp()

    @app.train()
    def train(msg, context):  # the Message API: (Message, Context)
        return msg

    with pytest.raises(TypeError, match=r"not a flwr.clientapp.ClientApp.*mesh-fl run APP_DIR.*fl.flower.run_app"):
        FlowerClientApp(app)
    with pytest.raises(TypeError, match="needs a client_fn"):
        FlowerClientApp(Scorer(0))  # a client instance, not a client_fn


def test_the_warmup_builds_the_client_and_fails_with_client_fns_error(endpoint) -> None:
    warm = {"v": 1, "kind": "warmup", "client_id": "ep-3", "dataset": "digits"}
    assert _remote(FlowerClientApp(scorer_fn))(warm)["kind"] == "ready"
    with pytest.raises(RuntimeError, match="partition file missing on this device"):
        _remote(FlowerClientApp(broken_client_fn))(warm)
    with pytest.raises(TypeError, match="client_fn returned dict, not a flwr NumPyClient or Client"):
        _remote(FlowerClientApp(not_a_client_fn))(warm)
    from fl.datasets import DatasetNotFound

    with pytest.raises(DatasetNotFound):
        _remote(FlowerClientApp(scorer_fn))({**warm, "dataset": "nope"})


@pytest.mark.parametrize("wrap", [lambda c: c, lambda c: c.to_client()], ids=["numpyclient", "client"])
def test_device_evaluation_calls_the_clients_evaluate(endpoint, wrap) -> None:
    app = _remote(FlowerClientApp(lambda context: wrap(scorer_fn(context))))
    task = {"v": 1, "kind": "evaluate", "round": 4, "client_id": "ep-3", "weights": encode_weights([np.ones(3), np.ones(2)]),
            "dataset": "digits", "holdout": 0.2}
    out = app(task)
    assert out["kind"] == "evaluation" and out["round"] == 4
    assert out["loss"] == 5.0 and out["num_examples"] == 9  # partition-id 2: the client's own test set
    assert out["metrics"] == {"accuracy": 0.5, "round": 4}
    # a training task of a run with federated evaluation on (holdout set) trains as before
    tr = app({**task, "kind": "train", "config": {"local_epochs": 1}})
    assert tr["num_samples"] == 5


def test_device_evaluation_without_evaluate_is_a_clear_error(endpoint) -> None:
    from fl.client import TaskError

    task = {"v": 1, "kind": "evaluate", "round": 1, "client_id": "ep-3", "weights": encode_weights([np.ones(3)]),
            "dataset": "digits"}
    with pytest.raises(TaskError, match="NoEvaluate has no evaluate"):
        _remote(FlowerClientApp(lambda context: NoEvaluate()))(task)
    with pytest.raises(TaskError, match="NoEvaluate has no evaluate"):
        _remote(FlowerClientApp(lambda context: NoEvaluate().to_client()))(task)
    with pytest.raises(TaskError, match="EVALUATE_NOT_IMPLEMENTED"):  # a plain flwr Client: its evaluate's status says so
        _remote(FlowerClientApp(lambda context: RawNoEvaluate()))(task)


class RawNoEvaluate(flwr.client.Client):
    def fit(self, ins):
        raise AssertionError("not called here")


def test_app_dependencies_split_into_provided_built_and_refused() -> None:
    """What the agent's Python has at a version in range is provided (never built); agent-only
    packages (flwr, torch, ...) out of range are refused by name, never downloaded; the rest goes
    into the app's execution environment; a false marker drops a requirement."""
    from importlib import metadata

    from fl.flower.delivery import plan_dependencies

    np_version = metadata.version("numpy")
    plan = plan_dependencies(["flwr[simulation]>=1.0", "numpy>=1.0", "meshflwr-absent>=1.2", "Other_Pkg[x]==2.0",
                              "skipme==1.0; python_version < '3.0'"])
    assert plan["refused"] == []
    assert plan["provided"] == [f"flwr=={metadata.version('flwr')}", f"numpy=={np_version}"]
    assert plan["build"] == ["meshflwr-absent>=1.2", "Other_Pkg[x]==2.0"]
    plan = plan_dependencies(["torch==0.0.1", "flwr<1.0", "jax>=0.1", "numpy<1.0", "pkg @ https://example.invalid/p.whl", "not a req!"])
    refused = " | ".join(plan["refused"])
    assert plan["build"] == ["numpy<1.0"]  # numpy is not agent-only: an environment may install another version
    assert f"torch==0.0.1 (installed: {metadata.version('torch')}; comes from the agent's Python only" in refused, refused
    assert "flwr<1.0 (installed:" in refused and "jax>=0.1 (not installed; comes from the agent's Python only" in refused
    assert "a URL requirement" in refused and "'not a req!' (not a valid requirement" in refused
    assert len(plan["refused"]) == 5 and plan["provided"] == []


def test_the_installer_probe_returns_the_environment_or_refuses_naming_the_package(monkeypatch: pytest.MonkeyPatch,
                                                                                  tmp_path: Path) -> None:
    from fl.flower.delivery import PROTOCOL, AppInstaller, MissingDependencies

    monkeypatch.setenv("MESH_ENDPOINT_DATA_DIR", str(tmp_path))
    base = {"v": PROTOCOL, "kind": "probe", "sha256": "a" * 64, "name": "demo"}
    out = AppInstaller()({**base, "dependencies": ["numpy>=1", "meshflwr-absent>=1.2"]})
    assert out["installed"] is False and out["environment"] == {"pip": ["meshflwr-absent>=1.2"]}
    assert out["provided"][0].startswith("numpy==")
    assert AppInstaller()({**base, "dependencies": ["numpy>=1"]})["environment"] is None
    with pytest.raises(MissingDependencies, match=r"'demo' needs torchvision==0\.0\.1 \(not installed; comes from the agent's Python only"):
        AppInstaller()({**base, "dependencies": ["numpy>=1", "torchvision==0.0.1"]})


def test_auto_ranking_is_by_expected_seconds_per_reply_then_name_then_id() -> None:
    from fl.flower.run import rank_endpoints

    rows = {"ep-a": {"name": "zeta"}, "ep-b": {"name": "alpha"}, "ep-c": {"name": "alpha"}, "ep-d": {"name": "mid"},
            "ep-e": {"name": "flaky"}, "ep-f": {"name": "new"}}
    pred = {"ep-a": {"predicted_s": 0.5, "p_online": 1.0, "source": "endpoint"},
            "ep-b": {"predicted_s": 0.5, "p_online": None, "source": "endpoint"},  # no outage history: 1
            "ep-c": {"predicted_s": 0.5, "p_online": 1.0, "source": "endpoint"},
            "ep-d": {"predicted_s": 0.2, "p_online": 1.0, "source": "endpoint"},
            "ep-e": {"predicted_s": 0.2, "p_online": 0.25, "source": "endpoint"},  # 0.8 s per reply expected
            "ep-f": {"predicted_s": None, "p_online": None, "source": "prior"}}
    ranked = rank_endpoints(pred, rows)
    assert [x["endpoint"] for x in ranked] == ["ep-d", "ep-b", "ep-c", "ep-a", "ep-e", "ep-f"]
    assert [x["rank"] for x in ranked] == [1, 2, 3, 4, 5, 6]
    assert ranked[4]["score"] == pytest.approx(0.8) and ranked[5]["score"] is None
    assert rank_endpoints(dict(reversed(list(pred.items()))), dict(reversed(list(rows.items())))) == ranked  # order-free
