"""Console storage on both backends (a real SQLite file, the local PostgreSQL server):
availability transitions, sessions, the page queries."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable

import pytest

from cloud_hub.console import queries
from cloud_hub.console.sessions import close_session, find_session, open_session
from cloud_hub.store import SqliteStore
from cloud_hub.store.availability import close_stale_sessions, events_between, prune_events, record_transition
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], SqliteStore]:
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "hub.sqlite3")
    from cloud_hub.store.postgres import PostgresStore

    url = request.getfixturevalue("pg_url")
    return lambda: PostgresStore(url)


async def _store(backend: Callable[[], SqliteStore]) -> tuple[SqliteStore, str, str]:
    store = await backend().open()
    uid = await store.create_user("ann")
    token = await store.create_api_token(uid)
    return store, uid, token


async def _endpoint(store: SqliteStore, uid: str, name: str) -> str:
    enroll = await store.create_enroll_token(uid, 60, 1)
    ep = await store.enroll_endpoint(enroll, name, "mqtt", b"k" * 32)
    assert ep
    return ep["id"]


async def test_transitions_are_recorded_once_and_pruned_keeping_the_last(backend: Callable[[], SqliteStore]) -> None:
    store, uid, _ = await _store(backend)
    ep = await _endpoint(store, uid, "pi")
    assert await store.tx(record_transition, ep, True, 100.0)
    assert not await store.tx(record_transition, ep, True, 101.0)  # no change, no row
    assert await store.tx(record_transition, ep, False, 110.0)
    assert await store.tx(record_transition, ep, True, 120.0)
    evs = await store.read_parallel(events_between, [ep], 105.0, 200.0)
    assert evs[ep] == [(100.0, True), (110.0, False), (120.0, True)]  # state before the window first
    assert await store.tx(prune_events, 115.0) == 1  # drops 100, keeps 110 (the state at 115)
    assert (await store.read_parallel(events_between, [ep], 115.0, 200.0))[ep] == [(110.0, False), (120.0, True)]
    await store.close()


async def test_hub_start_closes_sessions_the_database_still_calls_online(backend: Callable[[], SqliteStore]) -> None:
    store, uid, _ = await _store(backend)
    ep = await _endpoint(store, uid, "pi")
    await store.set_endpoint_state(ep, True, 500.0)
    await store.tx(record_transition, ep, True, 400.0)
    assert await store.tx(close_stale_sessions) == 1
    assert (await store.read_parallel(events_between, [ep], 0.0, 1e12))[ep] == [(400.0, True), (500.0, False)]
    assert await store.tx(close_stale_sessions) == 0
    await store.close()


async def test_sessions_expire_and_die_with_their_token(backend: Callable[[], SqliteStore]) -> None:
    store, uid, token = await _store(backend)
    sid = await open_session(store, uid, token)
    s = await find_session(store, sid)
    assert s and s.user_id == uid and s.user_name == "ann"
    assert s.hash == hashlib.sha256(sid.encode()).hexdigest()
    assert await find_session(store, sid + "x") is None
    assert await find_session(store, None) is None
    assert await find_session(store, "y" * 1000) is None
    expired = await open_session(store, uid, token, ttl_s=-1)
    assert await find_session(store, expired) is None
    await close_session(store, sid)
    assert await find_session(store, sid) is None
    sid2 = await open_session(store, uid, token)
    await store.tx(lambda db: db.execute("DELETE FROM api_tokens"))
    assert await find_session(store, sid2) is None
    rows = await store.read_parallel(lambda db: db.execute("SELECT COUNT(*) FROM console_sessions WHERE expires < ?", (time.time(),)).fetchone()[0])
    assert rows == 0, "signing in sweeps expired sessions"
    await store.close()


async def test_page_queries_count_filter_and_page(backend: Callable[[], SqliteStore]) -> None:
    store, uid, _ = await _store(backend)
    other = await store.create_user("ben")
    ep = await _endpoint(store, uid, "pi")
    ep_b = await _endpoint(store, other, "bens")
    await store.put_function(uid, "f" * 64, b"dill\nx", "fit")
    await store.put_function(other, "g" * 64, b"dill\ny", "other")
    now = time.time()
    rows = [{"id": f"t{i:03d}", "user_id": uid, "endpoint_id": ep, "function_id": "f" * 64, "args": b"json\n[]",
             "created": now + i, "expires": now + 1e6, "timeout": None} for i in range(12)]
    rows.append({"id": "tb", "user_id": other, "endpoint_id": ep_b, "function_id": "g" * 64, "args": b"json\n[]",
                 "created": now, "expires": now + 1e6, "timeout": None})
    await store.insert_tasks(rows)
    leased, _ = await store.lease(ep, 6, 30, 2**20)
    await store.ack(ep, [t["id"] for t in leased[:4]])
    await store.store_results(ep, [{"id": t["id"], "ok": i % 2 == 0, "data": b"json\n1", "started": now, "finished": now + 0.5}
                                   for i, t in enumerate(leased[:3])])
    counts = await store.read_parallel(queries.state_counts, uid)
    assert counts == {"queued": 6, "dispatched": 2, "on_device": 1, "succeeded": 2, "failed": 1}
    assert (await store.read_parallel(queries.state_counts, other))["queued"] == 1
    page1 = await store.read_parallel(lambda db: queries.list_tasks(db, uid, limit=5))
    assert [t["id"] for t in page1] == ["t011", "t010", "t009", "t008", "t007"]
    page2 = await store.read_parallel(lambda db: queries.list_tasks(db, uid, before=page1[-1]["rowid"], limit=5))
    assert [t["id"] for t in page2] == ["t006", "t005", "t004", "t003", "t002"]
    failed = await store.read_parallel(lambda db: queries.list_tasks(db, uid, state="failed"))
    assert [t["console_state"] for t in failed] == ["failed"]
    assert await store.read_parallel(lambda db: queries.list_tasks(db, uid, endpoint_id=ep_b)) == []
    assert await store.read_parallel(queries.task_detail, uid, "tb") is None
    d = await store.read_parallel(queries.task_detail, uid, leased[0]["id"])
    assert d["console_state"] == "succeeded" and d["data"] == b"json\n1" and d["endpoint_name"] == "pi"
    fns = await store.read_parallel(queries.function_stats, uid)
    assert len(fns) == 1 and fns[0]["tasks"] == 12 and fns[0]["succeeded"] == 2 and fns[0]["failed"] == 1
    assert fns[0]["mean_run_s"] == pytest.approx(0.5)
    series = await store.read_parallel(queries.throughput, uid, time.time(), 10.0, 6)
    assert len(series) == 6 and sum(ok for _, ok, _ in series) == 2 and sum(b for _, _, b in series) == 1
    eps, fns2 = await store.read_parallel(queries.names, uid)
    assert eps == [(ep, "pi")] and fns2 == [("f" * 64, "fit")]
    await store.close()
