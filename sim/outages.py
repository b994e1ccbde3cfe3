"""Outage models shared by both simulator modes: the discrete-event engine (``sim.des``) and the
real-process emulation (``sim.emulate``). One definition of each model, so a scenario's outages
mean the same thing whether they are simulated for a million tasks or injected into real links.

Pure: no I/O, no clocks. Each process is a lazy iterator of ``(time, going_down)`` transitions
drawn from its own seeded random stream.

* Markov on/off (Gilbert-Elliott style): exponential up and down times with the given means;
  it starts in its stationary state, so the long-run down share is ``down / (up + down)`` from
  the first second on.
* Scheduled: offline every day in a local-time window (e.g. 22:00-06:00: a solar-powered Pi
  asleep at night), shifted per endpoint by a fixed random offset of up to ``jitter_s``.
* Regional (correlated) outages are not a separate model: the same process drives a whole group
  of endpoints (the valley behind one cell tower). An endpoint is down while any process that
  covers it is down (see :func:`union`).
"""

from __future__ import annotations

import math
import random
import re
from typing import Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "DAY", "MarkovOutage", "ScheduledOutage", "OutageSpec", "parse_hhmm", "markov", "scheduled",
    "down_intervals", "union", "down_time",
]

DAY = 86400.0

_HHMM = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


def parse_hhmm(v: str) -> float:
    """``"19:30"`` -> seconds after midnight; a clear ValueError for anything else."""
    m = _HHMM.match(v)
    if not m:
        raise ValueError(f"expected a time of day as HH:MM, got {v!r}")
    return int(m.group(1)) * 3600.0 + int(m.group(2)) * 60.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MarkovOutage(_Model):
    """On/off outages with exponentially distributed up and down times."""

    mean_up_s: float = Field(gt=0)
    mean_down_s: float = Field(gt=0)


class ScheduledOutage(_Model):
    """Offline every day from ``offline_from`` to ``offline_to`` (simulated local time); each
    endpoint shifts both ends by its own fixed random offset of up to ``jitter_s``."""

    offline_from: str
    offline_to: str
    jitter_s: float = Field(default=0.0, ge=0)

    @field_validator("offline_from", "offline_to")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        parse_hhmm(v)
        return v


class OutageSpec(_Model):
    markov: MarkovOutage | None = None
    scheduled: ScheduledOutage | None = None


def markov(spec: MarkovOutage, t0: float, rng: random.Random) -> Iterator[tuple[float, bool]]:
    up, down = spec.mean_up_s, spec.mean_down_s
    t = t0
    if rng.random() < down / (up + down):
        yield t, True
        t += rng.expovariate(1.0 / down)
        yield t, False
    while True:
        t += rng.expovariate(1.0 / up)
        yield t, True
        t += rng.expovariate(1.0 / down)
        yield t, False


def scheduled(spec: ScheduledOutage, t0: float, rng: random.Random) -> Iterator[tuple[float, bool]]:
    a = parse_hhmm(spec.offline_from)
    b = parse_hhmm(spec.offline_to)
    dur = (b - a) % DAY
    if dur == 0:
        return
    off = rng.uniform(-spec.jitter_s, spec.jitter_s) if spec.jitter_s else 0.0
    day = math.floor(t0 / DAY) - 1
    while True:
        start = day * DAY + a + off
        end = start + dur
        day += 1
        if end <= t0:
            continue
        yield max(start, t0), True
        yield end, False


def down_intervals(transitions: Iterable[tuple[float, bool]], t_end: float) -> list[tuple[float, float]]:
    """The ``[start, end)`` down intervals of one process up to ``t_end`` (the last one clipped).

    Transitions alternate down/up as the generators above produce them; a process that ends
    (a zero-length schedule) simply has no more intervals."""
    out: list[tuple[float, float]] = []
    start: float | None = None
    for t, going_down in transitions:
        if t >= t_end:
            break
        if going_down:
            start = t
        elif start is not None:
            if t > start:
                out.append((start, t))
            start = None
    if start is not None and t_end > start:
        out.append((start, t_end))
    return out


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping or touching intervals: down while any covering process is down."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def down_time(intervals: Iterable[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1)`` covered by the (merged) intervals."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in union(intervals))
