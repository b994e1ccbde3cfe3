"""What the placement service (``cloud_hub/placement.py``) reads and writes: the scheduler's saved
profiles (``scheduler_state``, one JSON document), its decisions (``scheduler_decisions``, one row
per placement) and the task rows it places or moves.

Plain SQL that both stores run; callers pass these functions to ``store.tx``/``store.read`` (and
the console's to ``read_parallel``), so what ran in one transaction still does.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = [
    "load_state", "save_state", "endpoint_shares", "pending_tasks", "prune_decisions", "complete_decisions",
    "task_functions", "write_decisions", "stranded_tasks", "move_task", "mark_moved", "write_decision",
    "decisions_page", "decision_summary", "last_decision_seq",
]

_DECISION_INSERT = (
    "INSERT INTO scheduler_decisions (task_id, user_id, function_id, endpoint_id, policy, placed_at, predicted_s, state, detail) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, 'placed', ?)"
)


def load_state(db: Any) -> str | None:
    """The saved scheduler profiles (JSON), read at start-up; None before the first save."""
    row = db.execute("SELECT state FROM scheduler_state WHERE id=1").fetchone()
    return row[0] if row else None


def save_state(db: Any, saved: float, policy: str, state: str) -> None:
    """Replace the saved scheduler profiles (every ``scheduler_save_s`` and at shutdown)."""
    db.execute(
        "INSERT INTO scheduler_state (id, saved, policy, state) VALUES (1, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET saved=excluded.saved, policy=excluded.policy, state=excluded.state",
        (saved, policy, state),
    )


def endpoint_shares(db: Any) -> list[tuple[str, str]]:
    """Every (endpoint id, user id) share: who besides the owner may be placed on an endpoint."""
    return db.execute("SELECT endpoint_id, user_id FROM endpoint_shares").fetchall()


def pending_tasks(db: Any) -> list[tuple[str, str, str, int | None]]:
    """(id, endpoint, function, argument bytes) of every task not done, oldest first: the ledger after a restart."""
    return db.execute(
        "SELECT id, endpoint_id, function_id, LENGTH(args) FROM tasks WHERE state IN ('queued', 'leased', 'acked') "
        "ORDER BY created"
    ).fetchall()


def prune_decisions(db: Any, older_than: float) -> None:
    """Drop finished or moved decisions placed before ``older_than`` (kept as long as results)."""
    db.execute("DELETE FROM scheduler_decisions WHERE placed_at < ? AND state != 'placed'", (older_than,))


#: A run time longer than this is not a run's (a clock jump): it teaches nothing.
MAX_RUNTIME_S = 7 * 86400.0


def runtime_of(started: Any, finished: Any) -> float | None:
    """A result's run time, or None where its stamps could not come from a run (pure)."""
    if not (isinstance(started, (int, float)) and isinstance(finished, (int, float))):
        return None
    if isinstance(started, bool) or isinstance(finished, bool):
        return None
    runtime = float(finished) - float(started)
    if not math.isfinite(runtime) or not 0.0 <= runtime <= MAX_RUNTIME_S:
        return None
    return runtime


def complete_results(db: Any, results: Sequence[dict[str, Any]], now: float) -> None:
    """Close the decisions of tasks whose results are being stored, in the storing transaction
    (issue 30: one commit per results frame, not a second transaction after it)."""
    complete_decisions(db, [(now, runtime_of(r.get("started"), r.get("finished")), int(bool(r.get("ok"))), r["id"]) for r in results])


def complete_decisions(db: Any, done: Sequence[tuple[Any, ...]]) -> None:
    """Mark placed decisions done with their outcome: (completed_at, runtime_s, ok, task_id) each."""
    db.executemany(
        "UPDATE scheduler_decisions SET state='done', completed_at=?1, actual_s=?1 - placed_at, runtime_s=?2, ok=?3 "
        "WHERE task_id=?4 AND state='placed'",
        done,
    )


def task_functions(db: Any, ids: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """task id -> (function id, environment) of these tasks (results the scheduler did not place)."""
    fns: dict[str, tuple[str, str | None]] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for tid, fid, env in db.execute(f"SELECT id, function_id, env FROM tasks WHERE id IN ({','.join('?' * len(chunk))})",
                                        chunk).fetchall():
            fns[tid] = (fid, env)
    return fns


def write_decisions(db: Any, decisions: Sequence[tuple[Any, ...]]) -> None:
    """Store placement decisions (state 'placed'), in the transaction that inserts their tasks."""
    db.executemany(_DECISION_INSERT, decisions)


def stranded_tasks(db: Any, endpoint_id: str, limit: int, newest: bool) -> list[tuple[str, str, str, str, int, str | None]]:
    """(id, user, function, decision detail, argument bytes, env) of the endpoint's tasks the
    scheduler placed that never left the hub: the oldest ``limit``, or the newest (late-bound, not
    started at once) when ``newest``."""
    return db.execute(
        "SELECT t.id, t.user_id, t.function_id, d.detail, LENGTH(t.args), t.env FROM tasks t "
        "JOIN scheduler_decisions d ON d.task_id = t.id AND d.state = 'placed' "
        "WHERE t.endpoint_id = ? AND t.state = 'queued' AND t.dispatched IS NULL "
        + ("AND t.placed IS NOT NULL AND t.start_now IS NULL ORDER BY t.created DESC " if newest else "ORDER BY t.created ")
        + "LIMIT ?",
        (endpoint_id, limit),
    ).fetchall()


def move_task(db: Any, task_id: str, endpoint_id: str, env: str | None, from_endpoint: str) -> int:
    """Re-point a queued, never dispatched task at another endpoint; returns 0 when it left meanwhile."""
    return int(db.execute(
        "UPDATE tasks SET endpoint_id=?, env=? WHERE id=? AND endpoint_id=? AND state='queued' AND dispatched IS NULL",
        (endpoint_id, env, task_id, from_endpoint),
    ).rowcount)


def mark_moved(db: Any, task_id: str) -> None:
    """The task's placed decision is superseded (a new one follows)."""
    db.execute("UPDATE scheduler_decisions SET state='moved' WHERE task_id=? AND state='placed'", (task_id,))


def write_decision(db: Any, decision: Sequence[Any]) -> None:
    """Store one placement decision (state 'placed'): a moved task's new placement."""
    db.execute(_DECISION_INSERT, decision)


def decisions_page(db: Any, user_id: str, limit: int, before: int | None = None, task_id: str | None = None,
                   endpoint_id: str | None = None, function_id: str | None = None) -> list[tuple[Any, ...]]:
    """The user's decisions newest first, filtered, up to ``limit`` rows below the ``before`` cursor
    (``GET /v1/scheduler/decisions``; the caller asks one more to know whether a page follows)."""
    sql = ("SELECT seq, task_id, function_id, endpoint_id, policy, placed_at, predicted_s, state, completed_at, "
           "actual_s, runtime_s, ok, detail FROM scheduler_decisions WHERE user_id=?")
    args: list[Any] = [user_id]
    for col, val in (("task_id", task_id), ("endpoint_id", endpoint_id), ("function_id", function_id)):
        if val is not None:
            sql += f" AND {col}=?"
            args.append(val)
    if before is not None:
        sql += " AND seq < ?"
        args.append(before)
    return db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, limit)).fetchall()


def decision_summary(db: Any, user_id: str) -> tuple[Any, ...]:
    """(decisions, completed, moved, mean absolute error s, mean relative error) of the user's decisions."""
    return tuple(db.execute(
        "SELECT COUNT(*), COUNT(actual_s), COUNT(CASE WHEN state='moved' THEN 1 END), "
        "AVG(CASE WHEN ok=1 THEN ABS(actual_s - predicted_s) END), "
        "AVG(CASE WHEN ok=1 AND actual_s > 0 THEN ABS(actual_s - predicted_s) / actual_s END) "
        "FROM scheduler_decisions WHERE user_id=?",
        (user_id,),
    ).fetchone())


def last_decision_seq(db: Any, user_id: str) -> Any:
    """The seq of the user's newest decision (None without any): the console's nav and refresh."""
    return db.execute("SELECT MAX(seq) FROM scheduler_decisions WHERE user_id=?", (user_id,)).fetchone()[0]
