"""Scenario files for the discrete-event simulator (YAML, validated with pydantic).

Every model forbids unknown fields, so a typo (``mean_upp_s``) is an error that names the
file, the field path and what was expected, never a silently ignored setting. A scenario is
fully determined by its contents and ``seed``: the same file gives the same workload, the same
outage timeline and (for a given policy) the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Outage models are shared with the emulation mode (sim/outages.py); re-exported here.
from sim._scenario_io import ScenarioError, format_errors, read_mapping
from sim.outages import MarkovOutage, OutageSpec, ScheduledOutage, parse_hhmm  # noqa: F401

from .hardware import CATALOG, KINDS, HardwareClass


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EndpointGroupSpec(_Model):
    hardware: str
    count: int = Field(ge=1)
    name: str | None = None  # endpoint ids are f"{name}-{i}"; default: the hardware name
    tags: list[str] = []
    region: str | None = None
    outage: OutageSpec | None = None
    speed_jitter: float = Field(default=0.05, ge=0, le=1)  # per-endpoint lognormal sigma
    slow_fraction: float = Field(default=0.0, ge=0, le=1)  # share of throttled endpoints
    slow_factor: float = Field(default=0.6, gt=0, le=1)  # their speed multiplier
    link_jitter: float = Field(default=0.2, ge=0, le=2)  # per-endpoint lognormal sigma of RTT/bw
    # The agent's clock against the hub's, left after it set its clock from its welcome: its
    # frames' send stamps are this much late (negative: early). Only timings see it.
    clock_skew_s: float = Field(default=0.0, ge=-3600, le=3600)


class RegionSpec(_Model):
    """Endpoints sharing a region go down together (a valley's LTE mast, a farm's power)."""

    name: str
    outage: OutageSpec


class HardwareOverride(_Model):
    workers: int | None = Field(default=None, ge=1)
    speed: dict[str, float] | None = None
    benchmark: float | None = Field(default=None, gt=0)
    rtt_s: float | None = Field(default=None, ge=0)
    bandwidth_bps: float | None = Field(default=None, gt=0)
    cold_start_s: float | None = Field(default=None, ge=0)
    memory_mb: int | None = Field(default=None, ge=0)
    warm_slots: int | None = Field(default=None, ge=1)
    gpu: bool | None = None
    tags: list[str] | None = None


class RequiresSpec(_Model):
    tags: list[str] = []
    gpu: bool = False
    min_memory_mb: int = Field(default=0, ge=0)


class FunctionSpec(_Model):
    id: str
    kind: Literal["numeric", "train", "io"]
    base_s: float = Field(gt=0, description="runtime on one Pi Zero 2 W worker")
    cv: float = Field(default=0.2, ge=0, le=3, description="per-call lognormal spread")
    payload_kb: float = Field(default=10.0, ge=0)
    payload_cv: float = Field(default=0.5, ge=0, le=3)
    per_mb_s: float = Field(default=0.0, ge=0, description="extra Pi-Zero seconds per MB of payload")
    result_kb: float = Field(default=1.0, ge=0)
    cold_factor: float = Field(default=1.0, ge=0, description="x the class cold start (heavy imports)")
    requires: RequiresSpec | None = None


class PhaseSpec(_Model):
    """One wave of a ``phases`` workload: ``tasks`` submitted at ``at_s`` (seconds after the
    workload starts) in submissions of ``batch_size``, functions drawn from ``mix`` (default:
    the workload's mix). The report gives each phase its own makespan and lower bound."""

    name: str = ""
    at_s: float = Field(ge=0)
    tasks: int = Field(ge=1)
    batch_size: int = Field(default=1_000_000, ge=1)
    mix: dict[str, float] | None = None


class ArrivalSpec(_Model):
    """How submissions arrive. A submission is one client call with ``batch_size`` tasks
    (``Executor.map`` batches), placed together by the scheduler.

    * ``poisson``: submissions at ``rate_per_s`` (tasks/s = rate x batch_size);
    * ``bursty``: every ``burst_every_s`` a burst of ``burst_size`` tasks in one submission
      (a federated-learning round), plus a Poisson background of ``rate_per_s`` submissions;
    * ``batch``: everything at time 0, in submissions of ``batch_size``;
    * ``phases``: the listed waves, each at its own time (a flood, then waves of work).
    """

    kind: Literal["poisson", "bursty", "batch", "phases"]
    rate_per_s: float = Field(default=1.0, ge=0)
    batch_size: int = Field(default=1, ge=1)
    burst_every_s: float = Field(default=600.0, gt=0)
    burst_size: int = Field(default=100, ge=1)
    burst_mix: dict[str, float] | None = None  # function mix of bursts (default: workload mix)
    phases: list[PhaseSpec] = []

    @model_validator(mode="after")
    def _rate(self) -> "ArrivalSpec":
        if self.kind == "poisson" and self.rate_per_s <= 0:
            raise ValueError("poisson arrivals need rate_per_s > 0")
        if self.kind == "phases":
            if not self.phases:
                raise ValueError("phases arrivals need at least one phase")
            if any(b.at_s < a.at_s for a, b in zip(self.phases, self.phases[1:])):
                raise ValueError("phases must be listed in the order of their at_s")
        elif self.phases:
            raise ValueError("phases is only for kind: phases")
        return self


class WorkloadSpec(_Model):
    tasks: int = Field(ge=1)
    arrival: ArrivalSpec
    mix: dict[str, float]

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        if not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0:
            raise ValueError("mix needs at least one function with a positive weight")
        return v


class LagSpec(_Model):
    """Hub-side processing lag that grows with load: a frame the hub's link has read waits
    ``base_s + per_task_s * (tasks accepted and not yet completed)`` (at most ``max_s``) before
    the hub handles it, as in a busy event loop. Results are stored that much later; a hub that
    times frames after the wait (``link_timing: one-way``) reads it as link latency; a welcome
    stamped after it sets the agent's clock half of it wrong. ``echo_share``: the share of echoed
    round trips whose hub-side stamp still carries the lag of the moment (a send stamp taken
    before the frame left a busy loop)."""

    base_s: float = Field(default=0.0, ge=0)
    per_task_s: float = Field(default=0.0, ge=0)
    max_s: float = Field(default=5.0, ge=0)
    echo_share: float = Field(default=0.5, ge=0, le=1)


class RestartSpec(_Model):
    """An agent restart (SIGKILL, back after ``down_s``), ``at_s`` seconds after the workload
    starts: running tasks run again, warm workers are gone, and its hello gets a new welcome."""

    endpoint: str
    at_s: float = Field(ge=0)
    down_s: float = Field(default=1.0, gt=0)


class HubSpec(_Model):
    dead_after_s: float = Field(default=75.0, gt=0, description="watchdog: silent this long = dead")
    prefetch: int = Field(default=1, ge=0, description="tasks an agent fetches beyond its workers")
    history_days: float = Field(default=0.0, ge=0, description="outage history the hub saw before the workload")
    start_time: str = "08:00"
    link_sample_every: int = Field(default=8, ge=1, description="feed every n-th result's transfer time to the scheduler")
    # How the hub learns link latency. ``ideal``: the true round trip at registration and true
    # one-way times (no lag, no skew: the model before issue 27). ``one-way``: what the hub did
    # before issue 27: ``handled - agent's send stamp`` (after the lag, on the welcome-set
    # clock; below 0 read as 0, no round trips). ``echo``: echoed round trips stamped at socket
    # read (docs/scheduler.md "Link timing"), one-way times on the echo's clock offset; with a
    # scheduler that has no ``link_echo`` (the code before issue 27) it falls back to one-way.
    link_timing: Literal["ideal", "one-way", "echo"] = "ideal"
    lag: LagSpec | None = None

    @field_validator("start_time")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        parse_hhmm(v)
        return v


POLICY_NAMES = (
    "random", "round-robin", "least-loaded", "warming-aware", "fastest-endpoint",
    "delta", "delta-outage-aware", "oracle",
)


class Scenario(_Model):
    name: str
    description: str = ""
    seed: int = 0
    hub: HubSpec = HubSpec()
    hardware: dict[str, HardwareOverride] = {}
    endpoints: list[EndpointGroupSpec] = Field(min_length=1)
    regions: list[RegionSpec] = []
    functions: list[FunctionSpec] = Field(min_length=1)
    workload: WorkloadSpec
    restarts: list[RestartSpec] = []
    policies: list[str] = list(POLICY_NAMES)

    @model_validator(mode="after")
    def _refs(self) -> "Scenario":
        known_hw = set(CATALOG) | set(self.hardware)
        for i, g in enumerate(self.endpoints):
            if g.hardware not in known_hw:
                raise ValueError(f"endpoints[{i}].hardware {g.hardware!r} is not one of {sorted(known_hw)}")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError("region names must be unique")
        fids = [f.id for f in self.functions]
        if len(set(fids)) != len(fids):
            raise ValueError("function ids must be unique")
        for k in self.workload.mix:
            if k not in fids:
                raise ValueError(f"workload.mix names unknown function {k!r} (known: {fids})")
        for k in self.workload.arrival.burst_mix or {}:
            if k not in fids:
                raise ValueError(f"workload.arrival.burst_mix names unknown function {k!r}")
        arr = self.workload.arrival
        if arr.kind == "phases":
            for i, ph in enumerate(arr.phases):
                for k, w in (ph.mix or {}).items():
                    if k not in fids:
                        raise ValueError(f"workload.arrival.phases[{i}].mix names unknown function {k!r}")
                    if w < 0:
                        raise ValueError(f"workload.arrival.phases[{i}].mix: negative weight for {k!r}")
            if sum(ph.tasks for ph in arr.phases) != self.workload.tasks:
                raise ValueError("workload.tasks must equal the sum of the phases' tasks")
        ids = {f"{g.name or g.hardware}-{k}" for g in self.endpoints for k in range(g.count)}
        for i, r in enumerate(self.restarts):
            if r.endpoint not in ids:
                raise ValueError(f"restarts[{i}].endpoint {r.endpoint!r} is not an endpoint id (ids are <group name>-<n>)")
        for name, over in self.hardware.items():
            for kind in (over.speed or {}):
                if kind not in KINDS:
                    raise ValueError(f"hardware.{name}.speed: unknown function kind {kind!r} (known: {KINDS})")
            if name not in CATALOG and (over.workers is None or over.speed is None):
                raise ValueError(f"hardware.{name}: a new class needs at least workers and speed")
        for p in self.policies:
            if p not in POLICY_NAMES:
                raise ValueError(f"unknown policy {p!r} (known: {list(POLICY_NAMES)})")
        return self

    def hardware_class(self, name: str) -> HardwareClass:
        over = self.hardware.get(name)
        base = CATALOG.get(name)
        if over is None:
            assert base is not None
            return base
        fields = {k: v for k, v in over.model_dump().items() if v is not None}
        if base is None:
            base = HardwareClass(name, workers=1, speed={k: 1.0 for k in KINDS}, benchmark=1.0,
                                 rtt_s=0.05, bandwidth_bps=1e6, cold_start_s=2.0, memory_mb=1024,
                                 warm_slots=2)
        return base.with_overrides(fields)

    @property
    def n_endpoints(self) -> int:
        return sum(g.count for g in self.endpoints)


def _format_errors(err: ValidationError) -> str:
    return format_errors(err, "sim/des/scenario.py")


def load_scenario(source: str | Path | dict | Scenario) -> Scenario:
    """Load and validate a scenario from a YAML path, a dict, or pass a model through."""
    if isinstance(source, Scenario):
        return source
    data, where = read_mapping(source)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{where}: invalid scenario:\n{_format_errors(exc)}") from None
