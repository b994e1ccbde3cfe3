"""The set of endpoints the scheduler can place on, with work in flight and a search index.

Why a separate structure: with a thousand endpoints and a million tasks the placement hot path
cannot afford to look at every endpoint for every task. The fleet keeps

* a **ledger** of tasks placed and not yet completed per endpoint (count and predicted work),
  from which the queue wait is computed exactly and self-corrects on every completion;
* **groups** of endpoints that are identical for the prediction model apart from their queue,
  link, warm state and liveness: same hardware class, tags, GPU, memory and speed hint, and
  whether the endpoint runs some function faster than its hardware group (see
  :class:`scheduler.estimators.PairStats`). Each group keeps its members sorted by
  ``key = queue wait + round-trip latency``, the part of the predicted completion time that
  does not depend on the task, and per function the members where it is warm. Together with
  per-group lower bounds on the rest (see :mod:`scheduler.predict`) this lets the search visit
  a group's members best-first and stop as soon as no remaining member can beat the best found
  so far. The pruning is exact: it returns the same endpoint as a full scan (tests check this).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING, Iterable, Iterator

from .model import Constraints, EndpointState

if TYPE_CHECKING:
    from .availability import Availability, BehindGateway
    from .estimators import DecayedMean, RuntimeStats, Throughput
    from .profiles import Profiles

INF = float("inf")
DENSE_ON = 0.6  # share of warm members from which a function's warm list is dropped ...
DENSE_OFF = 0.4  # ... and below which it is rebuilt


# Sorted member lists are kept as two parallel lists, keys (floats) and nodes: bisecting a list
# of floats is cheaper than one of tuples, and a queue change moves a node on every task.
# Equal keys keep insertion order; the search visits all members whose bound ties, so the order
# among ties does not matter.
def _insert(keys: list[float], nodes: list["Node"], k: float, node: "Node") -> None:
    i = bisect_right(keys, k)
    keys.insert(i, k)
    nodes.insert(i, node)


def _remove(keys: list[float], nodes: list["Node"], k: float, node: "Node") -> None:
    i = bisect_left(keys, k)
    while nodes[i] is not node:
        i += 1
    del keys[i]
    del nodes[i]


class Node:
    """Scheduler-side state of one endpoint (wraps the hub's :class:`EndpointState`)."""

    __slots__ = (
        "ep", "id", "idx", "group", "n_out", "work_out", "extra", "wait", "key", "skey",
        "one_way", "bw", "hot", "dev", "blocked", "avail", "cold_est", "tp", "fn_out", "bias", "qscale",
    )

    def __init__(self, ep: EndpointState, idx: int) -> None:
        self.ep = ep
        self.id = ep.endpoint_id
        self.idx = idx
        self.group: Group | None = None
        self.n_out = 0  # tasks placed here and not completed (ledger)
        self.work_out = 0.0  # their predicted seconds of work (cold start + run)
        self.extra = 0  # backlog the agent reported beyond the ledger
        self.wait = 0.0
        self.key = 0.0  # queue wait + round-trip latency (exact, used in predictions)
        self.skey = 0.0  # the key this node is filed under in its group's lists (== key here;
        # the search only relies on skey <= key, so a lazier index could let it lag behind)
        self.one_way = 0.05
        self.bw = 1e6
        self.hot: set[str] = set(ep.warm_functions)  # warm, or about to be (a task was sent)
        self.dev: dict[str, float] = {}  # function -> deviation factor, only where != 1
        self.blocked: set[str] = set()  # functions that failed here with a missing module / OOM
        self.avail: Availability | BehindGateway | None = None  # the endpoint's Availability (set by the fleet)
        self.tp: Throughput | None = None  # the endpoint's measured Throughput (set by the fleet)
        self.cold_est: dict[str, float] = {}  # function -> this endpoint's own cold-start estimate
        self.fn_out: dict[str, int] = {}  # function -> its tasks in the ledger here (they make it warm)
        self.bias = 0.0  # calibration: seconds added to transfer + queue (Scheduler, bounded)
        self.qscale = 1.0  # calibration: measured / modelled queue wait (per-task overheads), bounded

    def compute_wait(self) -> float:
        """Predicted seconds before a newly placed task gets a worker (fluid model).

        ``(backlog - workers + 1)+ / throughput`` with throughput = workers / mean predicted
        work of the tasks ahead: no wait while a worker is free, then one mean task-time per
        worker for each task beyond capacity.
        """
        workers = self.ep.workers if self.ep.workers > 0 else 1
        n = self.n_out + self.extra
        if n < workers:
            return 0.0
        return (n - workers + 1) * self.mean_work(workers) / workers * self.qscale

    def mean_work(self, workers: int) -> float:
        """Mean seconds of work per task ahead: from the ledger's predictions, or for backlog
        only the agent reported, from the endpoint's measured throughput (workers / rate)."""
        if self.n_out:
            return self.work_out / self.n_out
        rate = self.tp.rate if self.tp is not None else None
        return workers / rate if rate else 1.0

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Node({self.id!r}, n_out={self.n_out}, wait={self.wait:.3g})"


class GroupFn:
    """What the search needs about one function in one group, kept up to date in place.

    ``wkeys``/``wnodes``: members where the function is warm (or about to be), sorted by key
    like the group's ``okeys``/``onodes`` - unless ``dense``: most members are warm (at least
    60 %, until it falls below 40 %), the lists are then left empty and the search scans the
    group's own with no cold-start bound (saves maintaining a copy of it on every
    queue change, the common case once a fleet has warmed up); ``count``: warm members;
    ``dev_min``: the smallest runtime deviation factor of a member
    (at most 1.0); ``cold_min``: the smallest per-endpoint cold-start estimate of a member;
    ``sv``/``stats``/``cold``: the group's runtime and cold-start estimators as of profiles
    structure version ``sv`` (references to the live objects).
    """

    __slots__ = ("wkeys", "wnodes", "dense", "count", "dev_min", "cold_min", "sv", "stats", "cold",
                 "cold_const")

    def __init__(self) -> None:
        self.wkeys: list[float] = []
        self.wnodes: list[Node] = []
        self.dense = False
        self.count = 0
        self.dev_min = 1.0
        self.cold_min = INF
        self.sv = -1
        self.stats: RuntimeStats | None = None
        self.cold: DecayedMean | None = None
        self.cold_const = 0.0  # cold-start fallback when the group has no estimate of its own


class Group:
    """Endpoints that share one model (see module docstring), sorted by ``key``."""

    __slots__ = ("gkey", "hardware", "speed", "sample", "nodes", "okeys", "onodes", "fn", "bw_max")

    def __init__(self, gkey: tuple, sample: EndpointState) -> None:
        self.gkey = gkey
        self.hardware = sample.hardware
        self.speed = sample.speed if sample.speed > 0 else 1.0
        self.sample = sample  # any member: its static attributes decide eligibility
        self.nodes: dict[int, Node] = {}
        self.okeys: list[float] = []  # members' keys, ascending
        self.onodes: list[Node] = []  # the members, in that order
        self.fn: dict[str, GroupFn] = {}
        self.bw_max = 0.0

    def allows(self, c: Constraints) -> bool:
        return c.allows(self.sample)

    def fn_of(self, function_id: str) -> GroupFn:
        gf = self.fn.get(function_id)
        if gf is None:
            gf = self.fn[function_id] = GroupFn()
        return gf

    def recompute_bounds(self) -> None:
        self.bw_max = max((n.bw for n in self.nodes.values()), default=0.0)
        for gf in self.fn.values():
            gf.dev_min = 1.0
        for n in self.nodes.values():
            for f, s in n.dev.items():
                gf = self.fn_of(f)
                if s < gf.dev_min:
                    gf.dev_min = s


class Fleet:
    """Endpoints by id, the in-flight ledger and the group index."""

    def __init__(self, profiles: "Profiles") -> None:
        self.profiles = profiles
        self.nodes: dict[str, Node] = {}
        self.by_idx: list[Node | None] = []
        self.groups: dict[tuple, Group] = {}
        self.ledger: dict[str, tuple[Node, float, str]] = {}  # task -> (node, work, function)
        self.version = 0  # bumped when membership/eligibility changes
        self._eligible_cache: dict[tuple, list[Node]] = {}
        self._groups_cache: dict[Constraints, list[Group]] = {}
        self._last_constraints: Constraints | None = None
        self._last_groups: list[Group] | None = None

    def _clear_groups_cache(self) -> None:
        self._groups_cache.clear()
        self._last_constraints = None
        self._last_groups = None

    # ------------------------------------------------------------------ membership
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[EndpointState]:
        return (n.ep for n in self.nodes.values())

    def __contains__(self, endpoint_id: object) -> bool:
        return endpoint_id in self.nodes

    def __getitem__(self, endpoint_id: str) -> EndpointState:
        return self.nodes[endpoint_id].ep

    def node(self, endpoint_id: str) -> Node:
        return self.nodes[endpoint_id]

    def upsert(self, ep: EndpointState) -> Node:
        """Add an endpoint or replace the hub's record of it (keeps its ledger)."""
        node = self.nodes.get(ep.endpoint_id)
        self.profiles.register_endpoint(ep.endpoint_id, ep.hardware, ep.speed)
        if node is None:
            node = Node(ep, len(self.by_idx))
            self.by_idx.append(node)
            self.nodes[ep.endpoint_id] = node
            node.avail = self.profiles.availability_view(ep.endpoint_id)
            node.tp = self.profiles.throughput_of(ep.endpoint_id)
            self._read_link(node)
            self._read_profiles(node)
        else:
            self._unindex(node)
            node.ep = ep
            node.hot = set(ep.warm_functions) | node.fn_out.keys()  # what it was sent stays warm (set_warm)
            node.avail = self.profiles.availability_view(ep.endpoint_id)  # its gateway may have changed
            self._read_link(node)
        self._index(node)
        self.version += 1
        self._eligible_cache.clear()
        return node

    def update(self, ep: EndpointState) -> None:
        """Re-read an endpoint whose fields the caller mutated in place (keeps its ledger)."""
        self.upsert(ep)

    def remove(self, endpoint_id: str) -> None:
        node = self.nodes.pop(endpoint_id)
        self._unindex(node)
        self.by_idx[node.idx] = None
        for tid in [t for t, (n, _, _) in self.ledger.items() if n is node]:
            del self.ledger[tid]
        self.version += 1
        self._eligible_cache.clear()

    @staticmethod
    def _fast(node: Node) -> bool:
        return any(s < 1.0 for s in node.dev.values())

    def _gkey(self, node: Node) -> tuple:
        # Endpoints that run some function faster than their hardware group sit in a group of
        # their own kind, so that one odd device cannot loosen the runtime bound of all the
        # ordinary ones. Slower ones stay: the bound (min factor, at most 1) remains tight.
        ep = node.ep
        return (ep.hardware, ep.tags, ep.gpu, ep.memory_mb, ep.speed, self._fast(node))

    def _index(self, node: Node) -> None:
        gk = self._gkey(node)
        g = self.groups.get(gk)
        if g is None:
            g = self.groups[gk] = Group(gk, node.ep)
            self._clear_groups_cache()
        node.group = g
        g.nodes[node.idx] = node
        node.wait = node.compute_wait()
        node.key = node.skey = node.wait + 2.0 * node.one_way + node.bias
        _insert(g.okeys, g.onodes, node.key, node)
        for f in node.hot:
            gf = g.fn_of(f)
            gf.count += 1
            if not gf.dense:
                _insert(gf.wkeys, gf.wnodes, node.skey, node)
        for f, gf in g.fn.items():
            self._settle(g, f, gf)
        for f, s in node.dev.items():
            gf = g.fn_of(f)
            if s < gf.dev_min:
                gf.dev_min = s
        for f, c in node.cold_est.items():
            gf = g.fn_of(f)
            if c < gf.cold_min:
                gf.cold_min = c
        if node.bw > g.bw_max:
            g.bw_max = node.bw

    def _unindex(self, node: Node) -> None:
        g = node.group
        if g is None:
            return
        k = node.skey
        _remove(g.okeys, g.onodes, k, node)
        del g.nodes[node.idx]
        for f in node.hot:
            gf = g.fn[f]
            gf.count -= 1
            if not gf.dense:
                _remove(gf.wkeys, gf.wnodes, k, node)
        node.group = None
        for f, gf in g.fn.items():
            self._settle(g, f, gf)
        if not g.nodes:
            del self.groups[g.gkey]
            self._clear_groups_cache()
        else:
            g.recompute_bounds()

    @classmethod
    def _warm_add(cls, g: Group, f: str, node: Node) -> None:
        """``node`` (a member of ``g``, ``f`` already in ``node.hot``) became warm for ``f``."""
        gf = g.fn_of(f)
        gf.count += 1
        if not gf.dense:
            _insert(gf.wkeys, gf.wnodes, node.skey, node)
            cls._settle(g, f, gf)

    @staticmethod
    def _settle(g: Group, f: str, gf: GroupFn) -> None:
        """Switch between an explicit warm list and "dense" (most members warm), with
        hysteresis so that one endpoint going cold and warm again does not rebuild lists."""
        n = len(g.nodes)
        if not n:
            return
        if not gf.dense:
            if gf.count >= DENSE_ON * n:
                gf.dense, gf.wkeys, gf.wnodes = True, [], []
        elif gf.count < DENSE_OFF * n:
            gf.dense = False
            members = sorted((m.skey, m.idx, m) for m in g.nodes.values() if f in m.hot)
            gf.wkeys = [k for k, _, _ in members]
            gf.wnodes = [m for _, _, m in members]

    def _read_profiles(self, node: Node) -> None:
        """Pick up what profiles already know about a (re)registered endpoint, e.g. after a
        hub restart with persisted profiles: deviation factors and cold-start estimates."""
        p = self.profiles
        eid = node.id
        for (f, e), st in p.pair.items():
            if e == eid and st.factor != 1.0:
                node.dev[f] = st.factor
        for (f, e), c in p.cold_pair.items():
            if e == eid:
                node.cold_est[f] = c.mean

    def _read_link(self, node: Node) -> None:
        ln = self.profiles.link(node.id)
        node.one_way = ln.latency
        node.bw = self.profiles.bandwidth(node.id)

    # ------------------------------------------------------------------ state changes
    def set_online(self, endpoint_id: str, online: bool) -> bool:
        """Record the hub's liveness belief; returns True if it changed."""
        node = self.nodes[endpoint_id]
        if bool(node.ep.online) == online:
            return False
        node.ep.online = online
        self._eligible_cache.clear()
        self.version += 1
        return True

    def set_backlog(self, endpoint_id: str, queued: int, running: int) -> None:
        """Backlog the agent reported; only the part the ledger does not know counts."""
        node = self.nodes[endpoint_id]
        node.ep.queued, node.ep.running = queued, running
        extra = queued + running - node.n_out
        node.extra = extra if extra > 0 else 0
        self._rekey(node)

    def set_workers(self, endpoint_id: str, workers: int) -> None:
        node = self.nodes[endpoint_id]
        if workers != node.ep.workers:
            node.ep.workers = workers
            self._rekey(node)

    def set_warm(self, endpoint_id: str, warm: Iterable[str]) -> None:
        """The agent's warm functions, merged with what the hub has sent it and not yet heard
        back about: a function with tasks in the ledger here stays warm (its worker loads it
        for the first of them), so a beat taken before the worker had loaded it does not mark it
        cold again (issue 27). Everything else the agent reports is authoritative."""
        node = self.nodes[endpoint_id]
        new = set(warm)
        node.ep.warm_functions = frozenset(new)
        if node.fn_out:
            new.update(node.fn_out)
        old = node.hot
        if new == old:
            return
        g = node.group
        node.hot = new
        assert g is not None  # every node in self.nodes is indexed
        for f in old - new:
            gf = g.fn[f]
            gf.count -= 1
            if not gf.dense:
                _remove(gf.wkeys, gf.wnodes, node.skey, node)
            self._settle(g, f, gf)
        for f in new - old:
            self._warm_add(g, f, node)

    def set_envs(self, endpoint_id: str, envs: Iterable[str]) -> None:
        """Environment spec ids the agent can start without a build (its heartbeats' ``envs``).
        Read live by the search (no index: few tasks name an environment)."""
        node = self.nodes.get(endpoint_id)
        if node is not None:
            node.ep.envs = frozenset(envs)

    def refresh_link(self, endpoint_id: str) -> None:
        node = self.nodes[endpoint_id]
        old_bw = node.bw
        self._read_link(node)
        g = node.group
        assert g is not None  # every node in self.nodes is indexed
        if node.bw > g.bw_max:
            g.bw_max = node.bw
        elif old_bw >= g.bw_max and node.bw < old_bw:
            g.bw_max = max(n.bw for n in g.nodes.values())
        self._rekey(node)

    def refresh_deviation(self, function_id: str, endpoint_id: str) -> None:
        node = self.nodes[endpoint_id]
        s = self.profiles.deviation_factor(function_id, endpoint_id)
        was_fast = self._fast(node)
        if s == 1.0:
            node.dev.pop(function_id, None)
        else:
            node.dev[function_id] = s
        if self._fast(node) != was_fast:
            self._unindex(node)
            self._index(node)
            self._eligible_cache.clear()
            return
        g = node.group
        assert g is not None  # every node in self.nodes is indexed
        m = 1.0
        for n in g.nodes.values():
            v = n.dev.get(function_id, 1.0)
            if v < m:
                m = v
        g.fn_of(function_id).dev_min = m

    def refresh_cold(self, function_id: str, endpoint_id: str) -> None:
        node = self.nodes[endpoint_id]
        c = self.profiles.cold_pair.get((function_id, endpoint_id))
        if c is not None:
            node.cold_est[function_id] = c.mean
            assert node.group is not None  # every node in self.nodes is indexed
            gf = node.group.fn_of(function_id)
            if c.mean < gf.cold_min:
                gf.cold_min = c.mean

    def set_bias(self, endpoint_id: str, bias: float) -> None:
        """Calibration's correction of this endpoint's transfer + queue terms (seconds)."""
        node = self.nodes[endpoint_id]
        if bias != node.bias:
            node.bias = bias
            self._rekey(node)

    def set_qscale(self, endpoint_id: str, scale: float) -> None:
        """Calibration's factor on this endpoint's modelled queue wait."""
        node = self.nodes[endpoint_id]
        if scale != node.qscale:
            node.qscale = scale
            self._rekey(node)

    def block(self, function_id: str, endpoint_id: str) -> None:
        """Never place this function here again (it failed with a missing module / OOM)."""
        self.nodes[endpoint_id].blocked.add(function_id)

    # ------------------------------------------------------------------ ledger
    def assign(self, task_id: str, node: Node, work: float, function_id: str) -> None:
        """Record a placement: the endpoint's queue grows by one task of ``work`` seconds."""
        if task_id in self.ledger:
            self.release(task_id)
        self.ledger[task_id] = (node, work, function_id)
        node.n_out += 1
        fo = node.fn_out
        fo[function_id] = fo.get(function_id, 0) + 1
        node.work_out += work
        if node.extra:
            node.extra -= 1
        if function_id not in node.hot:
            node.hot.add(function_id)
            assert node.group is not None  # a node placed on is indexed
            self._warm_add(node.group, function_id, node)
        if node.n_out + node.extra >= node.ep.workers:  # below capacity the key stays the same
            self._rekey(node)

    def release(self, task_id: str) -> Node | None:
        """A task left its endpoint's queue (completed, requeued or cancelled)."""
        entry = self.ledger.pop(task_id, None)
        if entry is None:
            return None
        node, work, f = entry
        fo = node.fn_out
        c = fo.get(f, 0) - 1
        if c > 0:
            fo[f] = c
        else:
            fo.pop(f, None)
        node.n_out -= 1
        if node.n_out <= 0:
            node.n_out = 0
            node.work_out = 0.0
        else:
            node.work_out -= work
            if node.work_out < 0.0:
                node.work_out = 0.0
        if node.n_out + node.extra + 1 >= node.ep.workers:  # below capacity the key stays the same
            self._rekey(node)
        return node

    def in_flight(self, endpoint_id: str) -> list[str]:
        node = self.nodes[endpoint_id]
        return [t for t, (n, _, _) in self.ledger.items() if n is node]

    def _rekey(self, node: Node) -> None:
        """Recompute the node's queue wait and move it in its group's sorted lists."""
        # inlined Node.compute_wait (hot path)
        workers = node.ep.workers
        if workers < 1:
            workers = 1
        n = node.n_out + node.extra
        if n < workers:
            w = 0.0
        else:
            w = (n - workers + 1) * (node.work_out / node.n_out if node.n_out else node.mean_work(workers)) / workers * node.qscale
        node.wait = w
        k = w + 2.0 * node.one_way + node.bias
        node.key = k
        old = node.skey
        if k == old:
            return
        g = node.group
        if g is None:
            node.skey = k
            return
        keys = g.okeys
        nodes = g.onodes
        i = bisect_left(keys, old)
        while nodes[i] is not node:
            i += 1
        del keys[i]
        del nodes[i]
        i = bisect_right(keys, k)
        keys.insert(i, k)
        nodes.insert(i, node)
        if node.hot:
            fn = g.fn
            for f in node.hot:
                gf = fn[f]
                if not gf.dense:
                    keys = gf.wkeys
                    nodes = gf.wnodes
                    i = bisect_left(keys, old)
                    while nodes[i] is not node:
                        i += 1
                    del keys[i]
                    del nodes[i]
                    i = bisect_right(keys, k)
                    keys.insert(i, k)
                    nodes.insert(i, node)
        node.skey = k

    # ------------------------------------------------------------------ queries
    def eligible(self, constraints: Constraints, *, online_only: bool = False) -> list[Node]:
        """Endpoints that satisfy ``constraints``, in registration order (cached)."""
        ck = (constraints, online_only)
        lst = self._eligible_cache.get(ck)
        if lst is None:
            lst = [
                n for n in self.by_idx
                if n is not None and constraints.allows(n.ep) and (not online_only or n.ep.online)
            ]
            self._eligible_cache[ck] = lst
        return lst

    def groups_for(self, constraints: Constraints) -> list[Group]:
        """Groups whose members satisfy ``constraints`` (cached until groups change)."""
        if constraints is self._last_constraints and self._last_groups is not None:
            return self._last_groups
        lst = self._groups_cache.get(constraints)
        self._last_constraints = constraints
        if lst is None:
            lst = self._groups_cache[constraints] = [
                g for g in self.groups.values() if g.allows(constraints)
            ]
        self._last_groups = lst
        return lst
