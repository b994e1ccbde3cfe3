"""What the console shows for admission and memoization: each endpoint's predicted capacity per
function, and cache hits and misses per function.

Predicted capacity answers the OpenWhisk proposal's wish to "calculate expected TPS
arithmetically": an endpoint's warm workers times the rate one worker sustains for that function,
measured from its recent successful runs here (1 / mean run time). It is what the endpoint can
take before work queues at the hub, and what a concurrency limit should be set against.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from cloud_hub.store.console import function_run_rates

__all__ = ["WINDOW_S", "function_rates", "predicted_capacity", "memo_counts"]

#: Runs older than this do not count (a function's speed changes with its code and its inputs).
WINDOW_S = 3600.0


def function_rates(db: sqlite3.Connection, user_id: str, endpoint_id: str, since: float) -> list[tuple[str, str, int, float]]:
    """(function id, name, runs, mean run seconds) of the user's functions that ran on the endpoint since ``since``."""
    rows = function_run_rates(db, user_id, endpoint_id, since)
    return [(fid, name, int(n), float(mean)) for fid, name, n, mean in rows if mean is not None]


def predicted_capacity(rates: list[tuple[str, str, int, float]], workers: int | None, warm: list[str] | None) -> list[dict[str, Any]]:
    """Per function: workers x (1 / mean run time) tasks per second. Pure arithmetic."""
    warm_set = set(warm or ())
    out = []
    for fid, name, runs, mean in rates:
        per_worker = 1.0 / mean if mean > 0 else None
        out.append({"function_id": fid, "name": name, "runs": runs, "mean_run_s": mean, "per_worker_per_s": per_worker,
                    "workers": workers, "warm": fid in warm_set,
                    "tasks_per_s": (workers * per_worker) if (workers and per_worker is not None) else None})
    return out


def memo_counts(db: sqlite3.Connection, user_id: str) -> dict[str, tuple[int, int]]:
    """function id -> (cache hits, misses) of the user's submits with cache=True."""
    from cloud_hub.store import memo

    return memo.counts(db, user_id)
