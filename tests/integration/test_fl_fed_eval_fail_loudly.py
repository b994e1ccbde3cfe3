"""Issue 17, items 4 and 5 for the native API (``fl.Federation``), on a real mesh: Mosquitto, the
hub and three digits agents (one worker each).

* Federated evaluation: the clients evaluate the global model on their own held-out part of
  their data; the record's ``fed_*`` numbers are the example-weighted mean of the per-client
  numbers the record carries, and each client's example count is its held-out part's size.
* Failing loudly: an app whose model cannot be loaded on the devices is marked failed by the
  warm-up (never ready), the run stops after ``max_failed_rounds`` rounds, ends ``failed`` in
  the hub with the error, and ``fit`` raises; ``evaluate_fn`` without ``eval_data`` is refused
  before anything reaches the hub.

Rounds and clients are kept tiny: the point is the plumbing, not the accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator

import numpy as np
import pytest

from fl import FedAsync, FedAvg, Federation
from fl.client import FunctionClientApp, local_split
from fl.data import load_client_data
from fl.drivers import FederationError
from fl.history import History
from fl.localmesh import DigitsMesh, digits_mesh

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = pytest.mark.integration

N = 3
TRAINER = {"threads": 1, "lr": 0.05, "batch_size": 32}


_Mesh = DigitsMesh


@pytest.fixture(scope="module")
def fl_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DigitsMesh]:
    with digits_mesh(tmp_path_factory.mktemp("flfedeval"), N, scheme="iid", seed=0) as dm:
        yield dm


def _mlp() -> Any:
    from fl.models import MLP

    torch.manual_seed(0)
    return MLP(64, (32,), 10)


class BrokenOnDevice(nn.Module):
    """A model that builds on the driver but cannot be loaded on a device (as when the device
    lacks a module the model needs): unpickling it inside an agent's worker raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        from fl import datasets

        if datasets.endpoint_id() is not None:
            raise RuntimeError("BrokenOnDevice cannot be built on this device")
        super().__setstate__(state)

    def forward(self, x: Any) -> Any:
        return self.fc(x)


def test_federated_evaluation_recorded_and_weighted_by_examples(fl_mesh: _Mesh, tmp_path: Path) -> None:
    client = fl_mesh.mesh.client
    fed = Federation(client, fl_mesh.ids)
    hist = fed.fit(_mlp(), "digits", rounds=3, strategy=FedAvg(), deadline_s=60, min_clients=N, trainer=TRAINER,
                   fed_eval_every=2, fed_eval_fraction=1.0, fed_eval_holdout=0.25, name="fed-eval-test")
    assert [r.round for r in hist] == [1, 2, 3]
    # every 2 rounds, and after the last one
    assert hist[0].fed_accuracy is None and "fed_eval" not in hist[0].extra
    for rec in (hist[1], hist[2]):
        per = rec.extra["fed_eval"]
        assert sorted(per) == sorted(fl_mesh.ids), rec.extra.get("fed_eval_failed")
        # each client's examples: the held-out quarter of its own partition
        for k, agent in enumerate(fl_mesh.clients):
            X, y = load_client_data(k, N, scheme="iid", seed=0)
            _, (_, y_test) = local_split((X, y), 0.25, agent.endpoint_id)
            assert per[agent.endpoint_id]["num_examples"] == len(y_test) == round(0.25 * len(y))
        n = sum(p["num_examples"] for p in per.values())
        assert rec.fed_examples == n
        assert rec.fed_accuracy == pytest.approx(sum(p["accuracy"] * p["num_examples"] for p in per.values()) / n)
        assert rec.fed_loss == pytest.approx(sum(p["loss"] * p["num_examples"] for p in per.values()) / n)
        assert 0.0 <= rec.fed_accuracy <= 1.0
    # the hub stores it next to the (here absent) central evaluation
    run = client.fl_run(fed.run_id)
    assert run["status"] == "finished"
    stored = run["rounds"][2]
    assert stored["extra"]["fed_accuracy"] == pytest.approx(hist[2].fed_accuracy)
    assert stored["extra"]["fed_examples"] == hist[2].fed_examples
    # CSV/JSON history carry it
    assert "fed_accuracy" in hist.to_csv().splitlines()[0].split(",")
    assert History.from_json(hist.to_json()).rounds[2].fed_accuracy == pytest.approx(hist[2].fed_accuracy)


def test_app_that_fails_to_load_fails_the_run_after_max_failed_rounds(fl_mesh: _Mesh) -> None:
    client = fl_mesh.mesh.client
    fed = Federation(client, fl_mesh.ids)
    with pytest.raises(FederationError, match="BrokenOnDevice cannot be built") as err:
        fed.fit(BrokenOnDevice(), "digits", rounds=6, strategy=FedAvg(), deadline_s=30, min_clients=1,
                trainer=TRAINER, max_failed_rounds=2, name="broken-app-test")
    assert "2 round(s) in a row" in str(err.value)
    assert fed.driver is not None
    # the warm-up marked every client failed with its error, and called none ready
    assert set(fed.driver._excluded) == set(fl_mesh.ids)
    assert all("BrokenOnDevice cannot be built" in e for e in fed.driver._excluded.values())
    assert not fed.driver._warm_info
    run = client.fl_run(fed.run_id)
    assert run["status"] == "failed" and "BrokenOnDevice cannot be built" in (run["error"] or "")
    assert run["rounds_done"] == 2 and [r["round"] for r in run["rounds"]] == [1, 2]
    assert all(sorted(r["dropped"]) == sorted(fl_mesh.ids) and not r["participants"] for r in run["rounds"])

    # a run shorter than max_failed_rounds in which no round trained fails too (never "finished")
    fed1 = Federation(client, fl_mesh.ids)
    with pytest.raises(FederationError, match="no round trained"):
        fed1.fit(BrokenOnDevice(), "digits", rounds=1, strategy=FedAvg(), deadline_s=30, min_clients=1,
                 trainer=TRAINER, max_failed_rounds=3, name="broken-app-short-test")
    run1 = client.fl_run(fed1.run_id)
    assert run1["status"] == "failed" and "BrokenOnDevice cannot be built" in (run1["error"] or "")
    assert run1["rounds_done"] == 1


def test_async_app_that_fails_to_load_fails_fast(fl_mesh: _Mesh) -> None:
    """Async mode (issue 17): every client failing its warm-up ends the run at once, after
    max_failed_rounds records, instead of one record per ``deadline_s * (1 + max_extensions)``
    (here 15 minutes each: without the fix this test would run past an hour)."""
    client = fl_mesh.mesh.client
    fed = Federation(client, fl_mesh.ids)
    with pytest.raises(FederationError, match="BrokenOnDevice cannot be built") as err:
        fed.fit(BrokenOnDevice(), "digits", rounds=6, strategy=FedAsync(), deadline_s=300, max_extensions=2,
                min_clients=1, trainer=TRAINER, max_failed_rounds=2, warmup_s=120, name="broken-app-async-test")
    assert "2 round(s) in a row" in str(err.value)
    assert set(fed.driver._excluded) == set(fl_mesh.ids) and not fed.driver._warm_info
    run = client.fl_run(fed.run_id)
    assert run["mode"] == "async" and run["status"] == "failed"
    assert "BrokenOnDevice cannot be built" in (run["error"] or "")
    assert [r["round"] for r in run["rounds"]] == [1, 2]
    for r in run["rounds"]:
        # written because nobody can train, not because the give-up time passed
        assert r["extra"]["reason"] == "every client failed its warm-up", r["extra"]
        assert sorted(r["dropped"]) == sorted(fl_mesh.ids) and not r["participants"] and not r["stragglers"]


def _train_needs_penalty(weights: Any, data: Any, config: Dict[str, Any]) -> Any:
    """Fails on every device the same way, as an app whose run_config lacks a key does."""
    return weights, len(data[1]), {"penalty": config["penalty"]}


def test_async_same_error_every_client_stops_after_max_failed_rounds(fl_mesh: _Mesh) -> None:
    """Async mode (issue 17): when every client's training fails with one error, a record is
    closed as soon as all have failed (not after the give-up time) and the run stops after
    max_failed_rounds such records, ``failed`` in the hub, as in sync mode."""
    client = fl_mesh.mesh.client
    app = FunctionClientApp(_train_needs_penalty, initial_weights=[np.zeros(3, np.float32)])
    fed = Federation(client, fl_mesh.ids)
    with pytest.raises(FederationError, match="penalty") as err:
        fed.fit(app, "digits", rounds=8, strategy=FedAsync(), deadline_s=300, max_extensions=2, min_clients=1,
                max_failed_rounds=3, warmup_s=120, name="same-error-async-test")
    assert "3 round(s) in a row" in str(err.value) and "KeyError" in str(err.value)
    assert set(fed.driver._warm_info) == set(fl_mesh.ids)  # the app loads: the warm-up passed
    run = client.fl_run(fed.run_id)
    assert run["mode"] == "async" and run["status"] == "failed" and "penalty" in (run["error"] or "")
    assert [r["round"] for r in run["rounds"]] == [1, 2, 3]
    for r in run["rounds"]:
        assert r["extra"]["reason"] == "every client failed since the last model", r["extra"]
        assert sorted(r["dropped"]) == sorted(fl_mesh.ids) and not r["participants"]
        assert len(set(r["dropped"].values())) == 1 and "penalty" in next(iter(r["dropped"].values()))


def _train(weights: Any, data: Any, config: Dict[str, Any]) -> Any:
    return weights, len(data[1]), {}


def _evaluate(weights: Any, data: Any) -> Any:
    return 0.0, {"accuracy": 1.0}


def test_evaluate_fn_without_eval_data_is_refused_before_anything_is_submitted(fl_mesh: _Mesh) -> None:
    client = fl_mesh.mesh.client
    before = len(client.fl_runs(limit=500))
    app = FunctionClientApp(_train, _evaluate, initial_weights=[np.zeros(3, np.float32)])
    fed = Federation(client, fl_mesh.ids)
    with pytest.raises(ValueError, match="eval_data"):
        fed.fit(app, "digits", rounds=1, deadline_s=10)
    assert fed.run_id is None and fed.driver is None
    assert len(client.fl_runs(limit=500)) == before


# ---------------------------------------------------------------- issue 17: device evaluation of every app kind


def _softmax_train(weights: Any, data: Any, config: Dict[str, Any]) -> Any:
    """Numpy softmax regression: a FunctionClientApp in any framework."""
    X, y = data
    X = X.astype(np.float64)
    W, b = (np.array(w, dtype=np.float64) for w in weights)
    for _ in range(5):
        z = X @ W + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        W -= 0.5 * X.T @ p / len(y)
        b -= 0.5 * p.mean(0)
    return [W, b], len(y), {}


def _softmax_evaluate(weights: Any, data: Any) -> Any:
    X, y = data
    z = X.astype(np.float64) @ weights[0] + weights[1]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-12))), {"accuracy": float(np.mean(p.argmax(1) == y))}


def _console_page(mesh: Any, path: str) -> str:
    import httpx

    with httpx.Client(base_url=mesh.url, follow_redirects=False, timeout=30, verify=False) as c:
        r = c.post("/console/login", data={"token": mesh.token})
        assert r.status_code == 303, r.text
        page = c.get(path)
        assert page.status_code == 200, page.text[:500]
        return page.text


def test_function_app_evaluates_on_a_fraction_of_the_devices_and_the_console_shows_it(fl_mesh: _Mesh) -> None:
    """The evaluate function ships with train (no eval_data: the devices are the only test
    set); half of the 3 clients (rounded up: 2) are asked each time, and the console's run page
    gets its "Fed. accuracy" column."""
    client = fl_mesh.mesh.client
    init = [np.zeros((64, 10)), np.zeros(10)]
    app = FunctionClientApp(_softmax_train, _softmax_evaluate, initial_weights=init)
    fed = Federation(client, fl_mesh.ids)
    hist = fed.fit(app, "digits", rounds=2, strategy=FedAvg(), deadline_s=60, min_clients=N, fed_eval_every=1,
                   fed_eval_fraction=0.5, fed_eval_holdout=0.25, name="fed-eval-function-app")
    sizes = {}
    for k, agent in enumerate(fl_mesh.clients):
        X, y = load_client_data(k, N, scheme="iid", seed=0)
        (_, y_train), (_, y_test) = local_split((X, y), 0.25, agent.endpoint_id)
        sizes[agent.endpoint_id] = (len(y_train), len(y_test))
    for rec in hist:
        asked = rec.extra["fed_eval_asked"]
        assert len(asked) == 2 and set(asked) < set(fl_mesh.ids), asked
        per = rec.extra["fed_eval"]
        assert sorted(per) == sorted(asked), rec.extra.get("fed_eval_failed")
        assert all(per[c]["num_examples"] == sizes[c][1] for c in asked)
        assert rec.fed_examples == sum(sizes[c][1] for c in asked)
        assert rec.fed_accuracy == pytest.approx(sum(p["accuracy"] * p["num_examples"] for p in per.values()) / rec.fed_examples)
        # the devices trained on their training part only
        assert rec.extra["num_samples"] == sum(s[0] for s in sizes.values())
    assert hist[-1].fed_accuracy > 0.5, [r.fed_accuracy for r in hist]  # softmax regression learns digits fast
    stored = client.fl_run(fed.run_id)
    assert stored["status"] == "finished" and stored["rounds"][1]["extra"]["fed_eval_asked"] == hist[1].extra["fed_eval_asked"]
    page = _console_page(fl_mesh.mesh, f"/console/fl/{fed.run_id}")
    assert "Fed. accuracy" in page
    assert f"{hist[-1].fed_accuracy * 100:.1f}%" in page, "the last round's federated accuracy is on the page"


def _flower_scoring_client_fn() -> Any:
    from flwr.client import NumPyClient

    class HoldoutClient(NumPyClient):  # an ordinary Flower client with its own train/test split
        def __init__(self, pid: int, X: np.ndarray, y: np.ndarray) -> None:
            self.pid = pid
            cut = len(y) - len(y) // 5
            self.train, self.test = (X[:cut], y[:cut]), (X[cut:], y[cut:])

        def fit(self, parameters: Any, config: Dict[str, Any]) -> Any:
            return parameters, len(self.train[1]), {}

        def evaluate(self, parameters: Any, config: Dict[str, Any]) -> Any:
            X, y = self.test
            pred = (X @ parameters[0]).argmax(1)
            return float(self.pid), len(y), {"accuracy": float(np.mean(pred == y)), "round": int(config["server-round"])}

    def client_fn(context: Any) -> Any:
        from fl.data import load_client_data

        pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
        if context.run_config.get("broken-partition") == pid:
            raise RuntimeError(f"partition {pid} cannot be loaded here")
        X, y = load_client_data(pid, n, scheme="iid", seed=0)
        return HoldoutClient(pid, X.astype(np.float64), y).to_client()

    return client_fn


def test_flower_client_evaluates_on_the_devices(fl_mesh: _Mesh) -> None:
    """FlowerClientApp with fed_eval_every: the client's own evaluate() runs on the devices
    (fraction 0.3 of 3: one client asked per evaluation), weighted by its num_examples."""
    pytest.importorskip("flwr")
    from fl.flower import FlowerClientApp

    client = fl_mesh.mesh.client
    app = FlowerClientApp(_flower_scoring_client_fn(), initial_weights=[np.eye(64, 10)])
    fed = Federation(client, fl_mesh.ids)
    hist = fed.fit(app, "digits", rounds=2, strategy=FedAvg(), deadline_s=60, min_clients=N, fed_eval_every=2,
                   fed_eval_fraction=0.3, name="fed-eval-flower-app")
    assert "fed_eval" not in hist[0].extra
    rec = hist[1]
    asked = rec.extra["fed_eval_asked"]
    assert len(asked) == 1, asked
    (c,) = asked
    k = fl_mesh.ids.index(c)
    X, y = load_client_data(k, N, scheme="iid", seed=0)
    test_y = y[len(y) - len(y) // 5:]
    assert rec.extra["fed_eval"] == {c: {"loss": float(k), "accuracy": pytest.approx(float(np.mean((X[len(y) - len(y) // 5:] @ np.eye(64, 10)).argmax(1) == test_y))),
                                         "num_examples": len(test_y)}}, rec.extra.get("fed_eval_failed")
    assert rec.fed_examples == len(test_y) and rec.fed_loss == float(k)
    assert client.fl_run(fed.run_id)["rounds"][1]["extra"]["fed_examples"] == len(test_y)


def test_flower_client_fn_failing_on_one_device_fails_its_warmup(fl_mesh: _Mesh) -> None:
    """The warm-up builds the Flower client: the device whose client_fn raises is left out
    with that first error and never called ready; the others train."""
    pytest.importorskip("flwr")
    from fl.flower import FlowerClientApp

    client = fl_mesh.mesh.client
    broken = fl_mesh.clients[0].endpoint_id
    app = FlowerClientApp(_flower_scoring_client_fn(), initial_weights=[np.eye(64, 10)], run_config={"broken-partition": 0})
    fed = Federation(client, fl_mesh.ids)
    hist = fed.fit(app, "digits", rounds=1, strategy=FedAvg(), deadline_s=60, min_clients=1, name="flower-warmup-fail")
    assert set(fed.driver._excluded) == {broken}, fed.driver._excluded
    assert "RuntimeError" in fed.driver._excluded[broken] and "partition 0 cannot be loaded here" in fed.driver._excluded[broken]
    assert broken not in fed.driver._warm_info and len(fed.driver._warm_info) == N - 1
    assert hist.metadata["warmup"]["failed"] == fed.driver._excluded
    assert sorted(hist[0].participants) == sorted(set(fl_mesh.ids) - {broken})
