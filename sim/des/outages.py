"""Outage processes: each yields its (time, going_down) transitions lazily, from its own seeded
random stream, so the outage timeline is identical whatever policy is being simulated.

* Markov on/off: exponential up and down times; starts in its stationary state.
* Scheduled: offline every day in a local-time window (e.g. 22:00-06:00), shifted per
  endpoint by a fixed random offset.
* A process can cover one endpoint or a whole region (correlated outage): the engine counts,
  per endpoint, how many of its processes are currently down; it is online when none is.
"""

from __future__ import annotations

import math
import random
from typing import Iterator

from .scenario import MarkovOutage, ScheduledOutage, parse_hhmm

DAY = 86400.0


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
