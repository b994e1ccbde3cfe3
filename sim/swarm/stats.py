"""Pure helpers for the swarm report: percentiles, rates, per-endpoint figures, worker summaries.

Kept apart from the harness so they are unit-tested without processes (tests/unit/test_swarm_stats.py).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

__all__ = ["percentile", "rate", "per_endpoint_kb", "sum_status", "split_evenly", "check_delivery"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    s = sorted(values)
    k = max(1, math.ceil(q / 100 * len(s)))
    return s[k - 1]


def rate(delta: float, seconds: float) -> float:
    """``delta`` per second, 0 for an empty interval (never a division by zero)."""
    return delta / seconds if seconds > 0 else 0.0


def per_endpoint_kb(rss_with: int, rss_base: int, n: int) -> float | None:
    """What each endpoint adds to a process's RSS, in KB (1024 B); None without endpoints."""
    if n <= 0:
        return None
    return (rss_with - rss_base) / n / 1024


_SUMMED = ("endpoints", "connected", "online", "reconnected", "unacked_results", "reconnects", "connect_failures", "cpu_s", "rss",
           "frames_out", "frames_in", "hellos", "heartbeats", "tasks", "duplicates", "rejected", "hello_required")


def sum_status(statuses: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The swarm's totals from each worker process's latest status line."""
    out = {k: 0.0 for k in _SUMMED}
    for st in statuses:
        for k in _SUMMED:
            out[k] += float(st.get(k, 0) or 0)
    return out


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one (no empty chunk)."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    parts = min(parts, len(items)) or 1
    q, r = divmod(len(items), parts)
    out, i = [], 0
    for p in range(parts):
        n = q + (1 if p < r else 0)
        out.append(list(items[i : i + n]))
        i += n
    return out


def check_delivery(submitted: Iterable[str], results: Iterable[str]) -> dict[str, int]:
    """Exactly-once check: submitted task ids against the task ids of results as delivered
    (one entry per delivery). ``lost``: no result; ``duplicated``: more than one; ``unknown``: a
    result for a task we did not submit."""
    sub = set(submitted)
    seen: dict[str, int] = {}
    for t in results:
        seen[t] = seen.get(t, 0) + 1
    return {
        "submitted": len(sub),
        "delivered": sum(1 for t in sub if t in seen),
        "lost": sum(1 for t in sub if t not in seen),
        "duplicated": sum(1 for t, c in seen.items() if c > 1),
        "unknown": sum(1 for t in seen if t not in sub),
    }
