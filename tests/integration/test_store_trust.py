"""The per-endpoint trust flag in the store (migration 15; docs/security.md, "What a stolen device
key can and cannot do"), on both backends: new endpoints start untrusted, only result rows of the
owner's own trusted endpoints say ``trusted``, the flag is read at every fetch, and a database
from before the migration starts with none trusted.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import pytest

from cloud_hub.store import SqliteStore
from cloud_hub.store.access import AccessStore
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

FID = "f" * 64


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], SqliteStore]:
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


async def test_trust_flag_decides_the_trusted_bit_of_each_result_row(store: SqliteStore) -> None:
    alice, bob = await store.create_user("alice"), await store.create_user("bob")
    tok = await store.create_enroll_token(alice, 60, 1)
    ep = str((await store.enroll_endpoint(tok, "pi", "mqtt", b"k" * 32))["id"])  # type: ignore[index]
    access = AccessStore(store)
    await access.share(ep, "bob")
    assert [e["trusted"] for e in await store.list_endpoints(user_id=alice)] == [False], "a new endpoint is not trusted"
    await store.put_function(alice, FID, b"body", "f")
    now = time.time()
    await store.insert_tasks([{"id": tid, "user_id": uid, "endpoint_id": ep, "function_id": FID, "args": b"a", "created": now,
                               "expires": now + 3600, "timeout": None} for tid, uid in (("ta", alice), ("tb", bob))])
    await store.store_results(ep, [{"id": "ta", "ok": True, "data": b"x"}, {"id": "tb", "ok": True, "data": b"y"}])

    async def bits(user: str) -> list[tuple[bool, bool]]:
        return [(r["own_endpoint"], r["trusted"]) for r in await store.results_after(user, 0, 10)]

    assert await bits(alice) == [(True, False)] and await bits(bob) == [(False, False)]
    assert await store.trusted_for(alice, [ep, "ep-nope"]) == {ep: (True, False)}

    assert await access.set_trusted(ep, True) is True
    assert await bits(alice) == [(True, True)], "read at every fetch: a stored result follows the flag"
    assert await bits(bob) == [(False, False)], "the owner's flag is the owner's alone"
    assert [r["trusted"] for r in await store.results(alice, ["ta"])] == [True]
    assert await store.trusted_for(alice, [ep]) == {ep: (True, True)} and await store.trusted_for(bob, [ep]) == {ep: (False, False)}
    assert [e["trusted"] for e in await store.list_endpoints(user_id=bob)] == [True], "shown in listings, to shared users too"

    assert await access.set_trusted(ep, False) is False
    assert await bits(alice) == [(True, False)]
    # the hub's own results (a task that expired before any endpoint ran it) are trusted
    await store.insert_tasks([{"id": "tx", "user_id": alice, "endpoint_id": ep, "function_id": FID, "args": b"a", "created": now,
                               "expires": now - 1, "timeout": None}])
    await store.expire_tasks(time.time(), lambda tid: b"expired")
    assert (await store.results(alice, ["tx"]))[0]["endpoint_id"] == ep  # on an endpoint: its flag, not the hub's say
    # a revoked endpoint cannot be marked
    await access.revoke(ep, lambda tid: b"revoked")
    assert await access.set_trusted(ep, True) is False


def test_endpoints_enrolled_before_the_migration_start_untrusted(tmp_path: Path) -> None:
    """A field device deployed before the upgrade is the one a thief carries off: no endpoint is
    trusted until its owner marks it."""
    from cloud_hub.store.migrations import MIGRATIONS
    from cloud_hub.store.sqlite import _statements

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, sql in MIGRATIONS:
        if version < 15:
            for statement in _statements(sql):
                db.execute(statement)
            db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.execute("INSERT INTO users (id, name, created) VALUES ('ua', 'alice', 0)")
    db.execute("INSERT INTO endpoints (id, user_id, name, transport, key, created) VALUES ('ep-old', 'ua', 'pi', 'mqtt', x'00', 0)")
    db.execute("INSERT INTO endpoints (id, user_id, name, transport, key, created, revoked) VALUES ('ep-gone', 'ua', 'pi2', 'mqtt', x'', 0, 1)")
    db.close()

    async def go() -> None:
        store = await SqliteStore(path).open()
        try:
            assert [(e["id"], e["trusted"]) for e in await store.list_endpoints(user_id="ua")] == [("ep-old", False)]
            tok = await store.create_enroll_token("ua", 60, 1)
            new = (await store.enroll_endpoint(tok, "pi3", "mqtt", b"k" * 32))["id"]  # type: ignore[index]
            assert {e["id"]: e["trusted"] for e in await store.list_endpoints(user_id="ua")} == {"ep-old": False, new: False}
        finally:
            await store.close()

    asyncio.run(go())
    with sqlite3.connect(path) as db:
        assert dict(db.execute("SELECT id, trusted FROM endpoints WHERE id LIKE 'ep-%'").fetchall())["ep-gone"] == 0
