"""Memoization (issue 16, item 2) on a real mesh: Mosquitto, the hub, one ZeroMQ agent.

- a repeat of a finished cached call is answered by the hub with no dispatch (its task is born
  done, the agent never sees it), and the value is the first call's;
- repeats submitted while the first call runs join it (one task at the hub), in the SDK and, from
  another client, at the hub (the same task id);
- ``ignore_for_cache`` names, a function registered with ``cache=True``;
- the scope is per user: another user's identical call runs;
- bad input: an argument that cannot be hashed, a malformed cache key: a clear error, nothing stored.
"""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import threading
import time
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor, HubError
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.protocol.memo import MemoKeyError
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import serialize

pytestmark = pytest.mark.integration


def slow_square(x: int, verbose: bool = False) -> int:
    import time

    time.sleep(0.3)
    return x * x


def slower_square(x: int) -> int:
    import time

    time.sleep(2.0)
    return x * x


def pid_of_run(x: int) -> tuple[int, int]:
    import os

    return x, os.getpid()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, AgentProcess]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    m = LocalMesh(tmp_path_factory.mktemp("memo"), heartbeat_s=0.5, lost_after_s=3.0)
    m.start()
    try:
        agent = m.add_agent("memo", "zmq", workers=2)
        m.wait_online(timeout=90)
        yield m, agent
    finally:
        m.stop()


def _db(m: LocalMesh) -> sqlite3.Connection:
    return sqlite3.connect(m.hub_cfg.db_path)


def _tasks(m: LocalMesh) -> int:
    with _db(m) as c:
        return int(c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


def _dispatched(m: LocalMesh, task_id: str) -> Any:
    with _db(m) as c:
        return c.execute("SELECT dispatched, state, attempts FROM tasks WHERE id=?", (task_id,)).fetchone()


def test_a_repeat_of_a_finished_call_is_answered_by_the_hub_without_dispatch(mesh: Any) -> None:
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        first = ex.submit(slow_square, 7, cache=True)
        assert first.result(timeout=60) == 49
        again = ex.submit(slow_square, 7, cache=True)
        assert again.result(timeout=60) == 49
        assert again.task_id != first.task_id  # type: ignore[attr-defined]
        dispatched, state, attempts = _dispatched(m, again.task_id)  # type: ignore[attr-defined]
        assert (dispatched, state, attempts) == (None, "done", 0)  # never left the hub
        assert _dispatched(m, first.task_id)[0] is not None  # type: ignore[attr-defined]
        # the same call without cache=True runs again; another argument is another call
        plain = ex.submit(slow_square, 7)
        other = ex.submit(slow_square, 8, cache=True)
        assert plain.result(timeout=60) == 49 and other.result(timeout=60) == 64
        assert _dispatched(m, plain.task_id)[0] is not None and _dispatched(m, other.task_id)[0] is not None  # type: ignore[attr-defined]
        # f(7) and f(x=7) are one call; ignore_for_cache leaves `verbose` out of the key
        assert ex.submit(slow_square, 9, cache=True, ignore_for_cache=["verbose"]).result(timeout=60) == 81
        kw = ex.submit(slow_square, x=9, verbose=True, cache=True, ignore_for_cache=["verbose"])
        assert kw.result(timeout=60) == 81 and _dispatched(m, kw.task_id)[0] is None  # type: ignore[attr-defined]
    with _db(m) as c:
        hits, misses = c.execute("SELECT SUM(hits), SUM(misses) FROM memo_counts").fetchone()
    assert (hits, misses) == (2, 3)


def test_repeats_submitted_while_the_first_runs_join_it(mesh: Any) -> None:
    m, agent = mesh
    before = _tasks(m)
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        futs = [ex.submit(slow_square, 11, cache=True) for _ in range(5)]
        assert [f.result(timeout=60) for f in futs] == [121] * 5
    assert _tasks(m) == before + 1


def test_a_repeat_from_another_process_while_the_first_runs_gets_the_same_task(mesh: Any) -> None:
    m, agent = mesh
    before = _tasks(m)
    other = Client(m.url, m.token)  # another client, as another process would have
    try:
        with Executor(m.client, endpoint=agent.endpoint_id) as one, Executor(other, endpoint=agent.endpoint_id) as two:
            first = one.submit(slower_square, 13, cache=True)
            deadline = time.monotonic() + 60
            while not hasattr(first, "task_id") and not first.done() and time.monotonic() < deadline:
                time.sleep(0.01)  # until the hub has accepted it
            assert hasattr(first, "task_id")
            second = two.submit(slower_square, 13, cache=True)  # the first runs for 2 s
            assert first.result(timeout=60) == second.result(timeout=60) == 169
            assert second.task_id == first.task_id  # type: ignore[attr-defined]
    finally:
        other.close()
    assert _tasks(m) == before + 1


def test_a_function_registered_with_cache_true_is_memoized_and_the_scope_is_per_user(mesh: Any) -> None:
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        fid = ex.register_function(pid_of_run, cache=True)
        a = ex.submit_to_registered_function(fid, (3,)).result(timeout=60)
        b = ex.submit(pid_of_run, 3)  # the same function object: cached too
        assert b.result(timeout=60) == a and _dispatched(m, b.task_id)[0] is None  # type: ignore[attr-defined]

    async def mint() -> str:
        store = await SqliteStore(m.hub_cfg.db_path).open()
        try:
            return await store.create_api_token(await store.create_user("bob"), "test")
        finally:
            await store.close()

    bob = Client(m.url, asyncio.run(mint()), trusted_endpoints=[agent.endpoint_id])
    m.client.share_endpoint(agent.endpoint_id, "bob")
    try:
        with Executor(bob, endpoint=agent.endpoint_id) as ex:
            f = ex.submit(pid_of_run, 3, cache=True)
            assert tuple(f.result(timeout=60))[0] == 3
            assert _dispatched(m, f.task_id)[0] is not None  # type: ignore[attr-defined]  # not demo's cache
    finally:
        bob.close()


def test_an_argument_that_cannot_be_hashed_is_refused_before_anything_is_stored(mesh: Any) -> None:
    m, agent = mesh
    before = _tasks(m)
    lock = threading.Lock()
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        with pytest.raises(MemoKeyError) as info:
            ex.submit(slow_square, lock, cache=True)
        assert "argument 'x'" in str(info.value) and "ignore_for_cache=['x']" in str(info.value)
        with pytest.raises(MemoKeyError, match="consumed by the call"):
            ex.submit(slow_square, (i for i in range(3)), cache=True)
        with pytest.raises(TypeError, match="cache must be True or False"):
            ex.submit(slow_square, 1, cache="yes")
        with pytest.raises(TypeError, match="not one string"):
            ex.submit(slow_square, 1, cache=True, ignore_for_cache="verbose")
    assert _tasks(m) == before


@pytest.mark.parametrize("key", ["abc", "G" * 64, "0" * 63])
def test_a_malformed_cache_key_is_refused_and_stores_nothing(mesh: Any, key: str) -> None:
    m, agent = mesh
    fid = m.client.register_function(slow_square)
    before = _tasks(m)
    spec = {"endpoint_id": agent.endpoint_id, "function_id": fid, "args": base64.b64encode(serialize(((1,), {}))).decode(), "cache_key": key}
    with pytest.raises(HubError) as info:
        m.client.request("POST", "/v1/tasks", json=spec)
    assert info.value.status == 422 and "cache_key" in str(info.value)
    assert _tasks(m) == before


def test_the_console_shows_cache_hits_and_misses_and_predicted_capacity(mesh: Any) -> None:
    import httpx

    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        assert [f.result(timeout=60) for f in [ex.submit(slow_square, 21, cache=True)]] == [441]
        assert ex.submit(slow_square, 21, cache=True).result(timeout=60) == 441
    with httpx.Client(base_url=m.url, follow_redirects=False, timeout=30) as c:
        assert c.post("/console/login", data={"token": m.token}).status_code == 303
        page = c.get("/console/functions").text
        with _db(m) as db:
            fid = db.execute("SELECT id FROM functions WHERE name='slow_square'").fetchone()[0]
            hits, misses = db.execute("SELECT hits, misses FROM memo_counts WHERE function_id=?", (fid,)).fetchone()
        assert "Cache hits · misses" in page and f"{hits} · {misses}" in page and hits >= 1
        ep_page = c.get(f"/console/endpoints/{agent.endpoint_id}").text
        assert "Predicted capacity" in ep_page and "tasks/s" in ep_page
        # slow_square sleeps 0.3 s: one worker does at most ~3.3 a second, the endpoint's 2 workers ~6.7
        row = ep_page.split("slow_square", 1)[1].split("</tr>", 1)[0]
        per_worker = float(row.split("/s</td>", 1)[0].rsplit(">", 1)[1])
        predicted = float(row.split(" tasks/s", 1)[0].rsplit(">", 1)[1])
        assert 0 < per_worker <= 3.4 and predicted == pytest.approx(2 * per_worker, abs=0.11)
