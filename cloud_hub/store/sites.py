"""Site gateways (docs/sites.md): which gateway serves which device, and work leased ahead to a
site and held there.
"""

from __future__ import annotations


import sqlite3
import time
from typing import TYPE_CHECKING, Any, Sequence, TypeVar


if TYPE_CHECKING:
    pass

from cloud_hub.store._engine import StoreEngine, _chunks
from cloud_hub.store.tasks import attach_envs

T = TypeVar("T")


class SiteStore(StoreEngine):
    """Devices behind gateways and the work a site holds."""

    async def site_devices(self) -> dict[str, str]:
        """device endpoint id -> the gateway endpoint that serves it (docs/sites.md)."""
        rows = await self._run(lambda: self._conn().execute(
            "SELECT id, gateway_id FROM endpoints WHERE gateway_id IS NOT NULL AND revoked IS NULL").fetchall())
        return {r[0]: r[1] for r in rows}

    async def lease_site(self, gateway_id: str, devices: Sequence[str], n: int, hold_s: float, max_bytes: int,
                         *, skip_returned: bool = False) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bytes]]:
        """Lease up to ``n`` queued tasks of a site's devices ahead of time to its gateway: each is
        leased for ``hold_s`` and marked with the gateway, so the device's lost session does not
        re-queue it while the gateway holds it (the dispatcher leases for ``lease_s`` and extends
        to ``site_hold_s`` once the gateway confirms it stored them: :meth:`hold_site`). Returns tasks per device and the
        function bodies they need (each body once).

        ``skip_returned``: leave out tasks that went back to the queue from an unconfirmed lease
        ahead to this same gateway (``site`` still names it): the gateway may hold their frames
        and is about to confirm them (:meth:`hold_site` re-claims them then), e.g. right after
        it came back from an uplink outage."""

        def q(db: sqlite3.Connection) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bytes]]:
            now = time.time()
            out: dict[str, list[dict[str, Any]]] = {}
            if not devices or n <= 0:
                return out, {}
            marks = ",".join("?" * len(devices))
            skip = " AND (site IS NULL OR site != ?)" if skip_returned else ""
            rows = db.execute(
                f"SELECT id, endpoint_id, function_id, args, timeout, expires FROM tasks WHERE endpoint_id IN ({marks}) "
                f"AND state='queued'{skip} ORDER BY created, rowid LIMIT ?", (*devices, *((gateway_id,) if skip_returned else ()), n)).fetchall()
            sizes: dict[str, int] = {}
            size = taken = 0
            for tid, ep, fid, args, timeout, exp in rows:
                if fid not in sizes:
                    sizes[fid] = db.execute("SELECT LENGTH(body) FROM functions WHERE id=?", (fid,)).fetchone()[0]
                    size += sizes[fid]
                size += len(args or b"")
                if taken and size > max_bytes:
                    break
                out.setdefault(ep, []).append({"id": tid, "fn": fid, "args": args, "timeout": timeout, "exp": exp})
                taken += 1
            attach_envs(db, [t for ts in out.values() for t in ts])
            db.executemany(
                "UPDATE tasks SET state='leased', leased_until=?, attempts=attempts+1, dispatched=?, site=? WHERE id=?",
                [(now + hold_s, now, gateway_id, t["id"]) for ts in out.values() for t in ts],
            )
            bodies: dict[str, bytes] = {}
            fids = list({t["fn"] for ts in out.values() for t in ts})
            for chunk in _chunks(fids):
                bodies.update(db.execute(f"SELECT id, body FROM functions WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
            return out, bodies

        return await self.tx(q)

    async def set_gateway(self, device_id: str, gateway_id: str | None) -> tuple[str | None, int]:
        """Re-home a device to another site gateway (or to none: it dials the hub's broker). The new
        gateway must be a live MQTT endpoint of the device's user; a ValueError changes nothing.
        Tasks leased ahead to the old gateway for this device go back to the queue at once (a copy
        the old gateway still hands over is de-duplicated by task id). Returns (old gateway, re-queued)."""

        def q(db: sqlite3.Connection) -> tuple[str | None, int]:
            row = db.execute("SELECT user_id, transport, gateway_id FROM endpoints WHERE id=? AND revoked IS NULL", (device_id,)).fetchone()
            if row is None:
                raise ValueError(f"unknown endpoint {device_id}")
            if row[1] != "mqtt":
                raise ValueError("only an MQTT endpoint can sit behind a site gateway")
            if gateway_id is not None:
                if gateway_id == device_id:
                    raise ValueError("an endpoint cannot be its own gateway")
                gw = db.execute("SELECT user_id, transport, gateway_id FROM endpoints WHERE id=? AND revoked IS NULL", (gateway_id,)).fetchone()
                if gw is None or gw[0] != row[0] or gw[1] != "mqtt" or gw[2] is not None:
                    raise ValueError(f"gateway {gateway_id} is not an MQTT endpoint of the device's user (itself behind no gateway)")
            db.execute("UPDATE endpoints SET gateway_id=? WHERE id=?", (gateway_id, device_id))
            n = db.execute("UPDATE tasks SET state='queued', leased_until=NULL, site=NULL WHERE endpoint_id=? AND state='leased' "
                           "AND site IS NOT NULL", (device_id,)).rowcount
            # Work that went back to the queue from the old gateway: no longer its to re-claim.
            db.execute("UPDATE tasks SET site=NULL WHERE endpoint_id=? AND state='queued' AND site IS NOT NULL", (device_id,))
            return row[2], n

        return await self.tx(q)

    async def hold_site(self, gateway_id: str, ids: Sequence[str], until: float, frame_ttl_s: float | None = None) -> int:
        """The gateway confirmed it stored these tasks (its own signed ack): their lease at the site
        now lasts until ``until`` (``site_hold_s``) instead of ``lease_s``.

        With ``frame_ttl_s`` (the validity of a frame leased ahead, ``site_hold_s``) it also
        re-claims tasks that went back to the queue because this confirmation came after their
        unconfirmed lease ran out (the uplink went down, or was slow): still queued, last leased
        ahead to this gateway, of a device it still serves, and with that frame still valid. They
        are leased to the site again until the frame expires, without sending anything: the
        gateway holds the frame. A gateway that lies about holding one delays that task by at most
        the frame's validity, as a gateway that dies does."""

        def q(db: sqlite3.Connection) -> int:
            n = sum(db.execute("UPDATE tasks SET leased_until=? WHERE id=? AND site=? AND state='leased'",
                               (until, i, gateway_id)).rowcount for i in ids)
            if frame_ttl_s is not None:
                now = time.time()
                n += sum(db.execute(
                    # the earlier of until and the frame's expiry (CASE: scalar MIN() is SQLite's own, LEAST() PostgreSQL's)
                    "UPDATE tasks SET state='leased', leased_until=CASE WHEN ? < dispatched + ? THEN ? ELSE dispatched + ? END "
                    "WHERE id=? AND site=? AND state='queued' "
                    "AND dispatched + ? > ? AND endpoint_id IN (SELECT id FROM endpoints WHERE gateway_id=?)",
                    (until, frame_ttl_s, until, frame_ttl_s, i, gateway_id, frame_ttl_s, now + 1.0, gateway_id)).rowcount for i in ids)
            return n

        return await self.tx(q, durable=False)

    async def unlease_site(self, gateway_id: str, ids: Sequence[str]) -> int:
        """Tasks leased ahead to this gateway in a site_down the hub gave up on (it could not be sent,
        or the gateway stored later batches but not it): back in the queue at once, and no longer
        the gateway's to re-claim, so the next lease sends them again."""

        def q(db: sqlite3.Connection) -> int:
            return sum(db.execute("UPDATE tasks SET state='queued', leased_until=NULL, site=NULL WHERE id=? AND site=? AND state='leased'",
                                  (i, gateway_id)).rowcount for i in ids)

        return await self.tx(q, durable=False)

    async def count_site_leased(self, gateway_id: str) -> int:
        """Tasks leased ahead to this gateway that no device has acknowledged yet."""
        return int(await self._run(lambda: self._conn().execute(
            "SELECT COUNT(*) FROM tasks WHERE site=? AND state='leased'", (gateway_id,)).fetchone()[0]))
