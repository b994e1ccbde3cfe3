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


class ArrivalSpec(_Model):
    """How submissions arrive. A submission is one client call with ``batch_size`` tasks
    (``Executor.map`` batches), placed together by the scheduler.

    * ``poisson``: submissions at ``rate_per_s`` (tasks/s = rate x batch_size);
    * ``bursty``: every ``burst_every_s`` a burst of ``burst_size`` tasks in one submission
      (a federated-learning round), plus a Poisson background of ``rate_per_s`` submissions;
    * ``batch``: everything at time 0, in submissions of ``batch_size``.
    """

    kind: Literal["poisson", "bursty", "batch"]
    rate_per_s: float = Field(default=1.0, ge=0)
    batch_size: int = Field(default=1, ge=1)
    burst_every_s: float = Field(default=600.0, gt=0)
    burst_size: int = Field(default=100, ge=1)
    burst_mix: dict[str, float] | None = None  # function mix of bursts (default: workload mix)

    @model_validator(mode="after")
    def _rate(self) -> "ArrivalSpec":
        if self.kind == "poisson" and self.rate_per_s <= 0:
            raise ValueError("poisson arrivals need rate_per_s > 0")
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


class HubSpec(_Model):
    dead_after_s: float = Field(default=75.0, gt=0, description="watchdog: silent this long = dead")
    prefetch: int = Field(default=1, ge=0, description="tasks an agent fetches beyond its workers")
    history_days: float = Field(default=0.0, ge=0, description="outage history the hub saw before the workload")
    start_time: str = "08:00"
    link_sample_every: int = Field(default=8, ge=1, description="feed every n-th result's transfer time to the scheduler")

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
