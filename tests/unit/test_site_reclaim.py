"""Work leased ahead to a site gateway whose confirmation came late (issue 15, docs/sites.md).

The hub leases a site's tasks to its gateway for a short unconfirmed lease and re-queues them if
the gateway's confirmation ("I stored them") does not arrive in time. Over an uplink that is down
half the time that happened to whole batches at every outage, and the hub sent them down the
uplink again although the gateway held them (village.yaml: 2.1 leases per site task). Checked here
on a real SQLite store: a task back in the queue keeps the gateway that was sent it; that gateway's
late confirmation re-claims it without anything being sent; the hub does not re-lease it to that
gateway while it waits for the confirmation; and nobody else's confirmation, nor one for a device
moved away, nor one for a frame that has expired, re-claims anything.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from cloud_hub.store import SqliteStore

HOLD_S = 3600.0


async def _setup(tmp: Path) -> tuple[SqliteStore, str, str, str, list[str]]:
    store = await SqliteStore(tmp / "hub.sqlite3").open()
    user = await store.create_user("alice")
    tok = await store.create_enroll_token(user, 3600, 4)
    gw, gw2, dev = [(await store.enroll_endpoint(tok, n, "mqtt", b"k" * 32))["id"] for n in ("gw", "gw2", "dev")]  # type: ignore[index]
    await store.set_gateway(dev, gw)
    fid = "f" * 64
    await store.put_function(user, fid, b"body", "fn")
    now = time.time()
    ids = [uuid.uuid4().hex for _ in range(4)]
    await store.insert_tasks([{"id": i, "user_id": user, "endpoint_id": dev, "function_id": fid, "args": b"a", "created": now + k,
                               "expires": None, "timeout": None} for k, i in enumerate(ids)])
    return store, gw, gw2, dev, ids


def _state(store: SqliteStore, ids: list[str]) -> dict[str, tuple[str, str | None]]:
    db = store._conn()
    return {i: tuple(db.execute("SELECT state, site FROM tasks WHERE id=?", (i,)).fetchone()) for i in ids}  # type: ignore[misc]


def test_late_confirmation_reclaims_instead_of_resending(tmp_path: Path) -> None:
    async def go() -> None:
        store, gw, gw2, dev, ids = await _setup(tmp_path)
        try:
            by_dev, _ = await store.lease_site(gw, [dev], 10, 0.01, 2**20)
            assert sorted(t["id"] for t in by_dev[dev]) == sorted(ids)
            await asyncio.sleep(0.05)
            # The unconfirmed lease ran out (the uplink went down before the confirmation came up).
            assert await store.requeue(expired_before=time.time()) == len(ids)
            assert all(v == ("queued", gw) for v in _state(store, ids).values()), "back in the queue, still naming the gateway"
            # While the hub waits for the returning gateway's confirmation, it does not send them again ...
            again, _ = await store.lease_site(gw, [dev], 10, 5.0, 2**20, skip_returned=True)
            assert again == {}
            # ... another gateway's confirmation re-claims nothing ...
            assert await store.hold_site(gw2, ids, time.time() + HOLD_S, frame_ttl_s=HOLD_S) == 0
            # ... and the gateway's own confirmation of what it holds re-claims them, sending nothing.
            assert await store.hold_site(gw, ids[:3], time.time() + HOLD_S, frame_ttl_s=HOLD_S) == 3
            assert await store.count_site_leased(gw) == 3
            st = _state(store, ids)
            assert all(st[i] == ("leased", gw) for i in ids[:3]) and st[ids[3]] == ("queued", gw)
            # The one it did not confirm (never reached it) goes out again once the wait is over.
            rest, _ = await store.lease_site(gw, [dev], 10, 5.0, 2**20)
            assert [t["id"] for t in rest[dev]] == [ids[3]]
            attempts = dict(store._conn().execute(f"SELECT id, attempts FROM tasks WHERE id IN ({','.join('?' * len(ids))})", ids).fetchall())
            assert attempts == {**{i: 1 for i in ids[:3]}, ids[3]: 2}, "each held task was sent once"
        finally:
            await store.close()

    asyncio.run(go())


def test_no_reclaim_after_a_move_an_expired_frame_or_a_direct_lease(tmp_path: Path) -> None:
    async def go() -> None:
        store, gw, gw2, dev, ids = await _setup(tmp_path)
        try:
            await store.lease_site(gw, [dev], 10, 0.01, 2**20)
            await asyncio.sleep(0.05)
            await store.requeue(expired_before=time.time())
            # A direct lease of one of them: it is the device's now, not the site's.
            direct, _ = await store.lease(dev, 1, 5.0, 2**20)
            assert [t["id"] for t in direct] == [ids[0]]
            assert await store.hold_site(gw, [ids[0]], time.time() + HOLD_S, frame_ttl_s=HOLD_S) == 0
            assert _state(store, [ids[0]])[ids[0]] == ("leased", None)
            # A frame the gateway holds past its validity cannot be handed on: no re-claim.
            assert await store.hold_site(gw, [ids[1]], time.time() + HOLD_S, frame_ttl_s=0.01) == 0
            # The device moved to another gateway: the old one re-claims nothing of it.
            await store.set_gateway(dev, gw2)
            assert await store.hold_site(gw, ids, time.time() + HOLD_S, frame_ttl_s=HOLD_S) == 0
            assert all(_state(store, ids)[i] == ("queued", None) for i in ids[1:])
        finally:
            await store.close()

    asyncio.run(go())
