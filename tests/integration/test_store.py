"""The hub store suite, run against both backends: SQLite (a real file) and PostgreSQL (the local server).

Each test gets a fresh database. ``two`` opens a second store on the same database: a second hub
replica for PostgreSQL, a second connection to the same file for SQLite.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

from cloud_hub.store import SqliteStore, StoreError, hash_token
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

FID = "f" * 64


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], SqliteStore]:
    """A factory: every call opens another store on the same fresh database."""
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "hub.sqlite3")
    from cloud_hub.store.postgres import PostgresStore

    url = request.getfixturevalue("pg_url")
    return lambda: PostgresStore(url)


@pytest.fixture
async def store(open_store: Callable[[], SqliteStore]) -> AsyncIterator[SqliteStore]:
    s = await open_store().open()
    yield s
    await s.close()


async def _endpoint(store: SqliteStore, uid: str, name: str = "pi") -> str:
    tok = await store.create_enroll_token(uid, 60, 1)
    ep = await store.enroll_endpoint(tok, name, "mqtt", b"k" * 32)
    assert ep is not None
    return str(ep["id"])


def _tasks(uid: str, ep: str, n: int, *, start: int = 0, expires_in: float = 3600, args: bytes = b"args") -> list[dict[str, Any]]:
    now = time.time()
    return [{"id": f"t{i:05d}", "user_id": uid, "endpoint_id": ep, "function_id": FID, "args": args,
             "created": now + i * 1e-3, "expires": now + expires_in, "timeout": None} for i in range(start, start + n)]


async def test_users_and_tokens_hashed_at_rest(store: SqliteStore) -> None:
    uid = await store.create_user("alice")
    assert await store.create_user("alice") == uid, "create_user is idempotent"
    tok = await store.create_api_token(uid, "laptop")
    assert await store.user_for_token(tok) == uid
    assert await store.user_for_token(tok + "x") is None
    stored = await store.tx(lambda db: [r[0] for r in db.execute("SELECT hash FROM api_tokens").fetchall()])
    assert stored == [hash_token(tok)] and tok not in stored


async def test_api_tokens_expire_and_are_revoked_by_id(store: SqliteStore) -> None:
    """Migration 13 (issue 18): an optional expiry and a revocation time; the id is the start of the hash."""
    from cloud_hub.store import token_id

    uid = await store.create_user("alice")
    good = await store.create_api_token(uid, "laptop", time.time() + 3600)
    old = await store.create_api_token(uid, "old", time.time() - 1)
    forever = await store.create_api_token(uid, "ci")
    assert await store.user_for_token(good) == uid and await store.user_for_token(forever) == uid
    assert await store.user_for_token(old) is None, "expired"
    assert (await store.api_token_state(old))[0] == uid  # type: ignore[index]  # known, so the hub can say "expired"
    listed = {r["name"]: r for r in await store.list_api_tokens("alice")}
    assert listed["laptop"]["id"] == token_id(good) and listed["ci"]["expires"] is None and listed["old"]["revoked"] is None
    r = await store.revoke_api_token(token_id(good)[:9])  # a unique prefix: tk_ and 6 hex digits
    assert r["id"] == token_id(good) and r["already"] is False
    assert await store.user_for_token(good) is None and await store.user_for_token(forever) == uid
    again = await store.revoke_api_token(good)  # by the token itself: nothing changes
    assert again["already"] is True and again["revoked"] == r["revoked"]
    # ambiguous, unknown and malformed ids change nothing
    now = time.time()
    for h in ("abcdef" + "0" * 58, "abcdef" + "1" * 58):
        await store.tx(lambda db, h=h: db.execute("INSERT INTO api_tokens (hash, user_id, name, created) VALUES (?, ?, ?, ?)", (h, uid, "x", now)))
    before = await store.list_api_tokens()
    with pytest.raises(StoreError, match="matches 2 API tokens"):
        await store.revoke_api_token("tk_abcdef")
    taken = {r["id"][3:9] for r in before}
    absent = next(p for p in ("123456", "654321", "fedcba") if p not in taken)
    with pytest.raises(StoreError, match="no API token"):
        await store.revoke_api_token("tk_" + absent)
    for bad in ("tk_abc", "tk_abcdeg", "abc%ef", ""):
        with pytest.raises(StoreError, match="is not a token id"):
            await store.revoke_api_token(bad)
    assert await store.list_api_tokens() == before


async def test_enrollment_tokens_are_used_up_and_expire(store: SqliteStore) -> None:
    uid = await store.create_user("alice")
    tok = await store.create_enroll_token(uid, 60, 2)
    assert await store.enroll_endpoint(tok, "a", "mqtt", b"1" * 32) is not None
    assert await store.enroll_endpoint(tok, "b", "zmq", b"2" * 32) is not None
    assert await store.enroll_endpoint(tok, "c", "mqtt", b"3" * 32) is None
    old = await store.create_enroll_token(uid, 1e-6, 5)
    await asyncio.sleep(0.01)
    assert await store.enroll_endpoint(old, "d", "mqtt", b"4" * 32) is None
    eps = await store.list_endpoints(uid)
    assert [e["name"] for e in eps] == ["a", "b"] and all(not e["online"] for e in eps)
    keys = await store.endpoint_keys()
    assert sorted(keys.values()) == [b"1" * 32, b"2" * 32]
    assert await store.endpoint_key(eps[1]["id"]) == b"2" * 32 and await store.endpoint_key("ep-none") is None
    await store.set_endpoint_state(eps[0]["id"], True, 123.5, {"capacity": 4})
    (e,) = await store.list_endpoints(uid, eps[0]["id"])
    assert e["online"] and e["last_seen"] == 123.5 and e["info"] == {"capacity": 4}


async def test_functions_and_ownership(store: SqliteStore) -> None:
    alice, bob = await store.create_user("alice"), await store.create_user("bob")
    await store.put_function(alice, FID, b"body", "fn")
    await store.put_function(alice, FID, b"body", "fn")  # idempotent
    ep = await _endpoint(store, alice)
    assert [f["size"] for f in await store.list_functions(alice)] == [4]
    assert await store.list_functions(bob) == []
    assert await store.owned_refs(alice, [ep, "ep-x"], [FID, "0" * 64]) == ({ep}, {FID})
    assert await store.owned_refs(bob, [ep], [FID]) == (set(), set())


async def test_queue_lease_ack_requeue_and_results_once(store: SqliteStore) -> None:
    uid = await store.create_user("alice")
    await store.put_function(uid, FID, b"body", "fn")
    ep = await _endpoint(store, uid)
    await store.insert_tasks(_tasks(uid, ep, 10))
    tasks, bodies = await store.lease(ep, 4, 30.0, 1 << 20)
    assert [t["id"] for t in tasks] == ["t00000", "t00001", "t00002", "t00003"], "oldest first"
    assert bodies == {FID: b"body"} and tasks[0]["args"] == b"args"
    small, _ = await store.lease(ep, 10, 30.0, 4 + 4 + 4)  # body + two args fit, the third does not
    assert len(small) == 2
    await store.ack(ep, ["t00000", "t00001"])
    assert await store.task_counts(uid) == {"acked": 2, "leased": 4, "queued": 4}
    # expired leases go back; a lost endpoint's leases go back; acked tasks the agent no longer holds go back
    assert await store.requeue(expired_before=time.time() + 60) == 4
    assert await store.requeue(endpoint_id=ep, not_in={"t00000"}) == 1
    assert await store.task_counts(uid) == {"acked": 1, "queued": 9}
    fresh = await store.store_results(ep, [{"id": "t00000", "ok": True, "data": b"r0", "started": 1.0, "finished": 2.0, "pid": 7}])
    assert fresh == [("t00000", uid)]
    assert await store.store_results(ep, [{"id": "t00000", "ok": True, "data": b"again"}]) == [], "stored once"
    twice = [{"id": "t00002", "ok": True, "data": b"r2"}] * 2
    assert await store.store_results(ep, twice) == [("t00002", uid)], "an id repeated in one batch counts once"
    assert await store.store_results("ep-other", [{"id": "t00001", "ok": True, "data": b"x"}]) == [], "only from its endpoint"
    (r,) = await store.results(uid, ["t00000", "t00001"])
    assert (r["task_id"], r["ok"], r["data"], r["started"], r["finished"]) == ("t00000", True, b"r0", 1.0, 2.0)
    t = await store.get_task("t00000", uid)
    assert t is not None and t["state"] == "done" and t["ok"]
    assert await store.get_task("t00000", "u_other") is None


async def test_result_stream_order_expiry_and_pruning(store: SqliteStore) -> None:
    uid = await store.create_user("alice")
    await store.put_function(uid, FID, b"body", "fn")
    ep = await _endpoint(store, uid)
    await store.insert_tasks(_tasks(uid, ep, 5) + _tasks(uid, ep, 2, start=100, expires_in=-1))
    assert await store.last_result_seq() == 0
    await store.lease(ep, 5, 30.0, 1 << 20)
    for i in (3, 1, 4):
        await store.store_results(ep, [{"id": f"t{i:05d}", "ok": True, "data": str(i).encode()}])
    expired = await store.expire_tasks(time.time(), lambda tid: b"expired " + tid.encode())
    assert sorted(expired) == [("t00100", uid), ("t00101", uid)]
    rows = await store.results_after(uid, 0, 100)
    assert [r["task_id"] for r in rows][:3] == ["t00003", "t00001", "t00004"]
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    assert await store.last_result_seq() == rows[-1]["seq"]
    assert await store.last_result_seq(uid) == rows[-1]["seq"]
    assert await store.last_result_seq("u_other") == 0, "a user's cursor says nothing about others' results"
    assert [r["task_id"] for r in await store.results_after(uid, rows[1]["seq"], 1)] == ["t00004"]
    assert await store.prune_results(time.time() + 1) == 5
    assert await store.results_after(uid, 0, 100) == [] and await store.task_counts(uid) == {"leased": 2}


async def test_result_cursors_count_each_users_own_results(store: SqliteStore) -> None:
    """A user's cursor moves by their own results only (the gaps between cursors once told how many
    results other users got), numbers are never handed out twice, even after pruning."""
    alice, bob = await store.create_user("alice"), await store.create_user("bob")
    await store.put_function(alice, FID, b"body", "fn")
    ep_a, ep_b = await _endpoint(store, alice, "a"), await _endpoint(store, bob, "b")
    await store.insert_tasks(_tasks(alice, ep_a, 4) + [dict(t, user_id=bob, endpoint_id=ep_b) for t in _tasks(bob, ep_b, 6, start=10)])
    await store.lease(ep_a, 4, 30.0, 1 << 20)
    await store.lease(ep_b, 6, 30.0, 1 << 20)
    for i in range(4):  # interleaved: bob's results land between alice's
        await store.store_results(ep_a, [{"id": f"t{i:05d}", "ok": True, "data": b"a"}])
        await store.store_results(ep_b, [{"id": f"t{10 + i:05d}", "ok": True, "data": b"b"}])
    mine = await store.results_after(alice, 0, 100)
    assert [r["seq"] for r in mine] == [1, 2, 3, 4], "alice's cursors say nothing of bob's results"
    assert await store.last_result_seq(alice) == 4 and await store.last_result_seq(bob) == 4
    assert [r["task_id"] for r in await store.results_after(alice, 2, 100)] == ["t00002", "t00003"]
    assert await store.prune_results(time.time() + 1) == 8
    assert await store.last_result_seq(alice) == 4, "pruning does not take a cursor back"
    await store.store_results(ep_b, [{"id": "t00014", "ok": True, "data": b"b"}])
    assert [r["seq"] for r in await store.results_after(bob, 4, 100)] == [5]
    await store.insert_tasks(_tasks(alice, ep_a, 1, start=50, expires_in=-1))
    assert await store.expire_tasks(time.time(), lambda tid: b"expired") == [("t00050", alice)]
    (hub_written,) = await store.results_after(alice, 4, 100)
    assert (hub_written["task_id"], hub_written["seq"]) == ("t00050", 5), "results the hub writes itself are numbered too"


def test_result_cursors_survive_the_upgrade_to_per_user(tmp_path: Path) -> None:
    """A hub database from before migration 14: each result keeps its global seq as its number (a
    cursor a client holds stays valid) and each user counts on from their own newest."""
    import sqlite3

    from cloud_hub.store.migrations import MIGRATIONS
    from cloud_hub.store.sqlite import _statements

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, sql in MIGRATIONS:
        if version < 14:
            for statement in _statements(sql):
                db.execute(statement)
            db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.execute("INSERT INTO users (id, name, created) VALUES ('ua', 'alice', 0), ('ub', 'bob', 0)")
    for i, user in enumerate(["ua", "ub", "ub", "ua", "ub"]):
        db.execute("INSERT INTO results (task_id, user_id, ok, data, received) VALUES (?, ?, 1, x'00', 0)", (f"r{i}", user))
    db.close()

    async def go() -> None:
        store = await SqliteStore(path).open()
        try:
            assert await store.last_result_seq("ua") == 4 and await store.last_result_seq("ub") == 5
            assert [r["seq"] for r in await store.results_after("ua", 0, 10)] == [1, 4]
            assert [r["task_id"] for r in await store.results_after("ub", 2, 10)] == ["r2", "r4"]
        finally:
            await store.close()

    asyncio.run(go())


async def test_endpoint_ownership_for_replicas(store: SqliteStore) -> None:
    now = time.time()
    assert await store.claim_endpoint("ep-1", "A", now + 10, now)
    assert not await store.claim_endpoint("ep-1", "B", now + 10, now), "held by A"
    assert await store.claim_endpoint("ep-1", "A", now + 20, now), "A renews"
    assert await store.claim_endpoint("ep-1", "B", now + 40, now + 21), "A's hold ran out"
    await store.release_endpoint("ep-1", "A")  # not A's any more: no effect
    assert not await store.claim_endpoint("ep-1", "A", now + 50, now + 22)
    await store.release_endpoint("ep-1", "B")
    assert await store.claim_endpoint("ep-1", "A", now + 50, now + 22)


async def test_scheduler_sql_through_tx(store: SqliteStore) -> None:
    """The placement service writes its own SQL through ``tx``: the upsert works on both backends."""
    for state in ("one", "two"):
        await store.tx(lambda db, s=state: db.execute(
            "INSERT INTO scheduler_state (id, saved, policy, state) VALUES (1, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET saved=excluded.saved, policy=excluded.policy, state=excluded.state",
            (time.time(), "delta", s)))
    assert await store.tx(lambda db: db.execute("SELECT state FROM scheduler_state WHERE id=1").fetchone()[0]) == "two"


async def test_two_writers_never_lease_a_task_twice_and_store_each_result_once(open_store: Callable[[], SqliteStore], store: SqliteStore) -> None:
    other = await open_store().open()
    try:
        uid = await store.create_user("alice")
        await store.put_function(uid, FID, b"body", "fn")
        ep = await _endpoint(store, uid)
        await store.insert_tasks(_tasks(uid, ep, 300))
        single = await store.create_enroll_token(uid, 60, 1)
        enrolled = await asyncio.gather(*(s.enroll_endpoint(single, f"race-{i}", "mqtt", b"k" * 32) for i, s in enumerate([store, other] * 3)))
        assert sum(e is not None for e in enrolled) == 1, "a single-use token enrolls one device, whichever replica sees it"
        leased: list[str] = []

        async def drain(s: SqliteStore) -> None:
            while True:
                tasks, _ = await s.lease(ep, 7, 30.0, 1 << 20)
                if not tasks:
                    return
                leased.extend(t["id"] for t in tasks)

        await asyncio.gather(drain(store), drain(other), drain(store), drain(other))
        assert len(leased) == len(set(leased)) == 300
        batch = [{"id": f"t{i:05d}", "ok": True, "data": b"r"} for i in range(300)]
        got = await asyncio.gather(*(s.store_results(ep, batch[i::3]) for s in (store, other) for i in range(3)))
        assert sum(len(g) for g in got) == 300, "each result stored once although every one was sent twice"
        seqs = [r["seq"] for r in await store.results_after(uid, 0, 1000)]
        assert len(seqs) == 300 and seqs == sorted(seqs)
    finally:
        await other.close()


async def test_database_newer_than_the_hub_is_refused(open_store: Callable[[], SqliteStore], store: SqliteStore) -> None:
    await store.tx(lambda db: db.execute("INSERT INTO schema_version VALUES (?)", (999,)))
    with pytest.raises(StoreError, match="newer than this hub"):
        await open_store().open()


async def test_fl_run_store_on_both_backends(store: SqliteStore) -> None:
    """FL runs use ``INSERT OR REPLACE`` (a round stored again replaces the first copy)."""
    from cloud_hub.store.fl import FLConflict, FLNotFound, FLStore

    fl = FLStore(store)
    uid = await store.create_user("alice")
    run = await fl.create_run(uid, name="mnist", strategy="fedavg", mode="sync", rounds_planned=3,
                              clients=["ep-1"], client_names={"ep-1": "pi"}, config={"lr": 0.1})
    rid = run["id"]
    await fl.put_round(uid, rid, 1, {"round": 1, "loss": 0.9}, b"w1", {"opt": 1})
    await fl.put_round(uid, rid, 1, {"round": 1, "loss": 0.8}, b"w1b", {"opt": 2})  # replaced, not duplicated
    got = await fl.get_run(uid, rid)
    assert [r["loss"] for r in got["rounds"]] == [0.8] and got["checkpoint"]["bytes"] == 3
    ck = await fl.get_checkpoint(uid, rid)
    assert ck["weights"] == b"w1b" and ck["state"] == {"opt": 2}
    with pytest.raises(FLConflict):
        await fl.put_round(uid, rid, 3, {"round": 3}, b"w3", {})
    assert (await fl.set_status(uid, rid, "finished"))["status"] == "finished"
    assert [r["id"] for r in await fl.list_runs(uid)] == [rid]
    with pytest.raises(FLNotFound):
        await fl.get_run("u_other", rid)


async def test_endpoints_with_queued_names_only_those_with_a_queued_task(store: SqliteStore) -> None:
    """The watchdog's recheck of drained sessions (one read for all that came due): leased, acked
    and other endpoints' tasks do not count; an unknown endpoint id is simply absent."""
    uid = await store.create_user("alice")
    await store.put_function(uid, FID, b"body", "fn")
    a, b, c = [await _endpoint(store, uid, n) for n in ("a", "b", "c")]
    assert await store.endpoints_with_queued([a, b, c, "ep-nosuch"]) == set()
    assert await store.endpoints_with_queued([]) == set()
    await store.insert_tasks(_tasks(uid, a, 2) + _tasks(uid, b, 1, start=10))
    assert await store.endpoints_with_queued([a, b, c, "ep-nosuch"]) == {a, b}
    tasks, _ = await store.lease(b, 5, 30.0, 1 << 20)
    assert [t["id"] for t in tasks] == ["t00010"]
    assert await store.endpoints_with_queued([a, b, c]) == {a}, "a leased task is not waiting"
    await store.ack(b, ["t00010"])
    assert await store.endpoints_with_queued([b, c]) == set()


async def test_count_leased_and_unlease_after_a_failed_send(store: SqliteStore) -> None:
    """What the dispatcher uses when a ``tasks`` frame fails to send (found by ``mesh-sim run``)."""
    uid = await store.create_user("alice")
    await store.put_function(uid, FID, b"body", "fn")
    ep = await _endpoint(store, uid)
    other = await _endpoint(store, uid, "other")
    await store.insert_tasks(_tasks(uid, ep, 5))
    tasks, _ = await store.lease(ep, 3, 30.0, 1 << 20)
    assert await store.count_leased(ep) == 3 and await store.count_leased(other) == 0
    await store.ack(ep, [tasks[0]["id"]])
    ids = [t["id"] for t in tasks]
    assert await store.unlease(other, ids) == 0, "only the endpoint's own tasks"
    assert await store.unlease(ep, ids) == 2, "the acked one stays on the device"
    assert await store.count_leased(ep) == 0
    assert await store.task_counts(uid) == {"acked": 1, "queued": 4}
    # The failed send was no attempt: never dispatched again (the scheduler may still move such a
    # task), not counted; a task that had reached an agent before keeps its dispatched time.
    for tid in ids[1:]:
        st = await store.get_task(tid, uid)
        assert (st["attempts"], st["dispatched"]) == (0, None), st
    again, _ = await store.lease(ep, 10, 30.0, 1 << 20)
    assert [t["id"] for t in again] == ["t00001", "t00002", "t00003", "t00004"]
    assert await store.unlease(ep, ["t00001"]) == 1
    again, _ = await store.lease(ep, 1, 30.0, 1 << 20)
    assert [t["id"] for t in again] == ["t00001"]
    await store.requeue(ep)  # that one reached the agent, and its session ended: attempt 1 stands
    again, _ = await store.lease(ep, 1, 30.0, 1 << 20)
    assert await store.unlease(ep, ["t00001"]) == 1
    st = await store.get_task("t00001", uid)
    assert st["attempts"] == 1 and st["dispatched"] is not None, st


async def test_submit_key_is_stored_with_its_tasks_and_a_second_insert_fails_whole(open_store: Callable[[], SqliteStore]) -> None:
    """Idempotent submission on both backends: the key row commits with the tasks; two replicas
    racing the same key insert once, and the loser's tasks are rolled back with its key row."""
    a, b = await open_store().open(), await open_store().open()
    try:
        uid = await a.create_user("alice")
        await a.put_function(uid, FID, b"body", "f")
        ep = await _endpoint(a, uid)
        rows = _tasks(uid, ep, 3)
        await a.insert_tasks(rows, also=lambda db: a.put_submit_key(db, uid, "key-00001", "h1", [r["id"] for r in rows], [ep] * 3, time.time()))
        assert await b.submit_key(uid, "key-00001") == ("h1", [r["id"] for r in rows], [ep] * 3)
        assert await b.submit_key(uid, "key-00002") is None
        other = _tasks(uid, ep, 3, start=10)
        with pytest.raises(Exception):
            await b.insert_tasks(other, also=lambda db: b.put_submit_key(db, uid, "key-00001", "h2", [r["id"] for r in other], [ep] * 3, time.time()))
        assert await a.submit_key(uid, "key-00001") == ("h1", [r["id"] for r in rows], [ep] * 3)
        assert (await a.list_endpoints(endpoint_id=ep))[0]["queued"] == 3, "the loser's tasks were rolled back"
        await a.prune_results(time.time() + 1)
        assert await a.submit_key(uid, "key-00001") is None, "keys expire with results"
    finally:
        await a.close()
        await b.close()
