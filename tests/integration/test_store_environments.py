"""The hub store keeps a task's environment spec and hands it out with the lease, on SQLite and
PostgreSQL; tasks without one carry no ``env`` key (no bytes in their frames); the endpoint's
owner is known for the sandbox default (docs/environments.md)."""

from __future__ import annotations

import pytest

from cloud_hub.store import SqliteStore
from mesh_agent.protocol.environment import encode, normalize
from tests.integration.test_store import FID, _endpoint, _tasks, open_store, store  # noqa: F401  (fixtures)
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


async def test_env_is_stored_with_the_task_and_leased_with_it(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    uid = await store.create_user("alice")
    other = await store.create_user("bob")
    ep = await _endpoint(store, uid)
    await store.put_function(uid, FID, b"body", "f")
    spec = encode(normalize({"pip": ["numpy>=1.26"], "sandbox": True, "tenant": other}))
    rows = _tasks(uid, ep, 4)
    rows[1]["env"] = spec
    rows[3]["env"] = encode(normalize({"sandbox": True}))
    await store.insert_tasks(rows)
    tasks, bodies = await store.lease(ep, 10, 30.0, 1 << 20)
    by_id = {t["id"]: t for t in tasks}
    assert by_id["t00001"]["env"] == spec and by_id["t00003"]["env"] == '{"sandbox":true}'
    assert "env" not in by_id["t00000"] and "env" not in by_id["t00002"]
    assert await store.endpoint_owners_of([ep, "ep-none"]) == {ep: uid}
