"""What a Prometheus scrape reads (``cloud_hub/metrics.py``): the fleet, the backlog, and the
results and FL rounds stored since the last scrape (by cursor: ``results.seq``, ``fl_rounds.created``).

Portable SQL (SQLite and PostgreSQL); each query walks an index or a small table. The scrape runs
them together in one visit to the store's reader connection (``read_parallel``).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["live_endpoints", "backlog", "results_after", "fl_status", "fl_rounds_after", "function_names", "cursors"]


def live_endpoints(db: Any) -> list[tuple[Any, ...]]:
    """(id, name, transport, last_seen, online, gateway_id, info) of every endpoint not revoked."""
    return db.execute(
        "SELECT id, name, transport, last_seen, online, gateway_id, info FROM endpoints WHERE revoked IS NULL"
    ).fetchall()


def backlog(db: Any) -> list[tuple[Any, ...]]:
    """(endpoint, state, count) of the tasks not done yet."""
    return db.execute(
        "SELECT endpoint_id, state, COUNT(*) FROM tasks WHERE state IN ('queued', 'leased', 'acked') GROUP BY endpoint_id, state"
    ).fetchall()


def results_after(db: Any, seq: int, limit: int) -> list[tuple[Any, ...]]:
    """(seq, ok, received, function, created, dispatched, predicted_s, placed_at) of the first
    ``limit`` results stored after cursor ``seq``, with their task and live decision."""
    return db.execute(
        "SELECT r.seq, r.ok, r.received, t.function_id, t.created, t.dispatched, d.predicted_s, d.placed_at "
        "FROM results r JOIN tasks t ON t.id = r.task_id "
        "LEFT JOIN scheduler_decisions d ON d.task_id = r.task_id AND d.state != 'moved' "
        f"WHERE r.seq > ? ORDER BY r.seq LIMIT {int(limit)}",
        (seq,),
    ).fetchall()


def fl_status(db: Any) -> dict[str, int]:
    """FL runs per status."""
    return dict(db.execute("SELECT status, COUNT(*) FROM fl_runs GROUP BY status").fetchall())


def fl_rounds_after(db: Any, after: float) -> list[tuple[str, float]]:
    """(record JSON, created) of the FL rounds stored after cursor ``after``, oldest first."""
    return db.execute(
        "SELECT record, created FROM fl_rounds WHERE created > ? ORDER BY created", (after,)
    ).fetchall()


def function_names(db: Any, fids: Sequence[str]) -> dict[str, str]:
    """function id -> name of these functions (label values for ids not seen before)."""
    out: dict[str, str] = {}
    for i in range(0, len(fids), 500):
        chunk = list(fids[i:i + 500])
        out.update(db.execute(f"SELECT id, name FROM functions WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
    return out


def cursors(db: Any) -> tuple[int, float]:
    """Where a new hub process starts counting: the newest result's seq and FL round's created."""
    seq = db.execute("SELECT COALESCE(MAX(seq), 0) FROM results").fetchone()[0]
    fl = db.execute("SELECT COALESCE(MAX(created), 0) FROM fl_rounds").fetchone()[0]
    return int(seq), float(fl)
