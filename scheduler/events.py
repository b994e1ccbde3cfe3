"""Observation events, for callers that prefer one ``observe(event)`` entry point.

:class:`scheduler.core.Scheduler` has one method per event as well (``task_completed``,
``heartbeat``, ...), which is what the hub and the simulator call on their hot paths; these
records are the same calls as data, handy for logs, queues and tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TaskCompleted:
    """A result reached the hub. ``runtime_s``: the function body's run time on the endpoint;
    ``cold_start_s``: extra time to start a cold worker (0 if warm). ``error`` is the remote
    exception type name for a failed task (e.g. "ModuleNotFoundError")."""

    task_id: str
    now: float
    runtime_s: float
    cold_start_s: float = 0.0
    result_bytes: int | None = None
    ok: bool = True
    error: str | None = None
    warm_functions: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    endpoint_id: str
    now: float
    queued: int | None = None
    running: int | None = None
    warm_functions: frozenset[str] | None = None
    workers: int | None = None
    rtt_s: float | None = None


@dataclass(frozen=True, slots=True)
class EndpointOffline:
    """The hub's watchdog declared the endpoint dead; it was last heard from at ``since``."""

    endpoint_id: str
    now: float
    since: float | None = None


@dataclass(frozen=True, slots=True)
class MessageTiming:
    """A message of ``nbytes`` took ``seconds`` one way between the hub and the endpoint."""

    endpoint_id: str
    nbytes: int
    seconds: float
    now: float


@dataclass(frozen=True, slots=True)
class TaskRequeued:
    """The hub took a placed task back (its endpoint died before fetching it, or it was
    cancelled); it is no longer in flight on that endpoint."""

    task_id: str
    now: float


Event = TaskCompleted | Heartbeat | EndpointOffline | MessageTiming | TaskRequeued
