"""Leases in the submit's own transaction (``Dispatcher.claim_insert_leases``, issue 30 item 3) on
a real mesh: Mosquitto, the in-process hub, a real agent process.

- a submit to an idle endpoint with credit is leased in the insert's transaction: no
  ``store.lease`` call of its own, the task row says dispatched once, the result comes;
- a submit the transaction refuses (an idempotency key reused for another request, an unknown
  function) leases nothing and leaves the session's pump free: the next submit is delivered;
- many concurrent submits (Executors in threads) each get exactly one result, and every task is
  leased once;
- a claim whose session ended before the commit gives its tasks back to the queue at once.
"""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import threading
import time
import uuid
from typing import Any, Iterator

import pytest

from cloud_hub import dispatcher as dispatcher_module
from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor
from cloud_hub.client._client import HubError
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.protocol import Kind, serialize
from tests.integration.test_drained_kicks import _Counted, _wait

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, AgentProcess, _Counted]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    mesh = LocalMesh(tmp_path_factory.mktemp("insert-lease"), heartbeat_s=0.5, lost_after_s=3.0, lease_s=6.0)
    mesh.start()
    try:
        agent = mesh.add_agent("il", "mqtt", workers=2)
        mesh.wait_online(agent, timeout=60)
        store = mesh.hub.hub.dispatcher.store  # type: ignore[union-attr]
        counted = _Counted(store)
        store.lease = counted  # type: ignore[method-assign]
        yield mesh, agent, counted
    finally:
        mesh.stop()


def _idle(disp: Any, ep: str, credit: int = 1) -> Any:
    s = disp._sessions[ep]
    _wait(lambda: s.credit >= credit and not s.pumping and s.drained, 15, "an idle, drained session with credit")
    return s


def _row(mesh: LocalMesh, tid: str) -> tuple[Any, ...]:
    with sqlite3.connect(mesh.hub_cfg.db_path, timeout=30) as db:
        return db.execute("SELECT state, attempts, dispatched IS NOT NULL FROM tasks WHERE id=?", (tid,)).fetchone()  # type: ignore[no-any-return]


def _task_in(ep: str, fid: str, x: int) -> Any:
    from cloud_hub.service.schemas import TaskIn

    return TaskIn.model_validate({"endpoint_id": ep, "function_id": fid, "args": base64.b64encode(serialize(((x,), {}))).decode()})


async def _accept(mesh: LocalMesh, tasks: list[Any]) -> list[str]:
    """The hub's submit path itself (``service.submit.accept``), on the hub's loop, as the demo user."""
    from cloud_hub.service.submit import accept

    hub = mesh.hub.hub  # type: ignore[union-attr]
    user, _why = await hub.auth(mesh.token)
    assert user is not None
    ids, _ = await accept(hub, user, tasks)
    return list(ids)


def _submit_with_claim_hook(mesh: LocalMesh, ep: str, fid: str, x: int, after_claim: Any) -> str:
    """Submit ``square(x)`` to ``ep``; ``after_claim()`` runs right after the submit has claimed the
    endpoint's pump and before its transaction commits (what a hello or a fetch could do then)."""
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    real = disp.claim_insert_leases

    def claim_then(eps: Any) -> Any:
        claims = real(eps)
        assert claims is not None and ep in claims.endpoints
        after_claim()
        return claims

    async def go() -> str:
        disp.claim_insert_leases = claim_then
        try:
            return (await _accept(mesh, [_task_in(ep, fid, x)]))[0]
        finally:
            disp.claim_insert_leases = real

    return asyncio.run_coroutine_threadsafe(go(), mesh.hub._loop).result(30)  # type: ignore[union-attr]


def test_a_submit_with_credit_is_leased_in_its_own_transaction(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    """An idle round trip needs no lease of its own. Up to three round trips, one of which must
    count none: on a loaded machine the agent's fetch after the last result can still be on its
    way, and its pump (or the lease it makes room for) is a lease rightly counted. Without the
    insert's lease every round trip costs one."""
    mesh, agent, counted = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    seen: list[int] = []
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(square, 2).result(30) == 4
        # The watchdog's recheck of a drained session (the safety net, tested in test_drained_kicks)
        # would add its own leases: off here, so only the round trips' own kicks count.
        disp._recheck_drained = lambda *_a: None  # collects nothing: no recheck
        try:
            for x in (7, 8, 9):
                # Credit for more than the one task: a lease that gets fewer than it asked for is
                # what says "drained" (with credit 1 it gets all it asked, and the next fetch leases).
                _idle(disp, ep, credit=2)
                before = counted.plain
                f = ex.submit(square, x)
                assert f.result(30) == x * x
                tid = f.task_id  # type: ignore[attr-defined]
                _wait(lambda: _row(mesh, tid)[0] == "done", 10, "the task stored done")
                assert _row(mesh, tid) == ("done", 1, 1)
                seen.append(counted.plain - before)
                if seen[-1] == 0:
                    break
        finally:
            del disp._recheck_drained
    # The result's kick (room only) finds the session drained: no lease call at all for such a round trip.
    assert 0 in seen, f"separate lease transactions per round trip: {seen}"


def test_a_refused_submit_leases_nothing_and_frees_the_pump(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    mesh, agent, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    c = mesh.client
    fid = c.register_function(square)
    with sqlite3.connect(mesh.hub_cfg.db_path, timeout=30) as db:
        tasks_before = db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    s = _idle(disp, ep)
    key = uuid.uuid4().hex
    c.submit_batch_placed([c.task_spec(ep, fid, (1,))], idempotency_key=key)
    s = _idle(disp, ep)
    # The same key with another request: refused inside the insert's transaction (409), nothing stored.
    with pytest.raises(HubError) as info:
        c.submit_batch_placed([c.task_spec(ep, fid, (2,)), c.task_spec(ep, fid, (3,))], idempotency_key=key)
    assert info.value.status == 409
    assert not s.pumping, "a refused submit left the session's pump claimed"
    # An unknown function: refused before the insert (404), nothing claimed either.
    with pytest.raises(HubError) as info:
        c.submit_batch_placed([{"endpoint_id": ep, "function_id": "f" * 64, "args": c.task_spec(ep, fid, (1,))["args"]}])
    assert info.value.status == 404 and not s.pumping
    with sqlite3.connect(mesh.hub_cfg.db_path, timeout=30) as db:
        assert db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == tasks_before + 1
    with Executor(c, ep) as ex:
        assert ex.submit(square, 5).result(30) == 25


def test_concurrent_submits_each_run_once(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    mesh, agent, _ = m
    ep = agent.endpoint_id
    group = "il-" + uuid.uuid4().hex[:8]
    out: dict[int, list[int]] = {}

    def one(k: int) -> None:
        with Executor(mesh.client, ep, task_group_id=group) as ex:
            got = []
            for i in range(15):  # round trips, so most submits find the session idle with credit
                got.append(ex.submit(square, k * 100 + i).result(60))
            out[k] = got

    threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {k: v for k, v in out.items()} == {k: [(k * 100 + i) ** 2 for i in range(15)] for k in range(4)}
    with sqlite3.connect(mesh.hub_cfg.db_path, timeout=30) as db:
        rows = db.execute("SELECT state, attempts FROM tasks WHERE task_group_id=?", (group,)).fetchall()
        results = db.execute("SELECT COUNT(*) FROM results r JOIN tasks t ON t.id=r.task_id WHERE t.task_group_id=?", (group,)).fetchone()[0]
    assert len(rows) == 60 and results == 60
    assert all(a == 1 for _, a in rows), "a task leased more than once"


def test_a_claim_whose_session_ended_gives_its_tasks_back(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    """The session is replaced between the claim and the commit (the agent said hello again): the
    tasks leased in the submit's transaction go back to the queue at once, and the new session gets
    them."""
    mesh, agent, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    s = _idle(disp, ep)
    fid = mesh.client.register_function(square)

    def end_the_session() -> None:
        # as a hello would: a new session object takes the endpoint's place before the commit. It
        # is marked pumping, so nothing (the agent's beats or a late fetch giving it credit) can
        # lease the task back to it before the check below; kicks only say "again".
        disp._sessions[ep] = type(s)(ep, s.link, time.time(), credit=0, pumping=True)

    tid = _submit_with_claim_hook(mesh, ep, fid, 9, end_the_session)
    _wait(lambda: _row(mesh, tid)[0] == "queued", 10, "the task back in the queue")
    assert _row(mesh, tid)[1] == 0  # the attempt that never left is not counted (store.unlease)

    async def back() -> None:  # the agent's own session back: it gets the task
        disp._sessions[ep] = s
        disp.kick(ep)

    asyncio.run_coroutine_threadsafe(back(), mesh.hub._loop).result(10)  # type: ignore[union-attr]
    _wait(lambda: _row(mesh, tid)[0] == "done", 30, "the task run by the agent")


def test_a_submit_whose_kick_comes_during_another_claim_is_not_stranded(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    """Submit B to an endpoint while submit A's claim holds its pump (between A's claim and A's
    pump): B claims nothing, inserts, and kicks a pump that is busy. That kick must reach A's pump,
    which then leases B's task, rather than A's short lease marking the queue drained (which left B
    to the watchdog's recheck). The recheck is off here, so only kicks can deliver B."""
    mesh, agent, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    _idle(disp, ep, credit=2)
    fid = mesh.client.register_function(square)

    async def both() -> tuple[str, str]:
        real_pump = disp._pump
        b: list[str] = []

        async def b_first(s: Any, first: Any = None) -> None:
            if first is not None and not b:  # A's claimed pump, before its first round: B lands now
                b.extend(await _accept(mesh, [_task_in(ep, fid, 12)]))
            await real_pump(s, first)

        disp._pump = b_first
        try:
            ids = await _accept(mesh, [_task_in(ep, fid, 11)])
            for _ in range(500):  # A's pump runs once its commit is done
                if b:
                    break
                await asyncio.sleep(0.01)
        finally:
            del disp._pump
        assert b, "A's submit did not lease in its own transaction"
        return ids[0], b[0]

    disp._recheck_drained = lambda *_a: None  # collects nothing: no recheck
    try:
        ta, tb = asyncio.run_coroutine_threadsafe(both(), mesh.hub._loop).result(30)  # type: ignore[union-attr]
        _wait(lambda: _row(mesh, ta)[0] == "done", 30, "A's task run")
        _wait(lambda: _row(mesh, tb)[0] == "done", 10, "B's task run without a recheck")
    finally:
        del disp._recheck_drained


def test_a_claim_whose_credit_went_meanwhile_gives_its_tasks_back(m: tuple[LocalMesh, AgentProcess, _Counted]) -> None:
    """The agent's credit goes to 0 between the claim and the commit (a fetch wanting 0, as an agent
    whose store fails sends): the claimed lease cannot be sent, so its tasks go back to the queue at
    once (not counted as an attempt), rather than staying leased until lease_s; with credit again
    they run."""
    mesh, agent, _ = m
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    ep = agent.endpoint_id
    s = _idle(disp, ep)
    fid = mesh.client.register_function(square)

    def the_credit_goes() -> None:
        s.credit = 0

    # The agent's beats (_resync_credit) and a fetch still on its way would give the credit back and
    # take the task before the check: both held off until then (the frames still arrive).
    async def no_resync(*_a: Any) -> None:
        return None

    async def no_fetch(*_a: Any) -> None:
        return None

    real_fetch = dispatcher_module._HANDLERS[Kind.FETCH]
    disp._resync_credit = no_resync
    dispatcher_module._HANDLERS[Kind.FETCH] = no_fetch
    try:
        tid = _submit_with_claim_hook(mesh, ep, fid, 13, the_credit_goes)
        _wait(lambda: _row(mesh, tid)[:2] == ("queued", 0), 20, "the unsent task back in the queue, no attempt counted")
    finally:
        dispatcher_module._HANDLERS[Kind.FETCH] = real_fetch
        del disp._resync_credit

    async def credit_back() -> None:
        s.credit = 2
        disp.kick(ep)

    asyncio.run_coroutine_threadsafe(credit_back(), mesh.hub._loop).result(10)  # type: ignore[union-attr]
    _wait(lambda: _row(mesh, tid)[0] == "done", 30, "the task run by the agent")

