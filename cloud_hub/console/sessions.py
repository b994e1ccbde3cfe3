"""Console sign-in sessions: an opaque random id in a cookie, only its SHA-256 in the hub database.

Why not a signed cookie: a server-side row can be revoked (sign out ends it everywhere at once)
and ties the session to the API token it was opened with, so deleting that token ends every
console session opened with it. The id is 256 random bits, so a plain SHA-256 suffices at rest
(the same reasoning as API tokens, see ``cloud_hub.store.hash_token``).
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass

from cloud_hub.store import SqliteStore, hash_token
from cloud_hub.store import console as sql

__all__ = ["COOKIE", "SESSION_TTL_S", "Session", "open_session", "find_session", "close_session", "csrf_token"]

COOKIE = "cm_console"
SESSION_TTL_S = 12 * 3600.0
_TOUCH_EVERY_S = 300.0  # last_used is written at most this often (reads stay reads)


@dataclass(frozen=True)
class Session:
    hash: str
    user_id: str
    user_name: str
    expires: float


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def csrf_token(session_id: str) -> str:
    """Per-session form token, derived from the (secret) session id so nothing more is stored."""
    return hashlib.sha256(b"console-csrf:" + session_id.encode()).hexdigest()[:32]


async def open_session(store: SqliteStore, user_id: str, api_token: str, ttl_s: float = SESSION_TTL_S) -> str:
    """Create a session for a user who proved ``api_token``; return the id for the cookie."""
    sid = secrets.token_urlsafe(32)
    now = time.time()

    def q(db: sqlite3.Connection) -> None:
        sql.drop_expired_sessions(db, now)  # housekeeping on each sign-in
        sql.insert_session(db, _hash(sid), user_id, hash_token(api_token), now, now + ttl_s)

    await store.tx(q)
    return sid


async def find_session(store: SqliteStore, session_id: str | None) -> Session | None:
    """The live session for a cookie value, or None (unknown, expired, or its API token is gone, expired or revoked)."""
    if not session_id or len(session_id) > 128:
        return None
    h = _hash(session_id)
    now = time.time()

    def q(db: sqlite3.Connection) -> tuple[Session, float] | None:
        row = sql.live_session(db, h, now)
        return (Session(h, row[0], row[1], row[2]), row[3]) if row else None

    found = await store.read_parallel(q)
    if found is None:
        return None
    sess, last_used = found
    if now - last_used > _TOUCH_EVERY_S:
        await store.tx(lambda db: sql.touch_session(db, h, now), durable=False)
    return sess


async def close_session(store: SqliteStore, session_id: str | None) -> None:
    if session_id:
        h = _hash(session_id)
        await store.tx(lambda db: sql.delete_session(db, h))
