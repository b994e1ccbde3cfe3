"""Federated learning on a real mesh: Mosquitto, the hub, five agent processes (one worker each)
that each declare their own non-IID share of the digits, plus one gateway agent.

One mesh for the whole module (agents and their warm workers are the expensive part); tests
run in file order and leave every agent running.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Dict, Iterator, List

import numpy as np
import psutil
import pytest

from cloud_hub.localmesh import AgentProcess
from fl import FedAvg, FedBuff, Federation, FederationError, Hierarchical
from fl.data import load_client_data, load_test_data
from fl.localmesh import DigitsMesh, digits_mesh
from fl.strategies import weighted_average
from fl.wire import decode_weights

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration

N = 5
TRAINER = {"threads": 1, "lr": 0.05, "batch_size": 32}


class _Mesh(DigitsMesh):
    @property
    def gateway(self) -> AgentProcess:
        return self.others["fl-gateway"]


@pytest.fixture(scope="module")
def fl_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mesh]:
    with digits_mesh(tmp_path_factory.mktemp("flmesh"), N, scheme="dirichlet", alpha=0.5, seed=0,
                     others={"fl-gateway": "zmq"}) as dm:
        yield _Mesh(dm.mesh, dm.clients, dm.others)


def _mlp() -> Any:
    from fl.models import MLP

    torch.manual_seed(0)
    return MLP(64, (64,), 10)


def test_fedavg_non_iid_digits_reaches_90_percent(fl_mesh: _Mesh) -> None:
    fed = Federation(fl_mesh.mesh.client, fl_mesh.ids)
    hist = fed.fit(_mlp(), "digits", rounds=20, strategy=FedAvg(), local_epochs=2, deadline_s=60, min_clients=3,
                   trainer=TRAINER, eval_data=load_test_data(), name="digits-fedavg-test")
    assert [r.round for r in hist] == list(range(1, 21))
    assert max(r.accuracy for r in hist) >= 0.90, [round(r.accuracy, 3) for r in hist]
    assert hist[-1].accuracy >= 0.90
    assert all(sorted(r.participants) == sorted(fl_mesh.ids) for r in hist)
    # the partitions really are non-IID: some client lacks a class another has plenty of
    labels = [np.bincount(load_client_data(k, N, "dirichlet", 0.5, 0)[1], minlength=10) for k in range(N)]
    assert min(min(c) for c in labels) < 5 and max(max(c) for c in labels) > 60
    run = fl_mesh.mesh.client.fl_run(fed.run_id)
    assert run["status"] == "finished" and run["rounds_done"] == 20
    assert [r["round"] for r in run["rounds"]] == list(range(1, 21))
    assert run["last_accuracy"] == pytest.approx(hist[-1].accuracy)
    ck = fl_mesh.mesh.client.fl_checkpoint(fed.run_id)
    assert ck["round"] == 20
    assert all(np.array_equal(a, b) for a, b in zip(decode_weights(ck["weights"]), fed.final_weights))


def test_agent_killed_mid_round_round_completes_and_agent_rejoins(fl_mesh: _Mesh) -> None:
    client = fl_mesh.mesh.client
    victim = fl_mesh.clients[1]
    killed = threading.Event()

    def kill_once_round_2_is_out(round: int, tasks: Dict[str, str]) -> None:
        # The hub has accepted round 2's tasks (one is the victim's) and the round's clock runs:
        # a power cut now is a device dying mid-round. The victim's workers were frozen when round
        # 1 ended (below), so it cannot have trained and answered before this kill: a task now
        # leaves the hub with the submit's own commit, and 0.02 s of training once beat this
        # callback (a fresh-clone run). Its agent process was not frozen: it beats, so it is
        # online and picked for round 2.
        if round == 2:
            assert victim.endpoint_id in tasks
            victim.kill()
            killed.set()

    def freeze_after_round_1_restart_after_round_3(rec: Any, _w: Any) -> None:
        if rec.round == 1 and victim.proc is not None:
            workers = psutil.Process(victim.proc.pid).children(recursive=True)
            assert workers, "the victim trained round 1 in a worker process"
            for w in workers:
                w.send_signal(signal.SIGSTOP)
        if rec.round == 3:
            victim.start()
            fl_mesh.mesh.wait_online(victim, timeout=60)

    fed = Federation(client, fl_mesh.ids)
    hist = fed.fit(_mlp(), "digits", rounds=9, strategy=FedAvg(), local_epochs=1, deadline_s=8, min_clients=3,
                   trainer=TRAINER, eval_data=load_test_data(), on_round_start=kill_once_round_2_is_out,
                   on_round=freeze_after_round_1_restart_after_round_3, max_extensions=0)
    assert killed.is_set()
    r2 = hist[1]
    assert victim.endpoint_id in r2.stragglers and victim.endpoint_id not in r2.participants
    assert sorted(r2.participants) == sorted(set(fl_mesh.ids) - {victim.endpoint_id})
    assert r2.extra.get("deadline_reached") is True and not r2.extra.get("skipped")
    assert r2.extra["version"] == 2  # the round produced a model without the victim
    later = [r for r in hist if r.round > 3 and victim.endpoint_id in r.participants]
    assert later, [(r.round, r.participants, r.stragglers) for r in hist]
    # its round-2 task ran after the restart (durable queue) and came back late: discarded, recorded
    late = [(lt["client"], lt["round"]) for r in hist for lt in r.extra.get("late_discarded", [])]
    assert (victim.endpoint_id, 2) in late
    # It learned through the kill (chance is 10 %). 9 one-epoch rounds end near 0.8 on this split
    # (0.794 seen in CI), so the bound is not a coin flip on the last round.
    assert hist[-1].accuracy > 0.7


def test_hub_restart_mid_run_resumes_from_checkpoint(fl_mesh: _Mesh) -> None:
    mesh = fl_mesh.mesh
    fed = Federation(mesh.client, fl_mesh.ids)
    # the driver stops after round 3 (laptop closed), then the hub restarts
    hist1 = fed.fit(_mlp(), "digits", rounds=6, strategy=FedAvg(), local_epochs=2, deadline_s=30, min_clients=3,
                    trainer=TRAINER, eval_data=load_test_data(), on_round=lambda rec, w: rec.round < 3)
    run_id = fed.run_id
    assert run_id and len(hist1) == 3
    ck3 = mesh.client.fl_checkpoint(run_id)
    mesh.stop_hub()
    mesh.start_hub()
    mesh.wait_online(*fl_mesh.clients, timeout=60)
    run = mesh.client.fl_run(run_id)
    assert run["status"] == "aborted" and run["rounds_done"] == 3
    assert mesh.client.fl_checkpoint(run_id)["weights"] == ck3["weights"]

    # a new driver resumes; during round 5 the hub restarts again under it
    restarted = threading.Event()

    def bounce_hub(rec: Any, _w: Any) -> None:
        if rec.round == 4:
            mesh.stop_hub()
            threading.Timer(1.0, lambda: (mesh.start_hub(), restarted.set())).start()

    starts: List[Any] = []
    fed2 = Federation(mesh.client, fl_mesh.ids)
    hist2 = fed2.fit(_mlp(), "digits", rounds=6, strategy=FedAvg(), local_epochs=2, deadline_s=30, min_clients=3,
                     trainer=TRAINER, eval_data=load_test_data(), resume=run_id, on_round=bounce_hub,
                     on_round_start=lambda r, t: starts.append(r))
    assert restarted.is_set()
    assert starts == [4, 5, 6]  # rounds 1-3 were not redone
    assert [r.round for r in hist2] == [1, 2, 3, 4, 5, 6]
    assert [r.accuracy for r in hist2[:3]] == [r.accuracy for r in hist1]
    assert hist2.metadata["resumed_from"] == 3
    # round 4 started from the round-3 checkpoint, not from fresh weights
    assert hist2[3].accuracy > 0.5 and hist2[3].accuracy >= hist1[2].accuracy - 0.1
    assert hist2[4].extra["hub_outage_s"] > 0  # round 5 waited out the hub's restart
    run = mesh.client.fl_run(run_id)
    assert run["status"] == "finished" and [r["round"] for r in run["rounds"]] == [1, 2, 3, 4, 5, 6]


def _flower_digits_client_fn() -> Any:
    from flwr.client import NumPyClient

    class DigitsLogReg(NumPyClient):  # an ordinary Flower client: numpy softmax regression
        def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
            self.X, self.y = X.astype(np.float64), y

        def get_parameters(self, config: Dict[str, Any]) -> List[np.ndarray]:
            return [np.zeros((64, 10)), np.zeros(10)]

        def fit(self, parameters: List[np.ndarray], config: Dict[str, Any]):  # type: ignore[override]
            W, b = (np.array(p, dtype=np.float64) for p in parameters)
            for _ in range(10 * int(config.get("local-epochs", 1))):
                z = self.X @ W + b
                p = np.exp(z - z.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                p[np.arange(len(self.y)), self.y] -= 1.0
                W -= 0.5 * self.X.T @ p / len(self.y)
                b -= 0.5 * p.mean(0)
            return [W, b], len(self.y), {"partition": int(self.pid)}

        def evaluate(self, parameters: List[np.ndarray], config: Dict[str, Any]):  # type: ignore[override]
            return 0.0, len(self.y), {}

    def client_fn(context: Any) -> Any:
        from fl.data import load_client_data

        pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
        X, y = load_client_data(pid, n, scheme="dirichlet", alpha=0.5, seed=0)
        c = DigitsLogReg(X, y)
        c.pid = pid
        return c.to_client()

    return client_fn


def test_flower_numpyclient_and_strategy_through_the_adapters(fl_mesh: _Mesh) -> None:
    import flwr.serverapp.strategy as flower_strategies

    from fl.flower import FlowerClientApp, FlowerStrategy

    client_fn = _flower_digits_client_fn()
    init = [np.zeros((64, 10)), np.zeros(10)]
    app = FlowerClientApp(client_fn, initial_weights=init)
    fed = Federation(fl_mesh.mesh.client, fl_mesh.ids)
    hist = fed.fit(app, "digits", rounds=2, strategy=FlowerStrategy(flower_strategies.FedAvg()), local_epochs=1,
                   deadline_s=30, min_clients=N)
    assert all(len(r.participants) == N for r in hist)
    # the same two rounds computed here, by hand: each client's Flower fit, then sample-weighted mean
    from types import SimpleNamespace

    w = init
    for rnd in (1, 2):
        ups, ns = [], []
        for k in range(N):
            c = client_fn(SimpleNamespace(node_config={"partition-id": k, "num-partitions": N})).numpy_client
            params, n, metrics = c.fit(w, {"local-epochs": 1, "server-round": rnd})
            assert metrics == {"partition": k}
            ups.append(params)
            ns.append(n)
        w = weighted_average(ups, ns, w)
    assert all(np.allclose(a, b, atol=1e-9) for a, b in zip(fed.final_weights, w))
    assert hist[-1].extra["num_samples"] == sum(ns)


def test_fedbuff_async_and_hierarchical_gateway(fl_mesh: _Mesh) -> None:
    client = fl_mesh.mesh.client
    hist = Federation(client, fl_mesh.ids).fit(
        _mlp(), "digits", rounds=6, strategy=FedBuff(buffer_size=3, max_staleness=20), local_epochs=2, deadline_s=30,
        trainer=TRAINER, eval_data=load_test_data())
    assert [r.extra["version"] for r in hist] == [1, 2, 3, 4, 5, 6], [r.extra for r in hist]
    assert all(len(r.participants) == 3 for r in hist), [(r.participants, r.dropped) for r in hist]
    assert any(s > 0 for r in hist for s in r.extra["staleness"].values()), [r.extra for r in hist]  # some arrived stale
    # it learns (from ~10% before training), though more slowly than FedAvg: staleness-discounted deltas
    assert max(r.accuracy for r in hist[-2:]) > hist.metadata["initial_eval"]["accuracy"] + 0.25, [r.accuracy for r in hist]

    gw = fl_mesh.gateway.endpoint_id
    fed = Federation(client, fl_mesh.ids[3:], gateways={gw: fl_mesh.ids[:3]})
    hh = fed.fit(_mlp(), "digits", rounds=3, strategy=Hierarchical(FedAvg(), FedAvg()), local_epochs=2, deadline_s=30,
                 trainer=TRAINER, eval_data=load_test_data())
    assert all(sorted(r.participants) == sorted(fl_mesh.ids) for r in hh), [(r.participants, r.stragglers, r.dropped) for r in hh]
    assert all("gateway_fallback" not in r.extra for r in hh), [r.extra for r in hh]
    assert hh[-1].accuracy > hh.metadata["initial_eval"]["accuracy"] + 0.3, [r.accuracy for r in hh]
    assert client.fl_run(fed.run_id)["mode"] == "hierarchical"


def test_too_few_updates_extend_then_skip_with_a_clear_record(fl_mesh: _Mesh) -> None:
    """Last in the module: it leaves one agent dead."""
    victim = fl_mesh.clients[4]

    def kill(round: int, tasks: Dict[str, str]) -> None:
        if round == 1:
            victim.kill()

    fed = Federation(fl_mesh.mesh.client, fl_mesh.ids)
    # no round trained: the run fails loudly (issue 17), with the reason, and keeps its records
    with pytest.raises(FederationError, match="no round trained in 2 round"):
        fed.fit(_mlp(), "digits", rounds=2, strategy=FedAvg(), local_epochs=1, deadline_s=3, min_clients=N,
                max_extensions=1, extension_s=2, trainer=TRAINER, eval_data=load_test_data(), on_round_start=kill)
    assert fed.driver is not None
    hist = fed.driver.history
    r1, r2 = hist
    # round 1: four updates, five needed: the deadline was extended once, then the round skipped
    assert r1.extra["skipped"] is True and r1.extra["extensions"] == 1 and r1.extra["deadline_reached"] is True
    assert "only 4 valid update(s), need min_clients=5" in r1.extra["reason"]
    assert r1.participants == [] and r1.stragglers == [victim.endpoint_id] and r1.extra["version"] == 0
    # round 2: the dead device is offline now, so too few clients even to start the round
    assert r2.extra["skipped"] is True and "only 4 clients available, need 5" in r2.extra["reason"]
    # the model was never averaged from too few updates
    final = decode_weights(fl_mesh.mesh.client.fl_checkpoint(fed.run_id)["weights"])
    assert all(np.array_equal(a, b) for a, b in zip(final, [w.detach().numpy() for w in _mlp().state_dict().values()]))
    assert r1.accuracy == r2.accuracy == hist.metadata["initial_eval"]["accuracy"]
    run = fl_mesh.mesh.client.fl_run(fed.run_id)
    assert run["status"] == "failed" and "only 4 clients available, need 5" in run["error"]
    stored = run["rounds"]
    assert [r["extra"]["reason"] for r in stored] == [r1.extra["reason"], r2.extra["reason"]]
