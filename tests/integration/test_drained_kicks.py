"""Drained queues (cloud_hub/dispatcher.py, ``_Session.drained`` / ``now_drained``, issue 30): after
a lease finds an endpoint's queue empty, kicks that only signal room (a fetch, a result) do not ask
the database again until a kick says new work may be there. What must hold on a real mesh
(Mosquitto, the in-process hub, a real agent process): no task is ever stranded by it.

- sequential round trips, a burst, and round trips again all complete;
- a task with start "now" submitted after the queue drained, while the agent's workers are busy,
  still runs at once;
- after the agent is SIGKILLed (its session lost, its leases re-queued) and restarted, work queued
  before and during the outage is delivered;
- and the saving itself: once drained, a room-only kick calls ``store.lease`` zero times, a
  new-work kick once, a start-now kick once (counted by wrapping the hub's store);
- the safety net: work queued with no kick at all (as a path that forgot one would) is still
  leased, by the watchdog's recheck of drained sessions."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


def hold(flag: str, marker: str, limit_s: float) -> int:
    """Occupy a worker until ``flag`` exists (at most ``limit_s``); say it started via ``marker``."""
    import os
    import time

    open(marker, "w").close()
    deadline = time.monotonic() + limit_s
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid()


def pid_of() -> int:
    import os

    return os.getpid()


def nap(x: int) -> int:
    import time

    time.sleep(0.02)
    return x


class _Counted:
    """Wraps the hub store's ``lease``: counts calls (plain and ``only_now``)."""

    def __init__(self, store: Any) -> None:
        self.inner = store.lease
        self.plain = 0
        self.now = 0

    async def __call__(self, *a: Any, **kw: Any) -> Any:
        if kw.get("only_now"):
            self.now += 1
        else:
            self.plain += 1
        return await self.inner(*a, **kw)


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]]:
    """A mesh with two agents: "d" (two workers, the default prefetch) and "tight" (one worker, no
    prefetch: while it runs a task the hub has no credit for it)."""
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    mesh = LocalMesh(tmp_path_factory.mktemp("drained"), heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0)
    mesh.start()
    try:
        agent = mesh.add_agent("d", "mqtt", workers=2)
        tight = mesh.add_agent("tight", "mqtt", workers=1, prefetch=0)
        mesh.wait_online(agent, tight, timeout=60)
        store = mesh.hub.hub.dispatcher.store  # type: ignore[union-attr]
        counted = _Counted(store)
        store.lease = counted  # type: ignore[method-assign]  # an instance attribute: what the dispatcher's self.store.lease finds
        yield mesh, agent, tight, counted
    finally:
        mesh.stop()


def _on_hub(mesh: LocalMesh, coro: Any, timeout: float = 10.0) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, mesh.hub._loop).result(timeout)  # type: ignore[union-attr]


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def test_once_drained_a_room_kick_does_not_lease_and_new_work_does(m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]) -> None:
    mesh, agent, _, counted = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    recheck = disp._recheck_drained
    disp._recheck_drained = lambda *a: None  # the watchdog's safety net would add leases to the counts (tested below)
    try:
        _counts_once_drained(mesh, disp, ep, counted)
    finally:
        disp._recheck_drained = recheck


def _counts_once_drained(mesh: LocalMesh, disp: Any, ep: str, counted: _Counted) -> None:
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(square, 3).result(30) == 9  # drains the queue (and the "now" one)
        s = disp._sessions[ep]
        _wait(lambda: s.credit > 0 and not s.pumping and s.drained and s.now_drained, 10, "an idle, drained session with credit")

        async def kick_and_settle(**kw: Any) -> tuple[int, int]:
            before = (counted.plain, counted.now)
            disp.kick(ep, **kw)
            for _ in range(2000):  # the pump runs as its own task: wait for it to end (bounded)
                await asyncio.sleep(0.002)
                if not s.pumping:
                    break
            return counted.plain - before[0], counted.now - before[1]

        assert _on_hub(mesh, kick_and_settle(new_work=False, start_now=False)) == (0, 0), "a fetch's kick asked the database"
        assert _on_hub(mesh, kick_and_settle(new_work=False, start_now=False)) == (0, 0)
        assert _on_hub(mesh, kick_and_settle(new_work=True, start_now=False)) == (1, 0), "a submit's kick leases once"
        assert s.drained and s.now_drained
        assert _on_hub(mesh, kick_and_settle(new_work=False, start_now=True)) == (0, 1), "a start-now submit looks for those only"
        assert _on_hub(mesh, kick_and_settle()) == (1, 1), "the default kick is always safe: both"
        assert _on_hub(mesh, kick_and_settle(new_work=False, start_now=False)) == (0, 0)

        # Sequential round trips through the real agent: its fetches and results ask nothing more;
        # each round trip costs about one lease (the submit's), not one per frame.
        before = counted.plain + counted.now
        for i in range(10):
            assert ex.submit(square, i).result(30) == i * i
        spent = counted.plain + counted.now - before
        print(f"{spent} store.lease calls for 10 sequential round trips")
        assert spent <= 15, f"{spent} leases for 10 round trips"


def test_round_trips_then_a_burst_then_round_trips_all_complete(m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]) -> None:
    mesh, agent, _, _ = m
    with Executor(mesh.client, agent.endpoint_id) as ex:
        for i in range(5):
            assert ex.submit(square, i).result(30) == i * i
        futs = [ex.submit(square, i) for i in range(200)]
        assert [f.result(60) for f in futs] == [i * i for i in range(200)]
        for i in range(5):
            assert ex.submit(square, i).result(30) == i * i
        # a second burst straight after, and two at once from two submitters
        with Executor(mesh.client, agent.endpoint_id) as ex2:
            a = [ex.submit(square, i) for i in range(50)]
            b = [ex2.submit(square, i) for i in range(50)]
            assert [f.result(60) for f in a] == [i * i for i in range(50)]
            assert [f.result(60) for f in b] == [i * i for i in range(50)]
            assert ex2.submit(square, 7).result(30) == 49


def test_start_now_after_the_queue_drained_runs_at_once_without_credit(
        m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted], tmp_path: Path) -> None:
    """An agent with one worker and no prefetch: while one task runs, the hub holds no credit for
    it and keeps the rest queued; a start-now task still goes out (outside credit) and runs at
    once, each time, although every lease before it found no such task (``now_drained``)."""
    mesh, _, tight, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = tight.endpoint_id
    flag, marker = tmp_path / "go", tmp_path / "started"
    try:
        with Executor(mesh.client, ep) as ex:
            assert ex.submit(square, 2).result(30) == 4
            s = disp._sessions[ep]
            _wait(lambda: not s.pumping and s.drained and s.now_drained, 10, "a drained session")
            holder = ex.submit(hold, str(flag), str(marker), 25.0)
            _wait(marker.exists, 20, "the one worker busy")
            behind = [ex.submit(square, i) for i in range(3)]  # no credit: they wait in the hub
            _wait(lambda: s.credit == 0 and not s.pumping, 10, "no credit left")
            for _ in range(3):
                t0 = time.monotonic()
                pid = ex.submit_now(pid_of).result(30)
                assert isinstance(pid, int)
                assert time.monotonic() - t0 < 20
                assert not holder.done() and not any(f.done() for f in behind), "it ran beside the busy worker, not after it"
            flag.touch()
            assert isinstance(holder.result(30), int)
            assert [f.result(30) for f in behind] == [0, 1, 4]
            # a start-now task in the same batch as a plain one, after the queue drained again
            _wait(lambda: not s.pumping and s.drained, 10, "drained again")
            both = [ex.submit(square, 5), ex.submit_now(square, 6)]
            assert [f.result(30) for f in both] == [25, 36]
    finally:
        flag.touch()


def test_work_queued_before_and_during_an_agent_outage_is_delivered_after_it(m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]) -> None:
    mesh, agent, _, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(square, 1).result(30) == 1
        s = disp._sessions[ep]
        _wait(lambda: not s.pumping and s.drained, 10, "a drained session")
        first = [ex.submit(nap, i) for i in range(40)]
        _wait(lambda: sum(f.done() for f in first) >= 2, 30, "the first results")
        agent.kill()  # SIGKILL: leased tasks go back to the queue when the hub loses the session
        mesh.wait_online(agent, timeout=20, online=False)
        during = [ex.submit(square, i) for i in range(20)]  # queued with no session to kick
        during_now = ex.submit_now(square, 9)
        time.sleep(0.2)
        assert not any(f.done() for f in during), "nothing can run them now"
        agent.start()
        mesh.wait_online(agent, timeout=30)
        assert [f.result(60) for f in first] == list(range(40))
        assert [f.result(60) for f in during] == [i * i for i in range(20)]
        assert during_now.result(60) == 81
        assert ex.submit(square, 4).result(30) == 16, "and new work after it"
    # the new session of the same endpoint starts undrained, then drains again
    s2 = disp._sessions[ep]
    assert s2 is not s
    _wait(lambda: not s2.pumping and s2.drained, 10, "the new session drained")


def test_work_queued_without_a_kick_is_found_by_the_watchdogs_recheck(m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]) -> None:
    """Submits while the dispatcher's kick does nothing (a path that queues work and forgets to
    kick): once kicks work again, only room-only kicks follow (results, fetches), which a drained
    session ignores. The watchdog's recheck (1 s after draining, then 2, 4...) must deliver them."""
    mesh, agent, _, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(square, 2).result(30) == 4
        s = disp._sessions[ep]
        _wait(lambda: s.credit > 0 and not s.pumping and s.drained, 10, "an idle, drained session with credit")
        kick, claim = disp.kick, disp.claim_insert_leases
        disp.kick = lambda *a, **kw: None
        disp.claim_insert_leases = lambda *a, **kw: None  # nor a lease in the submit's own transaction
        try:
            futs = [ex.submit(square, i) for i in range(5)]
            time.sleep(0.3)
            assert not any(f.done() for f in futs), "delivered with every kick switched off"
        finally:
            disp.kick, disp.claim_insert_leases = kick, claim
        t0 = time.monotonic()
        assert [f.result(30) for f in futs] == [i * i for i in range(5)]
        print(f"found by the recheck after {time.monotonic() - t0:.2f} s")


def test_an_idle_drained_sessions_recheck_reads_the_queue_and_leases_nothing(
        m: tuple[LocalMesh, AgentProcess, AgentProcess, _Counted]) -> None:
    """With nothing queued, the watchdog's rechecks (1 s after draining, then 2 s...) read the queue
    for all due sessions at once (``store.endpoints_with_queued``) and lease nothing: no lease
    transaction per idle endpoint, the session stays drained, and its next look backs off."""
    mesh, agent, _, counted = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    store = disp.store
    ep = agent.endpoint_id
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(square, 4).result(30) == 16
    s = disp._sessions[ep]
    _wait(lambda: s.credit > 0 and not s.pumping and s.drained and s.recheck_at, 10, "an idle, drained session with a recheck due")
    asked: list[list[str]] = []
    real = store.endpoints_with_queued

    async def counted_read(eps: Any) -> Any:
        asked.append(list(eps))
        return await real(eps)

    store.endpoints_with_queued = counted_read  # type: ignore[method-assign]
    try:
        plain, now = counted.plain, counted.now
        wait0 = s.recheck_wait
        _wait(lambda: any(ep in a for a in asked), 10, "the recheck's read of the queue")
        time.sleep(0.3)
        assert (counted.plain, counted.now) == (plain, now), "an idle recheck leased"
        assert s.drained and s.recheck_wait > wait0, "the next look backs off"
    finally:
        del store.endpoints_with_queued

