"""Users, API tokens (stored hashed) and enrollment tokens, and enrolling endpoints with them.
"""

from __future__ import annotations


import hashlib
import secrets
import sqlite3
import time
import uuid
from typing import TYPE_CHECKING, Any, Sequence, TypeVar


if TYPE_CHECKING:
    pass

from cloud_hub.store._engine import StoreEngine, StoreError

T = TypeVar("T")


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so one SHA-256 is enough (no need for a slow KDF)."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_id_of_hash(h: str) -> str:
    """An API token's public id: the start of its hash (``mesh-hub token ls`` / ``revoke``)."""
    return "tk_" + h[:12]


def token_id(token: str) -> str:
    return token_id_of_hash(hash_token(token))


class TokenStore(StoreEngine):
    """Who may use the hub: users, their API tokens, single- or multi-use enrollment tokens."""

    async def create_user(self, name: str) -> str:
        def q(db: sqlite3.Connection) -> str:
            row = db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
            if row:
                return row[0]
            uid = "u_" + uuid.uuid4().hex[:16]
            db.execute("INSERT INTO users (id, name, created) VALUES (?, ?, ?)", (uid, name, time.time()))
            return uid

        return await self.tx(q)

    async def create_api_token(self, user_id: str, name: str = "default", expires: float | None = None) -> str:
        """A new API token (shown once; only its SHA-256 is stored). ``expires``: a Unix time after
        which the hub refuses it, or None for a token that lasts until it is revoked."""
        token = "cm_" + secrets.token_urlsafe(32)

        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO api_tokens (hash, user_id, name, created, expires) VALUES (?, ?, ?, ?, ?)",
                (hash_token(token), user_id, name, time.time(), expires),
            )

        await self.tx(q)
        return token

    async def api_token_state(self, token: str) -> tuple[str, float | None, float | None] | None:
        """``(user id, expires, revoked)`` of a token, whether or not it is still good; None when unknown."""
        def q(db: sqlite3.Connection) -> tuple[str, float | None, float | None] | None:
            row = db.execute("SELECT user_id, expires, revoked FROM api_tokens WHERE hash=?", (hash_token(token),)).fetchone()
            return (row[0], row[1], row[2]) if row else None

        return await self._run(lambda: q(self._conn()))

    async def user_for_token(self, token: str) -> str | None:
        """The token's user while it is good (known, not expired, not revoked), else None."""
        state = await self.api_token_state(token)
        if state is None or state[2] is not None or (state[1] is not None and state[1] <= time.time()):
            return None
        return state[0]

    async def list_api_tokens(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every API token (or one user's, by name): its id (:func:`token_id`), user, name, times."""
        def q(db: sqlite3.Connection) -> list[dict[str, Any]]:
            sql = ("SELECT t.hash, u.name, t.name, t.created, t.expires, t.revoked FROM api_tokens t JOIN users u ON u.id = t.user_id"
                   + (" WHERE u.name=?" if user is not None else "") + " ORDER BY t.created")
            rows = db.execute(sql, (user,) if user is not None else ()).fetchall()
            return [{"id": token_id_of_hash(r[0]), "user": r[1], "name": r[2], "created": r[3], "expires": r[4], "revoked": r[5]}
                    for r in rows]

        return await self._run(lambda: q(self._conn()))

    async def revoke_api_token(self, which: str) -> dict[str, Any]:
        """Revoke one API token, named by its id (``tk_`` and at least 6 hex digits of it, a
        unique prefix) or by the token itself. Returns its row (``already`` True when it was
        revoked before: nothing changes). Unknown or ambiguous: :class:`StoreError`, nothing changes."""
        which = which.strip()
        if which.startswith("cm_"):
            exact, prefix = hash_token(which), None
        else:
            prefix = which.removeprefix("tk_").lower()
            exact = None
            if len(prefix) < 6 or any(c not in "0123456789abcdef" for c in prefix):
                raise StoreError(f"{which!r} is not a token id: give the id `mesh-hub token ls` shows (tk_ and at least "
                                 "6 hex digits), or the token itself")
        now = time.time()

        def q(db: sqlite3.Connection) -> dict[str, Any]:
            if exact is not None:
                rows = db.execute("SELECT hash, name, revoked FROM api_tokens WHERE hash=?", (exact,)).fetchall()
            else:
                assert prefix is not None  # exact is None only for an id
                rows = db.execute("SELECT hash, name, revoked FROM api_tokens WHERE hash LIKE ?", (prefix + "%",)).fetchall()
            if not rows:
                raise StoreError(f"no API token {which!r} (see `mesh-hub token ls`)")
            if len(rows) > 1:
                raise StoreError(f"{which!r} matches {len(rows)} API tokens: give more digits of the id")
            h, name, revoked = rows[0]
            if revoked is None:
                db.execute("UPDATE api_tokens SET revoked=? WHERE hash=?", (now, h))
            return {"id": token_id_of_hash(h), "name": name, "revoked": revoked if revoked is not None else now,
                    "already": revoked is not None}

        return await self.tx(q)

    async def create_enroll_token(self, user_id: str, ttl_s: float, uses: int) -> str:
        token = "ce_" + secrets.token_urlsafe(32)

        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO enroll_tokens (hash, user_id, expires, uses_left, created) VALUES (?, ?, ?, ?, ?)",
                (hash_token(token), user_id, time.time() + ttl_s, uses, time.time()),
            )

        await self.tx(q)
        return token

    async def enroll_endpoint(self, token: str, name: str, transport: str, key: bytes,
                              mqtt_hash: str | None = None, curve_key: str | None = None,
                              gateway_id: str | None = None) -> dict[str, Any] | None:
        """Consume one use of an enrollment token and create the endpoint, atomically.

        ``mqtt_hash``: Mosquitto hash of the endpoint's broker password (username = endpoint id);
        ``curve_key``: the agent's ZeroMQ CURVE public key (z85)."""

        def q(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT user_id FROM enroll_tokens WHERE hash=? AND uses_left > 0 AND expires > ?",
                (hash_token(token), time.time()),
            ).fetchone()
            if row is None:
                return None
            if gateway_id is not None:  # the gateway must be a live MQTT endpoint of the same user
                gw = db.execute("SELECT user_id, transport FROM endpoints WHERE id=? AND revoked IS NULL", (gateway_id,)).fetchone()
                if gw is None or gw[0] != row[0] or gw[1] != "mqtt":
                    raise ValueError(f"gateway {gateway_id} is not an MQTT endpoint of this token's user")
            db.execute("UPDATE enroll_tokens SET uses_left = uses_left - 1 WHERE hash=?", (hash_token(token),))
            eid = "ep-" + uuid.uuid4().hex[:12]
            db.execute(
                "INSERT INTO endpoints (id, user_id, name, transport, key, created, online, info, mqtt_user, mqtt_hash, curve_key, gateway_id) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, '{}', ?, ?, ?, ?)",
                (eid, row[0], name, transport, key, time.time(), eid if mqtt_hash else None, mqtt_hash, curve_key, gateway_id),
            )
            return {"id": eid, "user_id": row[0]}

        return await self.tx(q)

    async def enroll_endpoints(self, token: str, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Consume ``len(items)`` uses of one enrollment token and create all those endpoints in one
        transaction, or none (a fleet enrolled in bulk must not end half-enrolled). Each item:
        ``name``, ``transport``, ``key``, optional ``mqtt_hash`` and ``curve_key``, as for
        :meth:`enroll_endpoint`. None when the token is unknown, expired or has too few uses left;
        ``sqlite3.IntegrityError`` (a CURVE key already enrolled) rolls everything back."""

        def q(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            th = hash_token(token)
            row = db.execute("SELECT user_id FROM enroll_tokens WHERE hash=? AND uses_left >= ? AND expires > ?",
                             (th, len(items), time.time())).fetchone()
            if row is None:
                return None
            db.execute("UPDATE enroll_tokens SET uses_left = uses_left - ? WHERE hash=?", (len(items), th))
            now, out, rows = time.time(), [], []
            for it in items:
                eid = "ep-" + uuid.uuid4().hex[:12]
                mh = it.get("mqtt_hash")
                rows.append((eid, row[0], it["name"], it["transport"], it["key"], now, eid if mh else None, mh, it.get("curve_key")))
                out.append({"id": eid, "user_id": row[0]})
            db.executemany(
                "INSERT INTO endpoints (id, user_id, name, transport, key, created, online, info, mqtt_user, mqtt_hash, curve_key) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, '{}', ?, ?, ?)", rows)
            return out

        return await self.tx(q)
