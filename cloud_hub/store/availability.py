"""Endpoint availability history: one row per online/offline transition (table ``endpoint_events``).

The dispatcher writes a row when it marks an endpoint online (a hello from an agent it had no
session for) or offline (silence past ``lost_after_s``); the console draws availability timelines
from it, and it is the heartbeat history a scheduler can learn availability from. Only
transitions are stored, so the table grows with churn, not with heartbeats.

Functions here take a ``sqlite3.Connection`` and run inside ``SqliteStore.tx``/``read_parallel``.
"""

from __future__ import annotations

import sqlite3
from typing import Any

__all__ = ["record_transition", "close_stale_sessions", "events_between", "prune_events"]


def record_transition(db: sqlite3.Connection, endpoint_id: str, online: bool, at: float) -> bool:
    """Store a transition unless the endpoint's last recorded state is already ``online``."""
    last = db.execute(
        "SELECT online FROM endpoint_events WHERE endpoint_id=? ORDER BY at DESC, seq DESC LIMIT 1", (endpoint_id,)
    ).fetchone()
    if last is not None and bool(last[0]) == online:
        return False
    db.execute("INSERT INTO endpoint_events (endpoint_id, online, at) VALUES (?, ?, ?)", (endpoint_id, int(online), at))
    return True


def close_stale_sessions(db: sqlite3.Connection) -> int:
    """At hub start-up no agent has a session yet: endpoints the database still calls online are
    marked offline as of the last time they were heard (the hub cannot vouch for the gap)."""
    rows = db.execute("SELECT id, COALESCE(last_seen, created) FROM endpoints WHERE online=1").fetchall()
    for eid, seen in rows:
        db.execute("UPDATE endpoints SET online=0 WHERE id=?", (eid,))
        record_transition(db, eid, False, seen)
    return len(rows)


def events_between(db: sqlite3.Connection, endpoint_ids: list[str], start: float, end: float) -> dict[str, list[tuple[float, bool]]]:
    """Per endpoint: its state at ``start`` (the last transition before it, if any) followed by
    every transition in ``[start, end]``, oldest first."""
    out: dict[str, list[tuple[float, bool]]] = {}
    for eid in endpoint_ids:
        before = db.execute(
            "SELECT at, online FROM endpoint_events WHERE endpoint_id=? AND at < ? ORDER BY at DESC, seq DESC LIMIT 1",
            (eid, start),
        ).fetchone()
        rows: list[Any] = [before] if before else []
        rows += db.execute(
            "SELECT at, online FROM endpoint_events WHERE endpoint_id=? AND at >= ? AND at <= ? ORDER BY at, seq",
            (eid, start, end),
        ).fetchall()
        out[eid] = [(float(at), bool(on)) for at, on in rows]
    return out


def prune_events(db: sqlite3.Connection, older_than: float) -> int:
    """Drop transitions older than ``older_than`` but keep each endpoint's latest one before it,
    so the state at the start of any retained window stays known."""
    return db.execute(
        "DELETE FROM endpoint_events WHERE at < ? AND seq NOT IN "
        "(SELECT MAX(seq) FROM endpoint_events WHERE at < ? GROUP BY endpoint_id)",
        (older_than, older_than),
    ).rowcount
