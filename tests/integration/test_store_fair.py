"""Fair leases and the memo table on both store backends (SQLite file, local PostgreSQL).

- a lease under a policy takes turns between users (B's tasks go out while A has a backlog),
  honours shares and concurrency limits, and plain arrival order when ``fair`` is off;
- memo rows: a success of a task with a cache key is remembered, answers a lookup, is copied to
  a hit task born done, is evicted past ``max_entries`` (least recently used first) and expires.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cloud_hub.admission import parse_policy
from cloud_hub.store import SqliteStore
from cloud_hub.store import memo as memo_rows
from cloud_hub.store.memo import MemoSettings
from tests.integration.test_store import FID, _endpoint, _tasks, open_store, store  # noqa: F401  (fixtures)
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def _named(rows: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    for r in rows:
        r["id"] = prefix + r["id"]
    return rows


async def _two_users(store: SqliteStore) -> tuple[str, str, str]:  # noqa: F811  (shadows the imported fixture)
    a, b = await store.create_user("alice"), await store.create_user("bob")
    await store.put_function(a, FID, b"body", "fn")
    await store.put_function(b, FID, b"body", "fn")
    ep = await _endpoint(store, a)
    await store.insert_tasks(_named(_tasks(a, ep, 300), "a"))
    await store.insert_tasks(_named(_tasks(b, ep, 20, start=1000), "b"))  # B's arrive after A's backlog
    return a, b, ep


async def test_a_fair_lease_takes_turns_between_users(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    a, b, ep = await _two_users(store)
    first, _ = await store.lease(ep, 10, 30.0, 1 << 20, policy=parse_policy())
    ids = [t["id"] for t in first]
    assert sum(i.startswith("b") for i in ids) == 5
    # each user's share runs together (one environment switch per frame, not one per task)
    assert ids == sorted(ids, key=lambda i: (i[0] != ids[0][0], i))
    # A now runs 5 and B 5 here: equal shares keep alternating; B's backlog is not behind A's
    second, _ = await store.lease(ep, 10, 30.0, 1 << 20, policy=parse_policy())
    assert sum(t["id"].startswith("b") for t in second) == 5
    fifo, _ = await store.lease(ep, 10, 30.0, 1 << 20, policy=parse_policy(fair=False))
    assert all(t["id"].startswith("a") for t in fifo), "arrival order: A's older backlog first"
    assert [t["id"] for t in fifo] == sorted(t["id"] for t in fifo)


async def test_shares_and_concurrency_limits_shape_a_lease(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    a, b, ep = await _two_users(store)
    got, _ = await store.lease(ep, 20, 30.0, 1 << 20, policy=parse_policy(shares={"alice": 3}))
    assert sum(t["id"].startswith("a") for t in got) == 15
    capped = parse_policy({"users": {"bob": {"max_running": 7}}})
    more, _ = await store.lease(ep, 40, 30.0, 1 << 20, policy=capped)
    assert sum(t["id"].startswith("b") for t in more) == 2  # bob already runs 5 of his 7
    none, _ = await store.lease(ep, 40, 30.0, 1 << 20, policy=parse_policy({"functions": {FID: {"max_running": 10}}}))
    assert none == [], "the function already runs more than 10: nothing more goes out"


async def test_memo_rows_remember_answer_evict_and_expire(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    a = await store.create_user("alice")
    await store.put_function(a, FID, b"body", "fn")
    ep = await _endpoint(store, a)
    rows = _tasks(a, ep, 3)
    for i, r in enumerate(rows):
        r["memo_key"] = f"{i:064x}"
    await store.insert_tasks(rows)
    settings = MemoSettings(ttl_s=60, max_entries=2, max_result_bytes=100)
    store.memo = settings
    await store.lease(ep, 3, 30.0, 1 << 20)
    fresh = await store.store_results(ep, [{"id": "t00000", "ok": True, "data": b"v0"}, {"id": "t00001", "ok": False, "data": b"err"}])
    assert len(fresh) == 2
    now = time.time()
    found = await store.read(lambda db: memo_rows.lookup(db, a, [f"{i:064x}" for i in range(3)], now))
    assert list(found) == [f"{0:064x}"], "only a success is cached"
    await store.store_results(ep, [{"id": "t00002", "ok": True, "data": b"x" * 101}])  # too big to cache
    assert await store.read(lambda db: memo_rows.count(db, a)) == 1
    hit = found[f"{0:064x}"]
    row = {"id": "hit1", "function_id": FID, "expires": now + 60, "timeout": None}
    await store.tx(lambda db: memo_rows.write_hits(db, a, [(row, hit)], {FID: 2}, now))
    got = await store.results(a, ["hit1"])
    assert got[0]["data"] == b"v0" and got[0]["endpoint_id"] == ep
    assert await store.read(lambda db: memo_rows.counts(db, a)) == {FID: (1, 2)}
    # three more successes with keys: the least recently used entries go past max_entries=2
    more = _tasks(a, ep, 3, start=10)
    for i, r in enumerate(more):
        r["memo_key"] = f"{i + 10:064x}"
    await store.insert_tasks(more)
    await store.lease(ep, 3, 30.0, 1 << 20)
    await store.store_results(ep, [{"id": r["id"], "ok": True, "data": b"v"} for r in more])
    assert await store.read(lambda db: memo_rows.count(db, a)) == 2
    assert await store.tx(lambda db: memo_rows.prune(db, time.time() + 61)) == 2


async def test_a_user_with_many_functions_does_not_hide_the_next_user(store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811  (shadows the imported fixture)
    from cloud_hub.store import fair

    # Small caps, so that a handful of functions shows it: without the per-user cap, the first
    # user's 8 flows would fill the lease's view and the second user would not be seen at all.
    monkeypatch.setattr(fair, "MAX_FLOWS", 8)
    monkeypatch.setattr(fair, "MAX_FLOWS_PER_USER", 4)
    MAX_FLOWS_PER_USER = 4
    a, b = await store.create_user("alice"), await store.create_user("bob")
    if a > b:
        a, b = b, a  # `a` sorts first: the flood of functions comes before the other user in the index
    ep = await _endpoint(store, a)
    rows = []
    for k in range(MAX_FLOWS_PER_USER + 4):
        fid = f"{k:064x}"
        await store.put_function(a, fid, b"body", f"fn{k}")
        rows += [{**r, "id": f"a{k:02d}{r['id']}", "function_id": fid} for r in _tasks(a, ep, 3)]
    await store.put_function(b, FID, b"body", "fn")
    await store.insert_tasks(rows)
    await store.insert_tasks(_named(_tasks(b, ep, 3, start=500), "b"))
    got, _ = await store.lease(ep, 6, 30.0, 1 << 20, policy=parse_policy())
    assert sum(t["id"].startswith("b") for t in got) == 3


async def test_a_pending_cached_task_is_found_until_it_is_done(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    a = await store.create_user("alice")
    bob = await store.create_user("bob")
    await store.put_function(a, FID, b"body", "fn")
    ep = await _endpoint(store, a)
    rows = _tasks(a, ep, 2)
    rows[0]["memo_key"] = rows[1]["memo_key"] = "e" * 64  # two submits of one call (the older is joined)
    await store.insert_tasks(rows)
    got = await store.read(lambda db: memo_rows.pending(db, a, ["e" * 64, "d" * 64]))
    assert list(got) == ["e" * 64] and got["e" * 64].task_id == "t00000" and got["e" * 64].joined
    assert await store.read(lambda db: memo_rows.pending(db, bob, ["e" * 64])) == {}, "per user"
    await store.lease(ep, 2, 30.0, 1 << 20)
    await store.store_results(ep, [{"id": "t00000", "ok": True, "data": b"v"}, {"id": "t00001", "ok": True, "data": b"v"}])
    assert await store.read(lambda db: memo_rows.pending(db, a, ["e" * 64])) == {}
