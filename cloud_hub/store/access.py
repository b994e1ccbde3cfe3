"""Who may use what: endpoint sharing, function allow-lists, broker logins, CURVE keys, hub secrets.

Kept apart from the task path in ``sqlite.py``: these are rare writes (an owner shares an endpoint,
an enrollment adds a broker login) on top of the same single-writer SqliteStore.
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any, Callable, Iterable, Literal

from cloud_hub.broker_auth import BrokerAccount
from cloud_hub.store.sqlite import SqliteStore, fail_tasks

__all__ = ["AccessStore", "Role"]

Role = Literal["owner", "shared"]


class AccessStore:
    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    # ------------------------------------------------------------------ roles and sharing
    async def role(self, user_id: str, endpoint_id: str) -> Role | None:
        """``owner``, ``shared`` (the owner granted use), or None: the user may not see it at all."""

        def q(db: sqlite3.Connection) -> Role | None:
            row = db.execute("SELECT user_id FROM endpoints WHERE id=? AND revoked IS NULL", (endpoint_id,)).fetchone()
            if row is None:
                return None
            if row[0] == user_id:
                return "owner"
            shared = db.execute("SELECT 1 FROM endpoint_shares WHERE endpoint_id=? AND user_id=?", (endpoint_id, user_id)).fetchone()
            return "shared" if shared else None

        return await self.store.read(q)

    async def share(self, endpoint_id: str, user_name: str) -> str | None:
        """Grant ``user_name`` use of the endpoint; its user id, or None when no such user exists."""

        def q(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT id FROM users WHERE name=?", (user_name,)).fetchone()
            if row is None:
                return None
            db.execute("INSERT INTO endpoint_shares (endpoint_id, user_id, created) VALUES (?, ?, ?) ON CONFLICT (endpoint_id, user_id) DO NOTHING",
                       (endpoint_id, row[0], time.time()))
            return str(row[0])

        return await self.store.tx(q)

    async def unshare(self, endpoint_id: str, user_name: str) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "DELETE FROM endpoint_shares WHERE endpoint_id=? AND user_id=(SELECT id FROM users WHERE name=?)", (endpoint_id, user_name)
            )
            return cur.rowcount > 0

        return await self.store.tx(q)

    async def shares(self, endpoint_id: str) -> list[dict[str, Any]]:
        def q(db: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = db.execute(
                "SELECT u.name, s.created FROM endpoint_shares s JOIN users u ON u.id=s.user_id WHERE s.endpoint_id=? ORDER BY s.created",
                (endpoint_id,),
            ).fetchall()
            return [{"user": r[0], "created": r[1]} for r in rows]

        return await self.store.read(q)

    async def shared_user_ids(self, endpoint_id: str) -> list[str]:
        rows = await self.store.read(lambda db: db.execute("SELECT user_id FROM endpoint_shares WHERE endpoint_id=?", (endpoint_id,)).fetchall())
        return [r[0] for r in rows]

    async def user_name(self, user_id: str) -> str | None:
        row = await self.store.read(lambda db: db.execute("SELECT name FROM users WHERE id=?", (user_id,)).fetchone())
        return row[0] if row else None

    # ------------------------------------------------------------------ trust
    async def set_trusted(self, endpoint_id: str, trusted: bool) -> bool:
        """Mark the endpoint trusted (its owner's SDK unpickles its results) or not (data only, the
        default for a new endpoint; docs/security.md). Returns the flag as stored."""

        def q(db: sqlite3.Connection) -> bool:
            db.execute("UPDATE endpoints SET trusted=? WHERE id=? AND revoked IS NULL", (1 if trusted else 0, endpoint_id))
            row = db.execute("SELECT trusted FROM endpoints WHERE id=?", (endpoint_id,)).fetchone()
            return bool(row and row[0])

        return await self.store.tx(q)

    # ------------------------------------------------------------------ allow-lists
    async def allow_lists(self) -> dict[str, frozenset[str]]:
        """Every endpoint that has an allow-list (the others accept any function their users own)."""

        def q(db: sqlite3.Connection) -> dict[str, frozenset[str]]:
            rows = db.execute("SELECT id, allowed_functions FROM endpoints WHERE allowed_functions IS NOT NULL AND revoked IS NULL").fetchall()
            return {r[0]: frozenset(json.loads(r[1])) for r in rows}

        return await self.store.read(q)

    async def set_allow_list(self, endpoint_id: str, function_ids: Iterable[str] | None, error_blob: Callable[[str, str], bytes]) -> list[tuple[str, str]]:
        """Set (or with None clear) the list. Tasks still queued at the hub for a function now off
        the list get an error result, in the same transaction; returns their (task id, user id)."""
        allowed = None if function_ids is None else sorted(set(function_ids))

        def q(db: sqlite3.Connection) -> list[tuple[str, str]]:
            db.execute("UPDATE endpoints SET allowed_functions=? WHERE id=?", (None if allowed is None else json.dumps(allowed), endpoint_id))
            if allowed is None:
                return []
            rows = [
                (tid, uid, fid)
                for tid, uid, fid in db.execute("SELECT id, user_id, function_id FROM tasks WHERE endpoint_id=? AND state='queued'", (endpoint_id,))
                if fid not in allowed
            ]
            fail_tasks(db, [(tid, uid, error_blob(tid, fid)) for tid, uid, fid in rows], time.time())
            return [(tid, uid) for tid, uid, _ in rows]

        return await self.store.tx(q)

    async def revoke(self, endpoint_id: str, error_blob: Callable[[str], bytes]) -> list[tuple[str, str]]:
        """Revoke an endpoint for good (a stolen or retired device): its HMAC key, broker login and
        CURVE key are wiped, it leaves every listing, and every task of it without a result
        (queued, leased, or stored on the device) gets an error result, so no caller waits for a
        device that will never be heard again. Returns those (task id, user id)."""

        def q(db: sqlite3.Connection) -> list[tuple[str, str]]:
            now = time.time()
            db.execute(  # the empty key as a parameter: X'' is a bit string to PostgreSQL, not bytes
                "UPDATE endpoints SET revoked=?, online=0, key=?, mqtt_hash=NULL, curve_key=NULL WHERE id=? AND revoked IS NULL",
                (now, b"", endpoint_id),
            )
            db.execute("DELETE FROM endpoint_shares WHERE endpoint_id=?", (endpoint_id,))
            rows = db.execute("SELECT id, user_id FROM tasks WHERE endpoint_id=? AND state != 'done'", (endpoint_id,)).fetchall()
            fail_tasks(db, [(tid, uid, error_blob(tid)) for tid, uid in rows], now)
            return [(tid, uid) for tid, uid in rows]

        return await self.store.tx(q)

    # ------------------------------------------------------------------ transport credentials
    async def broker_accounts(self) -> list[BrokerAccount]:
        def q(db: sqlite3.Connection) -> list[BrokerAccount]:
            rows = db.execute("SELECT mqtt_user, mqtt_hash, id FROM endpoints WHERE mqtt_hash IS NOT NULL AND revoked IS NULL ORDER BY created").fetchall()
            sites: dict[str, list[str]] = {}  # a gateway's login also relays its devices' topics
            for dev, gw in db.execute("SELECT id, gateway_id FROM endpoints WHERE gateway_id IS NOT NULL AND revoked IS NULL ORDER BY created"):
                sites.setdefault(gw, []).append(dev)
            return [BrokerAccount(user, pw_hash, ep, relays=tuple(sites.get(ep, ()))) for user, pw_hash, ep in rows]

        return await self.store.read(q)

    async def curve_clients(self) -> dict[str, str]:
        """CURVE public key (z85) -> endpoint id, for every ZeroMQ endpoint."""
        rows = await self.store.read(lambda db: db.execute("SELECT curve_key, id FROM endpoints WHERE curve_key IS NOT NULL AND revoked IS NULL").fetchall())
        return dict(rows)

    async def secret(self, name: str, make: Callable[[], str]) -> str:
        """A hub secret (e.g. its CURVE keypair), created on first use and kept in the database."""

        def q(db: sqlite3.Connection) -> str:
            row = db.execute("SELECT value FROM hub_secrets WHERE name=?", (name,)).fetchone()
            if row:
                return str(row[0])
            value = make()
            db.execute("INSERT INTO hub_secrets (name, value, created) VALUES (?, ?, ?)", (name, value, time.time()))
            return value

        return await self.store.tx(q)
