"""Group commit in the hub's SQLite store (cloud_hub/store/group.py), on a real database file.

Operations that wait while the database thread is busy are committed in one transaction, each in
its own savepoint. What must hold: a bad operation in a group fails alone with a clear error and
changes nothing, the good ones are stored exactly once; nobody is told "stored" before the COMMIT
that holds their writes returned, and when that COMMIT fails, everyone in the group hears so and
nothing of the group is on disk. The database thread is held on an event to make the group
(no clocks)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from cloud_hub.store import SqliteStore

pytestmark = pytest.mark.integration

FID = "f" * 64


async def _setup(store: SqliteStore, n: int) -> tuple[str, str]:
    uid = await store.create_user("alice")
    tok = await store.create_enroll_token(uid, 60, 1)
    ep = await store.enroll_endpoint(tok, "pi", "mqtt", b"k" * 32)
    assert ep is not None
    await store.put_function(uid, FID, b"body", "noop")
    now = time.time()
    await store.insert_tasks([{"id": f"t{i}", "user_id": uid, "endpoint_id": ep["id"], "function_id": FID, "args": b"a",
                               "created": now + i * 1e-3, "expires": now + 3600, "timeout": None} for i in range(n)])
    return uid, str(ep["id"])


def _result(tid: str, **kw: Any) -> dict[str, Any]:
    return {"id": tid, "ok": True, "data": b"\x00none", "started": 1.0, "finished": 2.0, "pid": 7, **kw}


async def _in_one_group(store: SqliteStore, calls: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Hold the database thread, start every call (each queues its transaction), release: the
    calls' transactions then run as one group. Returns each call's value or exception."""
    started, gate = threading.Event(), threading.Event()

    def hold(db: sqlite3.Connection) -> None:
        started.set()
        gate.wait(60)

    holder = asyncio.ensure_future(store.read(hold))
    assert await asyncio.to_thread(started.wait, 60)
    futs = [asyncio.ensure_future(c()) for c in calls]
    for _ in range(5):  # each call runs up to its wait on the group's commit
        await asyncio.sleep(0)
    assert not any(f.done() for f in futs), "a caller was answered while its transaction could not have committed"
    gate.set()
    await holder
    return list(await asyncio.gather(*futs, return_exceptions=True))


async def _stored(store: SqliteStore) -> list[tuple[str, str]]:
    return await store.read(lambda db: db.execute("SELECT r.task_id, t.state FROM results r JOIN tasks t ON t.id=r.task_id ORDER BY 1").fetchall())


async def test_one_bad_results_batch_in_a_group_fails_alone_and_the_good_ones_are_stored_once(tmp_path: Path) -> None:
    store = await SqliteStore(tmp_path / "hub.sqlite3").open()
    try:
        uid, ep = await _setup(store, 4)
        before = store.group_stats
        out = await _in_one_group(store, [
            lambda: store.store_results(ep, [_result("t0")]),
            lambda: store.store_results(ep, [_result("t1", data=None)]),  # a broken agent: no data
            lambda: store.store_results(ep, [_result("t2"), _result("t3")]),
            lambda: store.ack(ep, ["t1"]),
        ])
        after = store.group_stats
        assert out[0] == [("t0", uid)] and sorted(out[2]) == [("t2", uid), ("t3", uid)] and out[3] is None
        assert isinstance(out[1], ValueError) and "result 0 (task t1) has no 'data' (bytes)" in str(out[1])
        assert after["transactions"] == before["transactions"] + 1, "the four were not one group"
        assert after["ops"] == before["ops"] + 3 and after["failed_ops"] == before["failed_ops"] + 1
        assert await _stored(store) == [("t0", "done"), ("t2", "done"), ("t3", "done")]
        # the bad batch changed nothing: t1 is as the ack left it, with no result
        assert await store.read(lambda db: db.execute("SELECT state FROM tasks WHERE id='t1'").fetchone()[0]) == "acked"
        # exactly once: the same results again (an agent re-sending before our ack) store nothing new
        assert await store.store_results(ep, [_result("t0"), _result("t2")]) == []
    finally:
        await store.close()
    reopened = await SqliteStore(tmp_path / "hub.sqlite3").open()  # committed means on disk
    try:
        assert await _stored(reopened) == [("t0", "done"), ("t2", "done"), ("t3", "done")]
    finally:
        await reopened.close()


async def test_a_failed_commit_fails_everyone_in_the_group_and_stores_nothing(tmp_path: Path) -> None:
    store = await SqliteStore(tmp_path / "hub.sqlite3").open()
    try:
        _, ep = await _setup(store, 2)

        def breaks_commit(db: sqlite3.Connection) -> None:
            # A foreign-key violation checked only at COMMIT: the savepoint releases fine, the
            # group's COMMIT fails, and with it every operation in the group.
            db.execute("PRAGMA defer_foreign_keys=ON")
            db.execute("INSERT INTO api_tokens (hash, user_id, name, created) VALUES ('h', 'u_nobody', 'x', 0)")

        out = await _in_one_group(store, [
            lambda: store.store_results(ep, [_result("t0")]),
            lambda: store.tx(breaks_commit),
            lambda: store.store_results(ep, [_result("t1")]),
        ])
        assert all(isinstance(o, sqlite3.IntegrityError) for o in out), out
        assert await _stored(store) == []
        # the store goes on: the same results in a later group are stored, once
        assert len(await store.store_results(ep, [_result("t0"), _result("t1")])) == 2
        assert [t for t, _ in await _stored(store)] == ["t0", "t1"]
    finally:
        await store.close()


async def test_an_idle_store_commits_each_operation_at_once(tmp_path: Path) -> None:
    """No added delay when nothing else is waiting: one operation, one transaction."""
    store = await SqliteStore(tmp_path / "hub.sqlite3").open()
    try:
        _, ep = await _setup(store, 3)
        before = store.group_stats
        for i in range(3):
            await store.store_results(ep, [_result(f"t{i}")])
        after = store.group_stats
        assert after["transactions"] - before["transactions"] == 3 and after["largest"] >= 1
    finally:
        await store.close()
