"""Emulation scenarios (YAML, validated with pydantic): who runs, how their links fail, which
processes get killed, and what workload runs through it all.

Every model forbids unknown fields, so a typo is an error naming the file and the field path.
A scenario plus its ``seed`` fixes the whole fault schedule and the workload: two runs of one
file inject the same faults at the same offsets and submit the same tasks.

Times are wall-clock seconds of the emulation, except scheduled outage windows, which are times
of day on a simulated clock where one day lasts ``clock.day_s`` wall seconds (a solar Pi "asleep
19:00-07:00" is down half of every ``day_s``). Outage models are the ones the discrete-event mode
uses (:mod:`sim.outages`).

``reduced`` holds a smaller variant of the same scenario for the test suite: a mapping merged
over the scenario (mappings recursively, the ``agents`` and ``regions`` lists by ``name``), plus
``agents_per_group`` to cap every group's count.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sim._scenario_io import ScenarioError, format_errors, read_mapping
from sim.outages import OutageSpec, parse_hhmm

__all__ = [
    "EmulationScenario", "ScenarioError", "load_scenario", "FUNCTIONS", "AgentGroup", "LinkSpec",
    "ServiceRestarts", "AgentKills", "FLSpec",
]

#: The workload's function catalog (bodies in sim/emulate/functions.py).
FUNCTIONS = ("echo", "sleep", "cpu", "fail")

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError(f"{v!r}: names are 1-31 characters of a-z, 0-9 and '-', starting with a letter")
    return v


CutSpec = Literal["reset", "blackhole", "mixed"]


class LinkSpec(_Model):
    """The link between an agent and the hub side, as its proxy shapes it."""

    latency_ms: float = Field(0.0, ge=0, le=10_000, description="one-way delay")
    jitter_ms: float = Field(0.0, ge=0, le=10_000, description="uniform +/- around latency_ms")
    bandwidth_kbps: float | None = Field(None, gt=0, description="per direction, shared by the link's connections")
    cut: CutSpec = Field("reset", description="how an outage looks: reset connections, a black hole, or a seeded mix")


class AgentGroup(_Model):
    name: str
    count: int = Field(ge=1, le=200)
    transport: Literal["mqtt", "zmq"] = "mqtt"
    workers: int = Field(1, ge=1, le=16)
    prefetch: int = Field(8, ge=0, le=10_000)
    region: str | None = None
    link: LinkSpec = LinkSpec()
    outage: OutageSpec | None = None
    mqtt_keepalive_s: int = Field(10, ge=5, le=3600, description="MQTT keepalive: how fast a black hole is noticed")
    device: str | None = Field(None, description="device profile (sim/emulate/devices.py), e.g. pi-zero-2w: cgroup CPU/memory limits, slow fsync")
    site_hold: int | None = Field(None, ge=0, le=100_000, description="this group's agents are site gateways (mesh-agent gateway, "
                                  "docs/sites.md) that hold this many tasks for their devices; their link is the site's uplink")
    gateway: str | None = Field(None, description="this group's agents sit behind the site gateway of this group (one gateway "
                                "agent, with site_hold); their link is the LAN to it")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _name(v)

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is not None:
            from .devices import profile

            profile(v)  # UnknownDevice (a ValueError) names the known profiles
        return v


Selection = Literal["strategy", "predicted", "random"]


class FLSpec(_Model):
    """A federated-learning run (FedAvg, the demo's MLP on non-IID digits) on the agents of
    ``groups``, driven by :class:`fl.Federation` alongside the task workload from ``start_s``.

    ``selections`` with more than one entry compares client-selection policies: one run per
    entry, one after the other on the same fleet (same rounds, seed and initial model), each
    timed to ``target_accuracy`` (sim/emulate/flrun.py)."""

    groups: list[str] | None = Field(None, description="agent groups that are FL clients (default: all MQTT/ZeroMQ agents)")
    rounds: int = Field(3, ge=1, le=1000)
    local_epochs: int = Field(1, ge=1, le=100)
    deadline_s: float = Field(30.0, gt=0, le=3600, description="round deadline")
    min_clients: int | None = Field(None, ge=1, description="fewest updates a round needs (default: every client, "
                                    "or clients_per_round when set)")
    max_extensions: int = Field(2, ge=0, le=100, description="deadline extensions while too few updates arrived")
    alpha: float = Field(0.5, gt=0, description="Dirichlet alpha of the non-IID split")
    start_s: float = Field(0.0, ge=0, description="seconds after the workload starts")
    selections: list[Selection] = Field(["strategy"], min_length=1, max_length=3,
                                        description="client selection per run, in order (Federation(selection=...))")
    clients_per_round: int | None = Field(None, ge=1, description="seats per round for predicted/random selection")
    fairness_rounds: int = Field(5, ge=1, le=1000, description="predicted selection: ask a client at least every this many rounds")
    target_accuracy: float = Field(0.9, gt=0, le=1, description="test accuracy each run is timed to")

    @field_validator("selections")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("selections must not repeat a policy")
        return v

    @model_validator(mode="after")
    def _seats(self) -> "FLSpec":
        if any(s != "strategy" for s in self.selections) and self.clients_per_round is None:
            raise ValueError("predicted/random selections need clients_per_round")
        if self.min_clients is not None and self.clients_per_round is not None and self.min_clients > self.clients_per_round:
            raise ValueError(f"min_clients ({self.min_clients}) cannot exceed clients_per_round ({self.clients_per_round})")
        return self


class RegionSpec(_Model):
    """A group of agents behind one cell tower: one outage process takes all of them down."""

    name: str
    outage: OutageSpec
    cut: CutSpec = "reset"

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _name(v)


class AgentKills(_Model):
    """Power cuts: SIGKILL of an agent (and its workers) at random times, restart after a while."""

    mean_interval_s: float = Field(gt=0, description="fleet-wide: mean seconds between two kills")
    down_s: tuple[float, float] = Field((1.0, 5.0), description="restart after a uniform draw from [lo, hi]")
    groups: list[str] | None = Field(None, description="only agents of these groups (default: all)")

    @field_validator("down_s")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] <= v[1]:
            raise ValueError("down_s must be [lo, hi] with 0 <= lo <= hi")
        return v


class ServiceRestarts(_Model):
    """Restarts of the hub or the broker at fixed offsets and/or every ``every_s`` seconds."""

    at_s: list[float] = []
    every_s: float | None = Field(None, gt=0)
    down_s: float = Field(2.0, ge=0, le=600, description="how long it stays down")
    signal: Literal["term", "kill", "mixed"] = Field("kill", description="kill = crash (SIGKILL), term = clean stop, mixed = a seeded choice per restart")

    @field_validator("at_s")
    @classmethod
    def _nonneg(cls, v: list[float]) -> list[float]:
        if any(t < 0 for t in v):
            raise ValueError("restart times must be >= 0")
        return sorted(v)


class GatewayMove(_Model):
    """A device moves to another site's gateway at ``at_s`` (docs/sites.md "Device moves"; sim/emulate/sites.py)."""

    at_s: float = Field(ge=0, description="seconds after the run starts")
    agent: str = Field(description="the device agent, e.g. farma-1 (group name and index)")
    to: str = Field(description="the gateway group it moves to")


class FaultsSpec(_Model):
    agent_kills: AgentKills | None = None
    gateway_moves: list[GatewayMove] = []
    hub_restarts: ServiceRestarts | list[ServiceRestarts] | None = None
    broker_restarts: ServiceRestarts | list[ServiceRestarts] | None = None


class WorkloadSpec(_Model):
    """Tasks arrive as a Poisson process over the run (``tasks`` of them), each to a uniformly
    chosen agent, with a function drawn from ``mix`` and a log-uniform payload size."""

    tasks: int = Field(ge=1, le=1_000_000)
    mix: dict[str, float]
    payload_bytes: tuple[int, int] = Field((16, 4096), description="log-uniform [lo, hi]")
    sleep_ms: tuple[float, float] = Field((1.0, 20.0), description="uniform run time of 'sleep' tasks")
    cpu_n: tuple[int, int] = Field((1000, 50_000), description="loop length of 'cpu' tasks")
    batch_max: int = Field(500, ge=1, le=50_000, description="most tasks per SDK batch submit")
    ttl_s: float = Field(86400.0, gt=0, description="task expiry (well past the run: nothing may expire)")

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if k not in FUNCTIONS]
        if bad:
            raise ValueError(f"unknown function {bad[0]!r} in mix (known: {', '.join(FUNCTIONS)})")
        if not v or any(w < 0 for w in v.values()) or sum(v.values()) <= 0:
            raise ValueError("mix needs at least one function with a positive weight")
        return v

    @field_validator("payload_bytes")
    @classmethod
    def _payload(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1] <= 4 * 2**20:
            raise ValueError("payload_bytes must be [lo, hi] with 1 <= lo <= hi <= 4 MiB")
        return v

    @field_validator("sleep_ms", "cpu_n")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] <= v[1]:
            raise ValueError("must be [lo, hi] with 0 <= lo <= hi")
        return v


class ClockSpec(_Model):
    """The simulated day that scheduled outages follow."""

    day_s: float = Field(120.0, gt=0, description="wall seconds per simulated day")
    start: str = Field("12:00", description="simulated time of day when the run starts")

    @field_validator("start")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        parse_hhmm(v)
        return v


class HubSpec(_Model):
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    lost_after_s: float = Field(4.0, gt=0, le=3600)
    lease_s: float = Field(8.0, gt=0, le=3600)


class ExpectSpec(_Model):
    """What the scenario claims to exercise; the run fails if it did not happen."""

    min_outage_share: float | None = Field(None, ge=0, le=1, description="realized link-down share of agent-time")
    min_tasks: int | None = Field(None, ge=0)


class EmulationScenario(_Model):
    name: str
    description: str = ""
    seed: int = 0
    duration_s: float = Field(gt=0, le=7 * 86400, description="faults and submissions happen in [0, duration_s)")
    drain_timeout_s: float = Field(180.0, gt=0, description="after healing, how long to wait for every result")
    clock: ClockSpec = ClockSpec()
    hub: HubSpec = HubSpec()
    agents: list[AgentGroup] = Field(min_length=1)
    regions: list[RegionSpec] = []
    faults: FaultsSpec = FaultsSpec()
    workload: WorkloadSpec
    fl: FLSpec | None = None
    expect: ExpectSpec = ExpectSpec()
    compare_without_gateways: bool = Field(False, description="run the same fleet, schedule and workload again without "
                                           "site gateways and compare uplink bytes and tasks done during uplink outages")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return _name(v)

    @model_validator(mode="after")
    def _refs(self) -> "EmulationScenario":
        groups = [g.name for g in self.agents]
        if len(set(groups)) != len(groups):
            raise ValueError("agent group names must be unique")
        regions = [r.name for r in self.regions]
        if len(set(regions)) != len(regions):
            raise ValueError("region names must be unique")
        for i, g in enumerate(self.agents):
            if g.region is not None and g.region not in regions:
                raise ValueError(f"agents[{i}].region {g.region!r} is not a region (known: {regions})")
        if self.faults.agent_kills and self.faults.agent_kills.groups:
            for gname in self.faults.agent_kills.groups:
                if gname not in groups:
                    raise ValueError(f"faults.agent_kills.groups names unknown group {gname!r} (known: {groups})")
        by_name = {g.name: g for g in self.agents}
        for i, g in enumerate(self.agents):
            if g.gateway is None:
                continue
            gw = by_name.get(g.gateway)
            if gw is None or gw.site_hold is None or gw.count != 1 or gw.transport != "mqtt":
                raise ValueError(f"agents[{i}].gateway {g.gateway!r} must name a group of one MQTT agent with site_hold")
            if g.transport != "mqtt" or g.site_hold is not None:
                raise ValueError(f"agents[{i}]: a device behind a gateway is an MQTT agent, not a gateway itself")
        for i, m in enumerate(self.faults.gateway_moves):
            grp, _, idx = m.agent.rpartition("-")
            g = by_name.get(grp)
            if g is None or g.gateway is None or not idx.isdigit() or int(idx) >= g.count:
                raise ValueError(f"faults.gateway_moves[{i}].agent {m.agent!r} is not a device behind a gateway")
            to = by_name.get(m.to)
            if to is None or to.site_hold is None:
                raise ValueError(f"faults.gateway_moves[{i}].to {m.to!r} is not a gateway group (one with site_hold)")
        if self.compare_without_gateways and not any(g.site_hold is not None for g in self.agents):
            raise ValueError("compare_without_gateways needs at least one gateway group (site_hold)")
        if self.fl is not None and self.fl.groups:
            for gname in self.fl.groups:
                if gname not in groups:
                    raise ValueError(f"fl.groups names unknown group {gname!r} (known: {groups})")
        if self.n_agents > 200:
            raise ValueError(f"{self.n_agents} agents: at most 200 real agent processes per run")
        return self

    @property
    def n_agents(self) -> int:
        return sum(g.count for g in self.agents)


def _format_errors(err: ValidationError) -> str:
    return format_errors(err, "sim/emulate/scenario.py")


def _merge(base: Any, over: Any, where: str) -> Any:
    """Deep merge for ``reduced``: mappings recursively, lists of named mappings by name;
    anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v, f"{where}.{k}") if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(over, dict) and base and all(isinstance(i, dict) and "name" in i for i in base):
        by_name = {item["name"]: item for item in base}
        for k in over:
            if k not in by_name:
                raise ScenarioError(f"reduced{where}: no item named {k!r} to override (known: {sorted(map(str, by_name))})")
        return [_merge(item, over[item["name"]], f"{where}.{item['name']}") if item.get("name") in over else item for item in base]
    return copy.deepcopy(over)


def _reduce(data: dict[str, Any], where: str) -> dict[str, Any]:
    red = data.get("reduced")
    if red is None:
        raise ScenarioError(f"{where}: this scenario has no 'reduced' variant")
    if not isinstance(red, dict):
        raise ScenarioError(f"{where}: 'reduced' must be a mapping")
    red = dict(red)
    cap = red.pop("agents_per_group", None)
    out = _merge({k: v for k, v in data.items() if k != "reduced"}, red, "")
    if cap is not None:
        if not isinstance(cap, int) or cap < 1:
            raise ScenarioError(f"{where}: reduced.agents_per_group must be a positive integer")
        out["agents"] = [{**g, "count": min(int(g.get("count", 1)), cap)} if isinstance(g, dict) else g for g in out.get("agents", [])]
    return out


def load_scenario(source: str | Path | dict[str, Any] | EmulationScenario, *, reduced: bool = False) -> EmulationScenario:
    """Load and validate an emulation scenario from a YAML path or a dict (``reduced``: its
    test-suite variant). Raises :class:`ScenarioError` with every problem found."""
    if isinstance(source, EmulationScenario):
        return source
    data, where = read_mapping(source)
    if "endpoints" in data and "functions" in data and "agents" not in data:
        raise ScenarioError(f"{where}: this is a discrete-event scenario; run it with `mesh-sim des {where}`")
    if reduced:
        data = _reduce(data, where)
    else:
        data = {k: v for k, v in data.items() if k != "reduced"}
    try:
        return EmulationScenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{where}: invalid scenario{' (reduced variant)' if reduced else ''}:\n{_format_errors(exc)}") from None
