"""Outsider's check of issue 28 item 1: a Pool's task (and a Process) starts now, or says why.

Written from docs/multiprocessing.md ("Start", "Cancel", "Lease") and README.md only, against a
real mesh: LocalMesh (real Mosquitto, real hub), real ``mesh-agent start`` processes, a real
redis-server on a free port. Parameters differ on purpose from the docs' examples (Barrier(3) and
Barrier(5), a cap of 1, Pool(5) on a fleet that can start 2, on-demand workers, an offline pin).

Every wait is bounded; a check that would hang fails with what it saw instead.
"""

from __future__ import annotations

import errno
import functools
import multiprocessing as std_mp
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor
from cloud_hub.client import multiprocessing as mp

try:  # where the program's Executor lives moved between revisions of the tree
    from cloud_hub.client.multiprocessing import _runner as _mp_runner
except ImportError:  # pragma: no cover - older tree
    from cloud_hub.client.multiprocessing import _state as _mp_runner  # type: ignore[no-redef]
from cloud_hub.localmesh import AgentProcess, LocalMesh
from tests.integration.test_mp_proxies import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]


# ---------------------------------------------------------------- what runs on the agents' workers
def _rc(url: str) -> Any:
    import redis as _redis

    return _redis.Redis.from_url(url)


def t_filler(url: str, key: str, dur: float) -> int:
    """Another program's long task: says it runs, then occupies its worker."""
    r = _rc(url)
    r.rpush(key, f"{os.environ.get('MESH_ENDPOINT_ID', '?')}:{time.time()!r}")
    time.sleep(dur)
    r.rpush(key + ":end", f"{os.getpid()}:{time.time()!r}")
    return os.getpid()


def t_barrier(bar: Any, url: str, key: str, i: int, wait_s: float) -> tuple[int, str | None, float]:
    r = _rc(url)
    r.rpush(key + ":arrived", f"{i}:{time.time()!r}")
    bar.wait(timeout=wait_s)
    return i, os.environ.get("MESH_ENDPOINT_ID"), time.time()


def t_count(url: str, key: str, x: int, dur: float = 0.3) -> int:
    """Counts how many of these run at once (redis counter), records its start and end."""
    r = _rc(url)
    n = r.incr(key + ":cur")
    r.rpush(key + ":seen", n)
    r.rpush(key + ":starts", repr(time.time()))
    try:
        time.sleep(dur)
        return x * 3
    finally:
        r.decr(key + ":cur")
        r.rpush(key + ":ends", repr(time.time()))


def t_pc(q: Any, role: str, n: int) -> int:
    if role == "cons":
        return sum(q.get(timeout=40) for _ in range(n))
    for i in range(n):
        q.put(i)
    return -1


def t_slow_square(x: int) -> int:
    time.sleep(0.08 * (7 - x) if x < 7 else 0)
    return x * x


def t_first_slow(x: int) -> int:
    if x == 0:
        time.sleep(3.0)
    return x + 100


def t_add(a: int, b: int) -> int:
    return a + b


def t_fail(x: int) -> int:
    if x == 3:
        raise ValueError(f"bad item {x}")
    return x


def t_plus(x: int) -> int:
    return x + 1


def p_wait(ev: Any, url: str, key: str, name: str) -> None:
    _rc(url).rpush(key, f"{name}:{time.time()!r}")
    if not ev.wait(60):
        raise SystemExit(3)


def p_mark(url: str, key: str, name: str) -> None:
    _rc(url).rpush(key, f"{name}:{time.time()!r}")


# ---------------------------------------------------------------- harness
@dataclass
class Env:
    mesh: LocalMesh
    redis_url: str
    r: Any
    a: AgentProcess
    b: AgentProcess
    extra: dict[str, AgentProcess] = field(default_factory=dict)


def _wait_len(r: Any, key: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.llen(key) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{key}: only {r.llen(key)} of {n} entries within {timeout} s")


def _bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any, BaseException | None]:
    """Run fn in a daemon thread; (finished, value, exception)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["v"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True, name="outsider-bounded")
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box.get("v"), box.get("e")


def _times(r: Any, key: str) -> list[float]:
    return [float(x.decode().rsplit(":", 1)[-1]) if b":" in x else float(x) for x in r.lrange(key, 0, -1)]


class Fillers:
    """Another program (its own Executor, its own task group): ``running`` long tasks per agent
    that occupy every pool slot, and ``queued`` more behind them in the agent's prefetch queue."""

    def __init__(self, env: Env, agents: list[AgentProcess], dur: float = 45.0, queued: int = 3) -> None:
        self.key = f"fill:{time.time_ns()}"
        self.t0 = time.time()
        self.exs = []
        self.futs = []
        for ag in agents:
            ex = Executor(client=env.mesh.client, endpoint=ag.endpoint_id)
            self.exs.append(ex)
            slots = ag.cfg.workers or 1
            self.futs += [ex.submit(t_filler, env.redis_url, self.key, dur) for _ in range(slots + queued)]
        want = {ag.endpoint_id: ag.cfg.workers or 1 for ag in agents}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            eps = [x.decode().split(":")[0] for x in env.r.lrange(self.key, 0, -1)]
            if all(eps.count(e) >= n for e, n in want.items()):
                break
            time.sleep(0.05)
        else:
            self.stop()
            raise AssertionError(f"precondition: the other program's tasks did not fill every slot within 40 s: "
                                 f"running per endpoint {[(e, eps.count(e)) for e in want]}, want {want}")
        time.sleep(0.5)  # the queued ones reach the agents' queues

    def stop(self) -> None:
        for ex in self.exs:
            try:
                ex.cancel_futures([f for f in self.futs if getattr(f, "_mesh_executor", None) is ex])
            except Exception:  # noqa: BLE001 - best effort
                pass
            ex.shutdown(wait=False, cancel_futures=True)
        time.sleep(4)  # the killed workers' replacements boot before the next check


def _add_agent_with_env(mesh: LocalMesh, name: str, env_vars: dict[str, str], **kw: Any) -> AgentProcess:
    """add_agent, its process started with these environment variables (Popen copies os.environ)."""
    old = {k: os.environ.get(k) for k in env_vars}
    os.environ.update(env_vars)
    try:
        return mesh.add_agent(name, **kw)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required (./taskw setup)")
    work = Path(tmp_path_factory.mktemp("o28b"))
    rs = RedisServer(work)
    mesh = LocalMesh(work / "mesh", heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0)
    mesh.start()
    try:
        a = mesh.add_agent("fill-a", "mqtt", workers=2, tags=["grp"])
        b = mesh.add_agent("fill-b", "zmq", workers=2, tags=["grp"])
        mesh.wait_online(a, b, timeout=60)
        mp.config(client=mesh.client, redis_url=rs.url, endpoint="auto", start_timeout_s=30)
        e = Env(mesh, rs.url, redis.Redis.from_url(rs.url), a, b)
        yield e
    finally:
        try:
            _mp_runner.shutdown_executor()
        finally:
            mesh.stop()
            rs.stop()


@pytest.fixture(scope="module")
def extra(env: Env) -> dict[str, AgentProcess]:
    """Agents added after the "auto" checks ran (so "auto" there spans fill-a and fill-b only)."""
    m = env.mesh
    cap = _add_agent_with_env(m, "cap1", {"MESH_START_NOW_MAX": "1"}, transport="mqtt", workers=1)
    od = m.add_agent("ondemand2", "zmq", workers=2, worker_idle_s=120)
    od3 = m.add_agent("ondemand3", "mqtt", workers=3, worker_idle_s=120)
    gone = m.add_agent("gone", "mqtt", workers=1)
    m.wait_online(cap, od, od3, gone, timeout=60)
    gone.stop(timeout=10)
    m.wait_online(gone, timeout=30, online=False)
    env.extra.update(cap=cap, od=od, od3=od3, gone=gone)
    return env.extra


def _cfg(endpoint: Any, start_timeout_s: float = 30) -> None:
    mp.config(endpoint=endpoint, start_timeout_s=start_timeout_s)


# ---------------------------------------------------------------- 1. Barrier(5) across agents, "auto"
def test_barrier5_auto_while_another_program_fills_every_slot_and_queue(env: Env) -> None:
    fill = Fillers(env, [env.a, env.b], dur=45, queued=3)
    try:
        _cfg("auto")
        key = f"b5:{time.time_ns()}"
        bar = mp.Barrier(5)
        t0 = time.time()
        with mp.Pool(5) as pool:
            res = pool.starmap_async(functools.partial(t_barrier, bar, env.redis_url, key), [(i, 60) for i in range(5)], chunksize=1)
            try:
                out = res.get(timeout=70)
            except std_mp.TimeoutError:
                pytest.fail(f"Barrier(5) Pool did not finish in 70 s; arrived: {env.r.lrange(key + ':arrived', 0, -1)}")
        elapsed = time.time() - t0
        assert [o[0] for o in out] == list(range(5)), out
        assert {o[1] for o in out} <= {env.a.endpoint_id, env.b.endpoint_id}, out
        # the fillers run 45 s: a chunk queued behind them would pass the barrier only after that
        assert elapsed < 30, f"Barrier(5) passed only after {elapsed:.1f} s (queued behind the other program?)"
    finally:
        fill.stop()


# ---------------------------------------------------------------- 2. Barrier(3) pinned to one busy agent
def test_barrier3_pinned_to_an_agent_whose_slots_and_prefetch_are_full(env: Env) -> None:
    fill = Fillers(env, [env.a], dur=45, queued=4)
    try:
        _cfg(env.a.endpoint_id)
        key = f"b3:{time.time_ns()}"
        bar = mp.Barrier(3)
        t0 = time.time()
        with mp.Pool(3) as pool:
            res = pool.starmap_async(functools.partial(t_barrier, bar, env.redis_url, key), [(i, 60) for i in range(3)], chunksize=1)
            try:
                out = res.get(timeout=70)
            except std_mp.TimeoutError:
                pytest.fail(f"Barrier(3) Pool did not finish in 70 s; arrived: {env.r.lrange(key + ':arrived', 0, -1)}")
        elapsed = time.time() - t0
        assert [o[0] for o in out] == [0, 1, 2]
        assert {o[1] for o in out} == {env.a.endpoint_id}, f"a pinned Pool ran elsewhere: {out}"
        assert elapsed < 30, f"Barrier(3) passed only after {elapsed:.1f} s"
        # the other program's tasks are untouched and still running/queued
        early = [(getattr(f, "task_id", None), f.cancelled() or f.exception(0) or f.result()) for f in fill.futs if f.done()]
        assert not early, (f"the other program's 45 s tasks ended {time.time() - fill.t0:.1f} s after submission: {early}; "
                           f"starts {env.r.lrange(fill.key, 0, -1)} ends {env.r.lrange(fill.key + ':end', 0, -1)}")
    finally:
        fill.stop()


# ---------------------------------------------------------------- 3. Queue between two chunks of one map
def test_queue_consumer_chunk_sent_first_and_producer_chunk_meet(env: Env) -> None:
    fill = Fillers(env, [env.a, env.b], dur=45, queued=2)
    try:
        _cfg({"tags": ["grp"]})
        q = mp.Queue()
        n = 60
        t0 = time.time()
        with mp.Pool(2) as pool:
            res = pool.starmap_async(functools.partial(t_pc, q), [("cons", n), ("prod", n)], chunksize=1)
            try:
                out = res.get(timeout=60)
            except std_mp.TimeoutError:
                pytest.fail("consumer/producer chunks of one map did not meet within 60 s")
        assert out == [sum(range(n)), -1]
        assert time.time() - t0 < 30
    finally:
        fill.stop()


# ---------------------------------------------------------------- 4. the Pool API through the window
def test_pool_api_through_the_window_order_errors_callbacks(env: Env) -> None:
    _cfg(env.b.endpoint_id)
    pool = mp.Pool(4)
    try:
        it = pool.imap(t_slow_square, range(9), chunksize=1)
        assert [it.next(timeout=60) for _ in range(9)] == [x * x for x in range(9)]
        with pytest.raises(StopIteration):
            it.next(timeout=5)

        assert sorted(pool.imap_unordered(t_slow_square, range(9), chunksize=2)) == sorted(x * x for x in range(9))

        got: list[Any] = []
        errs: list[BaseException] = []
        sr = pool.starmap_async(t_add, [(i, 10 * i) for i in range(11)], chunksize=3, callback=got.append, error_callback=errs.append)
        assert sr.get(timeout=60) == [11 * i for i in range(11)]
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == [[11 * i for i in range(11)]] and errs == []

        ecb: list[BaseException] = []
        ar = pool.apply_async(t_fail, (3,), error_callback=ecb.append)
        with pytest.raises(ValueError, match="bad item 3"):
            ar.get(timeout=60)
        deadline = time.monotonic() + 5
        while not ecb and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(ecb) == 1 and isinstance(ecb[0], ValueError), ecb
        assert not ar.successful()

        with pytest.raises(ValueError, match="bad item 3"):
            ok, _, exc = _bounded(lambda: pool.map(t_fail, range(8), chunksize=1), 60)
            assert ok, "map with a failing item did not return within 60 s"
            raise exc if exc is not None else AssertionError("map with a failing item did not raise")

        cbs: list[int] = []
        ars = [pool.apply_async(t_add, (i, i), callback=cbs.append) for i in range(10)]  # 10 > processes: through the window
        assert [x.get(timeout=60) for x in ars] == [2 * i for i in range(10)]
        deadline = time.monotonic() + 5
        while len(cbs) < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(cbs) == [2 * i for i in range(10)]
        pool.close()
        ok, _, exc = _bounded(pool.join, 30)
        assert ok and exc is None, f"join after close: finished={ok} exc={exc!r}"
    finally:
        pool.terminate()


def test_imap_next_timeout_keeps_the_item_as_the_stdlib_does(env: Env) -> None:
    """stdlib: IMapIterator.next(timeout) raises multiprocessing.TimeoutError and the next call
    returns that same item; nothing is skipped."""
    _cfg(env.b.endpoint_id)
    with mp.Pool(3) as pool:
        it = pool.imap(t_first_slow, range(3), chunksize=1)
        try:
            it.next(timeout=0.3)
        except std_mp.TimeoutError:
            kind = "multiprocessing.TimeoutError"
        except Exception as exc:  # noqa: BLE001 - reported
            kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        else:
            kind = "no exception"
        rest = [it.next(timeout=30) for _ in range(2)]
        problems = []
        if kind != "multiprocessing.TimeoutError":
            problems.append(f"next(timeout) raised {kind}, not multiprocessing.TimeoutError")
        if rest != [100, 101]:
            problems.append(f"after the timeout next() gave {rest}, expected [100, 101] (item 0 skipped?)")
        assert not problems, "; ".join(problems)


# ---------------------------------------------------------------- 5. Process.start() against the cap
def test_process_start_beyond_the_cap_raises_eagain_then_starts_later(env: Env, extra: dict[str, AgentProcess]) -> None:
    cap = extra["cap"]
    _cfg(cap.endpoint_id, start_timeout_s=20)
    key = f"pcap:{time.time_ns()}"
    ev = mp.Event()
    p1 = mp.Process(target=p_wait, args=(ev, env.redis_url, key, "p1"))
    p2 = mp.Process(target=p_wait, args=(ev, env.redis_url, key, "p2"))
    p3 = mp.Process(target=p_mark, args=(env.redis_url, key, "p3"))
    try:
        for p in (p1, p2):
            ok, _, exc = _bounded(p.start, 40)
            assert ok and exc is None, f"{p.name}.start() with room: finished={ok} exc={exc!r}"
        t0 = time.monotonic()
        ok, _, exc = _bounded(p3.start, 40)
        took = time.monotonic() - t0
        assert ok, "p3.start() beyond the cap did not return within 40 s"
        assert isinstance(exc, BlockingIOError), f"p3.start() beyond the cap: {exc!r}"
        msg = str(exc)
        assert exc.errno == errno.EAGAIN
        for part in ("cap 1", "start_now_max", "MESH_START_NOW_MAX", "in use"):
            assert part in msg, f"{part!r} missing from: {msg}"
        assert took < 15, f"refusal took {took:.1f} s (start_timeout_s=20): not 'at once'"
        assert p3.pid is None and p3.exitcode is None and not p3.is_alive()
        ev.set()
        for p in (p1, p2):
            p.join(40)
            assert p.exitcode == 0, f"{p.name} exitcode {p.exitcode}"
        ok, _, exc = _bounded(p3.start, 40)
        assert ok and exc is None, f"p3.start() again once there is room: finished={ok} exc={exc!r}"
        p3.join(40)
        assert p3.exitcode == 0
        names = [x.decode().split(":")[0] for x in env.r.lrange(key, 0, -1)]
        assert sorted(names) == ["p1", "p2", "p3"], names
    finally:
        ev.set()
        for p in (p1, p2, p3):
            if p._future is not None and p.is_alive():
                p.terminate()


# ---------------------------------------------------------------- 6. Pool(5) on a fleet that can start 2
def test_pool5_on_an_agent_that_can_start_two_finishes_and_never_exceeds_processes(env: Env, extra: dict[str, AgentProcess]) -> None:
    cap = extra["cap"]
    _cfg(cap.endpoint_id, start_timeout_s=20)
    key = f"p5:{time.time_ns()}"
    t0 = time.time()
    with mp.Pool(5) as pool:
        res = pool.map_async(functools.partial(t_count, env.redis_url, key, dur=0.3), range(24), chunksize=1)
        try:
            out = res.get(timeout=120)
        except std_mp.TimeoutError:
            pytest.fail(f"Pool(5) map on a 1-slot/cap-1 agent not done in 120 s: {env.r.llen(key + ':ends')} of 24 ran")
        # the default chunk size too (24 items / (4*5) -> 2 per chunk)
        out2 = pool.map(functools.partial(t_count, env.redis_url, key, dur=0.1), range(24, 40))
    took = time.time() - t0
    seen = [int(x) for x in env.r.lrange(key + ":seen", 0, -1)]
    assert out == [x * 3 for x in range(24)]
    assert out2 == [x * 3 for x in range(24, 40)]
    assert max(seen) <= 5, f"{max(seen)} Pool(5) tasks ran at once"
    assert max(seen) <= 2, f"{max(seen)} ran at once on an agent with 1 slot and cap 1"
    assert took < 110


# ---------------------------------------------------------------- 7. Pool whose siblings wait for a refused chunk
def test_pool_barrier_larger_than_what_the_fleet_can_start_raises_not_hangs(env: Env, extra: dict[str, AgentProcess]) -> None:
    """Demanding reading of the promise: 3 Pool tasks meet at a Barrier(3) on an agent that can start
    2 (1 slot + cap 1). The third is refused; the first two wait for it. Like a failed fork, the map
    should fail with BlockingIOError once start_timeout_s (6 s) passed, not wait for the barrier's own
    timeout (45 s here) or forever."""
    cap = extra["cap"]
    _cfg(cap.endpoint_id, start_timeout_s=6)
    key = f"bref:{time.time_ns()}"
    bar = mp.Barrier(3)
    pool = mp.Pool(3)
    try:
        t0 = time.time()
        res = pool.starmap_async(functools.partial(t_barrier, bar, env.redis_url, key), [(i, 45) for i in range(3)], chunksize=1)
        try:
            res.get(timeout=25)
        except BlockingIOError as exc:
            took = time.time() - t0
            assert took < 25 and "start_timeout_s" in str(exc)
            return
        except std_mp.TimeoutError:
            pytest.fail(f"no BlockingIOError within 25 s (start_timeout_s=6): the map waits; "
                        f"arrived at the barrier: {len(env.r.lrange(key + ':arrived', 0, -1))} of 3")
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"map raised {type(exc).__name__}: {exc} after {time.time() - t0:.1f} s, not BlockingIOError")
        pytest.fail("the map of a Barrier(3) on a fleet that can start 2 returned?")
    finally:
        pool.terminate()
        bar.abort()


# ---------------------------------------------------------------- 8. terminate() racing refusals; join is bounded
def test_terminate_while_chunks_are_refused_then_join_is_bounded(env: Env, extra: dict[str, AgentProcess]) -> None:
    cap = extra["cap"]
    _cfg(cap.endpoint_id, start_timeout_s=20)
    time.sleep(1.0)  # the previous check's cancelled tasks are gone
    rnd = random.Random(28)
    hung = []
    for i in range(12):
        key = f"trace:{i}:{time.time_ns()}"
        pool = mp.Pool(4)
        pool.map_async(functools.partial(t_count, env.redis_url, key, dur=0.25), range(16), chunksize=1)
        time.sleep(rnd.uniform(0.3, 2.0))
        pool.terminate()
        ok, _, exc = _bounded(pool.join, 20)
        undone = [f for f in pool._futures if not f.done()]
        if not ok or exc is not None or undone:
            inner = [getattr(f, "_inner", None) for f in undone]
            seen = [("not sent" if x is None else f"mesh future done={x.done()} cancelled={x.cancelled()} "
                     f"exc={None if not x.done() or x.cancelled() else x.exception(0)!r}") for x in inner]
            hung.append(f"round {i}: join finished={ok} exc={exc!r}, {len(undone)} futures never resolved: {seen}")
    assert not hung, hung


# ---------------------------------------------------------------- 9. terminate() mid-map: nothing starts after it
def test_terminate_mid_map_nothing_starts_after_it_returns(env: Env) -> None:
    _cfg(env.b.endpoint_id)
    key = f"term:{time.time_ns()}"
    pool = mp.Pool(3)
    res = pool.map_async(functools.partial(t_count, env.redis_url, key, dur=1.5), range(30), chunksize=1)
    _wait_len(env.r, key + ":starts", 4, 60)  # second wave under way
    ok, _, exc = _bounded(pool.terminate, 20)
    t_term = time.time()
    assert ok and exc is None, f"terminate(): finished={ok} exc={exc!r}"
    time.sleep(5)
    starts = _times(env.r, key + ":starts")
    late = [s - t_term for s in starts if s > t_term + 0.3]
    assert not late, f"{len(late)} tasks started after terminate() returned: +{[round(x, 2) for x in late]} s"
    assert len(starts) < 30
    ok, _, exc = _bounded(pool.join, 20)
    assert ok and exc is None, f"join after terminate: finished={ok} exc={exc!r}"
    ok, _, exc = _bounded(lambda: res.get(timeout=10), 15)
    assert ok and exc is not None, "map_async result after terminate returned a full result?"
    with pytest.raises(ValueError):
        pool.map(t_plus, [1])
    # the agent recovers: its killed workers are replaced
    with mp.Pool(2) as p2:
        ok, v, exc = _bounded(lambda: p2.map(t_plus, range(4)), 60)
    assert ok and exc is None and v == [1, 2, 3, 4], (ok, v, exc)


# ---------------------------------------------------------------- 10. on-demand workers (a metered device's default)
def test_process_on_an_on_demand_agent_with_one_busy_worker_starts_now(env: Env, extra: dict[str, AgentProcess]) -> None:
    """workers=2, worker_idle_s set (on demand, as the metered profile of a field device): one
    worker runs another program's 25 s task, the second slot has no worker yet. A Process must
    start at once (the free slot, or an extra worker), not in the busy worker's pipe behind it."""
    od = extra["od"]
    hog = Executor(client=env.mesh.client, endpoint=od.endpoint_id)
    hkey = f"hog:{time.time_ns()}"
    fut = hog.submit(t_filler, env.redis_url, hkey, 25)
    try:
        _wait_len(env.r, hkey, 1, 60)
        hog_started = _times(env.r, hkey)[0]
        _cfg(od.endpoint_id, start_timeout_s=40)
        key = f"pod:{time.time_ns()}"
        p = mp.Process(target=p_mark, args=(env.redis_url, key, "p"))
        t0 = time.time()
        ok, _, exc = _bounded(p.start, 60)
        took = time.time() - t0
        ran = _times(env.r, key)
        assert ok and exc is None, f"start(): finished={ok} exc={exc!r}"
        assert took < 10, (f"Process.start() returned after {took:.1f} s; its target ran {ran[0] - t0:.1f} s after start() "
                           f"and {ran[0] - hog_started:.1f} s after the other program's 25 s task started "
                           f"(queued behind the busy worker?)" if ran else f"start() took {took:.1f} s")
        p.join(30)
        assert p.exitcode == 0
    finally:
        hog.cancel_futures([fut])
        hog.shutdown(wait=False, cancel_futures=True)


def test_pool_barrier2_on_an_on_demand_agent_with_one_busy_worker(env: Env, extra: dict[str, AgentProcess]) -> None:
    od3 = extra["od3"]
    hog = Executor(client=env.mesh.client, endpoint=od3.endpoint_id)
    hkey = f"hog3:{time.time_ns()}"
    fut = hog.submit(t_filler, env.redis_url, hkey, 25)
    try:
        _wait_len(env.r, hkey, 1, 60)
        hog_started = _times(env.r, hkey)[0]
        _cfg(od3.endpoint_id, start_timeout_s=40)
        key = f"bod:{time.time_ns()}"
        bar = mp.Barrier(2)
        t0 = time.time()
        with mp.Pool(2) as pool:
            res = pool.starmap_async(functools.partial(t_barrier, bar, env.redis_url, key), [(i, 60) for i in range(2)], chunksize=1)
            try:
                out = res.get(timeout=50)
            except std_mp.TimeoutError:
                arrived = [round(float(x.decode().split(":", 1)[1]) - t0, 1) for x in env.r.lrange(key + ":arrived", 0, -1)]
                pytest.fail(f"Barrier(2) Pool on an on-demand agent not done in 50 s; chunks arrived at the barrier at +{arrived} s; "
                            f"the other program's 25 s task started at {hog_started - t0:+.1f} s")
        took = time.time() - t0
        arrived = sorted(float(x.decode().split(":", 1)[1]) for x in env.r.lrange(key + ":arrived", 0, -1))
        assert [o[0] for o in out] == [0, 1]
        assert took < 12, (f"Barrier(2) passed after {took:.1f} s; chunks arrived at +"
                           f"{[round(a - t0, 1) for a in arrived]} s, the other program's 25 s task started at "
                           f"{hog_started - t0:+.1f} s (a chunk queued behind it?)")
    finally:
        hog.cancel_futures([fut])
        hog.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- 11. nothing can start it: bounded failure
def test_pool_pinned_to_an_offline_agent_raises_blockingioerror_within_a_bound(env: Env, extra: dict[str, AgentProcess]) -> None:
    gone = extra["gone"]
    _cfg(gone.endpoint_id, start_timeout_s=5)
    pool = mp.Pool(2)
    try:
        t0 = time.time()
        res = pool.map_async(t_plus, [1, 2, 3], chunksize=1)
        try:
            res.get(timeout=30)
        except BlockingIOError as exc:
            took = time.time() - t0
            assert took < 25, f"BlockingIOError only after {took:.1f} s"
            assert "start_timeout_s" in str(exc), str(exc)
            return
        except std_mp.TimeoutError:
            pytest.fail("map pinned to an offline endpoint with start_timeout_s=5: no error within 30 s (it waits for the agent)")
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"map pinned offline raised {type(exc).__name__}: {exc}, not BlockingIOError")
        pytest.fail("map pinned to an offline endpoint returned results?")
    finally:
        pool.terminate()


def test_process_pinned_to_an_offline_agent_raises_blockingioerror_within_a_bound(env: Env, extra: dict[str, AgentProcess]) -> None:
    gone = extra["gone"]
    _cfg(gone.endpoint_id, start_timeout_s=5)
    key = f"poff:{time.time_ns()}"
    p = mp.Process(target=p_mark, args=(env.redis_url, key, "x"))
    t0 = time.time()
    ok, _, exc = _bounded(p.start, 40)
    took = time.time() - t0
    assert ok, "Process.start() pinned offline did not return within 40 s"
    assert isinstance(exc, BlockingIOError), repr(exc)
    assert took < 15, f"took {took:.1f} s with start_timeout_s=5"
    msg = str(exc)
    for part in ("start_timeout_s", gone.endpoint_id, "start_now_max"):
        assert part in msg, f"{part!r} missing from: {msg}"
    assert p.pid is None


# ---------------------------------------------------------------- 12. many sequential Pools: no leaked threads
def test_many_sequential_pools_leak_no_threads(env: Env) -> None:
    _cfg(env.b.endpoint_id)
    with mp.Pool(3) as p:  # warm: the Executor's own threads exist from here on
        assert p.map(t_plus, range(6)) == list(range(1, 7))
    time.sleep(0.5)
    before = {t.ident: t.name for t in threading.enumerate()}
    for i in range(12):
        with mp.Pool(3) as p:
            assert p.map(t_plus, range(i, i + 7), chunksize=2) == list(range(i + 1, i + 8))
            assert p.apply_async(t_add, (i, 1)).get(timeout=30) == i + 1
        p2 = mp.Pool(2)
        p2.map(t_plus, [1, 2])
        p2.close()
        ok, _, exc = _bounded(p2.join, 20)
        assert ok and exc is None
    time.sleep(1.0)
    after = {t.ident: t.name for t in threading.enumerate() if t.name != "outsider-bounded"}
    new = sorted(n for ident, n in after.items() if ident not in before)
    assert len(after) <= len(before) + 2, f"threads {len(before)} -> {len(after)}; new: {new}"


# ---------------------------------------------------------------- 13. a Barrier Pool right after terminate()
def test_barrier2_pool_right_after_terminating_a_pool_on_the_same_agent(env: Env) -> None:
    """Natural program: a Pool is terminated (its 2 running chunks' workers killed and replaced),
    then the next Pool's 2 tasks meet at a Barrier(2) on the same 2-worker agent. Both must start
    at once; neither may be put in the other's worker pipe."""
    _cfg(env.b.endpoint_id, start_timeout_s=30)
    time.sleep(2)  # nothing of the previous checks left on fill-b
    key0, key = f"t0:{time.time_ns()}", f"tb:{time.time_ns()}"
    p1 = mp.Pool(2)
    p1.map_async(functools.partial(t_count, env.redis_url, key0, dur=30), range(2), chunksize=1)
    _wait_len(env.r, key0 + ":starts", 2, 40)
    p1.terminate()
    bar = mp.Barrier(2)
    t0 = time.time()
    with mp.Pool(2) as p2:
        res = p2.starmap_async(functools.partial(t_barrier, bar, env.redis_url, key), [(i, 40) for i in range(2)], chunksize=1)
        try:
            out = res.get(timeout=30)
        except std_mp.TimeoutError:
            arrived = [round(float(x.decode().split(":", 1)[1]) - t0, 1) for x in env.r.lrange(key + ":arrived", 0, -1)]
            pytest.fail(f"Barrier(2) Pool right after terminate() not done in 30 s; arrived at the barrier at +{arrived} s")
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"Barrier(2) Pool right after terminate(): {type(exc).__name__}: {exc} after {time.time() - t0:.1f} s")
    took = time.time() - t0
    arrived = [round(float(x.decode().split(":", 1)[1]) - t0, 1) for x in env.r.lrange(key + ":arrived", 0, -1)]
    assert [o[0] for o in out] == [0, 1]
    assert took < 12, f"Barrier(2) right after terminate() passed only after {took:.1f} s; chunks arrived at +{arrived} s"


# ---------------------------------------------------------------- 14. after a cancel, both slots work again
def test_after_cancelling_running_tasks_both_worker_slots_take_new_work(env: Env) -> None:
    """docs "Cancel": a running task's worker is killed and a fresh one started in its place. Work
    sent right after the cancel must use both slots of a 2-worker agent, not queue in the pipe of
    whichever replacement booted first while the other sits idle."""
    ex = Executor(client=env.mesh.client, endpoint=env.b.endpoint_id)
    key1, key2 = f"c1:{time.time_ns()}", f"c2:{time.time_ns()}"
    try:
        fs = [ex.submit(t_filler, env.redis_url, key1, 30) for _ in range(5)]
        _wait_len(env.r, key1, 2, 40)
        time.sleep(0.5)
        ex.cancel_futures(fs)
        t0 = time.time()
        fs += [ex.submit(t_filler, env.redis_url, key2, 4) for _ in range(6)]
        time.sleep(3.5)
        starts = [round(x - t0, 1) for x in _times(env.r, key2)]
        assert len(starts) >= 2, (f"3.5 s after a cancel, {len(starts)} of 6 new 4 s tasks had started on a 2-worker agent "
                                  f"(starts at +{starts} s): one slot idle")
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
        time.sleep(3)
