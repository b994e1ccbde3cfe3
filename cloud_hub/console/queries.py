"""The console pages' reads, in console terms. Every read is scoped to one user.

Each function takes a ``sqlite3.Connection`` and runs on the store's read-only connection
(``SqliteStore.read_parallel``); none writes. The SQL is in ``cloud_hub/store/console.py`` (with
why it stays cheap); here the hub's task states become the console's.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from cloud_hub.store import console as sql

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
    by_state, failed = sql.task_state_counts(db, user_id)
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
    rows = sql.results_per_bucket(db, user_id, start, bucket_s)
    series = [[start + i * bucket_s, 0, 0] for i in range(buckets)]
    for b, ok, bad in rows:
        if 0 <= b < buckets:
            series[int(b)][1], series[int(b)][2] = int(ok or 0), int(bad or 0)
    return [(s, ok, bad) for s, ok, bad in series]


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
    All states together are the merge of the four index walks (``cloud_hub.store.console.task_page``)."""
    states = [_DB_STATE[state]] if state is not None else ["queued", "leased", "acked", "done"]
    out = sql.task_page(db, user_id, states, ok=_OK.get(state) if state is not None else None, endpoint_id=endpoint_id,
                        function_id=function_id, before=before, limit=limit)
    for row in out:
        row["console_state"] = _console_state(row)
    return out


def task_detail(db: sqlite3.Connection, user_id: str, task_id: str) -> dict[str, Any] | None:
    """One task with every hop's timestamp and its raw result blob (decoded safely by the caller)."""
    out = sql.task_row(db, user_id, task_id)
    if out is None:
        return None
    out["console_state"] = _console_state(out)
    return out


def function_stats(db: sqlite3.Connection, user_id: str) -> list[dict[str, Any]]:
    """The user's functions with task counts, failures and mean run time on the device."""
    return sql.function_stats(db, user_id)


def names(db: sqlite3.Connection, user_id: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(endpoint id, name) pairs of the endpoints the user may use (own and shared with them, not
    revoked: what ``GET /v1/endpoints`` lists) and (function id, name) pairs they registered."""
    return sql.endpoint_names(db, user_id), sql.function_names(db, user_id)
