"""Read a stopped SQLite hub's database file for a report: what ``mesh-sim`` checks after a run.

Why a module: the simulator proves nothing was lost by reading the hub's own tables once
everything stopped (a task's final state, how many result rows it has). That SQL belongs with the
rest of the hub's SQL, so the simulator calls these functions instead of querying the file.

Each function opens the file read-only, reads, and closes it; none changes anything.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["task_states", "result_summary", "finished_results"]


@contextmanager
def _read_only(path: str | Path) -> Iterator[sqlite3.Connection]:
    uri = "file:" + urllib.parse.quote(str(Path(path).resolve())) + "?mode=ro"
    db = sqlite3.connect(uri, uri=True)
    try:
        yield db
    finally:
        db.close()


def task_states(path: str | Path) -> dict[str, tuple[str, str, int]]:
    """Every task: its id -> (endpoint id, state, attempts)."""
    with _read_only(path) as db:
        return {tid: (ep, state, attempts)
                for tid, ep, state, attempts in db.execute("SELECT id, endpoint_id, state, attempts FROM tasks")}


def result_summary(path: str | Path) -> dict[str, tuple[int, bool, Any]]:
    """Every task with a result: its id -> (result rows, any ok, a payload). More than one row
    would be a duplicate, which the simulator counts."""
    with _read_only(path) as db:
        rows = db.execute("SELECT task_id, COUNT(*), MAX(ok), MAX(data) FROM results GROUP BY task_id")
        return {tid: (int(n), bool(ok), data) for tid, n, ok, data in rows}


def finished_results(path: str | Path) -> list[tuple[str, float]]:
    """(endpoint id, finished time) of every result that says when it finished."""
    with _read_only(path) as db:
        rows = db.execute("SELECT t.endpoint_id, r.finished FROM results r JOIN tasks t ON t.id = r.task_id "
                          "WHERE r.finished IS NOT NULL").fetchall()
    return [(ep, float(f)) for ep, f in rows]
