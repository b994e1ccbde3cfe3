"""Round drivers (fl.drivers) on a real mesh: Mosquitto, the hub and three agent processes (one
worker each) that declare ``digits``, though the client app here loads no data. The three built-in modes through
``Federation``, and a new mode written as one small class.

One mesh for the whole module; tests run in file order and leave every agent running. The
straggler test is last: its slow client is still sleeping in its worker when the test ends.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence

import numpy as np
import pytest

from fl import FedAsync, FedAvg, Federation
from fl.client import FunctionClientApp
from fl.localmesh import DigitsMesh, digits_mesh
from fl.drivers import Aggregate, SyncDriver, register_driver
from fl.strategies import ClientUpdate, Weights
from fl.wire import decode_weights, encode_weights

pytestmark = pytest.mark.integration

N = 3


_Mesh = DigitsMesh


@pytest.fixture(scope="module")
def fl_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DigitsMesh]:
    # the app loads no data, but an endpoint still refuses a run on a dataset it does not
    # declare: each agent declares its share of ``digits`` (never loaded here)
    with digits_mesh(tmp_path_factory.mktemp("fldrivers"), N, prefix="drv-client", workers=1) as dm:
        yield dm


def _train(weights: Weights, data: Any, config: Dict[str, Any]):
    """Client k (its ``client_index``) moves every weight to k+1 and reports k+1 samples."""
    k = int(config.get("client_index", 0))
    return [np.full_like(w, k + 1.0) for w in weights], k + 1, {"loss": 1.0 / (k + 1)}


def _slow_train(weights: Weights, data: Any, config: Dict[str, Any]):
    """``_train``, but client 2 sleeps well past the round's deadline: a real straggler."""
    import time as _time

    if int(config.get("client_index", 0)) == 2:
        _time.sleep(8.0)
    return _train(weights, data, config)


class _App(FunctionClientApp):
    loads_data = False  # the agents declare no datasets


class _PerClient(FedAvg):
    """FedAvg that gives each client its index in ``ids`` (so the training is client-specific:
    endpoint ids are random, the index is not)."""

    def __init__(self, ids: Sequence[str], **kw: Any) -> None:
        super().__init__(**kw)
        self.ids = list(ids)

    def configure_round(self, round, available_clients):
        out = super().configure_round(round, available_clients)
        for ins in out:
            ins.config["client_index"] = self.ids.index(ins.client_id)
        return out


_INIT = [np.zeros((2, 2), np.float32), np.zeros(2, np.float32)]


def _app(train: Any = _train) -> _App:
    return _App(train, initial_weights=_INIT)


def test_sync_rounds_aggregate_checkpoint_and_count_bytes(fl_mesh: _Mesh) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids
    fed = Federation(client, ids, poll_s=0.05)
    hist = fed.fit(_app(), "digits", rounds=2, strategy=_PerClient(ids), deadline_s=30, min_clients=3)
    # sample-weighted: (1*1 + 2*2 + 3*3) / 6
    assert all(np.allclose(w, 14 / 6) for w in fed.final_weights)
    run = client.fl_run(fed.run_id)
    assert run["mode"] == "sync" and run["status"] == "finished" and run["rounds_done"] == 2
    r1 = hist[0]
    assert sorted(r1.participants) == sorted(ids) and r1.extra["version"] == 1
    assert set(r1.extra["bytes_up"]) == set(ids) == set(r1.extra["bytes_down"])
    assert r1.extra["bytes_up_total"] == sum(r1.extra["bytes_up"].values()) > 0
    # The hub does not hand back a task's payload, so the bytes sent down are checked against
    # what round 1 must have sent each of the three clients: the initial weights' wire blob.
    assert r1.extra["bytes_down"] == {c: len(encode_weights(_INIT)) for c in ids}
    assert r1.extra["bytes_down_total"] == sum(r1.extra["bytes_down"].values()) == 3 * len(encode_weights(_INIT)) > 0
    assert [r["round"] for r in run["rounds"]] == [1, 2]
    assert run["rounds"][0]["extra"]["bytes_down_total"] == r1.extra["bytes_down_total"]
    ck = client.fl_checkpoint(fed.run_id)
    assert ck["round"] == 2
    assert all(np.array_equal(a, b) for a, b in zip(decode_weights(ck["weights"]), fed.final_weights))
    assert isinstance(fed.driver, SyncDriver)


def test_async_mode_one_record_per_model(fl_mesh: _Mesh) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids[:2]
    fed = Federation(client, ids, poll_s=0.05)
    hist = fed.fit(_app(), "digits", rounds=3, strategy=FedAsync(alpha=0.5), deadline_s=30)
    assert [r.extra["version"] for r in hist] == [1, 2, 3]
    assert client.fl_run(fed.run_id)["mode"] == "async"
    assert all(r.extra["bytes_up_total"] > 0 for r in hist)


@register_driver
class _MedianDriver(SyncDriver):
    """A new mode in one class: coordinate-wise median instead of the strategy's mean."""

    mode = "test-median"

    def aggregate(self, round: int, updates: List[ClientUpdate], current: Weights) -> Aggregate:
        if len(updates) < self.run.min_clients:
            return Aggregate(None, reason="too few")
        med = [np.median(np.stack([u.weights[t] for u in updates]), axis=0).astype(np.float32) for t in range(len(current))]
        return Aggregate(med, [u.client_id for u in updates], extra={"median_of": len(updates)})


class _MedianStrategy(_PerClient):
    driver = "test-median"


def test_a_new_mode_is_one_class(fl_mesh: _Mesh) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids
    fed = Federation(client, ids, poll_s=0.05)
    hist = fed.fit(_app(), "digits", rounds=1, strategy=_MedianStrategy(ids), deadline_s=30)
    assert all(np.allclose(w, 2.0) for w in fed.final_weights) and hist[0].extra["median_of"] == 3
    assert client.fl_run(fed.run_id)["mode"] == "test-median"
    # or named per run
    fed2 = Federation(client, ids, poll_s=0.05)
    fed2.fit(_app(), "digits", rounds=1, strategy=_PerClient(ids), deadline_s=30, driver=_MedianDriver)
    assert client.fl_run(fed2.run_id)["mode"] == "test-median"


def test_resume_continues_from_the_checkpoint(fl_mesh: _Mesh) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids[:2]
    fed = Federation(client, ids, poll_s=0.05)
    fed.fit(_app(), "digits", rounds=3, strategy=_PerClient(ids), deadline_s=30, on_round=lambda rec, w: rec.round < 2)
    run = client.fl_run(fed.run_id)
    assert run["status"] == "aborted" and run["rounds_done"] == 2
    # The hub does not list a run's tasks, so "only round 3's training tasks were sent" is read
    # from the driver's on_round_start hook: the rounds it started and the tasks of each.
    started: List[Any] = []
    hist = Federation(client, ids, poll_s=0.05).fit(
        _app(), "digits", rounds=3, strategy=_PerClient(ids), deadline_s=30, resume=fed.run_id,
        on_round_start=lambda r, tasks: started.append((r, sorted(tasks))))
    assert [r.round for r in hist] == [1, 2, 3] and hist.metadata["resumed_from"] == 2
    assert started == [(3, sorted(ids))]  # round 3 only: one training task per client
    run = client.fl_run(fed.run_id)
    assert run["status"] == "finished" and [r["round"] for r in run["rounds"]] == [1, 2, 3]


def _noisy_train(weights: Weights, data: Any, config: Dict[str, Any]):
    rng = np.random.default_rng(int(config["seed"]))
    return [w + rng.normal(0, 0.1, w.shape).astype(w.dtype) for w in weights], 10, {}


def test_compressed_uplink_through_sync_and_async_drivers(fl_mesh: _Mesh) -> None:
    # each agent keeps its error-feedback residual in its own MESH_ENDPOINT_DATA_DIR
    client, ids = fl_mesh.mesh.client, fl_mesh.ids
    big = [np.zeros((32, 32), np.float32), np.zeros(32, np.float32)]
    fed = Federation(client, ids, poll_s=0.05)
    plain = fed.fit(_App(_noisy_train, initial_weights=big), "digits", rounds=1, strategy=_PerClient(ids), deadline_s=30)
    hist = fed.fit(_App(_noisy_train, initial_weights=big), "digits", rounds=2, strategy=_PerClient(ids), deadline_s=30,
                   compression="topk:0.1+q8")
    assert client.fl_run(fed.run_id)["config"]["compression"] == "topk:0.1+q8" and hist.metadata["compression"] == "topk:0.1+q8"
    assert hist[0].bytes_up < plain[0].bytes_up / 5 and hist[0].bytes_down == plain[0].bytes_down
    assert hist[0].extra["error_feedback"] == {c: None for c in ids}
    assert hist[1].extra["error_feedback"] == {c: 1 for c in ids}
    # two rounds, three clients, 10 % of the weights each: at most 60 % of them moved
    w = np.concatenate([a.ravel() for a in fed.final_weights])
    assert 0.1 * w.size <= np.count_nonzero(w) <= 0.6 * w.size
    t = hist.traffic()
    assert t["up"] == sum(r.bytes_up for r in hist) and t["up_per_update"] == t["up"] / 6
    with pytest.raises(ValueError, match="cannot read compression"):
        fed.fit(_app(), "digits", rounds=1, compression="gzip")
    hist = Federation(client, ids, poll_s=0.05).fit(
        _app(), "digits", rounds=2, strategy=FedAsync(alpha=0.5), deadline_s=30, compression="fp16")
    assert [r.extra["version"] for r in hist] == [1, 2] and not any(r.dropped for r in hist)


def _dtype_train(weights: Weights, data: Any, config: Dict[str, Any]):
    """``_noisy_train`` that reports whether every weight it got was float32 (it runs on the
    endpoint, so what it saw comes back as a metric)."""
    out, n, _ = _noisy_train(weights, data, config)
    return out, n, {"got_float32": float(all(w.dtype == np.float32 for w in weights))}


def test_fp16_downlink_halves_the_bytes_down_and_clients_train_in_float32(fl_mesh: _Mesh) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids[:2]
    big = [np.zeros((32, 32), np.float32), np.zeros(32, np.float32)]
    fed = Federation(client, ids, poll_s=0.05)
    plain = fed.fit(_App(_dtype_train, initial_weights=big), "digits", rounds=2, strategy=_PerClient(ids), deadline_s=30)
    half = fed.fit(_App(_dtype_train, initial_weights=big), "digits", rounds=2, strategy=_PerClient(ids), deadline_s=30,
                   downlink="fp16", compression="q8")
    assert half[1].bytes_down < 0.6 * plain[1].bytes_down and client.fl_run(fed.run_id)["config"]["downlink"] == "fp16"
    seen = [m for h in (plain, half) for r in h for m in r.extra["client_metrics"].values()]
    assert len(seen) == 2 * 2 * 2 and all(m["got_float32"] == 1.0 for m in seen), seen
    assert all(w.dtype == np.float32 for w in fed.final_weights)  # the driver keeps float32
    with pytest.raises(ValueError, match="downlink"):
        fed.fit(_app(), "digits", rounds=1, downlink="q8")


def _late_train(weights: Weights, data: Any, config: Dict[str, Any]):
    """``_train``; in round 1 client 2 is slow (past the deadline) and leaves a marker when done;
    in round 2 client 1 waits for that marker (bounded) and then a little more, so client 2's
    late round-1 update surely arrives while round 2 is open."""
    import os
    import time as _time

    k, rnd, marker = int(config["client_index"]), int(config["round"]), config["marker"]
    if rnd == 1 and k == 2:
        _time.sleep(6.0)
        out = _train(weights, data, config)
        open(marker, "w").close()
        return out
    if rnd == 2 and k == 1:
        end = _time.monotonic() + 60.0
        while not os.path.exists(marker) and _time.monotonic() < end:
            _time.sleep(0.1)
        _time.sleep(3.0)
    return _train(weights, data, config)


class _LateRounds(_PerClient):
    """Round 1 asks everyone; round 2 asks clients 0 and 1 only (client 2's task of round 1 is
    still running there); every client learns the round and the marker path. With a 3 s
    deadline, min_clients=2 and one 60 s extension: round 1 ends at its deadline with clients 0
    and 1, round 2 is extended (client 1 waits) until client 1 is back."""

    def __init__(self, ids: Sequence[str], marker: str, **kw: Any) -> None:
        super().__init__(ids, **kw)
        self.marker = marker

    def configure_round(self, round, available_clients):
        pick = list(available_clients) if round == 1 else [c for c in available_clients if self.ids.index(c) < 2]
        out = super().configure_round(round, pick)
        for ins in out:
            ins.config.update(round=round, marker=self.marker)
        return out


@pytest.mark.parametrize("late_updates", ["use", "discard"])
def test_a_late_update_joins_the_next_round_when_asked_to(fl_mesh: _Mesh, tmp_path, late_updates: str) -> None:
    client, ids = fl_mesh.mesh.client, fl_mesh.ids
    marker = str(tmp_path / "client2-done")
    fed = Federation(client, ids, poll_s=0.05)
    hist = fed.fit(_app(_late_train), "digits", rounds=2, strategy=_LateRounds(ids, marker), deadline_s=3,
                   min_clients=2, late_updates=late_updates, max_extensions=1, extension_s=60)
    r1, r2 = hist
    assert r1.stragglers == [ids[2]] and sorted(r1.participants) == sorted(ids[:2])
    assert sorted(r2.extra["asked"]) == sorted(ids[:2]) and not r2.stragglers
    if late_updates == "use":
        # client 2's round-1 update (weights 3, 3 samples, one version stale: weight round(3 / sqrt 2) = 2)
        assert sorted(r2.participants) == sorted(ids)
        assert r2.extra["late_used"] == [{"client": ids[2], "round": 1, "staleness": 1, "num_samples": 3, "weight": 2}]
        assert "late_discarded" not in r2.extra
        assert all(np.allclose(w, (1 * 1 + 2 * 2 + 2 * 3) / 5) for w in fed.final_weights)
    else:  # Flower's semantics: listed, not used
        assert sorted(r2.participants) == sorted(ids[:2]) and "late_used" not in r2.extra
        assert r2.extra["late_discarded"] == [{"client": ids[2], "round": 1}]
        assert all(np.allclose(w, 5 / 3) for w in fed.final_weights)
    with pytest.raises(ValueError, match="late_updates must be 'discard' or 'use'"):
        fed.fit(_app(), "digits", rounds=1, late_updates="keep")


def test_straggler_is_recorded_and_the_round_goes_on(fl_mesh: _Mesh) -> None:
    """Last in the module: client 2's worker is still asleep when it ends."""
    client, ids = fl_mesh.mesh.client, fl_mesh.ids
    slow = ids[2]
    fed = Federation(client, ids, poll_s=0.05)
    hist = fed.fit(_app(_slow_train), "digits", rounds=1, strategy=_PerClient(ids), deadline_s=3, min_clients=2)
    (r1,) = hist
    assert r1.stragglers == [slow] and r1.extra["deadline_reached"] is True
    assert all(np.allclose(w, 5 / 3) for w in fed.final_weights)  # (1*1 + 2*2) / 3
    assert slow in r1.extra["bytes_down"] and slow not in r1.extra["bytes_up"]
    assert sorted(r1.participants) == sorted(ids[:2])
