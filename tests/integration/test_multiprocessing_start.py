"""A multiprocessing ``Process`` starts at once or ``start()`` says why (issue 28 item 1): on a
real mesh (hub, two ZeroMQ agents) with a real redis-server, while other work fills the agents'
workers and their prefetch queues. See docs/multiprocessing.md, "Start"."""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import LocalMesh
from tests.integration.test_mp_proxies import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, RedisServer]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    m = LocalMesh(tmp_path_factory.mktemp("mpstart"), heartbeat_s=0.5, lost_after_s=3.0)
    m.start()
    try:
        m.add_agent("busy", "zmq", workers=2)
        os.environ["MESH_START_NOW_MAX"] = "1"  # inherited by the next agent only
        try:
            m.add_agent("capped", "zmq", workers=1)
        finally:
            del os.environ["MESH_START_NOW_MAX"]
        m.wait_online(timeout=90)
        yield m, redis
    finally:
        m.stop()
        redis.stop()


@pytest.fixture
def mp(mesh: tuple[LocalMesh, RedisServer]) -> Iterator[Any]:
    from cloud_hub.client import multiprocessing
    from cloud_hub.client.multiprocessing import _runner, _state

    saved = dict(_state._settings)
    m, redis = mesh
    multiprocessing.config(client=Client(m.url, m.token), redis_url=redis.url)
    try:
        yield multiprocessing
    finally:
        _runner.shutdown_executor()
        with _state._lock:
            _state._settings.clear()
            _state._settings.update(saved)


def _agent(m: LocalMesh, name: str) -> Any:
    return next(a for a in m.agents if a.cfg.name == name)


def hold(url: str, running: str, gate: str) -> int:
    """Other work: say it runs, then wait for the gate."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=None)
    r.rpush(running, b"1")
    r.blpop([gate], timeout=600)
    return os.getpid()


def meet(barrier: Any, q: Any) -> None:
    barrier.wait(300)
    q.put(os.environ["MESH_ENDPOINT_ID"])


def _fill(m: LocalMesh, redis: RedisServer, agent: Any, running: int, queued: int) -> tuple[Executor, list[Any], str]:
    """``running`` tasks of another program that block on a gate, on ``agent``'s workers, and
    ``queued`` more in its prefetch queue behind them."""
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis.url, socket_timeout=None)
    tag = uuid.uuid4().hex
    ex = Executor(client=Client(m.url, m.token), endpoint=agent.endpoint_id)
    futures = [ex.submit(hold, redis.url, f"running:{tag}", f"gate:{tag}") for _ in range(running + queued)]
    for _ in range(running):
        assert r.blpop([f"running:{tag}"], timeout=120) is not None, "the other work did not start"
    return ex, futures, f"gate:{tag}"


def test_barrier_with_more_parties_than_the_agent_has_workers_while_other_work_runs(mesh: tuple[LocalMesh, RedisServer], mp: Any) -> None:
    """Both of the agent's workers run another program's tasks and more wait in its queue; 4
    Processes pinned to it meet at a Barrier(4). Each starts at once (on extra workers, outside
    the pool and ahead of its queue), so all 4 pass; the other work then finishes too."""
    import redis as redis_lib

    m, redis = mesh
    busy = _agent(m, "busy")
    ex, other, gate = _fill(m, redis, busy, running=2, queued=3)
    try:
        mp.config(endpoint=busy.endpoint_id)
        barrier, q = mp.Barrier(4), mp.Queue()
        procs = [mp.Process(target=meet, args=(barrier, q)) for _ in range(4)]
        for p in procs:
            p.start()
            assert p.pid is not None
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        assert {q.get(timeout=30) for _ in procs} == {busy.endpoint_id}
    finally:
        redis_lib.Redis.from_url(redis.url).rpush(gate, *[b"1"] * len(other))
    assert all(isinstance(f.result(300), int) for f in other)
    ex.shutdown()


def test_start_raises_when_the_endpoint_has_no_slot_and_its_cap_is_reached(mesh: tuple[LocalMesh, RedisServer], mp: Any) -> None:
    """The ``capped`` agent has 1 worker and starts at most 1 extra (MESH_START_NOW_MAX=1): with
    its worker busy, a first Process starts on the extra one, and a second one's ``start()``
    raises ``BlockingIOError`` (EAGAIN, as a failed fork) naming the slots and the cap. That
    Process was not started: it may be started again, and then runs."""
    import redis as redis_lib

    m, redis = mesh
    capped = _agent(m, "capped")
    r = redis_lib.Redis.from_url(redis.url, socket_timeout=None)
    ex, other, gate = _fill(m, redis, capped, running=1, queued=0)
    mp.config(endpoint=capped.endpoint_id)
    tag = uuid.uuid4().hex
    first = mp.Process(target=hold, args=(redis.url, f"first:{tag}", f"gate-first:{tag}"))
    first.start()
    assert r.blpop([f"first:{tag}"], timeout=120) is not None
    second = mp.Process(target=hold, args=(redis.url, f"second:{tag}", f"gate-second:{tag}"))
    with pytest.raises(BlockingIOError) as info:
        second.start()
    assert "all 1 worker slots of this endpoint are in use" in str(info.value) and "cap 1" in str(info.value)
    assert "start_now_max" in str(info.value)
    assert second.pid is None and second.exitcode is None and not second.is_alive()
    r.rpush(gate, b"1")
    r.rpush(f"gate-first:{tag}", b"1")
    first.join(300)
    assert first.exitcode == 0
    assert isinstance(other[0].result(300), int)
    second.start()  # room again
    r.rpush(f"gate-second:{tag}", b"1")
    second.join(300)
    assert second.exitcode == 0
    ex.shutdown()


def meet_in_pool(barrier: Any, i: int) -> tuple[int, str]:
    """A Pool task that waits for its siblings: passes only when all parties run at once."""
    barrier.wait(300)
    return i, os.environ["MESH_ENDPOINT_ID"]


def test_pool_tasks_meeting_at_a_barrier_start_now_while_other_work_runs(mesh: tuple[LocalMesh, RedisServer], mp: Any) -> None:
    """A Pool(4) pinned to the agent whose 2 workers run another program's tasks, with 3 more
    queued behind them: its 4 tasks meet at a Barrier(4). Each is sent with ``start: "now"``, so
    all 4 run at once (on extra workers) and the map returns in order; then a map of 12 items
    through the same Pool (never more than 4 on the mesh) and the other program's work finish."""
    import redis as redis_lib

    m, redis = mesh
    busy = _agent(m, "busy")
    ex, other, gate = _fill(m, redis, busy, running=2, queued=3)
    try:
        mp.config(endpoint=busy.endpoint_id)
        barrier = mp.Barrier(4)
        with mp.Pool(4) as pool:
            got = pool.starmap(meet_in_pool, [(barrier, i) for i in range(4)], chunksize=1)
            assert [i for i, _ in got] == [0, 1, 2, 3]
            assert {e for _, e in got} == {busy.endpoint_id}
            assert pool.map(abs, range(-6, 6)) == [abs(i) for i in range(-6, 6)]
    finally:
        redis_lib.Redis.from_url(redis.url).rpush(gate, *[b"1"] * len(other))
    assert all(isinstance(f.result(300), int) for f in other)
    ex.shutdown()


def test_pool_larger_than_the_cap_waits_for_room_and_finishes(mesh: tuple[LocalMesh, RedisServer], mp: Any) -> None:
    """The ``capped`` agent (1 worker, at most 1 extra) with its worker busy: a Pool(4) of 6
    tasks is refused beyond what the agent can start now; refused tasks wait in the program (the
    window shrinks to what runs) instead of failing, and all 6 results come back in order."""
    import redis as redis_lib

    m, redis = mesh
    capped = _agent(m, "capped")
    ex, other, gate = _fill(m, redis, capped, running=1, queued=0)
    try:
        mp.config(endpoint=capped.endpoint_id)
        with mp.Pool(4) as pool:
            assert pool.map(abs, range(-3, 3), chunksize=1) == [3, 2, 1, 0, 1, 2]
    finally:
        redis_lib.Redis.from_url(redis.url).rpush(gate, b"1")
    assert isinstance(other[0].result(300), int)
    ex.shutdown()
