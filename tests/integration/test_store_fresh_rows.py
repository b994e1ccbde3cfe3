"""``store_results`` hands back the stream rows of what it stored (``Fresh.rows``, issue 30), on a
real SQLite file. The SDK's result stream sends these from memory instead of reading them back,
so they must be exactly what ``results_after`` would have read: same numbers, same keys, same
values (the endpoint's flags included), per user, and nothing for a result stored before."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cloud_hub.store import SqliteStore
from cloud_hub.store.access import AccessStore

pytestmark = pytest.mark.integration

FID = "f" * 64


async def _setup(store: SqliteStore, n: int, *, bob: int = 0) -> tuple[str, str, str]:
    """alice's endpoint with ``n`` of her tasks t0.. and ``bob`` tasks b0.. of user bob on it."""
    uid = await store.create_user("alice")
    bid = await store.create_user("bob")
    tok = await store.create_enroll_token(uid, 60, 1)
    ep = await store.enroll_endpoint(tok, "pi", "mqtt", b"k" * 32)
    assert ep is not None
    await store.put_function(uid, FID, b"body", "noop")
    await store.put_function(bid, FID, b"body", "noop")
    now = time.time()
    rows = [{"id": f"t{i}", "user_id": uid, "endpoint_id": ep["id"], "function_id": FID, "args": b"a",
             "created": now + i * 1e-3, "expires": now + 3600, "timeout": None} for i in range(n)]
    rows += [{"id": f"b{i}", "user_id": bid, "endpoint_id": ep["id"], "function_id": FID, "args": b"a",
              "created": now + (n + i) * 1e-3, "expires": now + 3600, "timeout": None} for i in range(bob)]
    await store.insert_tasks(rows)
    return uid, bid, str(ep["id"])


def _result(tid: str, **kw: Any) -> dict[str, Any]:
    return {"id": tid, "ok": True, "data": b"\x00none", "started": 1.0, "finished": 2.0, "pid": 7, **kw}


async def _read_back(store: SqliteStore, user: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the stream would read for these rows: results_after from just before the first."""
    if not rows:
        return []
    return await store.results_after(user, rows[0]["seq"] - 1, len(rows))


async def _open(tmp_path: Path) -> SqliteStore:
    return await SqliteStore(tmp_path / "hub.sqlite3").open()


async def test_fresh_rows_are_what_results_after_reads_per_user_and_numbered_without_gaps(tmp_path: Path) -> None:
    store = await _open(tmp_path)
    try:
        uid, bid, ep = await _setup(store, 6, bob=3)
        assert await AccessStore(store).set_trusted(ep, True)
        fresh = await store.store_results(ep, [
            _result("t0"),
            _result("b0", ok=False, data=b"boom"),
            _result("t1", started=None, finished=None),  # optional fields absent or None
            {"id": "t2", "ok": 1, "data": bytearray(b"ba")},  # ok as an int, data as a bytearray: both accepted
            _result("b1"),
        ])
        assert sorted(fresh) == sorted([("t0", uid), ("b0", bid), ("t1", uid), ("t2", uid), ("b1", bid)])
        assert set(fresh.rows) == {uid, bid}
        for user, want_ids in ((uid, ["t0", "t1", "t2"]), (bid, ["b0", "b1"])):
            rows = fresh.rows[user]
            assert [r["task_id"] for r in rows] == want_ids, "in number order, which is batch order"
            seqs = [r["seq"] for r in rows]
            assert seqs == list(range(1, len(rows) + 1)), "each user's own numbers, from 1, no gap"
            back = await _read_back(store, user, rows)
            assert [set(r) for r in rows] == [set(b) for b in back], "the same keys as the stream's read"
            assert rows == back, "and the same values"
        # the endpoint's flags, per user: alice owns it and trusts it; bob only shares it
        assert all(r["own_endpoint"] and r["trusted"] and r["endpoint_id"] == ep for r in fresh.rows[uid])
        assert all(not r["own_endpoint"] and not r["trusted"] for r in fresh.rows[bid])

        # the next batch continues each user's numbers where the last one stopped
        more = await store.store_results(ep, [_result("t3"), _result("b2"), _result("t4")])
        assert [r["seq"] for r in more.rows[uid]] == [4, 5]
        assert [r["seq"] for r in more.rows[bid]] == [3]
        for user in (uid, bid):
            assert more.rows[user] == await _read_back(store, user, more.rows[user])
        everything = await store.results_after(uid, 0, 100)
        assert [r["seq"] for r in everything] == [1, 2, 3, 4, 5]
        assert everything == fresh.rows[uid] + more.rows[uid]
    finally:
        await store.close()


async def test_numbers_continue_after_results_the_hub_wrote_itself(tmp_path: Path) -> None:
    """A cancel writes a result (numbered) that never passes through Fresh: the next Fresh rows
    start after it, so an inbox that missed it sees a gap and reads the store."""
    store = await _open(tmp_path)
    try:
        uid, _, ep = await _setup(store, 3)
        first = await store.store_results(ep, [_result("t0")])
        assert [r["seq"] for r in first.rows[uid]] == [1]
        done = await store.cancel_tasks(uid, ["t1"])
        assert done["fresh"] == ["t1"]
        nxt = await store.store_results(ep, [_result("t2")])
        assert [r["seq"] for r in nxt.rows[uid]] == [3], "number 2 went to the cancel"
        assert nxt.rows[uid] == await _read_back(store, uid, nxt.rows[uid])
        late = await store.store_results(ep, [_result("t1")])  # the agent's result after the cancel
        assert late == [] and late.rows == {}
    finally:
        await store.close()


async def test_duplicates_give_an_empty_fresh_with_no_rows(tmp_path: Path) -> None:
    store = await _open(tmp_path)
    try:
        uid, _, ep = await _setup(store, 3)
        first = await store.store_results(ep, [_result("t0"), _result("t1")])
        assert len(first) == 2 and len(first.rows[uid]) == 2
        again = await store.store_results(ep, [_result("t0", data=b"other"), _result("t1")])
        assert again == [] and again.rows == {}, "re-sent after a lost result_ack: nothing new"
        mixed = await store.store_results(ep, [_result("t1"), _result("t2"), _result("nope")])  # one old, one new, one unknown
        assert mixed == [("t2", uid)]
        assert [(r["task_id"], r["seq"]) for r in mixed.rows[uid]] == [("t2", 3)]
        other = await store.store_results("someone-else", [_result("t2")])  # not this endpoint's task
        assert other == [] and other.rows == {}
        assert [r["data"] for r in await store.results_after(uid, 0, 10)] == [b"\x00none"] * 3, "the first copy stays"
    finally:
        await store.close()


async def test_a_batch_repeating_an_id_gives_one_row_holding_what_was_stored(tmp_path: Path) -> None:
    store = await _open(tmp_path)
    try:
        uid, _, ep = await _setup(store, 2)
        fresh = await store.store_results(ep, [_result("t0", data=b"one"), _result("t1"), _result("t0", data=b"two")])
        assert sorted(fresh) == [("t0", uid), ("t1", uid)]
        rows = fresh.rows[uid]
        assert sorted(r["task_id"] for r in rows) == ["t0", "t1"]
        assert [r["seq"] for r in rows] == [1, 2]
        assert rows == await store.results_after(uid, 0, 10), "the row sent from memory is the row stored"
    finally:
        await store.close()
