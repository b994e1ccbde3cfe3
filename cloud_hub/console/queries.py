"""Read-only SQL behind the console pages. Every query is scoped to one user.

Each function takes a ``sqlite3.Connection``; none writes. They run on the store's read-only
connection (its own thread, ``SqliteStore.read_parallel``), so a slow one never holds up the
dispatcher's writes, and they lean on existing indexes (``tasks_user``, ``results_age``)
instead of adding write cost to the hot path: a task list is an index walk that stops after
one page.
"""

from __future__ import annotations

import sqlite3
from typing import Any

__all__ = [
    "STATES",
    "state_counts",
    "throughput",
    "list_tasks",
    "task_detail",
    "function_stats",
    "names",
]

#: Console task states, in pipeline order (the hub's ``leased`` is "dispatched", ``acked`` is
#: "on device", ``done`` splits by the result into "succeeded" and "failed").
STATES: tuple[str, ...] = ("queued", "dispatched", "on_device", "succeeded", "failed")


def state_counts(db: sqlite3.Connection, user_id: str) -> dict[str, int]:
    """Tasks per console state. Done tasks split by their result: one scan of the user's failures."""
    by_state = dict(db.execute("SELECT state, COUNT(*) FROM tasks WHERE user_id=? GROUP BY state", (user_id,)).fetchall())
    failed = db.execute("SELECT COUNT(*) FROM results WHERE user_id=? AND ok=0", (user_id,)).fetchone()[0]
    done = by_state.get("done", 0)
    return {
        "queued": by_state.get("queued", 0),
        "dispatched": by_state.get("leased", 0),
        "on_device": by_state.get("acked", 0),
        "succeeded": max(0, done - failed),
        "failed": failed,
    }


def throughput(db: sqlite3.Connection, user_id: str, now: float, bucket_s: float, buckets: int) -> list[tuple[float, int, int]]:
    """Results received per time bucket over the last ``buckets * bucket_s`` seconds, oldest
    first: ``(bucket start, succeeded, failed)``. Buckets are aligned to multiples of
    ``bucket_s`` so that the series is stable between refreshes."""
    end = (int(now // bucket_s) + 1) * bucket_s
    start = end - buckets * bucket_s
    # Integer milliseconds and integer division: the same floor in SQLite and PostgreSQL (whose
    # CAST of a float rounds). "user_id || ''" keeps SQLite on the received index (the window),
    # not on all of the user's results.
    rows = db.execute(
        "SELECT (CAST(received * 1000 AS BIGINT) - ?) / ?, SUM(ok), SUM(1 - ok) FROM results "
        "WHERE received >= ? AND user_id || '' = ? GROUP BY 1",
        (int(start * 1000), int(bucket_s * 1000), start, user_id),
    ).fetchall()
    series = [[start + i * bucket_s, 0, 0] for i in range(buckets)]
    for b, ok, bad in rows:
        if 0 <= b < buckets:
            series[int(b)][1], series[int(b)][2] = int(ok or 0), int(bad or 0)
    return [(s, ok, bad) for s, ok, bad in series]


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


def _console_state(row: dict[str, Any]) -> str:
    s = row["state"]
    if s == "done":
        return "failed" if row["ok"] == 0 else "succeeded"
    return {"leased": "dispatched", "acked": "on_device"}.get(s, s)


_DB_STATE = {"queued": "queued", "dispatched": "leased", "on_device": "acked", "succeeded": "done", "failed": "done"}
_OK = {"succeeded": 1, "failed": 0}


def list_tasks(
    db: sqlite3.Connection,
    user_id: str,
    *,
    state: str | None = None,
    endpoint_id: str | None = None,
    function_id: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Newest first, one page; ``before`` is the rowid cursor of the previous page's last row.

    The ``tasks_user (user_id, state)`` index holds each (user, state) range in rowid order, so
    the newest ``limit`` tasks of one state are an index walk that stops after ``limit`` hits.
    All states together are the merge of the four walks: a page costs O(limit), not a sort of
    all of the user's tasks."""
    cond, extra = "", []
    if endpoint_id is not None:
        cond += " AND endpoint_id=?"
        extra.append(endpoint_id)
    if function_id is not None:
        cond += " AND function_id=?"
        extra.append(function_id)
    if state in _OK:
        cond += " AND EXISTS (SELECT 1 FROM results r WHERE r.task_id = tasks.id AND r.ok = ?)"
        extra.append(_OK[state])
    if before is not None:
        cond += " AND rowid < ?"
        extra.append(before)
    found: list[int] = []
    for st in ([_DB_STATE[state]] if state is not None else ["queued", "leased", "acked", "done"]):
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
    out = [dict(zip(_TASK_KEYS, r)) for r in rows]
    for row in out:
        row["console_state"] = _console_state(row)
    return out


def task_detail(db: sqlite3.Connection, user_id: str, task_id: str) -> dict[str, Any] | None:
    """One task with every hop's timestamp and its raw result blob (decoded safely by the caller)."""
    row = db.execute(
        f"SELECT {_TASK_COLS}, t.timeout, t.expires, LENGTH(t.args), r.data, r.pid {_TASK_FROM} WHERE t.id=? AND t.user_id=?",
        (task_id, user_id),
    ).fetchone()
    if row is None:
        return None
    out = dict(zip(_TASK_KEYS + ["timeout", "expires", "args_size", "data", "pid"], row))
    out["console_state"] = _console_state(out)
    return out


def function_stats(db: sqlite3.Connection, user_id: str) -> list[dict[str, Any]]:
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


def names(db: sqlite3.Connection, user_id: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(endpoint id, name) pairs of the endpoints the user may use (own and shared with them, not
    revoked: what ``GET /v1/endpoints`` lists) and (function id, name) pairs they registered."""
    eps = db.execute(
        "SELECT id, name FROM endpoints WHERE revoked IS NULL AND "
        "(user_id=? OR id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?)) ORDER BY name",
        (user_id, user_id),
    ).fetchall()
    fns = db.execute(
        "SELECT f.id, COALESCE(f.name, f.id) FROM functions f JOIN function_owners o ON o.function_id=f.id "
        "WHERE o.user_id=? ORDER BY f.name", (user_id,)
    ).fetchall()
    return [(a, b) for a, b in eps], [(a, b) for a, b in fns]
