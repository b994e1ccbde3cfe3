"""Promise 2 of issue 30 (docs/architecture.md, "The transactions on a task's path"): when the
endpoint's agent has credit, a submit's tasks are leased in the transaction that inserts them and
sent right after; exactly-once is unchanged: every accepted task gets exactly one result, is never
lost, and runs once unless an agent died holding it.

Real processes (Mosquitto, ``mesh-hub serve``, ``mesh-agent start``), real SIGKILL / SIGSTOP. Each
task appends a line (its key, pid, wall time) to a marker file per run, so runs are counted outside
the product; results are counted in the hub's ``results`` table, and the ``tasks`` table must hold
nothing queued, leased or acked once everything settled.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from cloud_hub.client import Client, Executor

from . import _h
from ._h import record

RT_BOUND_S = 6.0  # a round trip to an agent with free workers; a lease claimed and never sent waits lease_s (10 s)


class Load:
    """Futures by key, with how often each completed, round-trip times and thread errors."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.futs: dict[str, cf.Future] = {}
        self.calls: Counter[str] = Counter()
        self.rt: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def submit(self, ex: Executor, k: str, sleep: float = 0.0, now: bool = False) -> cf.Future:
        f = (ex.submit_now if now else ex.submit)(record, self.marker, k, sleep)
        with self.lock:
            assert k not in self.futs, k
            self.futs[k] = f

        def cb(_f: cf.Future, k: str = k) -> None:
            with self.lock:
                self.calls[k] += 1
        f.add_done_callback(cb)
        return f

    def roundtrip(self, ex: Executor, k: str, now: bool = False, timeout: float = 90.0) -> None:
        t = time.monotonic()
        self.submit(ex, k, now=now).result(timeout)
        self.rt.append((k, time.monotonic() - t))

    def thread(self, name: str, fn: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"{name}: {exc!r:.400}")
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def verify(self, m, what: str, *, died_at: list[float] | None = None, wait_s: float = 90.0,
               rt_bound: float | None = None) -> dict[str, Any]:
        """Every future done with its own key, once; every key run once (more only if its first run
        began before an agent SIGKILL in ``died_at``); one result row per task; nothing stuck."""
        futs = dict(self.futs)
        done, pending = cf.wait(list(futs.values()), timeout=wait_s)
        detail = ""
        if pending:
            lost = [k for k, f in futs.items() if not f.done()]
            ids = [getattr(futs[k], "task_id", None) for k in lost]
            detail = (f"\n{len(lost)} of {len(futs)} futures not done {wait_s} s after the load, e.g. {lost[:4]} "
                      f"task ids {ids[:4]}; hub states of those: {_h.states(m, [i for i in ids if i])}; "
                      f"runs: {[_h.runs(self.marker).get(k) for k in lost[:4]]}{_h.logs(m)}")
        assert not self.errors, f"{what}: load threads failed: {self.errors[:5]}{detail}"
        assert not pending, f"{what}:{detail}"
        bad = [(k, repr(f.exception())[:200] if f.exception() else f.result()) for k, f in futs.items()
               if f.exception() is not None or f.result() != k]
        assert not bad, f"{what}: {len(bad)} futures failed or got another task's result: {bad[:5]}"
        time.sleep(0.3)
        twice = {k: n for k, n in self.calls.items() if n != 1}
        assert not twice, f"{what}: futures completed {twice}"
        runs = _h.runs(self.marker)
        times = _h.run_times(self.marker)
        never = [k for k in futs if runs.get(k, 0) == 0]
        assert not never, f"{what}: {len(never)} tasks have a result but never ran: {never[:5]}"
        dup = {k: n for k, n in runs.items() if k in futs and n > 1}
        excused = {}
        if dup and died_at:
            excused = {k: n for k, n in dup.items() if any(min(times[k]) < t for t in died_at)}
        unexcused = {k: (n, [round(x, 3) for x in times[k]]) for k, n in dup.items() if k not in excused}
        assert not unexcused, (f"{what}: {len(unexcused)} tasks ran more than once without an agent dying while "
                               f"holding them (SIGKILLs at {[round(t, 3) for t in died_at or []]}): "
                               f"{list(unexcused.items())[:6]}{_h.logs(m, 2000)}")
        ids = [f.task_id for f in futs.values()]
        assert len(set(ids)) == len(ids), f"{what}: two futures share a task id"
        counts = _h.result_counts(m, ids)
        not_once = {i: counts.get(i, 0) for i in ids if counts.get(i, 0) != 1}
        assert not not_once, f"{what}: tasks without exactly one result row: {list(not_once.items())[:5]}"
        settled = _h.until(lambda: not _h.stuck(m, ids), 20, 0.25)
        assert settled, f"{what}: tasks still queued/leased/acked 20 s after all results: {_h.stuck(m, ids)[:5]}"
        if rt_bound is not None:
            slow = sorted([(k, round(t, 2)) for k, t in self.rt if t > rt_bound], key=lambda x: -x[1])
            assert not slow, f"{what}: round trips over {rt_bound} s on a mesh with free workers: {slow[:6]}{_h.logs(m, 2000)}"
        worst = max((t for _, t in self.rt), default=0.0)
        print(f"\n[{what}] round trips: {sorted((round(t, 2), k) for k, t in self.rt)[-8:]}")
        print(f"\n[{what}] tasks={len(futs)} reruns(excused)={len(excused)} round trips={len(self.rt)} worst rt={worst:.2f}s")
        return {"excused": excused}


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p2")
    with _h.mesh(tmp, lease_s=10.0) as m:
        z = m.add_agent("z", "zmq", workers=4, prefetch=16, tags=["t30c"])
        q = m.add_agent("q", "mqtt", workers=2, prefetch=2, tags=["t30c"])
        m.wait_online(z, q)
        yield m, z, q, tmp
        for a in (z, q):  # never leave a stopped agent behind
            if a.proc is not None and a.proc.poll() is None:
                try:
                    os.killpg(a.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass


def ex_for(m, **kw: Any) -> Executor:
    return Executor(Client(m.url, m.token), **kw)


def _burst_loop(load: Load, ex: Executor, tag: str, stop: threading.Event, size: int, pause: float, sleep: float) -> None:
    i = 0
    while not stop.is_set() and i < 60:
        for j in range(size):
            load.submit(ex, f"{tag}-{i}-{j}", sleep=sleep)
        i += 1
        stop.wait(pause)


def _rt_loop(load: Load, ex: Executor, tag: str, stop: threading.Event, n: int, now: bool = False) -> None:
    for i in range(n):
        if stop.is_set():
            return
        load.roundtrip(ex, f"{tag}-{i}", now=now)


def _with_executors(specs: list[dict], body: Any) -> None:
    exs = [ex_for(**s) for s in specs]
    ok = False
    try:
        body(exs)
        ok = True
    finally:
        for e in exs:
            try:
                e.shutdown(wait=ok)  # all futures are done when body passed; never hang on a failure
            except Exception:  # noqa: BLE001
                pass


# --------------------------------------------------------------------------- A. concurrency, no faults
def test_concurrent_executors_round_trips_and_bursts(mx):
    m, z, q, tmp = mx
    load = Load(str(tmp / f"runs-a-{uuid.uuid4().hex[:6]}"))
    stop = threading.Event()
    specs = [dict(m=m, endpoint_id=z.endpoint_id), dict(m=m, endpoint_id=z.endpoint_id, early_results=True),
             dict(m=m, endpoint_id=z.endpoint_id, stream=False), dict(m=m, endpoint_id=q.endpoint_id),
             dict(m=m, endpoint_id=z.endpoint_id), dict(m=m, endpoint_id=q.endpoint_id, early_results=True)]

    def body(exs):
        # 1. round trips only (at most 6 tasks in flight, the agents have free workers and credit): each
        # submit is leased in its insert and sent at once; one claimed and never sent would wait lease_s
        lat = Load(load.marker + "-rt")
        lat.submit(exs[0], "a-warm").result(60)  # the SDK serializes `record` once (cached for every Executor)
        ts = [lat.thread(f"rt{n}", _rt_loop, lat, ex, f"a-rt{n}", stop, 10) for n, ex in enumerate(exs)]
        for t in ts:
            t.join(120)
        lat.verify(m, "concurrent round trips", rt_bound=RT_BOUND_S)
        # 2. bursts from three Executors while the others keep doing round trips
        ts = []
        for n, ex in enumerate(exs):
            ts.append(load.thread(f"rt{n}", _rt_loop, load, ex, f"a2-rt{n}", stop, 30))
            if n % 2 == 0:
                ts.append(load.thread(f"burst{n}", _burst_loop, load, ex, f"a-b{n}", stop, 40, 0.2, 0.0))
        time.sleep(3)
        stop.set()
        for t in ts:
            t.join(120)
        load.verify(m, "concurrent executors with bursts")

    _with_executors(specs, body)


# --------------------------------------------------------------------------- B. agent SIGKILL + restart
def test_submits_racing_an_agent_sigkill_and_restart(mx):
    m, z, q, tmp = mx
    load = Load(str(tmp / f"runs-b-{uuid.uuid4().hex[:6]}"))
    stop = threading.Event()
    died: list[float] = []
    specs = [dict(m=m, endpoint_id=z.endpoint_id), dict(m=m, endpoint_id=z.endpoint_id, early_results=True),
             dict(m=m, endpoint_id=z.endpoint_id, stream=False)]

    def body(exs):
        ts = [load.thread("b0", _burst_loop, load, exs[0], "b-b0", stop, 8, 0.1, 0.05),
              load.thread("b1", _burst_loop, load, exs[1], "b-b1", stop, 5, 0.07, 0.05),
              load.thread("b2", _burst_loop, load, exs[2], "b-b2", stop, 6, 0.15, 0.1)]
        for round_ in range(2):
            time.sleep(1.5)
            died.append(time.time())
            z.kill()
            time.sleep(0.7 if round_ == 0 else 1.5)
            z.start()
        time.sleep(1.0)
        stop.set()
        for t in ts:
            t.join(120)
        load.verify(m, "agent SIGKILL x2", died_at=died, wait_s=120)

    try:
        _with_executors(specs, body)
    finally:
        if not z.alive():
            z.start()
    m.wait_online(z, timeout=30)


# --------------------------------------------------------------------------- C. agent SIGSTOP / SIGCONT
def test_submits_while_agents_are_frozen_run_exactly_once(mx):
    """z (ZeroMQ) frozen 5.5 s, past lost_after_s (4 s): the hub ends its session and re-queues what was
    leased, including leases made in the insert's transaction; q (MQTT) frozen 2.5 s, under it: the hub
    keeps leasing to it while it cannot read. Nobody died, so every task runs exactly once."""
    m, z, q, tmp = mx
    load = Load(str(tmp / f"runs-c-{uuid.uuid4().hex[:6]}"))
    stop = threading.Event()
    specs = [dict(m=m, endpoint_id=z.endpoint_id), dict(m=m, endpoint_id=z.endpoint_id, early_results=True),
             dict(m=m, endpoint_id=z.endpoint_id, stream=False), dict(m=m, endpoint_id=q.endpoint_id)]
    frozen: set = set()

    def freeze(a, on: bool) -> None:
        os.killpg(a.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)  # the agent and its workers
        (frozen.add if on else frozen.discard)(a)

    def body(exs):
        ts = [load.thread("c0", _burst_loop, load, exs[0], "c-b0", stop, 6, 0.15, 0.1),
              load.thread("c1", _burst_loop, load, exs[1], "c-b1", stop, 4, 0.1, 0.0),
              load.thread("c2", _burst_loop, load, exs[2], "c-b2", stop, 3, 0.2, 0.05),
              load.thread("c3", _burst_loop, load, exs[3], "c-q3", stop, 3, 0.15, 0.0)]
        time.sleep(1.0)
        freeze(z, True)
        time.sleep(1.0)
        freeze(q, True)
        time.sleep(2.5)
        freeze(q, False)
        time.sleep(2.0)  # z: 5.5 s in all
        freeze(z, False)
        time.sleep(1.5)
        stop.set()
        for t in ts:
            t.join(120)
        load.verify(m, "agents SIGSTOP (z 5.5 s, q 2.5 s) / SIGCONT", wait_s=120)

    try:
        _with_executors(specs, body)
    finally:
        for a in list(frozen):
            os.killpg(a.proc.pid, signal.SIGCONT)


# --------------------------------------------------------------------------- D. hub SIGKILL + restart
def test_submits_through_a_hub_sigkill_and_restart(mx):
    m, z, q, tmp = mx
    load = Load(str(tmp / f"runs-d-{uuid.uuid4().hex[:6]}"))
    stop = threading.Event()
    specs = [dict(m=m, endpoint_id=z.endpoint_id), dict(m=m, endpoint_id=q.endpoint_id, early_results=True),
             dict(m=m, endpoint_id=z.endpoint_id, stream=False), dict(m=m, endpoint_id=z.endpoint_id)]

    def body(exs):
        ts = [load.thread("d0", _burst_loop, load, exs[0], "d-b0", stop, 10, 0.1, 0.05),
              load.thread("d1", _burst_loop, load, exs[1], "d-b1", stop, 3, 0.2, 0.0),
              load.thread("d2", _burst_loop, load, exs[2], "d-b2", stop, 5, 0.15, 0.0),
              load.thread("d3", _rt_loop, load, exs[3], "d-rt3", stop, 400)]
        time.sleep(1.5)
        m.kill_hub()
        time.sleep(1.0)
        m.start_hub()
        time.sleep(2.0)
        stop.set()
        for t in ts:
            t.join(150)
        load.verify(m, "hub SIGKILL + restart", wait_s=120)

    _with_executors(specs, body)
    m.wait_online(z, q, timeout=30)


# --------------------------------------------------------------------------- E. mixed placement + key races
def test_mixed_named_auto_tags_start_now_and_racing_idempotent_resubmits(mx):
    m, z, q, tmp = mx
    load = Load(str(tmp / f"runs-e-{uuid.uuid4().hex[:6]}"))
    stop = threading.Event()
    died: list[float] = []
    specs = [dict(m=m, endpoint="auto"), dict(m=m, endpoint=[z.endpoint_id, q.endpoint_id]),
             dict(m=m, endpoint={"tags": ["t30c"]}), dict(m=m, endpoint_id=z.endpoint_id),
             dict(m=m, endpoint_id=q.endpoint_id)]
    # the same batch under one key, raced over REST, the msgpack stream and the JSON stream
    c = m.client
    fid = c.register_function(record)
    marker = load.marker
    race_keys = [f"e-race-{i}" for i in range(6)]
    specs_race = [Client.task_spec(z.endpoint_id, fid, (marker, k)) for k in race_keys[:3]] + \
                 [Client.task_spec(q.endpoint_id, fid, (marker, k)) for k in race_keys[3:]]
    ikey = f"race-{uuid.uuid4().hex}"
    body_json = Client.batch_body(specs_race, ikey, None, None)
    body_mp = dict(body_json, tasks=[dict(t, args=_h.base64.b64decode(t["args"])) for t in body_json["tasks"]])
    answers: list[Any] = []
    go = threading.Event()

    def race(kind: str) -> None:
        go.wait(20)
        try:
            if kind == "rest":
                st, a = _h.rest(m, body_json)
                answers.append((kind, tuple(a["task_ids"]) if st == 201 else (st, a)))
            else:
                s = _h.RawWS(m, enc="msgpack" if kind == "mp" else None)
                try:
                    _, a = s.submit_mp(body_mp) if kind == "mp" else s.submit_json(body_json)
                finally:
                    s.close()
                answers.append((kind, tuple(a["task_ids"]) if a.get("op") == "accepted" else a))
        except Exception as exc:  # noqa: BLE001
            answers.append((kind, repr(exc)))

    def body(exs):
        ts = [load.thread("e-auto", _burst_loop, load, exs[0], "e-auto", stop, 10, 0.2, 0.05),
              load.thread("e-list", _burst_loop, load, exs[1], "e-list", stop, 6, 0.2, 0.0),
              load.thread("e-tags", _burst_loop, load, exs[2], "e-tags", stop, 6, 0.25, 0.0),
              load.thread("e-now-z", _rt_loop, load, exs[3], "e-now-z", stop, 60, True),
              load.thread("e-now-q", _rt_loop, load, exs[4], "e-now-q", stop, 30, True),
              load.thread("e-rt-q", _rt_loop, load, exs[4], "e-rt-q", stop, 30)]
        racers = [threading.Thread(target=race, args=(k,), daemon=True) for k in ("rest", "mp", "json") * 3]
        time.sleep(1.0)
        [r.start() for r in racers]
        go.set()
        time.sleep(0.5)
        died.append(time.time())
        q.kill()  # the MQTT agent dies mid-mix; auto/list/tags tasks may move, q's named tasks wait for it
        time.sleep(1.0)
        q.start()
        time.sleep(2.0)
        stop.set()
        for t in ts + racers:
            t.join(150)
        assert len(answers) == 9, f"racers did not all answer: {answers}"
        distinct = {a for _, a in answers}
        assert len(distinct) == 1 and isinstance(next(iter(distinct)), tuple), f"one key raced on 3 paths answered: {answers}"
        race_ids = list(next(iter(distinct)))
        load.verify(m, "mixed placement + q SIGKILL", died_at=died, wait_s=120)
        # the raced batch: each of its 6 tasks ran once (or again only if q died holding it) and has one result
        ok = _h.until(lambda: all(_h.result_counts(m, race_ids).get(i) == 1 for i in race_ids), 60, 0.25)
        assert ok, f"raced batch: results {dict(_h.result_counts(m, race_ids))} states {_h.states(m, race_ids)}"
        runs, times = _h.runs(marker), _h.run_times(marker)
        bad = {k: runs.get(k, 0) for k in race_keys
               if runs.get(k, 0) == 0 or (runs[k] > 1 and not any(min(times[k]) < t for t in died))}
        assert not bad, f"raced batch: tasks not run exactly once: {bad} (answers {answers[:2]})"
        assert not _h.stuck(m, race_ids), _h.stuck(m, race_ids)

    try:
        _with_executors(specs, body)
    finally:
        if not q.alive():
            q.start()
    m.wait_online(z, q, timeout=30)


def test_zz_nothing_left_in_flight_anywhere(mx):
    """After every test of this module settled: no task of this hub is queued, leased or acked."""
    m, *_ = mx
    ok = _h.until(lambda: not _h.stuck(m), 20, 0.25)
    assert ok, f"tasks left in flight after everything settled: {_h.stuck(m)[:8]} states {_h.states(m)}"
