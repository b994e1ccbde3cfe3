"""Placement policies behind one small interface.

A policy has three hooks, in the spirit of a Flower ``Strategy``:

* ``bind(profiles)`` once, to get the shared :class:`~scheduler.profiles.Profiles`;
* ``place(tasks, fleet, now) -> list[Placement]`` for a batch of tasks. Tasks are placed one by
  one in order and each placement is recorded in the fleet's ledger before the next task is
  considered, so a batch is list-scheduled by earliest predicted finish, not placed
  independently (a batch of 100 does not all land on the one fastest endpoint);
* ``observe(event)`` for completions, requeues, heartbeats (most policies only need the shared
  profiles, which the :class:`~scheduler.core.Scheduler` updates before calling this).

Every placement carries the predictions the policy compared, so the console can explain it.
"""

from __future__ import annotations

import heapq
import random
from typing import Callable, Container, Protocol, Sequence, runtime_checkable

from .events import Event, TaskCompleted, TaskRequeued
from .environments import block_key
from .fleet import Fleet, Group, Node
from .model import NoEligibleEndpoint, Placement, Prediction, TaskInfo
from .predict import Predictor
from .profiles import Profiles

INF = float("inf")


@runtime_checkable
class Policy(Protocol):
    name: str

    def bind(self, profiles: Profiles) -> None: ...

    def place(self, tasks: Sequence[TaskInfo], fleet: Fleet, now: float) -> list[Placement]: ...

    def observe(self, event: Event) -> None: ...


class BasePolicy:
    """Shared machinery: eligibility, ledger commits, placement records.

    Subclasses implement :meth:`choose`, returning the node and a short reason (and optionally
    the predictions compared); the base class predicts the chosen endpoint's completion time
    (so "predicted vs actual" works for every policy) and commits the placement.
    """

    name = "base"
    outage_aware = False

    def __init__(self, profiles: Profiles | None = None) -> None:
        self.profiles: Profiles | None = None
        self.predictor: Predictor | None = None
        if profiles is not None:
            self.bind(profiles)

    def bind(self, profiles: Profiles) -> None:
        self.profiles = profiles
        self.predictor = Predictor(profiles)

    def observe(self, event: Event) -> None:
        if isinstance(event, (TaskCompleted, TaskRequeued)):
            self.task_left(event.task_id)

    # Tasks this policy wants to hear about when they complete or are taken back (the
    # scheduler calls ``task_left`` only for these, without building an event object, when the
    # policy does not override ``observe``).
    watched: Container = frozenset()

    def task_left(self, task_id: str) -> None:
        """A watched task completed or was taken back."""
        return None

    def eligible(self, task: TaskInfo, fleet: Fleet) -> list[Node]:
        allowed = fleet.eligible(task.constraints)
        if task.endpoints is not None:
            ids = task.endpoints
            allowed = [n for n in allowed if n.id in ids]
        f = task.function_id
        nodes = allowed
        if any(n.blocked for n in allowed):
            b = block_key(f, task.env)
            nodes = [n for n in allowed if b not in n.blocked]
        if not nodes:
            detail = "the function is blocked on every eligible endpoint" if allowed else ""
            raise NoEligibleEndpoint(task, len(fleet), detail)
        return nodes

    def choose(self, task: TaskInfo, fleet: Fleet, now: float) -> tuple[Node, str, tuple[Prediction, ...], int, Prediction | None]:
        raise NotImplementedError

    def place(self, tasks: Sequence[TaskInfo], fleet: Fleet, now: float) -> list[Placement]:
        if self.predictor is None:
            raise RuntimeError(f"policy {self.name!r} is not bound to profiles; call bind() first")
        out: list[Placement] = []
        self.predictor.begin_batch()
        estimate = self.predictor.estimate
        aware = self.outage_aware
        choose = self.choose
        assign = fleet.assign
        name = self.name
        for task in tasks:
            node, reason, compared, pruned, pred = choose(task, fleet, now)
            if pred is None:
                pred = estimate(task, node, now, outage_aware=aware)
            if not compared:
                compared = (pred,)
            if type(pred) is tuple:  # (endpoint, total, t_in, queue, cold, run, t_out, outage, src, expl)
                work, expl = pred[4] + pred[5], pred[9]
            else:
                work, expl = pred.cold + pred.run, pred.exploration
            assign(task.task_id, node, work, task.function_id)
            out.append(Placement(task.task_id, task.function_id, node.id, name, now, pred,
                                 compared, pruned, reason, expl, task.payload_bytes, task.env))
        return out


def _nothing_left(task: TaskInfo) -> str:
    if task.endpoints is not None:
        return "or the function is blocked on every one that would qualify"
    return "the function is blocked on every eligible endpoint"


class RandomPolicy(BasePolicy):
    """Uniformly random eligible endpoint (seeded, so simulations are reproducible)."""

    name = "random"

    def __init__(self, profiles: Profiles | None = None, seed: int = 0) -> None:
        super().__init__(profiles)
        self.rng = random.Random(seed)

    def choose(self, task, fleet, now):
        nodes = self.eligible(task, fleet)
        return nodes[self.rng.randrange(len(nodes))], "random", (), 0, None


class RoundRobinPolicy(BasePolicy):
    """Eligible endpoints in turn (one cursor per constraint set)."""

    name = "round-robin"

    def __init__(self, profiles: Profiles | None = None) -> None:
        super().__init__(profiles)
        self.cursor: dict[object, int] = {}

    def choose(self, task, fleet, now):
        nodes = self.eligible(task, fleet)
        k = task.constraints
        i = self.cursor.get(k, 0)
        self.cursor[k] = i + 1
        return nodes[i % len(nodes)], "round-robin", (), 0, None


def _load(node: Node) -> float:
    w = node.ep.workers if node.ep.workers > 0 else 1
    return (node.n_out + node.extra) / w


class LeastLoadedPolicy(BasePolicy):
    """Endpoint with the fewest tasks in flight per worker (ties: registered first)."""

    name = "least-loaded"

    def choose(self, task, fleet, now):
        nodes = self.eligible(task, fleet)
        best = min(nodes, key=_load)
        return best, f"least loaded ({_load(best):.2f} tasks/worker)", (), 0, None


class WarmingAwarePolicy(BasePolicy):
    """funcX-style: an endpoint where the function is warm and a worker is free, else the least
    loaded endpoint (which then becomes warm)."""

    name = "warming-aware"

    def choose(self, task, fleet, now):
        nodes = self.eligible(task, fleet)
        f = task.function_id
        env = task.env  # warm over environments too (funcX routes over warm containers)
        warm = [n for n in nodes if f in n.hot and (env is None or env in n.ep.envs) and n.n_out + n.extra < (n.ep.workers or 1)]
        if warm:
            best = min(warm, key=_load)
            return best, "warm with a free worker", (), 0, None
        if env is not None:
            held = [n for n in nodes if env in n.ep.envs and n.n_out + n.extra < (n.ep.workers or 1)]
            if held:
                return min(held, key=_load), "holds the environment, with a free worker", (), 0, None
        best = min(nodes, key=_load)
        return best, "no warm endpoint free: least loaded", (), 0, None


class _Exploring(BasePolicy):
    """Delta's exploration rule, shared by the profile-driven policies: until a hardware group
    has run a function once, its estimates are guesses, so the first task of that function
    that finds such a group (and no probe of it in flight) is sent there as a probe."""

    probe = True

    def __init__(self, profiles: Profiles | None = None, *, probe: bool = True) -> None:
        super().__init__(profiles)
        self.probe = probe
        self.probes: dict[tuple[str, str], str] = {}  # (function, hardware) -> task in flight
        self.probe_tasks: dict[str, tuple[str, str]] = {}
        self.watched = self.probe_tasks  # probes in flight
        self._explored: dict[str, int] = {}  # function -> fleet version when all were profiled

    def task_left(self, task_id: str) -> None:
        key = self.probe_tasks.pop(task_id, None)
        if key is not None:
            self.probes.pop(key, None)

    def _unprofiled(self, task: TaskInfo, groups: Sequence[Group], fleet: Fleet) -> list[Group] | None:
        """Groups of the first hardware class that still needs a probe for this function."""
        f = task.function_id
        if self._explored.get(f) == fleet.version:
            return None  # every hardware class in the fleet has run f (cached until it changes)
        profiled = self.profiles.profiled  # type: ignore[union-attr]
        pending = False
        for g in groups:
            hw = g.hardware
            if not profiled(f, hw):
                pending = True
                if (f, hw) not in self.probes:
                    probe = [x for x in groups if x.hardware == hw]
                    if task.env is not None and task.env_cost is not None \
                            and not any(task.env in n.ep.envs for x in probe for n in x.onodes):
                        return None  # a probe must not first build an environment: a later task without one probes
                    if task.inputs and not any(n.id == ep for x in probe for n in x.onodes for ep, _ in task.inputs):
                        return None  # nor first move the task's inputs there (scheduler/locality.py)
                    return probe
        if not pending and all(profiled(f, g.hardware) for g in fleet.groups.values()):
            self._explored[f] = fleet.version
        return None

    def _mark_probe(self, task: TaskInfo, hardware: str) -> None:
        key = (task.function_id, hardware)
        self.probes[key] = task.task_id
        self.probe_tasks[task.task_id] = key


class FastestEndpointPolicy(_Exploring):
    """Always the endpoint with the best known runtime for the function (Delta's baseline),
    regardless of its queue."""

    name = "fastest-endpoint"

    def choose(self, task, fleet, now):
        groups = [g for g in fleet.groups_for(task.constraints) if g.okeys]
        if not groups:
            raise NoEligibleEndpoint(task, len(fleet))
        f = task.function_id
        if self.probe:
            hw_groups = self._unprofiled(task, groups, fleet)
            if hw_groups is not None:
                node = self._fastest(task, hw_groups)
                if node is not None:
                    self._mark_probe(task, node.ep.hardware)
                    return node, f"probe: first run of {f} on {node.ep.hardware}", (), 0, None
        node = self._fastest(task, groups)
        if node is None:
            raise NoEligibleEndpoint(task, len(fleet), _nothing_left(task))
        return node, "fastest known runtime", (), 0, None

    def _fastest(self, task: TaskInfo, groups: Sequence[Group]) -> Node | None:
        p = self.profiles
        f = task.function_id
        ids = task.endpoints
        best: Node | None = None
        best_r = INF
        for g in groups:
            r, _ = p.group_runtime(f, g.hardware, task.payload_bytes, g.speed)  # type: ignore[union-attr]
            gf = g.fn.get(f)
            if r * (gf.dev_min if gf is not None else 1.0) > best_r:
                continue
            for node in g.nodes.values():
                if block_key(f, task.env) in node.blocked or (ids is not None and node.id not in ids):
                    continue
                rr = r * node.dev.get(f, 1.0)
                if rr < best_r or (rr == best_r and node.idx < best.idx):  # type: ignore[union-attr]
                    best, best_r = node, rr
        return best


class DeltaPolicy(_Exploring):
    """Smallest predicted completion time (Delta), with exploration and batch list scheduling.

    ``prune`` (default on) uses the fleet's group index to skip endpoints that provably cannot
    win; ``prune=False`` scans every eligible endpoint and is kept as the reference the tests
    compare against.
    """

    name = "delta"

    def __init__(self, profiles: Profiles | None = None, *, probe: bool = True, prune: bool = True,
                 explain: bool = True, max_compared: int = 8) -> None:
        super().__init__(profiles, probe=probe)
        self.prune = prune
        self.explain = explain
        # Predictions kept per placement: the best endpoint of each of the best groups. With
        # hundreds of small groups (endpoints without a shared hardware class) assembling all
        # of them would cost more than the search itself.
        self.max_compared = max(1, max_compared)

    def _search(self, task: TaskInfo, groups: Sequence[Group], now: float, probe: bool = False):
        return self.predictor.search(task, groups, now, prune=self.prune, batch_stable=not probe)  # type: ignore[union-attr]

    def choose(self, task, fleet, now):
        groups = fleet.groups_for(task.constraints)
        if not groups:
            raise NoEligibleEndpoint(task, len(fleet))
        pr = self.predictor
        aware = self.outage_aware
        reason = "smallest predicted completion"
        res = None
        if self.probe and self._explored.get(task.function_id) != fleet.version:
            hw_groups = self._unprofiled(task, groups, fleet)
            if hw_groups is not None:
                res = self._search(task, hw_groups, now, probe=True)
                if res.node is not None:
                    self._mark_probe(task, res.node.ep.hardware)
                    reason = f"probe: first run of {task.function_id} on {res.node.ep.hardware}"
                else:
                    res = None
        if res is None:
            res = self._search(task, groups, now)
        node = res.node
        if node is None:
            raise NoEligibleEndpoint(task, len(fleet), _nothing_left(task))
        assemble = pr.assemble  # type: ignore[union-attr]
        ob = res.ob
        pred = assemble(task, node, now, res.run, res.cold, res.source, outage_aware=aware, ob=ob)
        compared: tuple = ()
        if self.explain:
            gb = res.group_best
            if len(gb) == 1:
                compared = (pred,)
            else:
                if len(gb) > self.max_compared:  # the winner is the smallest (total, idx): kept
                    gb = heapq.nsmallest(self.max_compared, gb, key=lambda x: (x[0], x[1].idx))
                compared = tuple(
                    pred if n is node else assemble(task, n, now, run, cold, src, outage_aware=aware, ob=ob)
                    for _, n, run, cold, src in gb
                )
        return node, reason, compared, res.pruned, pred


class OutageAwareDeltaPolicy(DeltaPolicy):
    """Delta plus the availability model (what Delta left as a TODO).

    * Endpoints the hub has declared dead are not candidates (unless every eligible endpoint is
      dead: then the one expected back and done soonest gets the task, which waits there).
    * Every prediction adds the expected delay from outages over the task's window: the chance
      of a random outage times its mean length plus the lost work, or a recurring
      time-of-day outage (a Pi that sleeps every night) that the task would run into.
    """

    name = "delta-outage-aware"
    outage_aware = True

    def _search(self, task: TaskInfo, groups: Sequence[Group], now: float, probe: bool = False):
        pr = self.predictor
        res = pr.search(task, groups, now, outage_aware=True, prune=self.prune, skip_offline=True,  # type: ignore[union-attr]
                        batch_stable=not probe)
        if res.node is None and not probe:
            # Every eligible endpoint is believed offline: the task has to wait somewhere, so
            # pick the one expected back (and done) soonest.
            res = pr.search(task, groups, now, outage_aware=True, prune=self.prune, batch_stable=True)  # type: ignore[union-attr]
        return res


POLICIES: dict[str, Callable[..., BasePolicy]] = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "warming-aware": WarmingAwarePolicy,
    "fastest-endpoint": FastestEndpointPolicy,
    "delta": DeltaPolicy,
    "delta-outage-aware": OutageAwareDeltaPolicy,
}


def make_policy(name: str, profiles: Profiles | None = None, **kwargs) -> BasePolicy:
    """Build a policy by name (see ``POLICIES``); unknown names get a clear error."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(profiles, **kwargs)


def register_policy(name: str, factory: Callable[..., BasePolicy]) -> None:
    """Make another policy available to ``make_policy`` (the simulator's oracle uses this)."""
    POLICIES[name] = factory
