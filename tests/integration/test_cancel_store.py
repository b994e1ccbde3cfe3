"""The hub store's side of cancellation and driver leases (issue 28 items 2 and 3), on SQLite and
PostgreSQL (migration 17): one cancelled result per task, written at once; a cancel to send only
for tasks already sent to their agent; all-or-nothing by id; an expired lease cancels its group."""

from __future__ import annotations

import time

import pytest

from cloud_hub.store import SqliteStore
from cloud_hub.store.sqlite import UnknownTask
from mesh_agent.protocol import deserialize
from tests.integration.test_store import FID, _endpoint, _tasks, open_store, store  # noqa: F401  (fixtures)
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


async def _setup(store: SqliteStore) -> tuple[str, str]:  # noqa: F811  (shadows the imported fixture)
    uid = await store.create_user("alice")
    ep = await _endpoint(store, uid)
    await store.put_function(uid, FID, b"source\nf\ndef f(): pass\n", "f")
    return uid, ep


async def test_cancel_by_id_writes_one_result_and_a_cancel_only_for_sent_tasks(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    uid, ep = await _setup(store)
    await store.insert_tasks(_tasks(uid, ep, 3))
    sent, _ = await store.lease(ep, 2, 30.0, 1 << 20)  # t00000, t00001 on their way to the agent
    await store.ack(ep, [sent[0]["id"]])
    out = await store.cancel_tasks(uid, ["t00000", "t00001", "t00002"])
    assert sorted(out["cancelled"]) == ["t00000", "t00001", "t00002"] and out["done"] == []
    assert sorted(out["fresh"]) == ["t00000", "t00001", "t00002"] and out["endpoints"] == {ep}
    assert sorted(await store.pending_cancels(ep)) == ["t00000", "t00001"]  # the queued one needs no cancel sent
    assert await store.cancel_endpoints() == {ep}
    rows = await store.results(uid, ["t00000", "t00001", "t00002"])
    assert len(rows) == 3
    assert all(not r["ok"] and deserialize(r["data"])["type"] == "mesh_agent.TaskCancelled" for r in rows)
    again = await store.cancel_tasks(uid, ["t00000"])  # twice: still cancelled, nothing new
    assert again["cancelled"] == ["t00000"] and again["fresh"] == []
    assert len(await store.results(uid, ["t00000"])) == 1
    assert await store.store_results(ep, [{"id": "t00000", "ok": True, "data": b"json\n1"}]) == []  # the agent's late result: a repeat
    assert await store.cancels_applied(ep, ["t00000", "t00001"]) == 2
    assert await store.pending_cancels(ep) == [] and await store.cancel_endpoints() == set()


async def test_cancel_is_all_or_nothing_and_only_for_the_submitter(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    uid, ep = await _setup(store)
    other = await store.create_user("mallory")
    await store.insert_tasks(_tasks(uid, ep, 2))
    with pytest.raises(UnknownTask, match="unknown task t00001"):
        await store.cancel_tasks(other, ["t00001"])
    with pytest.raises(UnknownTask, match="unknown task nope"):
        await store.cancel_tasks(uid, ["t00000", "nope"])
    assert await store.results(uid, ["t00000", "t00001"]) == []  # nothing changed
    done = await store.cancel_tasks(uid, ["t00000"])
    assert done["cancelled"] == ["t00000"]


async def test_an_expired_group_lease_cancels_the_group_and_nothing_else(store: SqliteStore) -> None:  # noqa: F811  (shadows the imported fixture)
    uid, ep = await _setup(store)
    mine = [{**t, "task_group_id": "driver-1"} for t in _tasks(uid, ep, 2)]
    others = [{**t, "task_group_id": "driver-2"} for t in _tasks(uid, ep, 2, start=10)]
    await store.insert_tasks(mine + others)
    now = time.time()
    await store.renew_group_lease(uid, "driver-1", 5.0, now=now)
    await store.renew_group_lease(uid, "driver-2", 5.0, now=now)
    await store.renew_group_lease(uid, "driver-2", 5.0, now=now + 4)  # renewed
    assert await store.expire_group_leases(now + 1) == []
    gone = await store.expire_group_leases(now + 6)
    assert [(g["group"], sorted(g["fresh"])) for g in gone] == [("driver-1", ["t00000", "t00001"])]
    assert len(await store.results(uid, ["t00000", "t00001", "t00010", "t00011"])) == 2
    assert await store.expire_group_leases(now + 6) == []  # the row went with it
    assert await store.release_group_lease(uid, "driver-2") is True
    assert await store.expire_group_leases(now + 100) == []
