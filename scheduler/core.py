"""``Scheduler``: the one object the hub (and the simulator) talks to.

It owns the learned :class:`~scheduler.profiles.Profiles`, the :class:`~scheduler.fleet.Fleet`
(endpoints, in-flight ledger, search index) and one placement policy, and keeps a decision log
(placement + predictions compared + what actually happened) for the console. It does no I/O and
reads no clock: every call carries ``now``.

Typical hub wiring::

    sched = Scheduler("delta-outage-aware")
    sched.add_endpoint(EndpointState("pi-7", workers=4, hardware="pi4", tags=frozenset({"farm"})), now)
    placements = sched.place([TaskInfo("t1", "fhash", payload_bytes=2048)], now)
    sched.heartbeat("pi-7", now, queued=3, running=4, warm_functions={"fhash"})
    sched.message_timing("pi-7", nbytes=2048, seconds=0.041, now=now)
    sched.task_completed("t1", now, runtime_s=1.8, cold_start_s=0.0, result_bytes=512)
    dead = sched.sweep(now)          # endpoints silent longer than dead_after_s
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Sequence

from .events import EndpointOffline, Event, Heartbeat, MessageTiming, TaskCompleted, TaskRequeued
from .environments import ENV_ERROR, block_key
from .estimators import TermError
from .fleet import Fleet
from .model import Decision, EndpointState, Placement, Prediction, TaskInfo
from .policies import BasePolicy, Policy, make_policy
from .profiles import Profiles

# Failures that mean "this function cannot run on this endpoint" (Delta blocks them too).
BLOCKING_ERRORS = frozenset({"ModuleNotFoundError", "ImportError", "MemoryError"})


class Scheduler:
    def __init__(
        self,
        policy: str | Policy = "delta",
        *,
        profiles: Profiles | None = None,
        dead_after_s: float = 75.0,
        keep_decisions: int = 10_000,
        calibrate: bool = True,
        **policy_kwargs: Any,
    ) -> None:
        self.profiles = profiles if profiles is not None else Profiles()
        self.fleet = Fleet(self.profiles)
        if isinstance(policy, str):
            self.policy: Policy = make_policy(policy, self.profiles, **policy_kwargs)
        else:
            self.policy = policy
            self.policy.bind(self.profiles)
        self.dead_after_s = dead_after_s
        # Policies that only need to know when their tasks leave get a direct call instead of
        # an event object per completion (the hot path of a large simulation).
        self._task_left = None
        self._watched: object = None
        if isinstance(self.policy, BasePolicy) and type(self.policy).observe is BasePolicy.observe:
            self._task_left = self.policy.task_left
            self._watched = self.policy.watched
        self._inflight: dict[str, Placement] = {}
        self.recent: deque[Decision] = deque(maxlen=keep_decisions)
        self._n_done = 0
        self._abs_err = 0.0
        self._rel_err = 0.0
        # (endpoint, worker) -> functions that worker has run: the first call of a function in
        # a worker is a cold call (it deserialized the function, ran its imports). Bounded.
        self._worker_fns: dict[tuple[str, Any], set[str]] = {}
        # Calibration (issue 27): per endpoint, per term, predicted against actual; a consistent
        # error of the transfer terms (tasks that found a free worker) becomes a bounded
        # correction of the endpoint's transfer + queue key (Fleet.set_bias).
        self.calibrate = calibrate
        self.calibration: dict[str, dict[str, TermError]] = {}
        self._qacc: dict[str, list[float]] = {}  # endpoint -> [decayed measured queue, decayed modelled queue, samples]

    # ------------------------------------------------------------------ endpoints
    def add_endpoint(self, ep: EndpointState, now: float | None = None) -> None:
        """Register (or replace) an endpoint; with ``now`` and ``ep.online`` it counts as seen."""
        self.fleet.upsert(ep)
        if now is not None and ep.online:
            self.profiles.heartbeat(ep.endpoint_id, now)
            ep.last_seen = now

    def remove_endpoint(self, endpoint_id: str) -> list[str]:
        """Forget an endpoint; returns the tasks that were in flight there (for the hub to requeue)."""
        tasks = self.fleet.in_flight(endpoint_id)
        for t in tasks:
            self._inflight.pop(t, None)
        self.fleet.remove(endpoint_id)
        return tasks

    def heartbeat(
        self,
        endpoint_id: str,
        now: float,
        *,
        queued: int | None = None,
        running: int | None = None,
        warm_functions: Iterable[str] | None = None,
        workers: int | None = None,
        rtt_s: float | None = None,
    ) -> bool:
        """The hub heard from the endpoint. Returns True if it was believed offline."""
        fleet = self.fleet
        node = fleet.nodes[endpoint_id]
        node.ep.last_seen = now
        self.profiles.heartbeat(endpoint_id, now)
        back = fleet.set_online(endpoint_id, True)
        if workers is not None:
            fleet.set_workers(endpoint_id, workers)
        if queued is not None or running is not None:
            fleet.set_backlog(endpoint_id, queued or 0, running or 0)
        if warm_functions is not None:
            fleet.set_warm(endpoint_id, warm_functions)
        if rtt_s is not None:
            self.profiles.observe_rtt(endpoint_id, rtt_s, now)
            fleet.refresh_link(endpoint_id)
        return back

    def endpoint_offline(self, endpoint_id: str, now: float, since: float | None = None) -> list[str]:
        """Declare an endpoint dead (last heard from at ``since``). Returns the tasks placed
        there and not completed; the hub may requeue the ones the agent never fetched and
        report them with :meth:`task_requeued`."""
        node = self.fleet.nodes[endpoint_id]
        if since is None:
            since = node.ep.last_seen
        self.profiles.mark_offline(endpoint_id, now, since)
        self.fleet.set_online(endpoint_id, False)
        return self.fleet.in_flight(endpoint_id)

    def sweep(self, now: float) -> list[str]:
        """Watchdog: declare endpoints silent for more than ``dead_after_s`` offline."""
        dead = []
        for node in list(self.fleet.nodes.values()):
            ep = node.ep
            if ep.online and ep.last_seen is not None and now - ep.last_seen > self.dead_after_s:
                self.endpoint_offline(ep.endpoint_id, now, ep.last_seen)
                dead.append(ep.endpoint_id)
        return dead

    def link_echo(self, endpoint_id: str, rtt_s: float, now: float, offset_s: float | None = None) -> None:
        """An echoed timestamp came back: the link's round trip ``rtt_s`` (the peer's hold
        time and this side's queueing taken out) and the exchange's clock offset ``offset_s``
        (the peer's stamps minus ours). Latency becomes half a low percentile of recent round
        trips; the offset that of the fastest one (NTP). Same as ``heartbeat(rtt_s=...)``."""
        self.profiles.observe_rtt(endpoint_id, rtt_s, now, offset_s)
        self.fleet.refresh_link(endpoint_id)

    def clock_offset(self, endpoint_id: str) -> float | None:
        """The endpoint's clock minus ours, from its fastest recent echo (None until echoed)."""
        ln = self.profiles.links.get(endpoint_id)
        return ln.clock.offset if ln is not None else None

    def message_timing(self, endpoint_id: str, nbytes: int, seconds: float, now: float) -> None:
        """A message of ``nbytes`` took ``seconds`` one way between hub and endpoint."""
        self.profiles.observe_transfer(endpoint_id, nbytes, seconds, now)
        self.fleet.refresh_link(endpoint_id)

    # ------------------------------------------------------------------ tasks
    def place(
        self,
        tasks: Sequence[TaskInfo],
        now: float,
        endpoints: Iterable[EndpointState] | None = None,
    ) -> list[Placement]:
        """Choose endpoints for a batch (list-scheduled: each placement sees the ones before).

        ``endpoints``, if given, are synced into the fleet first (new objects replace the
        stored ones); otherwise the fleet as maintained by the other calls is used. Raises
        :class:`~scheduler.model.NoEligibleEndpoint` if a task's constraints rule out every
        endpoint (tasks before it in the batch stay placed).
        """
        if endpoints is not None:
            nodes = self.fleet.nodes
            for ep in endpoints:
                n = nodes.get(ep.endpoint_id)
                if n is None or n.ep is not ep:
                    self.fleet.upsert(ep)
        placements = self.policy.place(tasks, self.fleet, now)
        inflight = self._inflight
        for pl in placements:
            inflight[pl.task_id] = pl
        return placements

    def assign(self, task: TaskInfo, endpoint_id: str, now: float) -> None:
        """A task the caller placed itself (a user named the endpoint): it joins that
        endpoint's queue in the ledger with its predicted work, so that later placements see
        the backlog, and leaves it on completion like any other. No decision is recorded."""
        node = self.fleet.nodes[endpoint_id]
        pr = getattr(self.policy, "predictor", None)
        if pr is not None:
            p = pr.estimate(task, node, now)
            work = p.cold + p.run
        else:
            work = self.profiles.runtime(task.function_id, endpoint_id, task.payload_bytes)[0]
        self.fleet.assign(task.task_id, node, work, task.function_id)

    def task_completed(
        self,
        task_id: str,
        now: float,
        runtime_s: float,
        *,
        cold_start_s: float = 0.0,
        result_bytes: int | None = None,
        ok: bool = True,
        error: str | None = None,
        warm_functions: Iterable[str] | None = None,
        endpoint_id: str | None = None,
        function_id: str | None = None,
        payload_bytes: int | None = None,
        worker: Any = None,
        started_at: float | None = None,
    ) -> Decision | None:
        """A result reached the hub: learn from it and close its decision.

        ``runtime_s`` is the function body's own run time as the agent measured it;
        ``cold_start_s`` the extra start-up time when the worker was cold. Failed tasks
        (``ok=False``) teach nothing about runtime; a failure of a type in
        ``BLOCKING_ERRORS`` blocks the function on that endpoint. ``endpoint_id`` /
        ``function_id`` / ``payload_bytes`` are only needed for tasks this scheduler did not
        place (e.g. after a hub restart).

        ``worker``: which worker ran it (the agent's worker pid), for callers whose ``runtime_s``
        includes any cold start (the hub's agents report one span per call). The first call of
        a function in a worker is then a cold call, split into a cold-start and a run-time
        sample (:meth:`Profiles.observe_call`). Leave it None when ``cold_start_s`` is reported
        apart (the simulator). ``started_at``: when the run began, on this scheduler's clock
        (the hub maps the agent's stamp through its clock offset); it splits the calibration of
        the transfer and queue terms into before and after the run.
        """
        pl = self._inflight.pop(task_id, None)
        env = pl.env if pl is not None else None
        if pl is not None:
            if endpoint_id is None:
                endpoint_id = pl.endpoint_id
            if function_id is None:
                function_id = pl.function_id
            if payload_bytes is None:
                payload_bytes = pl.payload_bytes
        elif endpoint_id is None or function_id is None:
            entry = self.fleet.ledger.get(task_id)  # a task the caller placed itself (``assign``)
            if entry is not None:
                endpoint_id = endpoint_id or entry[0].id
                function_id = function_id or entry[2]
        if endpoint_id is None or function_id is None:
            raise KeyError(f"unknown task {task_id!r}: pass endpoint_id and function_id")
        fleet = self.fleet
        node = fleet.release(task_id)
        if node is None or node.id != endpoint_id:
            node = fleet.nodes.get(endpoint_id)
        if node is not None:
            ep = node.ep
            if not ep.online:
                self.heartbeat(endpoint_id, now)  # a result is proof of life
            else:
                ep.last_seen = now
            if ok:
                busy = node.n_out + node.extra > 0  # more work here after this one (throughput)
                if worker is not None and cold_start_s <= 0.0 and env is None:
                    changed, cold_changed = self.profiles.observe_call(
                        function_id, endpoint_id, runtime_s, now, payload_bytes or 0, result_bytes,
                        cold_call=self._first_in_worker(endpoint_id, worker, function_id), busy=busy)
                    if changed:
                        fleet.refresh_deviation(function_id, endpoint_id)
                    if cold_changed:
                        fleet.refresh_cold(function_id, endpoint_id)
                else:
                    if self.profiles.observe_completion(
                        function_id, endpoint_id, runtime_s, now,
                        payload_bytes or 0, result_bytes, cold_start_s, busy,
                    ):
                        fleet.refresh_deviation(function_id, endpoint_id)
                    if cold_start_s > 0.0:
                        fleet.refresh_cold(function_id, endpoint_id)
            elif error in BLOCKING_ERRORS or (error == ENV_ERROR and env is not None):
                fleet.block(block_key(function_id, env), endpoint_id)
            if warm_functions is not None:
                fleet.set_warm(endpoint_id, warm_functions)
        if self._task_left is not None:
            if task_id in self._watched:  # type: ignore[operator]
                self._task_left(task_id)
        else:
            self.policy.observe(TaskCompleted(task_id, now, runtime_s, cold_start_s, result_bytes, ok, error))
        if pl is None:
            return None
        actual = now - pl.placed_at
        dec = Decision(pl, now, actual, runtime_s, ok)
        p = pl.raw_predicted
        if ok and p is not None:
            if isinstance(p, Prediction):  # else already a tuple in its field order
                p = (p.endpoint_id, p.total, p.transfer_in, p.queue, p.cold, p.run, p.transfer_out, p.outage)
            err = actual - p[1]
            if err < 0.0:
                err = -err
            self._n_done += 1
            self._abs_err += err
            if actual > 0.0:
                self._rel_err += err / actual
            if self.calibrate and node is not None:
                self._calibrate(node, p, actual, runtime_s + cold_start_s, now, started_at)
        self.recent.append(dec)
        return dec

    #: The correction of an endpoint's transfer + queue terms stays within these seconds: it
    #: may add up to this much, and take away at most its predicted round trip.
    MAX_BIAS_S = 2.0
    #: The factor on an endpoint's modelled queue wait stays within these bounds, and follows
    #: about the last 1 / (1 - QSCALE_DECAY) queued tasks.
    QSCALE_BOUNDS = (0.5, 2.5)
    QSCALE_DECAY = 0.9

    def _calibrate(self, node: Any, p: tuple, actual: float, run_act: float, now: float, started_at: float | None) -> None:
        """Compare one completed prediction's terms with what happened."""
        eid = node.id
        cal = self.calibration.get(eid)
        if cal is None:
            cal = self.calibration[eid] = {k: TermError() for k in ("total", "run", "overhead")}
        bias = node.bias
        cal["total"].observe(p[1], actual)
        cal["run"].observe(p[4] + p[5], run_act)
        # transfer in + queue + transfer out, as predicted before the correction
        over = p[2] + p[3] - bias + p[6]
        cal["overhead"].observe(over, actual - run_act)
        if p[3] - bias <= 0.0:
            # No queue predicted (a worker was free): the rest is the link and the hub's own
            # delays. Only this part is corrected; a queue error depends on the load of the moment.
            t = cal.get("transfer")
            if t is None:
                t = cal["transfer"] = TermError()
            t.observe(over, actual - run_act)
        if started_at is not None:
            start_act = started_at - (now - actual)
            for name, pred, act in (("queue", p[2] + p[3] - bias, start_act), ("transfer_out", p[6], actual - start_act - run_act)):
                t = cal.get(name)
                if t is None:
                    t = cal[name] = TermError()
                t.observe(pred, act)
            self._scale_queue(node, p[3] - bias, start_act - p[2])
        t = cal.get("transfer")
        b = t.bias() if t is not None else 0.0
        lo = -2.0 * node.one_way
        b = lo if b < lo else self.MAX_BIAS_S if b > self.MAX_BIAS_S else b
        if b != bias:
            self.fleet.set_bias(eid, b)

    def _scale_queue(self, node: Any, pred_q: float, act_q: float) -> None:
        """The queue model counts only the tasks' own run and cold times; per-task overheads
        (dispatch, results, a CPU shared with the hub) make a backlog drain slower than that, by
        a factor that is the endpoint's, not the moment's. So: a decayed ratio of measured to
        modelled queue wait over the tasks that did queue, bounded (``QSCALE_BOUNDS``)."""
        if pred_q <= 0.0 or not math.isfinite(act_q):
            return
        raw = pred_q / node.qscale  # as modelled, before the factor in force
        acc = self._qacc.get(node.id)
        if acc is None:
            acc = self._qacc[node.id] = [0.0, 0.0, 0]
        d = self.QSCALE_DECAY
        acc[0] = d * acc[0] + max(0.0, act_q)
        acc[1] = d * acc[1] + raw
        acc[2] += 1
        if acc[2] < 5 or acc[1] <= 0.0:
            return
        lo, hi = self.QSCALE_BOUNDS
        s = acc[0] / acc[1]
        s = lo if s < lo else hi if s > hi else s
        if abs(s - node.qscale) > 0.02:
            self.fleet.set_qscale(node.id, s)

    def calibration_report(self, endpoint_id: str) -> dict[str, Any]:
        """Per term: mean error (actual - predicted), its spread, mean absolute and relative
        error, samples, and the corrections in force (``applied_bias_s``, from ``transfer``;
        ``applied_queue_scale``, the factor on the modelled queue wait)."""
        out = {k: t.to_dict() for k, t in self.calibration.get(endpoint_id, {}).items()}
        node = self.fleet.nodes.get(endpoint_id)
        out["applied_bias_s"] = node.bias if node is not None else 0.0  # type: ignore[assignment]
        out["applied_queue_scale"] = node.qscale if node is not None else 1.0  # type: ignore[assignment]
        return out

    def _first_in_worker(self, endpoint_id: str, worker: Any, function_id: str) -> bool:
        key = (endpoint_id, worker)
        fns = self._worker_fns.get(key)
        if fns is None:
            if len(self._worker_fns) >= 50_000:  # workers come and go (restarts): forget the oldest
                for k in list(self._worker_fns)[:10_000]:
                    del self._worker_fns[k]
            fns = self._worker_fns[key] = set()
        if function_id in fns:
            return False
        fns.add(function_id)
        return True

    def task_requeued(self, task_id: str, now: float) -> None:
        """The hub took a placed task back (never fetched by a dead endpoint, or cancelled)."""
        self.fleet.release(task_id)
        pl = self._inflight.pop(task_id, None)
        if pl is not None:
            self.recent.append(Decision(pl, requeued_at=now))
        if self._task_left is not None:
            if task_id in self._watched:  # type: ignore[operator]
                self._task_left(task_id)
        else:
            self.policy.observe(TaskRequeued(task_id, now))

    def retract(self, task_ids: Iterable[str]) -> None:
        """Undo placements that never took effect (the hub refused the rest of the batch or
        could not store it): they leave the ledger and record no decision, as if never made."""
        for task_id in task_ids:
            self.fleet.release(task_id)
            self._inflight.pop(task_id, None)
            # also for tasks placed by a batch that then failed (never in ``_inflight``): the
            # policy may have marked them as probes
            if self._task_left is not None:
                if task_id in self._watched:  # type: ignore[operator]
                    self._task_left(task_id)
            else:
                self.policy.observe(TaskRequeued(task_id, 0.0))

    def observe(self, event: Event) -> None:
        """Single entry point taking an event record (same effect as the specific methods)."""
        if isinstance(event, TaskCompleted):
            self.task_completed(event.task_id, event.now, event.runtime_s,
                                cold_start_s=event.cold_start_s, result_bytes=event.result_bytes,
                                ok=event.ok, error=event.error, warm_functions=event.warm_functions)
        elif isinstance(event, Heartbeat):
            self.heartbeat(event.endpoint_id, event.now, queued=event.queued, running=event.running,
                           warm_functions=event.warm_functions, workers=event.workers, rtt_s=event.rtt_s)
        elif isinstance(event, EndpointOffline):
            self.endpoint_offline(event.endpoint_id, event.now, event.since)
        elif isinstance(event, MessageTiming):
            self.message_timing(event.endpoint_id, event.nbytes, event.seconds, event.now)
        elif isinstance(event, TaskRequeued):
            self.task_requeued(event.task_id, event.now)
        else:
            raise TypeError(f"unknown scheduler event {event!r}")

    # ------------------------------------------------------------------ console / persistence
    def decision(self, task_id: str) -> Decision | None:
        """The decision for a task: still open (no actual time yet) or among the recent ones."""
        pl = self._inflight.get(task_id)
        if pl is not None:
            return Decision(pl)
        for d in reversed(self.recent):
            if d.placement.task_id == task_id:
                return d
        return None

    def decisions(self, limit: int = 100) -> list[Decision]:
        """Most recent closed decisions first (predicted vs actual)."""
        out = []
        for d in reversed(self.recent):
            out.append(d)
            if len(out) >= limit:
                break
        return out

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def prediction_error(self) -> dict[str, float]:
        """Mean absolute and mean relative error of predicted completion times so far."""
        n = self._n_done
        return {
            "completed": n,
            "mean_abs_error_s": self._abs_err / n if n else 0.0,
            "mean_rel_error": self._rel_err / n if n else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        """What the hub persists across restarts: the learned profiles (endpoints and tasks in
        flight live in the hub's own database and are re-added on start)."""
        return {"policy": self.policy.name, "profiles": self.profiles.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], **kwargs: Any) -> "Scheduler":
        kwargs.setdefault("policy", d.get("policy", "delta"))
        return cls(profiles=Profiles.from_dict(d["profiles"]), **kwargs)


__all__ = ["Scheduler", "BLOCKING_ERRORS", "BasePolicy"]
