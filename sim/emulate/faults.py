"""The fault schedule: every link outage, power cut and service restart of a run, computed up
front from the scenario and its seed (pure: no I/O, no clock).

Because it is computed before anything starts, a run is reproducible: the same scenario and
seed give the same schedule (``digest`` proves it), and the runner only replays it against real
processes. Each random process draws from its own named stream (``seed/agent/model``), so adding
a group to a scenario does not shift the faults of the others.

Link outages reuse the shared models in :mod:`sim.outages` (the discrete-event mode's Markov and
scheduled processes); a region's process covers all its members (a correlated outage).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Literal

from sim.outages import DAY, OutageSpec, down_intervals, down_time, markov, parse_hhmm, scheduled, union

from .scenario import CutSpec, EmulationScenario

__all__ = ["AgentSlot", "FaultEvent", "FaultSchedule", "build_schedule"]

EventKind = Literal["link_down", "link_up", "agent_kill", "agent_start", "hub_stop", "hub_start", "broker_stop", "broker_start",
                    "gateway_move"]


@dataclass(frozen=True)
class AgentSlot:
    """One agent process of the run."""

    name: str
    group: str
    transport: str
    region: str | None


@dataclass(frozen=True)
class FaultEvent:
    t: float  # seconds after the run starts
    kind: EventKind
    target: str  # agent name, "hub" or "broker"
    cause: str = ""  # link events: which process ("markov", "scheduled", "region:valley:markov")
    mode: str = ""  # link_down: "reset" | "blackhole"; service stops: "term" | "kill"


_ORDER = {"link_up": 0, "agent_start": 1, "hub_start": 2, "broker_start": 3, "link_down": 4, "agent_kill": 5, "hub_stop": 6, "broker_stop": 7,
          "gateway_move": 8}


@dataclass
class FaultSchedule:
    duration_s: float
    agents: list[AgentSlot]
    events: list[FaultEvent]

    def digest(self) -> str:
        """sha256 of the schedule (times to the microsecond): equal digests, equal runs."""
        rows = [[round(e.t, 6), e.kind, e.target, e.cause, e.mode] for e in self.events]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    def link_down(self, agent: str) -> list[tuple[float, float]]:
        """Planned down intervals of an agent's link (all causes merged), clipped to the run."""
        opened: dict[str, float] = {}
        spans: list[tuple[float, float]] = []
        for e in self.events:
            if e.target != agent:
                continue
            if e.kind == "link_down":
                opened[e.cause] = e.t
            elif e.kind == "link_up" and e.cause in opened:
                spans.append((opened.pop(e.cause), e.t))
        spans += [(t, self.duration_s) for t in opened.values()]
        return union(spans)

    def outage_share(self) -> float:
        """Planned share of agent-time with the link down."""
        if not self.agents:
            return 0.0
        total = sum(down_time(self.link_down(a.name), 0.0, self.duration_s) for a in self.agents)
        return total / (len(self.agents) * self.duration_s)

    def count(self, kind: EventKind) -> int:
        return sum(1 for e in self.events if e.kind == kind)

    def as_json(self) -> list[dict[str, object]]:
        return [asdict(e) for e in self.events]


def _stream(seed: int, *parts: str) -> random.Random:
    return random.Random("/".join([str(seed), *parts]))  # str seeds hash with sha512: stable across runs


def _processes(spec: OutageSpec, day_s: float, start_of_day: float, rng_of: Callable[[str], random.Random],
               duration: float) -> Iterator[tuple[str, list[tuple[float, float]]]]:
    """(model name, down intervals in run seconds) for each model the spec enables."""
    if spec.markov is not None:
        yield "markov", down_intervals(markov(spec.markov, 0.0, rng_of("markov")), duration)
    if spec.scheduled is not None:
        k = DAY / day_s  # simulated seconds per wall second
        gen = scheduled(spec.scheduled, start_of_day, rng_of("scheduled"))
        yield "scheduled", down_intervals((((t - start_of_day) / k, d) for t, d in gen), duration)


def _mode(cut: CutSpec, rng: random.Random) -> str:
    return rng.choice(("reset", "blackhole")) if cut == "mixed" else cut


def build_schedule(sc: EmulationScenario) -> FaultSchedule:
    """Every fault of the run, sorted by time (ties: restorations before new faults)."""
    seed, T = sc.seed, sc.duration_s
    start = parse_hhmm(sc.clock.start)
    agents = [AgentSlot(f"{g.name}-{i}", g.name, g.transport, g.region) for g in sc.agents for i in range(g.count)]
    groups = {g.name: g for g in sc.agents}
    events: list[FaultEvent] = []

    def link(agent: str, cause: str, spans: list[tuple[float, float]], modes: list[str]) -> None:
        for (a, b), mode in zip(spans, modes):
            events.append(FaultEvent(a, "link_down", agent, cause, mode))
            if b < T:
                events.append(FaultEvent(b, "link_up", agent, cause))

    # Each agent's own link processes.
    for a in agents:
        g = groups[a.group]
        if g.outage is None:
            continue
        for model, spans in _processes(g.outage, sc.clock.day_s, start, lambda m, n=a.name: _stream(seed, "agent", n, m), T):
            mrng = _stream(seed, "agent", a.name, model, "mode")
            link(a.name, model, spans, [_mode(g.link.cut, mrng) for _ in spans])
    # Regions: one process, all members down together.
    for r in sc.regions:
        members = [a for a in agents if a.region == r.name]
        if not members:
            continue
        for model, spans in _processes(r.outage, sc.clock.day_s, start, lambda m, n=r.name: _stream(seed, "region", n, m), T):
            mrng = _stream(seed, "region", r.name, model, "mode")
            modes = [_mode(r.cut, mrng) for _ in spans]
            for a in members:
                link(a.name, f"region:{r.name}:{model}", spans, modes)
    # Power cuts: a fleet-wide Poisson process; each picks a live agent and restarts it later.
    kills = sc.faults.agent_kills
    if kills is not None:
        rng = _stream(seed, "kills")
        eligible = [a.name for a in agents if kills.groups is None or a.group in kills.groups]
        dead_until: dict[str, float] = {}
        t = rng.expovariate(1.0 / kills.mean_interval_s)
        while t < T and eligible:
            alive = [n for n in eligible if dead_until.get(n, -1.0) <= t]
            if alive:
                victim = rng.choice(alive)
                back = t + rng.uniform(*kills.down_s)
                dead_until[victim] = back
                events.append(FaultEvent(t, "agent_kill", victim, "power-cut", "kill"))
                if back < T:
                    events.append(FaultEvent(back, "agent_start", victim, "power-cut"))
            t += rng.expovariate(1.0 / kills.mean_interval_s)
    # Hub and broker restarts at fixed offsets (one spec or several, e.g. short ones and a long one).
    for svc, specs in (("hub", sc.faults.hub_restarts), ("broker", sc.faults.broker_restarts)):
        if specs is None:
            continue
        srng = _stream(seed, svc, "signal")
        planned: list[tuple[float, float, str]] = []
        for spec in specs if isinstance(specs, list) else [specs]:
            times = set(spec.at_s)
            if spec.every_s:
                times.update(spec.every_s * k for k in range(1, int(T / spec.every_s) + 1))
            planned += [(t, spec.down_s, spec.signal) for t in times if t < T]
        up_at = -1.0
        for t, down_s, signal in sorted(planned):
            if t < up_at:
                continue  # still down from the previous restart
            sig = srng.choice(("term", "kill")) if signal == "mixed" else signal
            events.append(FaultEvent(t, f"{svc}_stop", svc, "restart", sig))  # type: ignore[arg-type]
            up_at = t + down_s
            events.append(FaultEvent(up_at, f"{svc}_start", svc, "restart"))  # type: ignore[arg-type]
    # Devices moving to another site's gateway (sim/emulate/sites.py); cause = the gateway group.
    for m in sc.faults.gateway_moves:
        if m.at_s < T:
            events.append(FaultEvent(m.at_s, "gateway_move", m.agent, m.to))
    events.sort(key=lambda e: (e.t, _ORDER[e.kind], e.target, e.cause))
    return FaultSchedule(T, agents, events)
