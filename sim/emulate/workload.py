"""The workload plan: which task is submitted when, to which agent, with which function and
payload (pure, seeded; the runner submits it through the SDK).

Arrivals are a Poisson process conditioned on the task count: ``tasks`` uniform times over the
run, sorted. Payloads are derived from ``(seed, seq)`` (SHAKE-128), so they need not be stored to
be checked and two runs of a scenario send the same bytes.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from .scenario import EmulationScenario

__all__ = ["TaskPlan", "plan_workload", "payload_of"]


@dataclass(frozen=True)
class TaskPlan:
    seq: int
    t: float  # seconds after the run starts
    agent: int  # index into the schedule's agents
    fn: str
    size: int  # payload bytes
    param: float  # sleep ms / cpu loop length / unused


def payload_of(seed: int, seq: int, size: int) -> bytes:
    return hashlib.shake_128(f"{seed}/{seq}".encode()).digest(size)


def plan_workload(sc: EmulationScenario, n_agents: int) -> list[TaskPlan]:
    w = sc.workload
    rng = random.Random(f"{sc.seed}/workload")
    times = sorted(rng.uniform(0.0, sc.duration_s) for _ in range(w.tasks))
    names = list(w.mix)
    weights = [w.mix[k] for k in names]
    lo, hi = w.payload_bytes
    out: list[TaskPlan] = []
    for seq, t in enumerate(times):
        fn = rng.choices(names, weights)[0]
        size = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if fn == "sleep":
            param = rng.uniform(*w.sleep_ms)
        elif fn == "cpu":
            param = float(rng.randint(int(w.cpu_n[0]), int(w.cpu_n[1])))
        else:
            param = 0.0
        out.append(TaskPlan(seq, t, rng.randrange(n_agents), fn, max(lo, min(hi, size)), param))
    return out
