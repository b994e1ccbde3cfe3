"""Which queued rows a lease takes when the endpoint's lookahead caps the scheduler's tasks.

Why a cap: a task the scheduler placed (``placed`` = 1) can still move to another endpoint while
it waits in the hub, but not once it sits in an agent's prefetch queue. Sending an endpoint all
of its share at once (the agent's credit is its workers plus a prefetch of 256) fixes a wave's
split on predictions made before the wave ran; when run times drift (a shared CPU, a throttled
Pi) one endpoint ends early and the others finish the wave late. With the cap, an endpoint holds
only a few placed tasks beyond its workers and the rest stay in the hub, where an endpoint that
runs out of work takes them over (docs/scheduler.md, "Late binding"). Tasks that name their
endpoint are never capped: nothing could move them anyway.
"""

from __future__ import annotations

from typing import Any, Sequence

#: extra rows a capped lease reads, so that tasks naming the endpoint behind placed ones it must
#: skip still go out in this lease (a placed task beyond the cap is skipped, not a barrier)
PLACED_SKIP = 256


def keep_placed(rows: Sequence[tuple[Any, ...]], n: int, placed_max: int | None) -> list[tuple[Any, ...]]:
    """At most ``n`` of ``rows`` (oldest first, the last column ``placed``), of which at most
    ``placed_max`` placed ones (None: no cap); order kept."""
    if placed_max is None:
        return list(rows[:n])
    out: list[tuple[Any, ...]] = []
    left = max(0, placed_max)
    for r in rows:
        if r[-1]:
            if left <= 0:
                continue
            left -= 1
        out.append(r)
        if len(out) >= n:
            break
    return out
