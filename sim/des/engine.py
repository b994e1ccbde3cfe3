"""Discrete-event simulation of the mesh that drives the real :mod:`scheduler` code.

One event loop (``heapq``, simulated clock) plays the hub, the links and the agents; every
placement is made by a real :class:`scheduler.Scheduler` with one of its real policies, fed
with the same observations a hub would give it (completions with run and cold-start times,
heartbeat-level liveness from the watchdog, sampled message timings).

Model (see docs/scheduler.md for the reasoning):

* Hub: places each submission (a batch of tasks) when it arrives; keeps per-endpoint queues.
  An agent holds at most ``workers + prefetch`` of them; the rest stay at the hub.
* Links: a task's payload reaches the endpoint ``latency + bytes / bandwidth`` after
  placement; a result reaches the hub the same way after the run.
* Endpoints: FIFO queue, ``workers`` parallel workers, an LRU of warm functions
  (``warm_slots``); a cold function pays the class's cold start (x the function's factor).
  Per-endpoint speed jitter and a share of throttled devices make members of a class differ.
* Outages: while an endpoint is offline nothing on it progresses and nothing reaches the hub.
  Tasks running when it goes down are re-run from the start when it is back (the agent's
  durable inbox still holds them: at-least-once execution; a power cut also clears the warm
  workers). After ``dead_after_s`` of silence the hub's watchdog declares it dead: the
  scheduler is told (``endpoint_offline``) and the tasks the agent never fetched are taken
  back and placed again (``task_requeued`` + ``place``). Results already on the wire when an
  outage starts are delivered; a task placed on an endpoint that is offline waits there.
* Every task completes exactly once; the engine checks it.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from array import array
from collections import deque
from typing import Any

import numpy as np

from scheduler import Constraints, EndpointState, Scheduler, TaskInfo
from scheduler.model import NO_CONSTRAINTS

from . import outages as outage_models
from .hardware import HardwareClass
from .scenario import Scenario, parse_hhmm
from .workload import Workload, generate

FINISH, RESULT, OUTAGE, DETECT = 0, 1, 2, 3
DAY = 86400.0


class SimEndpoint:
    """Ground truth of one endpoint (what the scheduler does not see)."""

    __slots__ = ("idx", "id", "cls", "speedmul", "one_way", "bw", "workers", "tags",
                 "region", "hold")

    def __init__(self, idx: int, eid: str, cls: HardwareClass, speedmul: float, rtt: float,
                 bw: float, tags: frozenset[str], region: str | None, prefetch: int) -> None:
        self.idx = idx
        self.id = eid
        self.cls = cls
        self.speedmul = speedmul
        self.one_way = rtt / 2.0
        self.bw = bw
        self.workers = cls.workers
        self.tags = tags
        self.region = region
        self.hold = cls.workers + prefetch  # tasks the agent keeps in its inbox


class Simulation:
    """One scenario under one policy. ``run()`` (once per instance) returns a JSON-able result
    dict. A ``Workload`` may be shared between simulations of the same scenario so that every
    policy sees the same tasks."""

    def __init__(self, sc: Scenario, policy: str, workload: Workload | None = None) -> None:
        self.sc = sc
        self.policy_name = policy
        self.wl = workload if workload is not None else generate(sc)
        self._build_functions()
        self._build_endpoints()
        self._build_sizes()
        if policy == "oracle":
            from .oracle import OraclePolicy

            self.scheduler = Scheduler(OraclePolicy(self), dead_after_s=sc.hub.dead_after_s,
                                       keep_decisions=1000)
        else:
            kw: dict[str, Any] = {"seed": sc.seed} if policy == "random" else {}
            self.scheduler = Scheduler(policy, dead_after_s=sc.hub.dead_after_s,
                                       keep_decisions=1000, **kw)

    # ------------------------------------------------------------------ setup
    def _build_functions(self) -> None:
        sc = self.sc
        self.fids = [f.id for f in sc.functions]
        self.fspecs = list(sc.functions)
        self.fconstraints = []
        for f in sc.functions:
            r = f.requires
            if r is None:
                self.fconstraints.append(NO_CONSTRAINTS)
            else:
                self.fconstraints.append(Constraints(frozenset(r.tags), r.gpu, r.min_memory_mb))
        self.f_result_bytes = [f.result_kb * 1024.0 for f in sc.functions]

    def _build_endpoints(self) -> None:
        sc = self.sc
        rng = np.random.default_rng([sc.seed, 2])
        self.eps: list[SimEndpoint] = []
        self.ep_by_id: dict[str, int] = {}
        self.states: list[EndpointState] = []
        for g in sc.endpoints:
            cls = sc.hardware_class(g.hardware)
            base = g.name or g.hardware
            jit = np.exp(rng.normal(0.0, g.speed_jitter, g.count)) if g.speed_jitter else np.ones(g.count)
            slow = rng.random(g.count) < g.slow_fraction
            lj = np.exp(rng.normal(0.0, g.link_jitter, (g.count, 2))) if g.link_jitter else np.ones((g.count, 2))
            for k in range(g.count):
                idx = len(self.eps)
                eid = f"{base}-{k}"
                if eid in self.ep_by_id:
                    raise ValueError(f"duplicate endpoint id {eid!r}: give endpoint groups distinct names")
                tags = set(cls.tags) | set(g.tags)
                if g.region:
                    tags.add(f"region:{g.region}")
                sm = float(jit[k]) * (g.slow_factor if slow[k] else 1.0)
                ep = SimEndpoint(idx, eid, cls, sm, cls.rtt_s * float(lj[k, 0]),
                                 cls.bandwidth_bps / float(lj[k, 1]), frozenset(tags), g.region,
                                 sc.hub.prefetch)
                self.eps.append(ep)
                self.ep_by_id[eid] = idx
                self.states.append(EndpointState(
                    eid, workers=cls.workers, hardware=cls.name, tags=frozenset(tags), gpu=cls.gpu,
                    memory_mb=cls.memory_mb, speed=cls.benchmark, online=True,
                ))
        # per (function, endpoint) constants, flattened: runtime scale and cold start
        nf = len(self.fspecs)
        self.run_scale = [0.0] * (nf * len(self.eps))
        self.cold_s = [0.0] * (nf * len(self.eps))
        for e, ep in enumerate(self.eps):
            for fi, f in enumerate(self.fspecs):
                self.run_scale[e * nf + fi] = 1.0 / (ep.cls.speed[f.kind] * ep.speedmul)
                self.cold_s[e * nf + fi] = ep.cls.cold_start_s * f.cold_factor

    def _build_sizes(self) -> None:
        """Per task: its work in Pi-Zero-seconds (base + per-MB part, times its own noise)."""
        wl = self.wl
        fn = np.frombuffer(wl.fn, dtype=np.int32)
        base = np.array([f.base_s for f in self.fspecs])[fn]
        per_b = np.array([f.per_mb_s / 1e6 for f in self.fspecs])[fn]
        size = (base + per_b * np.frombuffer(wl.nbytes)) * np.frombuffer(wl.noise)
        self.t_size = array("d", size.tobytes())

    def true_runtime(self, task: int, e: int) -> float:
        """The run time task ``task`` has on endpoint ``e`` (deterministic per pair; the engine
        computes exactly this)."""
        return self.t_size[task] * self.run_scale[e * len(self.fspecs) + self.wl.fn[task]]

    def _outage_processes(self, t0: float, t_work: float | None = None) -> list[tuple[list[int], Any]]:
        sc = self.sc
        procs: list[tuple[list[int], Any]] = []
        pi = 0

        def stream() -> random.Random:
            nonlocal pi
            pi += 1
            return random.Random(sc.seed * 1_000_003 + pi)

        idx = 0
        for g in sc.endpoints:
            members = list(range(idx, idx + g.count))
            idx += g.count
            if g.outage is None:
                continue
            for e in members:
                if g.outage.markov is not None:
                    procs.append(([e], outage_models.markov(g.outage.markov, t0, stream())))
                if g.outage.scheduled is not None:
                    procs.append(([e], outage_models.scheduled(g.outage.scheduled, t0, stream())))
        for r in sc.regions:
            members = [e.idx for e in self.eps if e.region == r.name]
            if not members:
                continue
            if r.outage.markov is not None:
                procs.append((members, outage_models.markov(r.outage.markov, t0, stream())))
            if r.outage.scheduled is not None:
                procs.append((members, outage_models.scheduled(r.outage.scheduled, t0, stream())))
        for rs in sc.restarts:  # agent restarts (SIGKILL mid-burst): down, then a new hello
            at = (t_work if t_work is not None else t0) + rs.at_s
            procs.append(([self.ep_by_id[rs.endpoint]], iter([(at, True), (at + rs.down_s, False)]
                                                              + [(math.inf, False)] * 2)))
        return procs

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        sc = self.sc
        wl = self.wl
        sched = self.scheduler
        n = wl.n
        nf = len(self.fspecs)
        eps = self.eps
        ne = len(eps)
        fids = self.fids
        fcons = self.fconstraints
        fres = self.f_result_bytes
        fres_i = [int(x) for x in fres]
        run_scale = self.run_scale
        cold_tab = self.cold_s
        t_fn, t_bytes = wl.fn, wl.nbytes
        t_size = self.t_size
        # per (endpoint, function): the result's trip back to the hub
        x_out = [eps[e].one_way + fres[fi] / eps[e].bw for e in range(ne) for fi in range(nf)]
        dead_after = sc.hub.dead_after_s
        link_every = sc.hub.link_sample_every

        t_hist = parse_hhmm(sc.hub.start_time)
        t_work = t_hist + sc.hub.history_days * DAY
        self._t_work = t_work

        # per-task state
        t_arrive = array("d", bytes(8 * n))
        t_done = array("d", [math.nan]) * n
        t_ready = array("d", bytes(8 * n))
        t_ep = array("i", [-1]) * n
        # per-endpoint state
        free = [ep.workers for ep in eps]
        queue: list[deque[int]] = [deque() for _ in range(ne)]
        running: list[dict[int, float]] = [{} for _ in range(ne)]
        down = [0] * ne
        epoch = [0] * ne
        declared = [False] * ne
        down_since = [0.0] * ne
        held = [0] * ne
        warm: list[dict[int, None]] = [{} for _ in range(ne)]
        warm_dirty = [False] * ne
        warm_slots = [ep.cls.warm_slots for ep in eps]
        one_way = [ep.one_way for ep in eps]
        bw = [ep.bw for ep in eps]
        ep_ids = [ep.id for ep in eps]
        ep_by_id = self.ep_by_id

        heap: list[tuple] = []
        push = heapq.heappush
        pop = heapq.heappop
        seq = 0
        stats = {"reruns": 0, "requeued": 0, "duplicates": 0, "outages": 0,
                 "exploration_placements": 0}

        # How the hub learns links (HubSpec.link_timing) and its lag under load (HubSpec.lag).
        lt = sc.hub.link_timing
        link_echo = getattr(sched, "link_echo", None) if lt == "echo" else None
        mode = "ideal" if lt == "ideal" else ("echo" if link_echo is not None else "one-way")
        self.link_timing_used = mode
        lag = sc.hub.lag
        lag_base = lag.base_s if lag is not None else 0.0
        lag_per = lag.per_task_s if lag is not None else 0.0
        lag_max = lag.max_s if lag is not None else 0.0
        echo_share = lag.echo_share if lag is not None else 0.0
        lagged = lag is not None and (lag_base > 0.0 or lag_per > 0.0) and lag_max > 0.0
        lag_rng = random.Random(sc.seed * 7919 + 17)
        arrived = [0]  # tasks accepted so far (the hub's load is arrived - done)

        def hub_lag() -> float:
            x = lag_base + lag_per * (arrived[0] - done)
            return min(x, lag_max)

        # The agent's send stamps on the hub's clock are late by its residual skew plus half the
        # lag its welcome was stamped after (the welcome's hub time is read as the middle of the
        # hello's round trip).
        skew = [0.0] * ne
        i0 = 0
        for g in sc.endpoints:
            for k in range(g.count):
                skew[i0 + k] = g.clock_skew_s
            i0 += g.count
        stamp_err = list(skew)
        done = 0

        def feed_link(e: int, nbytes: float, read: float, now: float) -> None:
            """A timed frame of ``nbytes`` from endpoint ``e``: read by the hub's link at
            ``read``, handled at ``now`` (after the lag); sent ``latency + bytes / bw`` before."""
            trip = one_way[e] + nbytes / bw[e]
            eid = ep_ids[e]
            if mode == "ideal":
                sched.message_timing(eid, int(nbytes), trip, now)
            elif mode == "one-way":
                dt = trip + (now - read) - stamp_err[e]
                if -1.0 < dt < 120.0:
                    sched.message_timing(eid, int(nbytes), max(dt, 0.0), now)
            else:
                # the round trip of the echo this frame carries (the hub's stamp taken, in a share
                # of them, before its own frame left the busy loop), and the exchange's offset
                extra = (now - read) if echo_share and lag_rng.random() < echo_share else 0.0
                link_echo(eid, 2.0 * one_way[e] + extra, now, stamp_err[e] - extra / 2.0)
                off = sched.clock_offset(eid)
                dt = trip - stamp_err[e] + (off if off is not None else 0.0)
                if -1.0 < dt < 120.0:
                    sched.message_timing(eid, int(nbytes), max(dt, 0.0), now)

        # Registration: the hub times the handshake (RTT) and the agent's registration message
        # (64 KiB: environment manifest), as a real hub would.
        reg = 65536
        for e, st in enumerate(self.states):
            sched.add_endpoint(st, t_hist)
            if mode == "ideal":
                sched.heartbeat(st.endpoint_id, t_hist, rtt_s=2.0 * eps[e].one_way)
                sched.message_timing(st.endpoint_id, reg, eps[e].one_way + reg / eps[e].bw, t_hist)
            else:
                stamp_err[e] = skew[e] + hub_lag() / 2.0
                feed_link(e, reg, t_hist, t_hist)

        procs = self._outage_processes(t_hist, t_work)
        for p, (_, it) in enumerate(procs):
            t, d = next(it)
            seq += 1
            push(heap, (t, seq, OUTAGE, p, d))

        def start_tasks(e: int, now: float) -> None:
            nonlocal seq
            q = queue[e]
            run_e = running[e]
            w = warm[e]
            base = e * nf
            ep_epoch = epoch[e]
            while free[e] > 0 and q:
                task = q.popleft()
                fi = t_fn[task]
                st = t_ready[task]
                if st < now:
                    st = now
                if fi in w:
                    del w[fi]
                    w[fi] = None
                    cold = 0.0
                else:
                    cold = cold_tab[base + fi]
                    w[fi] = None
                    if len(w) > warm_slots[e]:
                        del w[next(iter(w))]
                    warm_dirty[e] = True
                run = t_size[task] * run_scale[base + fi]
                fin = st + cold + run
                run_e[task] = fin
                free[e] -= 1
                seq += 1
                push(heap, (fin, seq, FINISH, e, task, ep_epoch, run, cold))

        def enqueue(placements: list, now: float) -> None:
            for pl in placements:
                task = pl.task_id
                e = ep_by_id[pl.endpoint_id]
                t_ep[task] = e
                t_ready[task] = now + one_way[e] + t_bytes[task] / bw[e]
                queue[e].append(task)
                if pl.exploration:
                    stats["exploration_placements"] += 1
                if free[e] > 0 and not down[e]:
                    start_tasks(e, now)

        # Task ids are the task's index (the scheduler only needs hashable ids; ints are cheaper
        # than strings on the hot path).
        def task_info(task: int) -> TaskInfo:
            fi = t_fn[task]
            return TaskInfo(task, fids[fi], int(t_bytes[task]), fcons[fi])  # type: ignore[arg-type]

        def go_offline(e: int, now: float) -> None:
            nonlocal seq
            epoch[e] += 1
            stats["outages"] += 1
            run_e = running[e]
            if run_e:
                stats["reruns"] += len(run_e)
                # re-run from the start when back, in their original order, before the queue
                queue[e].extendleft(sorted(run_e, key=run_e.__getitem__, reverse=True))
                run_e.clear()
            free[e] = eps[e].workers
            if warm[e]:
                warm[e].clear()
                warm_dirty[e] = True
            held[e] = min(len(queue[e]), eps[e].hold)
            down_since[e] = now
            seq += 1
            push(heap, (now + dead_after, seq, DETECT, e, epoch[e]))

        def go_online(e: int, now: float) -> None:
            if mode != "ideal":  # a new hello: its welcome sets the agent's clock again
                stamp_err[e] = skew[e] + hub_lag() / 2.0
            if declared[e]:
                declared[e] = False
                sched.heartbeat(ep_ids[e], now)
            if queue[e]:
                start_tasks(e, now)

        def detect(e: int, ep_epoch: int, now: float) -> None:
            if not down[e] or epoch[e] != ep_epoch:
                return
            declared[e] = True
            sched.endpoint_offline(ep_ids[e], now, since=down_since[e])
            q = queue[e]
            back: list[int] = []
            while len(q) > held[e]:
                back.append(q.pop())
            if not back:
                return
            back.reverse()
            stats["requeued"] += len(back)
            for task in back:
                sched.task_requeued(task, now)  # type: ignore[arg-type]
                t_ep[task] = -1
            enqueue(sched.place([task_info(t) for t in back], now), now)

        # ---------------------------------------------------------------- history phase
        while heap and heap[0][0] < t_work:
            ev = pop(heap)
            now = ev[0]
            kind = ev[2]
            if kind == OUTAGE:
                self._outage(ev, procs, down, go_offline, go_online, heap, now)
            elif kind == DETECT:
                detect(ev[3], ev[4], now)

        # ---------------------------------------------------------------- workload phase
        sub_time, sub_start = wl.sub_time, wl.sub_start
        n_sub = len(sub_time)
        si = 0
        next_sub = t_work + sub_time[0] if n_sub else math.inf
        last_done = t_work
        events = 0
        gc_was = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        wall0 = time.perf_counter()
        try:
            while done < n:
                if heap and heap[0][0] <= next_sub:
                    ev = pop(heap)
                    events += 1
                    now = ev[0]
                    kind = ev[2]
                    if kind == FINISH:
                        e = ev[3]
                        task = ev[4]
                        if ev[5] != epoch[e]:
                            continue  # killed by an outage; it will run again
                        del running[e][task]
                        free[e] += 1
                        seq += 1
                        push(heap, (now + x_out[e * nf + t_fn[task]], seq, RESULT, e, task, ev[6], ev[7]))
                        if queue[e]:
                            start_tasks(e, now)
                    elif kind == RESULT:
                        e = ev[3]
                        task = ev[4]
                        if lagged and len(ev) == 7:  # read by the hub's link; handled after the lag
                            seq += 1
                            push(heap, (now + hub_lag(), seq, RESULT, e, task, ev[5], ev[6], now))
                            continue
                        if t_done[task] == t_done[task]:  # not NaN: already completed
                            stats["duplicates"] += 1
                            continue
                        t_done[task] = now
                        done += 1
                        last_done = now
                        fi = t_fn[task]
                        wf = None
                        if warm_dirty[e]:
                            warm_dirty[e] = False
                            wf = frozenset(fids[x] for x in warm[e])
                        if declared[e]:
                            declared[e] = False  # a result is proof of life
                        sched.task_completed(task, now, ev[5], cold_start_s=ev[6],  # type: ignore[arg-type]
                                             result_bytes=fres_i[fi], warm_functions=wf)
                        if task % link_every == 0:
                            if mode == "ideal":
                                sched.message_timing(ep_ids[e], int(t_bytes[task]),
                                                     one_way[e] + t_bytes[task] / bw[e], now)
                            else:
                                feed_link(e, t_bytes[task], ev[7] if len(ev) > 7 else now, now)
                    elif kind == OUTAGE:
                        self._outage(ev, procs, down, go_offline, go_online, heap, now)
                    else:
                        detect(ev[3], ev[4], now)
                else:
                    now = next_sub
                    a, b = sub_start[si], sub_start[si + 1]
                    for task in range(a, b):
                        t_arrive[task] = now
                    arrived[0] = b
                    si += 1
                    next_sub = t_work + sub_time[si] if si < n_sub else math.inf
                    tasks = [TaskInfo(t, fids[t_fn[t]], int(t_bytes[t]), fcons[t_fn[t]])  # type: ignore[arg-type]
                             for t in range(a, b)]
                    enqueue(sched.place(tasks, now), now)
        finally:
            wall = time.perf_counter() - wall0
            gc.unfreeze()
            if gc_was:
                gc.enable()

        return self._report(t_work, t_arrive, t_done, t_ep, last_done, wall, events, stats)

    def _outage(self, ev, procs, down, go_offline, go_online, heap, now) -> None:
        _, _, _, p, going_down = ev
        members, it = procs[p]
        for e in members:
            if going_down:
                down[e] += 1
                if down[e] == 1:
                    go_offline(e, now)
            else:
                down[e] -= 1
                if down[e] == 0:
                    go_online(e, now)
        t, d = next(it)
        # sequence numbers for outage events live in their own range (negative) so that they
        # never collide with task events at the same instant and order stays deterministic
        heapq.heappush(heap, (t, -(p + 1), OUTAGE, p, d))

    # ------------------------------------------------------------------ bounds
    def _eligible(self, fi: int) -> list[int]:
        c = self.fconstraints[fi]
        out = []
        for e, st in enumerate(self.states):
            if c.tags <= st.tags and (not c.gpu or st.gpu) and st.memory_mb >= c.min_memory_mb:
                out.append(e)
        return out

    def lower_bound(self, a: int, b: int, t0: float) -> float:
        """A lower bound on the makespan (from ``t0``) of tasks ``a..b-1``, from ground truth:
        the largest of (1) each task's arrival plus its fastest possible trip (payload in, its
        run on the eligible endpoint that runs it fastest, result back; no queue, no cold
        start), (2) per function, for every arrival time, the work still to arrive divided by
        the capacity of the endpoints that may run it (workers / run time), and (3) the same
        for all functions together on the whole fleet, each endpoint at its best speed. Hub lag,
        outages and cold starts are not in it: it is what no policy can beat."""
        if b <= a:
            return 0.0
        wl = self.wl
        nf = len(self.fspecs)
        ne = len(self.eps)
        sub_t = np.frombuffer(wl.sub_time)
        sub_s = np.frombuffer(wl.sub_start, dtype=np.int64)
        # arrival time of every task (submission of each task), relative to t0
        counts = np.diff(sub_s)
        arr = np.repeat(sub_t, counts)[a:b] + (self._t_work - t0)
        fn = np.frombuffer(wl.fn, dtype=np.int32)[a:b]
        size = np.frombuffer(self.t_size)[a:b]
        nbytes = np.frombuffer(wl.nbytes)[a:b]
        rs = np.array(self.run_scale).reshape(ne, nf)
        ow = np.array([ep.one_way for ep in self.eps])
        bw = np.array([ep.bw for ep in self.eps])
        wk = np.array([ep.workers for ep in self.eps], dtype=float)
        best = 0.0
        fleet_cap = float((wk / rs.min(axis=1)).sum())
        for fi in range(nf):
            m = fn == fi
            if not m.any():
                continue
            el = np.array(self._eligible(fi))
            if len(el) == 0:
                continue
            trip = (size[m] * rs[el, fi].min() + (2.0 * ow[el] + self.f_result_bytes[fi] / bw[el]).min()
                    + nbytes[m] * (1.0 / bw[el]).min())
            best = max(best, float((arr[m] + trip).max()))
            cap = float((wk[el] / rs[el, fi]).sum())
            suffix = np.cumsum(size[m][::-1])[::-1]
            best = max(best, float((arr[m] + suffix / cap).max()))
        suffix = np.cumsum(size[::-1])[::-1]
        best = max(best, float((arr + suffix / fleet_cap).max()))
        return best

    def ideal_shares(self, a: int, b: int) -> dict[int, float]:
        """For tasks ``a..b-1`` of one function: the share of each eligible endpoint that
        minimises their makespan when all arrive at once (workers / run time, normalised). Empty
        for a mix of functions."""
        fn = set(np.frombuffer(self.wl.fn, dtype=np.int32)[a:b].tolist())
        if len(fn) != 1:
            return {}
        fi = fn.pop()
        nf = len(self.fspecs)
        rate = {e: self.eps[e].workers / self.run_scale[e * nf + fi] for e in self._eligible(fi)}
        tot = sum(rate.values())
        return {e: r / tot for e, r in rate.items()}

    # ------------------------------------------------------------------ results
    def _report(self, t_work, t_arrive, t_done, t_ep, last_done, wall, events, stats) -> dict[str, Any]:
        n = len(t_done)
        done = np.frombuffer(t_done, dtype=float)
        arr = np.frombuffer(t_arrive, dtype=float)
        if np.isnan(done).any():
            raise RuntimeError(f"{int(np.isnan(done).sum())} tasks never completed")
        if stats["duplicates"]:
            raise RuntimeError(f"{stats['duplicates']} duplicate results")
        ct = done - arr
        per_class: dict[str, int] = {}
        eps_of = np.frombuffer(t_ep, dtype=np.int32)
        counts = np.bincount(eps_of[eps_of >= 0], minlength=len(self.eps))
        for e, c in enumerate(counts.tolist()):
            if c:
                cname = self.eps[e].cls.name
                per_class[cname] = per_class.get(cname, 0) + c
        err = self.scheduler.prediction_error()
        lb = self.lower_bound(0, n, t_work)
        makespan = float(last_done - t_work)
        out_phases = []
        ps = self.wl.phase_start
        specs = self.sc.workload.arrival.phases
        for k in range(len(ps) - 1):
            a, b = ps[k], ps[k + 1]
            t0 = float(arr[a])
            ph_lb = self.lower_bound(a, b, t0)
            ph_ms = float(done[a:b].max() - t0)
            cnt = np.bincount(eps_of[a:b][eps_of[a:b] >= 0], minlength=len(self.eps))
            ideal = self.ideal_shares(a, b)
            errs = [(abs(d.error_s), d.actual_s) for d in self.scheduler.recent
                    if a <= d.placement.task_id < b and d.error_s is not None]  # type: ignore[operator]
            out_phases.append({
                "name": specs[k].name or f"phase {k + 1}",
                "tasks": b - a,
                "start_s": round(t0 - t_work, 6),
                "makespan_s": ph_ms,
                "lower_bound_s": ph_lb,
                "makespan_vs_lower_bound": ph_ms / ph_lb if ph_lb > 0 else None,
                "share": {self.eps[e].id: int(c) / (b - a) for e, c in enumerate(cnt.tolist()) if c or e in ideal},
                "ideal_share": {self.eps[e].id: v for e, v in ideal.items()},
                # over the phase's last decisions the scheduler keeps (up to 1,000)
                "prediction_median_abs_error_s": float(np.median([x[0] for x in errs])) if errs else None,
                "actual_median_s": float(np.median([x[1] for x in errs])) if errs else None,
            })
        return {
            "policy": self.policy_name,
            "tasks": n,
            "endpoints": len(self.eps),
            "makespan_s": makespan,
            "lower_bound_s": lb,
            "makespan_vs_lower_bound": makespan / lb if lb > 0 else None,
            "link_timing": getattr(self, "link_timing_used", self.sc.hub.link_timing),
            **({"phases": out_phases} if out_phases else {}),
            "completion_mean_s": float(ct.mean()),
            "completion_p50_s": float(np.percentile(ct, 50)),
            "completion_p99_s": float(np.percentile(ct, 99)),
            "completion_max_s": float(ct.max()),
            "tasks_per_class": per_class,
            "prediction_mean_abs_error_s": err["mean_abs_error_s"],
            "prediction_mean_rel_error": err["mean_rel_error"],
            "exploration_placements": stats["exploration_placements"],
            "reruns_after_outage": stats["reruns"],
            "requeued_from_dead": stats["requeued"],
            "outages": stats["outages"],
            "events": events,
            "wall_s": wall,
        }
