"""The web console's SQL: the pages' reads (``cloud_hub/console/queries.py``, ``capacity.py``, the
optional pages' summaries, an endpoint's recent transitions) and its sign-in sessions
(``console_sessions``, ``cloud_hub/console/sessions.py``).

Every page read is scoped to one user and none writes. They run on the store's read-only
connection (its own thread, ``SqliteStore.read_parallel``), so a slow one never holds up the
dispatcher's writes, and they lean on existing indexes (``tasks_user``, ``results_age``) instead of
adding write cost to the hot path: a task list is an index walk that stops after one page.
Plain SQL that both stores run. The console modules keep what the pages make of the rows
(console states, capacity arithmetic).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "task_state_counts", "results_per_bucket", "task_page", "task_row", "function_stats", "endpoint_names",
    "function_names", "function_run_rates", "fl_run_summary", "recent_transitions", "drop_expired_sessions",
    "insert_session", "live_session", "touch_session", "delete_session",
]

_TASK_COLS = (
    "t.rowid, t.id, t.endpoint_id, e.name, t.function_id, f.name, t.state, t.created, t.dispatched, t.acked, "
    "t.done, t.attempts, r.ok, r.started, r.finished, r.received"
)
_TASK_KEYS = [
    "rowid", "id", "endpoint_id", "endpoint_name", "function_id", "function_name", "state", "created", "dispatched",
    "acked", "done", "attempts", "ok", "started", "finished", "received",
]
_TASK_FROM = (
    "FROM tasks t LEFT JOIN results r ON r.task_id = t.id LEFT JOIN endpoints e ON e.id = t.endpoint_id "
    "LEFT JOIN functions f ON f.id = t.function_id"
)


# ------------------------------------------------------------------ pages


def task_state_counts(db: Any, user_id: str) -> tuple[dict[str, int], int]:
    """The user's tasks per hub state, and their failed results (one scan of the user's failures)."""
    by_state = dict(db.execute("SELECT state, COUNT(*) FROM tasks WHERE user_id=? GROUP BY state", (user_id,)).fetchall())
    failed = db.execute("SELECT COUNT(*) FROM results WHERE user_id=? AND ok=0", (user_id,)).fetchone()[0]
    return by_state, failed


def results_per_bucket(db: Any, user_id: str, start: float, bucket_s: float) -> list[tuple[Any, ...]]:
    """(bucket index, succeeded, failed) of the user's results received since ``start``, per ``bucket_s``."""
    # Integer milliseconds and integer division: the same floor in SQLite and PostgreSQL (whose
    # CAST of a float rounds). "user_id || ''" keeps SQLite on the received index (the window),
    # not on all of the user's results.
    return db.execute(
        "SELECT (CAST(received * 1000 AS BIGINT) - ?) / ?, SUM(ok), SUM(1 - ok) FROM results "
        "WHERE received >= ? AND user_id || '' = ? GROUP BY 1",
        (int(start * 1000), int(bucket_s * 1000), start, user_id),
    ).fetchall()


def task_page(db: Any, user_id: str, states: Sequence[str], *, ok: int | None = None, endpoint_id: str | None = None,
              function_id: str | None = None, before: int | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """One page of the user's tasks in these hub states (and with this result ``ok``), newest
    first below the rowid cursor ``before``, as dicts.

    The ``tasks_user (user_id, state)`` index holds each (user, state) range in rowid order, so
    the newest ``limit`` tasks of one state are an index walk that stops after ``limit`` hits.
    Several states together are the merge of their walks: a page costs O(limit), not a sort of
    all of the user's tasks."""
    cond = ""
    extra: list[Any] = []
    if endpoint_id is not None:
        cond += " AND endpoint_id=?"
        extra.append(endpoint_id)
    if function_id is not None:
        cond += " AND function_id=?"
        extra.append(function_id)
    if ok is not None:
        cond += " AND EXISTS (SELECT 1 FROM results r WHERE r.task_id = tasks.id AND r.ok = ?)"
        extra.append(ok)
    if before is not None:
        cond += " AND rowid < ?"
        extra.append(before)
    found: list[int] = []
    for st in states:
        found += [r[0] for r in db.execute(
            f"SELECT rowid FROM tasks WHERE user_id=? AND state=?{cond} ORDER BY rowid DESC LIMIT ?",
            (user_id, st, *extra, limit),
        )]
    rowids = sorted(found, reverse=True)[:limit]
    if not rowids:
        return []
    rows = db.execute(
        f"SELECT {_TASK_COLS} {_TASK_FROM} WHERE t.rowid IN ({','.join('?' * len(rowids))}) ORDER BY t.rowid DESC", rowids
    ).fetchall()
    return [dict(zip(_TASK_KEYS, r)) for r in rows]


def task_row(db: Any, user_id: str, task_id: str) -> dict[str, Any] | None:
    """One of the user's tasks with every hop's timestamp and its raw result blob (decoded safely by the caller)."""
    row = db.execute(
        f"SELECT {_TASK_COLS}, t.timeout, t.expires, LENGTH(t.args), r.data, r.pid {_TASK_FROM} WHERE t.id=? AND t.user_id=?",
        (task_id, user_id),
    ).fetchone()
    if row is None:
        return None
    return dict(zip(_TASK_KEYS + ["timeout", "expires", "args_size", "data", "pid"], row))


def function_stats(db: Any, user_id: str) -> list[dict[str, Any]]:
    """The user's functions with task counts, failures and mean run time on the device."""
    rows = db.execute(
        "SELECT f.id, f.name, f.created, LENGTH(f.body), COUNT(t.id), "
        "COALESCE(SUM(CASE WHEN t.state != 'done' THEN 1 ELSE 0 END), 0), "
        "COALESCE(SUM(CASE WHEN r.ok = 1 THEN 1 ELSE 0 END), 0), COALESCE(SUM(CASE WHEN r.ok = 0 THEN 1 ELSE 0 END), 0), "
        "AVG(CASE WHEN r.ok = 1 AND r.finished >= r.started THEN r.finished - r.started END) "
        "FROM functions f JOIN function_owners o ON o.function_id = f.id "
        "LEFT JOIN tasks t ON t.function_id = f.id AND t.user_id = o.user_id LEFT JOIN results r ON r.task_id = t.id "
        "WHERE o.user_id=? GROUP BY f.id ORDER BY f.created DESC",
        (user_id,),
    ).fetchall()
    keys = ["id", "name", "created", "size", "tasks", "pending", "succeeded", "failed", "mean_run_s"]
    return [dict(zip(keys, r)) for r in rows]


def endpoint_names(db: Any, user_id: str) -> list[tuple[str, str]]:
    """(id, name) of the endpoints the user may use: own and shared with them, not revoked (what ``GET /v1/endpoints`` lists)."""
    eps = db.execute(
        "SELECT id, name FROM endpoints WHERE revoked IS NULL AND "
        "(user_id=? OR id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?)) ORDER BY name",
        (user_id, user_id),
    ).fetchall()
    return [(a, b) for a, b in eps]


def function_names(db: Any, user_id: str) -> list[tuple[str, str]]:
    """(id, name or id) of the functions the user registered."""
    fns = db.execute(
        "SELECT f.id, COALESCE(f.name, f.id) FROM functions f JOIN function_owners o ON o.function_id=f.id "
        "WHERE o.user_id=? ORDER BY f.name", (user_id,)
    ).fetchall()
    return [(a, b) for a, b in fns]


def function_run_rates(db: Any, user_id: str, endpoint_id: str, since: float) -> list[tuple[Any, ...]]:
    """(function id, name, runs, mean run seconds) of the user's successful runs on the endpoint since ``since``, top 50."""
    return db.execute(
        "SELECT t.function_id, COALESCE(f.name, t.function_id), COUNT(*), AVG(r.finished - r.started) FROM tasks t "
        "JOIN results r ON r.task_id = t.id LEFT JOIN functions f ON f.id = t.function_id "
        "WHERE t.endpoint_id=? AND t.state='done' AND t.created > ? AND t.user_id=? AND r.ok = 1 AND r.finished >= r.started "
        "AND t.dispatched IS NOT NULL GROUP BY t.function_id, f.name ORDER BY COUNT(*) DESC LIMIT 50",
        (endpoint_id, since, user_id)).fetchall()


def fl_run_summary(db: Any, user_id: str) -> tuple[Any, ...]:
    """(runs, last update, runs running) of the user's FL runs (the FL page's nav); raises on a hub without ``fl_runs``."""
    return tuple(db.execute(
        "SELECT COUNT(*), MAX(updated), SUM(CASE WHEN status = 'running' THEN 1 ELSE 0 END) FROM fl_runs WHERE user_id=?",
        (user_id,)).fetchone())


def recent_transitions(db: Any, endpoint_id: str) -> list[tuple[Any, ...]]:
    """(at, online) of the endpoint's last 20 availability transitions, newest first (its console page)."""
    return db.execute("SELECT at, online FROM endpoint_events WHERE endpoint_id=? ORDER BY at DESC, seq DESC LIMIT 20",
                      (endpoint_id,)).fetchall()


# ------------------------------------------------------------------ sessions


def drop_expired_sessions(db: Any, now: float) -> None:
    """Delete sessions expired before ``now`` (housekeeping on each sign-in)."""
    db.execute("DELETE FROM console_sessions WHERE expires < ?", (now,))


def insert_session(db: Any, session_hash: str, user_id: str, token_hash: str, now: float, expires: float) -> None:
    """Store a new session (its id's SHA-256), tied to the API token it was opened with."""
    db.execute(
        "INSERT INTO console_sessions (hash, user_id, token_hash, created, expires, last_used) VALUES (?, ?, ?, ?, ?, ?)",
        (session_hash, user_id, token_hash, now, expires, now),
    )


def live_session(db: Any, session_hash: str, now: float) -> tuple[Any, ...] | None:
    """(user id, user name, expires, last used) of a live session whose API token is still valid, or None."""
    row = db.execute(
        "SELECT s.user_id, u.name, s.expires, s.last_used FROM console_sessions s "
        "JOIN users u ON u.id = s.user_id JOIN api_tokens t ON t.hash = s.token_hash "
        "WHERE s.hash=? AND s.expires > ? AND t.user_id = s.user_id AND t.revoked IS NULL AND (t.expires IS NULL OR t.expires > ?)",
        (session_hash, now, now),
    ).fetchone()
    return tuple(row) if row is not None else None


def touch_session(db: Any, session_hash: str, now: float) -> None:
    """Record that the session was used at ``now`` (written at most every few minutes)."""
    db.execute("UPDATE console_sessions SET last_used=? WHERE hash=?", (now, session_hash))


def delete_session(db: Any, session_hash: str) -> None:
    """End a session (sign out)."""
    db.execute("DELETE FROM console_sessions WHERE hash=?", (session_hash,))
