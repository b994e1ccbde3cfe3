"""ORACLE policy: earliest-finish list scheduling with perfect knowledge of run times.

It is not a scheduler anyone could deploy: it reads the simulator's ground truth - the exact
run time every task will have on every endpoint, cold starts, and the links - and keeps an
exact model of each endpoint's workers (a heap of worker free times, FIFO like the agents)
and warm functions. It does not know future outages. It is the yardstick for how much the
real policies lose by having to learn and estimate.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from scheduler.model import Prediction
from scheduler.policies import BasePolicy

if TYPE_CHECKING:
    from .engine import Simulation


class OraclePolicy(BasePolicy):
    name = "oracle"

    def __init__(self, sim: "Simulation") -> None:
        super().__init__(None)
        self.sim = sim
        self.free = [[0.0] * ep.workers for ep in sim.eps]
        self.warm: list[dict[int, None]] = [{} for _ in sim.eps]

    def choose(self, task, fleet, now):
        sim = self.sim
        nodes = self.eligible(task, fleet)
        ti = int(task.task_id)
        fi = sim.wl.fn[ti]
        nf = len(sim.fspecs)
        nbytes = sim.wl.nbytes[ti]
        rb = sim.f_result_bytes[fi]
        best = None
        best_fin = float("inf")
        best_parts = None
        for node in nodes:
            e = node.idx  # endpoints are registered in simulator order
            ep = sim.eps[e]
            t_in = ep.one_way + nbytes / ep.bw
            h = self.free[e]
            start = now + t_in
            if h[0] > start:
                start = h[0]
            cold = 0.0 if fi in self.warm[e] else sim.cold_s[e * nf + fi]
            run = sim.true_runtime(ti, e)
            t_out = ep.one_way + rb / ep.bw
            fin = start + cold + run + t_out
            if fin < best_fin:
                best, best_fin = node, fin
                best_parts = (t_in, start - now - t_in, cold, run, t_out, start)
        assert best is not None and best_parts is not None
        e = best.idx
        t_in, queue, cold, run, t_out, start = best_parts
        heapq.heapreplace(self.free[e], start + cold + run)
        w = self.warm[e]
        if fi in w:
            del w[fi]
        w[fi] = None
        if len(w) > sim.eps[e].cls.warm_slots:
            del w[next(iter(w))]
        pred = Prediction(best.id, best_fin - now, t_in, queue, cold, run, t_out, 0.0, "oracle", False)
        return best, "oracle: true run times", (), 0, pred
