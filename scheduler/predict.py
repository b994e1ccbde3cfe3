"""Predicted completion time of a task on an endpoint, and the earliest-finish search.

Model (all seconds, see docs/scheduler.md)::

    total = transfer_in + queue + cold + run + transfer_out [+ outage]
    transfer_in  = latency + (payload_bytes + input bytes the endpoint lacks) / bandwidth
    queue        = (backlog - workers + 1)+ * mean predicted work / workers   (fleet ledger)
    cold         = 0 if the function is warm (or already sent) there, else its cold-start penalty
    run          = R(function, hardware group, payload) * deviation(function, endpoint)
    transfer_out = latency + expected result bytes / bandwidth
    outage       = expected delay from the availability model (outage-aware policies only)

Unprofiled pairs fall back to the function's speed-normalised mean across endpoints divided by
the endpoint's speed hint, then to a prior; such predictions are flagged ``exploration``.

The search visits eligible groups in order of a lower bound and, inside each group, members in
order of ``key = queue + 2 * latency``; for any member ``total >= key + (payload+result)/max
group bandwidth + cold lower bound + min deviation * R`` (added in the same order as ``total``,
so float rounding cannot break the inequality), so once that bound exceeds the best total found
the rest of the group can be skipped. Members where the function is warm are scanned from
their own sorted list (no cold start), the cold rest from the group's list with the cold-start
lower bound; groups are visited in order of their bound. This returns exactly what a full scan returns (ties go to
the endpoint registered first) while usually evaluating a handful of endpoints per group.
"""

from __future__ import annotations

from typing import Sequence

from .environments import block_key, env_cold_start
from .locality import moved_bytes
from .fleet import Group, Node
from .model import Prediction, TaskInfo
from .profiles import Profiles

INF = float("inf")


class SearchResult:
    """Outcome of one earliest-finish search.

    ``group_best`` holds, per group that was searched, its best evaluated member as
    ``(total, node, run, cold, source)`` so that predictions can be reported without
    recomputing them.
    """

    __slots__ = ("node", "total", "run", "cold", "source", "group_best", "evaluated", "pruned", "ob")

    def __init__(self) -> None:
        self.node: Node | None = None
        self.total = INF
        self.run = 0.0
        self.cold = 0.0
        self.source = "prior"
        self.group_best: list[tuple[float, Node, float, float, str]] = []
        self.evaluated = 0
        self.pruned = 0
        self.ob = 0.0  # expected result bytes used


class Predictor:
    """Turns profiles and fleet state into predictions; stateless apart from its references."""

    def __init__(self, profiles: Profiles) -> None:
        self.profiles = profiles
        self._bcache: dict[tuple, list[tuple]] = {}

    def result_bytes(self, task: TaskInfo) -> float:
        rb = task.result_bytes
        return float(rb) if rb is not None else self.profiles.result_bytes(task.function_id)

    def cold(self, function_id: str, node: Node) -> float:
        if function_id in node.hot:
            return 0.0
        return self.profiles.cold_start(function_id, node.id, node.ep.hardware)

    def estimate(self, task: TaskInfo, node: Node, now: float, *, outage_aware: bool = False) -> Prediction:
        """Full prediction, with every component, for one endpoint."""
        p = self.profiles
        f = task.function_id
        ep = node.ep
        r, src = p.group_runtime(f, ep.hardware, task.payload_bytes, ep.speed if ep.speed > 0 else 1.0)
        s = node.dev.get(f)
        if s is not None:
            r *= s
        return Prediction(*self.assemble(task, node, now, r, self.cold(f, node) + self.env_cold(task, node), src, outage_aware=outage_aware))

    @staticmethod
    def env_cold(task: TaskInfo, node: Node) -> float:
        """Build or pull time, and the price of the bytes, of the task's environment where the
        endpoint does not hold it (scheduler/environments.py); 0 for tasks without one."""
        if task.env is None or task.env_cost is None or task.env in node.ep.envs:
            return 0.0
        return env_cold_start(task.env_cost, False, node.bw, node.ep.metered)

    def assemble(self, task: TaskInfo, node: Node, now: float, run: float, cold: float, source: str,
                 *, outage_aware: bool = False, ob: float | None = None) -> tuple:
        """A prediction as a plain tuple in :class:`Prediction` field order, from already
        computed runtime and cold start (same arithmetic as the search, so totals match it
        exactly). Tuples are what the hot path records; see :func:`scheduler.model.as_prediction`."""
        b = task.payload_bytes
        if ob is None:
            ob = self.result_bytes(task)
        bw = node.bw
        total = ((node.key + (b + ob) / bw) + cold) + run
        mv = moved_bytes(task.inputs, node.id) if task.inputs else 0  # inputs this endpoint lacks
        if mv:
            total += mv / bw
            b = b + mv
        outage = 0.0
        if outage_aware:
            assert node.avail is not None  # set by the fleet when it adds the endpoint
            outage = node.avail.expected_delay(now, now + node.wait + node.one_way + b / bw, cold + run)
            total += outage
        if source == "group" and node.dev and task.function_id in node.dev:
            source = "endpoint"
        return (node.id, total, node.one_way + b / bw, node.wait + node.bias, cold, run,
                node.one_way + ob / bw, outage, source, source == "function" or source == "prior")

    def begin_batch(self) -> None:
        """Start a batch: estimates stay fixed until the next call (see ``search``)."""
        self._bcache.clear()

    def _static_plan(self, f: str, groups: Sequence[Group]) -> list[tuple]:
        p = self.profiles
        sv = p.structure_version
        out = []
        for g in groups:
            gf = g.fn.get(f)
            if gf is None:
                gf = g.fn_of(f)
            if gf.sv != sv:  # (re)bind the group's live estimator objects
                gf.sv = sv
                gf.stats = p.group.get((f, g.hardware))
                gf.cold = p.cold_group.get((f, g.hardware))
                gf.cold_const = p.cold_start(f, hardware=g.hardware)
            gst = gf.stats
            if gst is not None:
                r0, slope, src = gst.intercept, gst.slope, "group"
            else:
                r0, slope, src = 0.0, None, "prior"  # fallback: computed per task
            cgs = gf.cold
            cg = cgs.mean if cgs is not None else gf.cold_const
            c_cold = gf.cold_min  # lower bound of a cold member's cold start
            if c_cold > cg:
                c_cold = cg
            # runtime lower bound at zero payload (the slope is never negative; a fallback
            # estimate is computed per task, so bound it by 0)
            r_lb0 = r0 * gf.dev_min if slope is not None and r0 > 0.0 else 0.0
            out.append((g, gf, r0, slope, src, cg, c_cold, gf.dev_min, r_lb0))
        return out

    def search(
        self,
        task: TaskInfo,
        groups: Sequence[Group],
        now: float,
        *,
        outage_aware: bool = False,
        prune: bool = True,
        skip_offline: bool = False,
        batch_stable: bool = False,
    ) -> SearchResult:
        """Endpoint with the smallest predicted completion time among ``groups``' members.

        ``skip_offline``: leave out endpoints the hub believes offline. ``batch_stable``: the
        caller guarantees that ``groups`` is the same list object for the whole batch begun by
        :meth:`begin_batch` and that no profile changes in between (the policies' ``place``
        does); the per-group estimates are then computed once per batch and function.
        """
        p = self.profiles
        f = task.function_id
        b = task.payload_bytes
        rb = task.result_bytes
        ob = float(rb) if rb is not None else p.result_bytes(f)
        bo = b + ob
        ids = task.endpoints  # an explicit id list: members outside it are skipped
        env = task.env if task.env_cost is not None else None  # an environment to build where not held
        bk = block_key(f, task.env)  # what a failure here blocked: the function, or the function in this environment
        inputs = task.inputs  # data already on some endpoints (scheduler/locality.py)
        skip = skip_offline or ids is not None  # one test per member on the common path
        res = SearchResult()
        res.ob = ob

        # Per group: runtime of an ordinary member, cold-start estimate and lower bounds. The
        # task-independent part is computed once per batch (profiles do not change while a
        # batch is being placed; only queues and warm sets do, and those are read live).
        static = None
        ck = None
        if batch_stable:
            ck = (f, id(groups))
            static = self._bcache.get(ck)
        if static is None:
            static = self._static_plan(f, groups)
            if ck is not None:
                self._bcache[ck] = static
        # Order the groups by a payload-free lower bound of their best member (the same
        # additions as a member's total, minus non-negative terms, so rounding cannot break
        # it): once a group's bound exceeds the best total found, so do all later groups'.
        plan = []
        n_total = 0
        i = 0
        for entry in static:
            g = entry[0]
            okeys = g.okeys
            if not okeys:
                continue
            n_total += len(okeys)
            gf = entry[1]
            if gf.dense:
                first = okeys[0] + entry[8]
            else:
                first = (okeys[0] + entry[6]) + entry[8]
                wk = gf.wkeys
                if wk:
                    fw = wk[0] + entry[8]
                    if fw < first:
                        first = fw
            plan.append((first, i, entry))
            i += 1
        if i > 1:
            plan.sort()

        best_t = INF
        best: Node | None = None
        best_idx = -1
        best_run = best_cold = 0.0
        best_src = "prior"
        evaluated = 0
        group_best = res.group_best
        for first, _, entry in plan:
            if prune and first > best_t:
                break
            g, gf, r0, slope, src, cg, c_cold, dev_min, _ = entry
            if slope is None:
                r, src = p.group_runtime(f, g.hardware, b, g.speed)
            elif slope:
                r = r0 + slope * b
                if r < 0.0:
                    r = 0.0
            else:
                r = r0
            r_lb = r * dev_min
            x_lb = bo / g.bw_max if g.bw_max > 0.0 else 0.0
            okeys = g.okeys
            n_all = len(okeys)
            dense = gf.dense
            if dense:
                wkeys, wnodes = okeys, g.onodes
            else:
                wkeys, wnodes = gf.wkeys, gf.wnodes
            gb_t = INF
            gb: Node | None = None
            gb_idx = -1
            gb_run = gb_cold = 0.0
            seen = 0
            # Pass 1: members where the function is warm (no cold start), best-first; in a
            # dense group all members, with their actual cold start (0 for most).
            for key, node in zip(wkeys, wnodes):
                if prune and ((key + x_lb) + 0.0) + r_lb > best_t:
                    break
                if node.blocked and bk in node.blocked:
                    continue
                if skip and ((skip_offline and not node.ep.online) or (ids is not None and node.id not in ids)):
                    continue
                seen += 1
                if node.dev:
                    s = node.dev.get(f)
                    run = r * s if s is not None else r
                else:
                    run = r
                if dense and f not in node.hot:
                    cold = node.cold_est.get(f, cg) if node.cold_est else cg
                else:
                    cold = 0.0
                if env is not None and env not in node.ep.envs:  # >= 0: the pruning bounds stay lower bounds
                    cold += env_cold_start(task.env_cost, False, node.bw, node.ep.metered)
                t = ((node.key + bo / node.bw) + cold) + run
                mv = moved_bytes(inputs, node.id) if inputs else 0  # >= 0: the pruning bounds stay lower bounds
                if mv:
                    t += mv / node.bw
                if outage_aware:
                    t += node.avail.expected_delay(now, now + node.wait + node.one_way + (b + mv) / node.bw, cold + run)
                idx = node.idx
                if t < gb_t or (t == gb_t and idx < gb_idx):
                    gb_t, gb, gb_idx, gb_run, gb_cold = t, node, idx, run, cold
                    if t < best_t or (t == best_t and idx < best_idx):
                        best_t, best, best_idx, best_run, best_cold, best_src = t, node, idx, run, cold, src
            # Pass 2: the cold members, bounded with the cold-start lower bound.
            if not dense and len(wkeys) < n_all:
                for key, node in zip(okeys, g.onodes):
                    if prune and ((key + x_lb) + c_cold) + r_lb > best_t:
                        break
                    if f in node.hot:
                        continue
                    if node.blocked and bk in node.blocked:
                        continue
                    if skip and ((skip_offline and not node.ep.online) or (ids is not None and node.id not in ids)):
                        continue
                    seen += 1
                    if node.dev:
                        s = node.dev.get(f)
                        run = r * s if s is not None else r
                    else:
                        run = r
                    cold = node.cold_est.get(f, cg) if node.cold_est else cg
                    if env is not None and env not in node.ep.envs:
                        cold += env_cold_start(task.env_cost, False, node.bw, node.ep.metered)
                    t = ((node.key + bo / node.bw) + cold) + run
                    mv = moved_bytes(inputs, node.id) if inputs else 0
                    if mv:
                        t += mv / node.bw
                    if outage_aware:
                        t += node.avail.expected_delay(now, now + node.wait + node.one_way + (b + mv) / node.bw, cold + run)
                    idx = node.idx
                    if t < gb_t or (t == gb_t and idx < gb_idx):
                        gb_t, gb, gb_idx, gb_run, gb_cold = t, node, idx, run, cold
                        if t < best_t or (t == best_t and idx < best_idx):
                            best_t, best, best_idx, best_run, best_cold, best_src = t, node, idx, run, cold, src
            evaluated += seen
            if gb is not None:
                group_best.append((gb_t, gb, gb_run, gb_cold, src))
        res.node = best
        res.total = best_t
        res.run = best_run
        res.cold = best_cold
        res.source = best_src
        res.evaluated = evaluated
        res.pruned = n_total - evaluated if n_total > evaluated else 0
        return res
