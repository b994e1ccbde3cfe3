"""What the dispatcher tells interested parties (the scheduler's placement service) as it works.

Why a separate interface: the dispatcher moves tasks and results and must not know about
scheduling. It calls these hooks at the points where it learns something (an agent said hello,
beat, sent a frame or results, or went silent); the default implementation does nothing. Hooks
are synchronous and must return quickly: they run on the dispatcher's event loop, between
frames. One that needs the database starts its own task. An exception in a hook is logged by
the dispatcher and never affects message handling.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["DispatchObserver"]


class DispatchObserver:
    """No-op base: override what you need. All times are hub ``time.time()`` seconds."""

    def endpoint_online(self, endpoint_id: str, now: float, info: dict[str, Any]) -> None:
        """The agent said hello. ``info``: capacity, prefetch, tags, hardware, gpu, memory_mb, ..."""

    def endpoint_lost(self, endpoint_id: str, now: float, last_seen: float) -> None:
        """The watchdog declared the endpoint lost (silent since ``last_seen``)."""

    def heartbeat(self, endpoint_id: str, now: float, info: dict[str, Any]) -> None:
        """A heartbeat: running, queued, warm (function ids), capacity, resource use."""

    def frame_received(self, endpoint_id: str, kind: str, nbytes: int, sent_at: float, now: float) -> None:
        """A verified frame of ``nbytes`` arrived; the agent stamped it ``sent_at`` (hub clock,
        as corrected by the agent from the hub's welcome) and the link read it at ``now``."""

    def link_echo(self, endpoint_id: str, rtt_s: float, offset_s: float, now: float, hub_lag_s: float) -> None:
        """The agent echoed one of our stamps: the link's round trip ``rtt_s`` (its hold and our
        queueing taken out), the exchange's clock offset ``offset_s`` (the agent's stamps minus our
        clock) and how long the frame waited in the hub before it was handled (``hub_lag_s``)."""

    def results_stored(self, endpoint_id: str, now: float, results: Sequence[dict[str, Any]], fresh: set[str]) -> None:
        """A results frame was stored; ``fresh`` are the task ids stored for the first time
        (the others were duplicates from a re-execution). Each result has id, ok, data,
        started, finished."""

    def lookahead(self, endpoint_id: str, capacity: int) -> int | None:
        """How many scheduler-placed tasks the endpoint may hold without a result (running and
        queued on the agent); None: no cap, it takes what its credit allows."""
        return None

    def endpoint_starving(self, endpoint_id: str, now: float) -> None:
        """The endpoint could take more work and the hub has none queued for it."""

    def tasks_expired(self, task_ids: Sequence[str], now: float) -> None:
        """These tasks passed their expiry without running; each got an error result."""
