"""The endpoint registry: keys, state and sessions, replica claims, functions and who owns or
trusts what (the checks a submit makes).
"""

from __future__ import annotations


import json
import sqlite3
import time
from typing import Mapping, TYPE_CHECKING, Any, Iterable, Sequence, TypeVar


if TYPE_CHECKING:
    pass

from cloud_hub.store._engine import StoreEngine, _chunks

T = TypeVar("T")



def put_functions(db: Any, user_id: str, functions: Mapping[str, tuple[str, bytes]], now: float) -> None:
    """Store function bodies (id -> (name, body)) and that ``user_id`` owns each; a body stored
    before is kept (the id is its content hash). Run inside the caller's transaction: a submit
    stores its batch's bodies in the one that inserts its tasks."""
    for fid, (name, body) in functions.items():
        db.execute("INSERT INTO functions (id, body, name, created) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING", (fid, body, name, now))
        db.execute("INSERT INTO function_owners (function_id, user_id) VALUES (?, ?) ON CONFLICT (function_id, user_id) DO NOTHING",
                   (fid, user_id))


def owned_refs_in(db: Any, user_id: str, endpoint_ids: Iterable[str], fids: Iterable[str]) -> tuple[set[str], set[str]]:
    """Which of these endpoints (own or shared, not revoked) and functions the user may use."""
    eps, fns = list(set(endpoint_ids)), list(set(fids))
    found_e: set[str] = set()
    found_f: set[str] = set()
    for chunk in _chunks(eps):
        found_e.update(r[0] for r in db.execute(
            f"SELECT id FROM endpoints WHERE revoked IS NULL AND (user_id=? OR id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?)) "
            f"AND id IN ({','.join('?' * len(chunk))})", (user_id, user_id, *chunk)))
    for chunk in _chunks(fns):
        found_f.update(r[0] for r in db.execute(
            f"SELECT function_id FROM function_owners WHERE user_id=? AND function_id IN ({','.join('?' * len(chunk))})", (user_id, *chunk)))
    return found_e, found_f


class EndpointStore(StoreEngine):
    """Endpoints, their sessions and owners, and registered functions."""

    async def endpoint_keys(self) -> dict[str, bytes]:
        return await self._run(lambda: dict(self._conn().execute("SELECT id, key FROM endpoints WHERE revoked IS NULL").fetchall()))

    async def list_endpoints(self, user_id: str | None = None, endpoint_id: str | None = None) -> list[dict[str, Any]]:
        def q() -> list[dict[str, Any]]:
            sql = (
                "SELECT e.id, e.user_id, e.name, e.transport, e.created, e.last_seen, e.online, e.info, "
                "(SELECT COUNT(*) FROM tasks t WHERE t.endpoint_id=e.id AND t.state='queued'), "
                "(SELECT COUNT(*) FROM tasks t WHERE t.endpoint_id=e.id AND t.state IN ('leased','acked')), e.trusted "
                "FROM endpoints e WHERE e.revoked IS NULL"
            )
            args: list[Any] = []
            if user_id is not None:  # the user's own endpoints and those shared with them
                sql += " AND (e.user_id=? OR e.id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?))"
                args += [user_id, user_id]
            if endpoint_id is not None:
                sql += " AND e.id=?"
                args.append(endpoint_id)
            rows = self._conn().execute(sql + " ORDER BY e.created", args).fetchall()
            cols = ["id", "user_id", "name", "transport", "created", "last_seen", "online", "info", "queued", "in_flight", "trusted"]
            out = [dict(zip(cols, r)) for r in rows]
            for e in out:
                e["online"] = bool(e["online"])
                e["trusted"] = bool(e["trusted"])
                e["info"] = json.loads(e["info"] or "{}")
            return out

        return await self._run(q)

    async def set_endpoint_state(self, endpoint_id: str, online: bool, last_seen: float, info: dict[str, Any] | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            if info is None:
                db.execute("UPDATE endpoints SET online=?, last_seen=? WHERE id=?", (int(online), last_seen, endpoint_id))
            else:
                db.execute(
                    "UPDATE endpoints SET online=?, last_seen=?, info=? WHERE id=?",
                    (int(online), last_seen, json.dumps(info), endpoint_id),
                )

        await self.tx(q)

    async def touch_endpoints(self, rows: Sequence[tuple[float, dict[str, Any], str]]) -> None:
        """Many endpoints' ``last_seen`` and live info, ``(last_seen, info, endpoint_id)`` each, in one
        transaction without an fsync. Why: heartbeats arrive at N / heartbeat_s per second (2,000/s
        for 10,000 endpoints at 5 s); one durable transaction each saturated the hub's one database
        thread. The row is what replicas and the console read, so seconds-stale is fine, and a
        crash loses only liveness figures that the next heartbeat brings back."""

        def q(db: sqlite3.Connection) -> None:
            db.executemany("UPDATE endpoints SET online=1, last_seen=?, info=? WHERE id=?",
                           [(seen, json.dumps(info), ep) for seen, info, ep in rows])

        if rows:
            await self.tx(q, durable=False)

    async def claim_endpoint(self, endpoint_id: str, replica: str, until: float, now: float) -> bool:
        """Hold (or renew) an endpoint's session for this hub replica unless another holds it."""

        def q(db: sqlite3.Connection) -> bool:
            db.execute(
                "INSERT INTO endpoint_owners (endpoint_id, replica, until) VALUES (?, ?, ?) "
                "ON CONFLICT(endpoint_id) DO UPDATE SET replica=excluded.replica, until=excluded.until "
                "WHERE endpoint_owners.replica=excluded.replica OR endpoint_owners.until < ?",
                (endpoint_id, replica, until, now),
            )
            row = db.execute("SELECT replica FROM endpoint_owners WHERE endpoint_id=?", (endpoint_id,)).fetchone()
            return bool(row and row[0] == replica)

        return await self.tx(q, durable=False)

    async def release_endpoint(self, endpoint_id: str, replica: str) -> None:
        await self.tx(lambda db: db.execute("DELETE FROM endpoint_owners WHERE endpoint_id=? AND replica=?", (endpoint_id, replica)), durable=False)

    async def endpoint_transport(self, endpoint_id: str) -> str | None:
        """The link an endpoint enrolled for: a replica takes over only endpoints it can reach."""
        row = await self._run(lambda: self._conn().execute("SELECT transport FROM endpoints WHERE id=? AND revoked IS NULL", (endpoint_id,)).fetchone())
        return str(row[0]) if row else None

    async def endpoint_key(self, endpoint_id: str) -> bytes | None:
        """One endpoint's key: for an endpoint enrolled through another hub replica."""
        row = await self._run(lambda: self._conn().execute("SELECT key FROM endpoints WHERE id=?", (endpoint_id,)).fetchone())
        return bytes(row[0]) if row else None

    async def put_function(self, user_id: str, fid: str, body: bytes, name: str) -> None:
        await self.tx(put_functions, user_id, {fid: (name, body)}, time.time())

    async def list_functions(self, user_id: str) -> list[dict[str, Any]]:
        def q() -> list[dict[str, Any]]:
            rows = self._conn().execute(
                "SELECT f.id, f.name, f.created, LENGTH(f.body) FROM functions f JOIN function_owners o "
                "ON o.function_id=f.id WHERE o.user_id=? ORDER BY f.created",
                (user_id,),
            ).fetchall()
            return [dict(zip(["id", "name", "created", "size"], r)) for r in rows]

        return await self._run(q)

    async def owned_refs(self, user_id: str, endpoint_ids: Iterable[str], fids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Which of these endpoints and functions the user may use (the submit path asks
        :func:`owned_refs_in` inside its own transaction instead)."""
        eps, fns = set(endpoint_ids), set(fids)
        return await self.read_parallel(lambda db: owned_refs_in(db, user_id, eps, fns))

    async def endpoint_owners_of(self, endpoint_ids: Iterable[str]) -> dict[str, str]:
        """endpoint id -> the user who enrolled it (sandbox by default for anyone else's tasks, docs/environments.md)."""
        # An endpoint's owner never changes (nothing updates endpoints.user_id), so known owners are
        # answered from memory: this runs on every submit and every stream's first task per endpoint.
        known = self._owners
        eps = [e for e in set(endpoint_ids) if e not in known]

        def q() -> dict[str, str]:
            db = self._conn()
            out: dict[str, str] = {}
            for chunk in _chunks(eps):
                out.update(db.execute(f"SELECT id, user_id FROM endpoints WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
            return out

        if eps:
            if len(known) > 100_000:  # bounded: a hub with more endpoints reads the rest each time
                known.clear()
            known.update(await self._run(q))
        return {e: known[e] for e in endpoint_ids if e in known}

    async def trusted_for(self, user_id: str, endpoint_ids: Iterable[str]) -> dict[str, tuple[bool, bool]]:
        """endpoint id -> (the user owns it, trusted for the user: owned and marked trusted), read
        fresh (the flag changes; the result stream asks again every few seconds)."""
        eps = list(set(endpoint_ids))

        def q() -> dict[str, tuple[bool, bool]]:
            db = self._conn()
            out: dict[str, tuple[bool, bool]] = {}
            for chunk in _chunks(eps):
                for eid, owner, trusted in db.execute(
                        f"SELECT id, user_id, trusted FROM endpoints WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall():
                    out[eid] = (owner == user_id, owner == user_id and bool(trusted))
            return out

        return await self._run(q) if eps else {}

    async def endpoint_info(self, endpoint_id: str) -> dict[str, Any] | None:
        """The info JSON kept in an endpoint's row (one indexed read, no task counts)."""
        row = await self._run(lambda: self._conn().execute("SELECT info FROM endpoints WHERE id=?", (endpoint_id,)).fetchone())
        return None if row is None else json.loads(row[0] or "{}")
