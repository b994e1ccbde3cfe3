"""Plain data the scheduler works on: tasks, endpoints, predictions, placements, decisions.

These are deliberately small, dependency-free dataclasses so that the hub can map its database
rows onto them and the discrete-event simulator can build millions of them cheaply. Everything
that is learned over time (profiles) lives in :mod:`scheduler.profiles`; everything the
scheduler tracks about work in flight lives in :mod:`scheduler.fleet`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EMPTY: frozenset[str] = frozenset()


class NoEligibleEndpoint(LookupError):
    """Raised when no registered endpoint satisfies a task's constraints.

    The hub should reject the submission (or hold the task) with this message: it names the
    task, its constraints and how many endpoints were considered, which is what a user needs to
    fix the request.
    """

    def __init__(self, task: "TaskInfo", considered: int, detail: str = "") -> None:
        self.task_id = task.task_id
        self.constraints = task.constraints
        self.considered = considered
        scope = f"all {considered} endpoints"
        if task.endpoints is not None:
            scope = f"the {len(task.endpoints)} listed endpoints"
        msg = (
            f"no eligible endpoint for task {task.task_id!r} (function {task.function_id!r}): "
            f"constraints {task.constraints.describe()} rule out {scope}"
        )
        if detail:
            msg += f"; {detail}"
        super().__init__(msg)


@dataclass(frozen=True, slots=True)
class Constraints:
    """What a task needs from an endpoint. Endpoints that do not satisfy them are never chosen.

    Hashable (the fleet caches eligible groups per constraint set); the hash is computed once.
    """

    tags: frozenset[str] = EMPTY
    gpu: bool = False
    min_memory_mb: int = 0
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tags, frozenset):
            object.__setattr__(self, "tags", frozenset(self.tags))
        object.__setattr__(self, "_hash", hash((self.tags, self.gpu, self.min_memory_mb)))

    def __hash__(self) -> int:
        return self._hash

    def allows(self, ep: "EndpointState") -> bool:
        return (
            (not self.gpu or ep.gpu)
            and ep.memory_mb >= self.min_memory_mb
            and self.tags <= ep.tags
        )

    @property
    def trivial(self) -> bool:
        return not self.tags and not self.gpu and self.min_memory_mb <= 0

    def describe(self) -> str:
        parts = []
        if self.tags:
            parts.append("tags=" + ",".join(sorted(self.tags)))
        if self.gpu:
            parts.append("gpu")
        if self.min_memory_mb:
            parts.append(f"memory>={self.min_memory_mb}MB")
        return "{" + " ".join(parts) + "}" if parts else "{}"

    def to_dict(self) -> dict[str, Any]:
        return {"tags": sorted(self.tags), "gpu": self.gpu, "min_memory_mb": self.min_memory_mb}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Constraints":
        if not d:
            return NO_CONSTRAINTS
        return cls(frozenset(d.get("tags", ())), bool(d.get("gpu", False)), int(d.get("min_memory_mb", 0)))


NO_CONSTRAINTS = Constraints()


@dataclass(slots=True)
class TaskInfo:
    """One task to place. ``result_bytes`` is an optional hint; otherwise it is learned per function.

    ``task_id`` is only used as a key: the hub's string ids work, and so does any hashable
    (the simulator uses ints).
    """

    task_id: str
    function_id: str
    payload_bytes: int = 0
    constraints: Constraints = NO_CONSTRAINTS
    result_bytes: int | None = None
    #: Only these endpoints may run the task (a user's explicit list); ``None``: any endpoint
    #: the constraints allow. Kept out of :class:`Constraints` on purpose: constraints are
    #: static attributes shared by whole groups of endpoints (the search index prunes by
    #: group), whereas an id list cuts across groups and is checked per member.
    endpoints: frozenset[str] | None = None
    #: The task's environment spec id (mesh_agent/protocol/environment.py) and what building it costs an
    #: endpoint that lacks it (scheduler/environments.py); None: the agent's own Python.
    env: str | None = None
    env_cost: Any = None
    #: Where the task's inputs already lie, ``(endpoint_id, bytes)`` each (scheduler/locality.py):
    #: bytes an endpoint lacks are added to its transfer-in time. Empty: placed as before.
    inputs: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True, eq=False)
class EndpointState:
    """The hub's current view of one endpoint (from registration and heartbeats).

    ``speed`` is a relative CPU score (1.0 = a Raspberry Pi Zero 2 W core, say) reported at
    registration; it only matters for functions never profiled on this hardware, where it
    scales the function's known runtime elsewhere. ``online`` is the hub's belief (False once
    the endpoint has been silent past the dead-after timeout). ``queued``/``running`` are what
    the agent last reported; work the scheduler placed itself is tracked exactly in the fleet's
    ledger, so these only add backlog the ledger does not know about.
    """

    endpoint_id: str
    workers: int = 1
    hardware: str = "generic"
    tags: frozenset[str] = EMPTY
    gpu: bool = False
    memory_mb: int = 0
    speed: float = 1.0
    online: bool = True
    queued: int = 0
    running: int = 0
    warm_functions: frozenset[str] = EMPTY
    #: environment spec ids this endpoint can start without a build (its heartbeats' ``envs``)
    envs: frozenset[str] = EMPTY
    #: on a metered link (paid per byte): fetching an environment costs more than its seconds
    metered: bool = False
    last_seen: float | None = None

    def signature(self) -> tuple:
        """Static attributes that decide eligibility; endpoints sharing it form one group."""
        return (self.hardware, self.tags, self.gpu, self.memory_mb)


@dataclass(slots=True)
class Prediction:
    """Predicted completion time of one task on one endpoint, split into its parts (seconds).

    ``total`` = transfer_in + queue + cold + run + transfer_out + outage. ``source`` says where
    the runtime came from: "endpoint" (this endpoint's own profile), "group" (its hardware
    group), "function" (the function's speed-normalised mean elsewhere), "prior" (nothing known)
    or "oracle". ``exploration`` is True when the estimate is not yet trusted (its hardware
    group has never run this function).
    """

    endpoint_id: str
    total: float
    transfer_in: float = 0.0
    queue: float = 0.0
    cold: float = 0.0
    run: float = 0.0
    transfer_out: float = 0.0
    outage: float = 0.0
    source: str = "prior"
    exploration: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoint_id": self.endpoint_id,
            "total": self.total,
            "transfer_in": self.transfer_in,
            "queue": self.queue,
            "cold": self.cold,
            "run": self.run,
            "transfer_out": self.transfer_out,
            "outage": self.outage,
            "source": self.source,
            "exploration": self.exploration,
        }


PredictionLike = Prediction | tuple


def as_prediction(p: PredictionLike | None) -> Prediction | None:
    """Policies may record predictions as plain tuples in :class:`Prediction` field order
    (cheap on the hot path); this turns either form into a :class:`Prediction`."""
    if p is None or isinstance(p, Prediction):
        return p
    return Prediction(*p)


@dataclass(slots=True)
class Placement:
    """Where one task goes and why.

    ``predicted`` is the prediction for the chosen endpoint; ``compared`` the predictions the
    policy compared, best first (for delta with pruning: the best endpoint of each of the
    best groups it looked at, at most ``max_compared``, winner included); ``pruned`` counts the endpoints it proved could not
    win without evaluating them. ``reason`` is a short text for the console ("smallest
    predicted completion", "probe: first run of f on pi4", ...). Policies may store the
    predictions as tuples (``raw_predicted``/``raw_compared``, in :class:`Prediction` field
    order); the properties materialise them on access.
    """

    task_id: str
    function_id: str
    endpoint_id: str
    policy: str
    placed_at: float
    raw_predicted: PredictionLike | None = None
    raw_compared: tuple = ()
    pruned: int = 0
    reason: str = ""
    exploration: bool = False
    payload_bytes: int = 0
    env: str | None = None  # the task's environment spec id (failures block the function in it only)

    @property
    def predicted(self) -> Prediction | None:
        return as_prediction(self.raw_predicted)

    @property
    def predicted_total(self) -> float | None:
        p = self.raw_predicted
        if p is None:
            return None
        return p.total if isinstance(p, Prediction) else p[1]

    @property
    def compared(self) -> tuple[Prediction, ...]:
        preds = [as_prediction(p) for p in self.raw_compared]
        preds.sort(key=lambda x: x.total)  # type: ignore[union-attr]
        return tuple(preds)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        pred = self.predicted
        return {
            "task_id": self.task_id,
            "payload_bytes": self.payload_bytes,
            "function_id": self.function_id,
            "endpoint_id": self.endpoint_id,
            "policy": self.policy,
            "placed_at": self.placed_at,
            "predicted": pred.to_dict() if pred else None,
            "compared": [p.to_dict() for p in self.compared],
            "pruned": self.pruned,
            "reason": self.reason,
            "exploration": self.exploration,
        }


@dataclass(slots=True)
class Decision:
    """A placement plus what actually happened, for "predicted vs actual" in the console."""

    placement: Placement
    completed_at: float | None = None
    actual_s: float | None = None  # placement -> result at the hub (same span as predicted.total)
    runtime_s: float | None = None  # the function body's own run time, as the agent measured it
    ok: bool | None = None
    requeued_at: float | None = None  # set when the hub took the task back instead

    @property
    def error_s(self) -> float | None:
        """Actual minus predicted completion time (positive: slower than predicted)."""
        p = self.placement.predicted_total
        if self.actual_s is None or p is None:
            return None
        return self.actual_s - p

    def to_dict(self) -> dict[str, Any]:
        d = self.placement.to_dict()
        d.update(
            completed_at=self.completed_at,
            actual_s=self.actual_s,
            runtime_s=self.runtime_s,
            ok=self.ok,
            requeued_at=self.requeued_at,
            error_s=self.error_s,
        )
        return d
