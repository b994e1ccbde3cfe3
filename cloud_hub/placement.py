"""Hub-side scheduling: one :class:`scheduler.Scheduler`, fed from what the dispatcher sees.

Why it lives here and not in the dispatcher: the scheduler is pure logic and the dispatcher
moves bytes; this module is the glue between them and the database.

* **Feeding it.** :class:`PlacementService` is the dispatcher's observer
  (:class:`cloud_hub.observer.DispatchObserver`): hellos register endpoints (workers, tags,
  hardware class, GPU, memory), heartbeats report backlog and warm functions, every verified
  frame is a timed message for the link model, the watchdog's "lost" feeds the availability
  model, and every fresh result is a completion with the function's own run time
  (``finished - started`` on the agent).
* **Placing.** ``POST /v1/tasks[/batch]`` with ``endpoint_id`` = ``"auto"``, a list of ids or
  ``{"tags": [...]}`` calls :meth:`PlacementService.place` before anything is stored; the whole
  batch is placed in one call (list-scheduled by earliest predicted finish). Each placement
  becomes a decision row written in the same transaction as the task rows, so a 2xx means both
  are on disk, and a refusal stores neither.
* **Tenancy.** Every endpoint carries a private tag naming its owner (``@owner:<user>``; user
  tags cannot contain ``@``), and every request adds its caller's, so one user's "auto" can
  never land on another user's device. An explicit list is checked against ownership by the
  API first, and is passed to the scheduler as ``TaskInfo.endpoints``.
* **Outages.** When the watchdog loses an endpoint, tasks the scheduler placed there that never
  left the hub (queued, never dispatched) are placed again under the same selector; with the
  outage-aware policy they move to a live endpoint (the old decision becomes ``moved``). Tasks
  already handed to the agent stay: its durable queue runs them when it is back.
* **Persistence.** Learned profiles are saved as one JSON document every
  ``scheduler_save_s`` and at shutdown, and loaded at start-up; decisions are rows from the
  start. After a restart, endpoints are re-registered from the endpoints table (offline until
  their agents say hello again).

The agent does not report cold starts separately: a worker's first call of a function pays
its deserialization (and the function's own imports) inside the measured run time. Results name
the worker (its pid), so the scheduler splits each worker's first call of a function into a
cold-start and a run-time sample; :data:`COLD_START_PRIOR_S` is the prior until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import io
import json
import logging
import math
import pickle
import re
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from cloud_hub.observer import DispatchObserver
from cloud_hub.store import scheduling
from scheduler import Constraints, EndpointState, NoEligibleEndpoint, Scheduler, TaskInfo
from scheduler.environments import EnvCosts
from scheduler.model import Placement, Prediction
from scheduler.profiles import Profiles

if TYPE_CHECKING:
    from cloud_hub.service.schemas import TaskIn
    from cloud_hub.config import HubConfig
    from cloud_hub.store import SqliteStore

__all__ = ["PlacementService", "PlacementError", "owner_tag", "OWNER_PREFIX"]

log = logging.getLogger("cloud_hub.placement")

OWNER_PREFIX = "@owner:"
COLD_START_PRIOR_S = 0.25
MAX_COMPARED = 8  # predictions kept per decision (best first)
_TAG = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MOVE_LIMIT = 50_000  # stranded tasks re-placed per lost endpoint in one pass
_PLACE_CHUNK = 500  # tasks placed between two yields to the event loop
_STEAL_EVERY_S = 0.05  # an endpoint that runs out of work looks for more at most this often
_LOOKAHEAD_MAX = 32  # placed tasks per worker an endpoint may hold, at most (a slow link, short tasks)
_LOOKAHEAD_MIN = 3  # and at least: the one running, and two ready for when it ends
_TURN_S = 0.05  # the hub's own turn-around from a result to the next lease, allowed for (2 loaded cores)


def owner_tag(user_id: str) -> str:
    return OWNER_PREFIX + user_id


class PlacementError(Exception):
    """A placement request the hub refuses; ``status`` is the HTTP code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class _Req:
    """One task's selector, as stored with its decision (to explain it and to re-place it)."""

    kind: str  # "auto" | "list" | "tags"
    endpoints: list[str] | None
    tags: list[str] | None
    constraints: dict[str, Any]

    def selector(self) -> dict[str, Any]:
        return {"kind": self.kind, "endpoints": self.endpoints, "tags": self.tags}

    def task_info(self, user_id: str, task_id: str, function_id: str, payload_bytes: int) -> TaskInfo:
        c = self.constraints
        tags = set(c.get("tags") or ()) | set(self.tags or ()) | {owner_tag(user_id)}
        cons = Constraints(frozenset(tags), bool(c.get("gpu", False)), int(c.get("min_memory_mb", 0)))
        ids = frozenset(self.endpoints) if self.endpoints is not None else None
        return TaskInfo(task_id, function_id, payload_bytes, cons, endpoints=ids)


def _finite(x: float | None, nd: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)


_PRED_FIELDS = ("endpoint_id", "total", "transfer_in", "queue", "cold", "run", "transfer_out", "outage", "source", "exploration")


def _pred_row(p: Prediction) -> list[Any]:
    """A prediction as stored: a compact array in :data:`_PRED_FIELDS` order with times in
    whole microseconds (a decision row is written for every placed task, so its size and the
    cost of building it matter). Non-finite times are stored as null."""
    try:
        return [p.endpoint_id, int(p.total * 1e6), int(p.transfer_in * 1e6), int(p.queue * 1e6), int(p.cold * 1e6),
                int(p.run * 1e6), int(p.transfer_out * 1e6), int(p.outage * 1e6), p.source, p.exploration]
    except (OverflowError, ValueError):
        return [p.endpoint_id, *(None if x is None else int(x * 1e6) for x in map(_finite, (
            p.total, p.transfer_in, p.queue, p.cold, p.run, p.transfer_out, p.outage))), p.source, p.exploration]


def _pred_out(a: list[Any] | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {
        "endpoint_id": a[0],
        **{k: (None if v is None else v / 1e6) for k, v in zip(_PRED_FIELDS[1:8], a[1:8])},
        "source": a[8],
        "exploration": a[9],
    }


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # noqa: ARG002 - never resolve anything
        raise pickle.UnpicklingError("globals are not allowed here")


def error_type(data: bytes | None) -> str | None:
    """The remote exception's type name from a failed result's error blob, without running any
    code: JSON is parsed, a pickle is read with an unpickler that resolves no globals (the
    error dict is plain str/bytes; the exception inside stays opaque bytes)."""
    if not data:
        return None
    try:
        if data.startswith(b"json\n"):
            d = json.loads(data[5:])
        elif data.startswith(b"pickle\n"):
            d = _NoGlobals(io.BytesIO(data[7:])).load()
        else:
            return None
    except Exception:
        return None
    t = d.get("type") if isinstance(d, dict) else None
    if not isinstance(t, str):
        return None
    return t.rsplit(".", 1)[-1]


#: The longest run time a result may claim (a week): beyond it, or negative, or not finite, the
#: timings are not a run's (a forged or broken frame) and the scheduler learns nothing from them.
_runtime = scheduling.runtime_of
_MAX_RUNTIME_S = scheduling.MAX_RUNTIME_S


def _tenant_of(env: Any) -> bool:
    """Whether a stored spec (``tasks.env``, JSON) is another user's sandboxed one."""
    if not env:
        return False
    try:
        spec = json.loads(env) if isinstance(env, (str, bytes)) else env
    except ValueError:
        return False
    return isinstance(spec, dict) and bool(spec.get("tenant"))


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class PlacementService(DispatchObserver):
    def __init__(self, cfg: "HubConfig", store: "SqliteStore", kick: Callable[[str], None] | None = None,
                 allow_list: Callable[[str], frozenset[str] | None] | None = None) -> None:
        self.cfg = cfg
        self.store = store
        self.kick = kick or (lambda endpoint_id: None)
        # An endpoint's function allow-list (None: any function), as the dispatcher enforces it.
        self.allow_list = allow_list or (lambda endpoint_id: None)
        self.sched = self._new_scheduler(None)
        self._owner: dict[str, str] = {}  # endpoint -> user
        self._shared: dict[str, set[str]] = {}  # endpoint -> users the owner shared it with (they may place work on it)
        self._bg: set[asyncio.Task[Any]] = set()
        self._saver: asyncio.Task[None] | None = None
        self._changes = 0  # observations since the last save
        self.stats = {"placed": 0, "moved": 0, "rebalanced": 0, "refused": 0, "saves": 0}
        self._stealing = False  # one look for work to move at a time
        self._starved_at: dict[str, float] = {}  # endpoint -> when it last looked (monotonic)
        self.env_costs = EnvCosts()  # environment id -> build seconds and bytes, learned from agents' heartbeats
        self._builds_seen: dict[tuple[str, str], Any] = {}  # (endpoint, environment) -> last figure folded in
        self.hub_lag: dict[str, float] = {}  # endpoint -> moving mean of the time its frames wait in the hub before handling

    def _new_scheduler(self, state: dict[str, Any] | None) -> Scheduler:
        kw: dict[str, Any] = {"policy": self.cfg.scheduler_policy, "dead_after_s": self.cfg.lost_after_s, "keep_decisions": 1000}
        if state is not None:
            return Scheduler.from_dict(state, **kw)
        return Scheduler(profiles=Profiles(default_cold_start_s=COLD_START_PRIOR_S), **kw)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load saved profiles and re-register every endpoint (offline until its hello)."""
        raw = await self.store.tx(scheduling.load_state, durable=False)
        if raw is not None:
            try:
                self.sched = self._new_scheduler(json.loads(raw))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("saved scheduler profiles unusable (%s); starting with empty profiles", exc)
        for ep_id, uid in await self.store.read(scheduling.endpoint_shares):
            self._shared.setdefault(ep_id, set()).add(uid)
        for e in await self.store.list_endpoints():
            self._owner[e["id"]] = e["user_id"]
            if "capacity" in e["info"]:  # it has said hello at least once: we know what it is
                self._register(e["id"], e["user_id"], e["info"], online=False, now=None)
        await self._restore_ledger()
        self._saver = asyncio.create_task(self._save_forever(), name="scheduler-save")

    async def _restore_ledger(self) -> None:
        """Every task not done yet is in its endpoint's queue: the ledger must know, or the first
        placements after a restart would see idle endpoints that have hours of work queued."""
        now = time.time()
        nodes = self.sched.fleet.nodes
        for tid, eid, fid, nbytes in await self.store.tx(scheduling.pending_tasks, durable=False):
            if eid in nodes:
                self.sched.assign(TaskInfo(tid, fid, nbytes or 0), eid, now)

    async def stop(self) -> None:
        if self._saver is not None:
            self._saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._saver
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=10)
        await self.save()

    async def save(self) -> None:
        state = json.dumps(self.sched.to_dict(), separators=(",", ":"))
        self._changes = 0

        def q(db: sqlite3.Connection) -> None:
            scheduling.save_state(db, time.time(), self.sched.policy.name, state)

        await self.store.tx(q)
        self.stats["saves"] += 1

    async def _save_forever(self) -> None:
        last_prune = time.time()
        while True:
            await asyncio.sleep(self.cfg.scheduler_save_s)
            try:
                if self._changes:
                    await self.save()
                if time.time() - last_prune > 3600:
                    last_prune = time.time()
                    await self._prune(time.time() - self.cfg.result_ttl_s)
            except Exception:
                log.exception("saving scheduler state failed")

    async def _prune(self, older_than: float) -> None:
        def q(db: sqlite3.Connection) -> None:
            scheduling.prune_decisions(db, older_than)

        await self.store.tx(q, durable=False)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)

        def done(task: asyncio.Task[Any]) -> None:
            self._bg.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("scheduler background work failed", exc_info=task.exception())

        t.add_done_callback(done)

    # ------------------------------------------------------------------ endpoints
    def _register(self, endpoint_id: str, user_id: str, info: dict[str, Any], *, online: bool, now: float | None) -> None:
        self._owner[endpoint_id] = user_id
        raw_tags = info.get("tags") or []
        tags = {t for t in raw_tags if isinstance(t, str) and _TAG.match(t)} if isinstance(raw_tags, list) else set()
        hw = info.get("hardware")
        # Without a declared hardware class each endpoint is its own group: profiled on its own.
        hardware = hw if isinstance(hw, str) and _TAG.match(hw) else f"endpoint:{endpoint_id}"
        ep = EndpointState(
            endpoint_id,
            workers=max(1, _int(info.get("capacity"), 1)),
            hardware=hardware,
            tags=frozenset(tags | {owner_tag(u) for u in {user_id} | self._shared.get(endpoint_id, set())}),
            gpu=info.get("gpu") is True,
            memory_mb=max(0, _int(info.get("memory_mb"))),
            online=online,
        )
        gw = info.get("gateway")  # a device behind a site gateway (docs/sites.md): its uplink is modelled apart
        self.sched.profiles.set_gateway(endpoint_id, gw if isinstance(gw, str) and gw.startswith("ep-") else None)
        nodes = self.sched.fleet.nodes
        old = nodes[endpoint_id].ep if endpoint_id in nodes else None
        if old is None or (old.signature(), old.workers, old.online) != (ep.signature(), ep.workers, ep.online):
            self.sched.add_endpoint(ep, now)
        elif endpoint_id in nodes:
            nodes[endpoint_id].avail = self.sched.profiles.availability_view(endpoint_id)

    def set_shared(self, endpoint_id: str, users: Iterable[str]) -> None:
        """The users the owner shared this endpoint with (docs/security.md): each gets the owner
        tag here, so their "auto", list and tag selectors may place work on it."""
        self._shared[endpoint_id] = set(users)
        node = self.sched.fleet.nodes.get(endpoint_id)
        owner = self._owner.get(endpoint_id)
        if node is None or owner is None:
            return
        plain = {t for t in node.ep.tags if not t.startswith(OWNER_PREFIX)}
        # A new record, not an in-place edit: the fleet un-indexes the old one by its old tags.
        self.sched.add_endpoint(dataclasses.replace(node.ep, tags=frozenset(plain | {owner_tag(u) for u in {owner} | self._shared[endpoint_id]})))

    def remove(self, endpoint_id: str) -> None:
        """A revoked endpoint: nothing is placed on it any more."""
        if endpoint_id in self.sched.fleet:
            self.sched.remove_endpoint(endpoint_id)
        self._owner.pop(endpoint_id, None)
        self._shared.pop(endpoint_id, None)

    def endpoint_online(self, endpoint_id: str, now: float, info: dict[str, Any]) -> None:
        user = self._owner.get(endpoint_id)
        if user is None:  # enrolled since start-up: look its owner up (once)
            self._spawn(self._register_new(endpoint_id, now, info))
            return
        self._register(endpoint_id, user, info, online=True, now=now)
        self.sched.heartbeat(endpoint_id, now)
        self._changes += 1

    async def _register_new(self, endpoint_id: str, now: float, info: dict[str, Any]) -> None:
        rows = await self.store.list_endpoints(endpoint_id=endpoint_id)
        if rows:
            self._register(endpoint_id, rows[0]["user_id"], info, online=True, now=now)
            self.sched.heartbeat(endpoint_id, now)
            self._changes += 1

    def endpoint_lost(self, endpoint_id: str, now: float, last_seen: float) -> None:
        if endpoint_id not in self.sched.fleet:
            return
        self.sched.endpoint_offline(endpoint_id, now, last_seen)
        self._changes += 1
        self._spawn(self._replace_stranded(endpoint_id))

    def _with_environment(self, info: TaskInfo, environment: dict[str, Any]) -> None:
        """A task whose environment must be built (pip) or pulled (container) costs an endpoint
        that lacks it that build, and the bytes on its link (scheduler/environments.py)."""
        from mesh_agent.protocol.environment import env_id, normalize

        spec = normalize(environment)
        if not spec or not (spec.get("pip") or spec.get("container")):
            return  # variables and the sandbox cost nothing to "build"
        info.env = env_id(spec)
        info.env_cost = self.env_costs.get(info.env, container=bool(spec.get("container")))

    def _learn_builds(self, endpoint_id: str, builds: dict[str, Any]) -> None:
        """Fold each build an agent reports (once: beats repeat them) into the environment's cost."""
        costs, seen = self.env_costs, self._builds_seen
        if len(seen) > 10_000:  # bounded: forgetting only means a figure may be folded in once more
            seen.clear()
        for sid, fig in builds.items():
            if seen.get((endpoint_id, sid)) == fig or not (isinstance(fig, list) and len(fig) == 2):
                continue
            seen[(endpoint_id, sid)] = fig
            try:
                costs.observe(str(sid), float(fig[0]), int(fig[1]))
            except (TypeError, ValueError):  # a bad figure teaches nothing (the frame's shape was checked already)
                continue

    def tasks_expired(self, task_ids: Sequence[str], now: float) -> None:
        self.tasks_ended(task_ids, now)

    def tasks_ended(self, task_ids: Sequence[str], now: float) -> None:
        """Tasks the hub failed without running them (expired, function taken off an allow-list,
        endpoint revoked): they leave their queues without teaching anything, and their
        decisions close with ``ok: false``."""
        self.sched.retract(task_ids)
        done = [(now, None, 0, t) for t in task_ids]
        self._spawn(self._record_results("", now, done, []))

    def heartbeat(self, endpoint_id: str, now: float, info: dict[str, Any]) -> None:
        if endpoint_id not in self.sched.fleet:
            return
        warm = info.get("warm")
        envs = info.get("envs")
        if isinstance(envs, list):  # environments it holds (docs/environments.md): no build there
            self.sched.fleet.set_envs(endpoint_id, [e for e in envs if isinstance(e, str)])
        builds = info.get("eb")
        if isinstance(builds, dict):
            self._learn_builds(endpoint_id, builds)
        node = self.sched.fleet.nodes.get(endpoint_id)
        if node is not None:
            node.ep.metered = info.get("beats") == "adaptive"  # the metered profile beats on change
        self.sched.heartbeat(
            endpoint_id, now,
            queued=max(0, _int(info.get("queued"))),
            running=max(0, _int(info.get("running"))),
            warm_functions=[w for w in warm if isinstance(w, str)] if isinstance(warm, list) else None,
            workers=max(1, _int(info.get("capacity"), 1)),
        )
        self._changes += 1

    def frame_received(self, endpoint_id: str, kind: str, nbytes: int, sent_at: float, now: float) -> None:
        # A hello may come from a device whose clock is still wrong (it learns ours from the
        # welcome), so only later frames are timed. ``now`` is when the link read the frame (not
        # when its lane got to it), and the agent's stamp is put on our clock with the offset of
        # its fastest echoed round trip (NTP), once there is one: the one-way times then feed the
        # size term (bandwidth), while the latency itself comes from echoed round trips.
        if kind == "hello" or endpoint_id not in self.sched.fleet:
            return
        off = self.sched.clock_offset(endpoint_id)
        dt = now - (sent_at - off if off is not None else sent_at)
        if -1.0 < dt < 120.0:
            self.sched.message_timing(endpoint_id, nbytes, max(dt, 0.0), now)

    def link_echo(self, endpoint_id: str, rtt_s: float, offset_s: float, now: float, hub_lag_s: float) -> None:
        if endpoint_id not in self.sched.fleet:
            return
        self.sched.link_echo(endpoint_id, rtt_s, now, offset_s)
        lag = self.hub_lag.get(endpoint_id)
        self.hub_lag[endpoint_id] = hub_lag_s if lag is None else lag + 0.1 * (hub_lag_s - lag)

    def results_stored(self, endpoint_id: str, now: float, results: Sequence[dict[str, Any]], fresh: set[str]) -> None:
        if not fresh:
            return
        # Their decisions were closed by the results' own transaction (store/scheduling.complete_results).
        unknown: list[tuple[str, float, int, bool, str | None]] = []
        for r in results:
            tid = r.get("id")
            if tid not in fresh:
                continue
            ok = bool(r.get("ok"))
            runtime = _runtime(r.get("started"), r.get("finished"))
            data = r.get("data") or b""
            err = None if ok else error_type(data)
            if runtime is None:  # nothing to learn from (or timings no run could have): it still leaves its queue
                self.sched.retract([tid])
                continue
            pid = r.get("pid")  # the worker: its first call of a function is a cold call (Scheduler.task_completed)
            pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
            if err is not None:
                # A failure may block the function on this endpoint (scheduler BLOCKING_ERRORS): decided
                # once the task's stored spec is read, so another user's sandboxed failure, which may
                # be of their own making, never blocks the function for the owner or anyone else.
                unknown.append((tid, runtime, len(data), ok, err))
                continue
            try:
                self.sched.task_completed(tid, now, runtime, result_bytes=len(data), ok=ok, error=err, worker=pid)
            except KeyError:  # not placed by this scheduler (an explicit endpoint, or before a restart)
                unknown.append((tid, runtime, len(data), ok, err))
        self._changes += len(fresh)
        if unknown:
            self._spawn(self._record_results(endpoint_id, now, [], unknown))

    async def _record_results(self, endpoint_id: str, now: float, done: list[tuple[float, float | None, int, str]],
                              unknown: list[tuple[str, float, int, bool, str | None]]) -> None:
        def q(db: sqlite3.Connection) -> dict[str, tuple[str, str | None]]:
            scheduling.complete_decisions(db, done)
            return scheduling.task_functions(db, [u[0] for u in unknown])

        fns = await self.store.tx(q, durable=False)
        if endpoint_id not in self.sched.fleet:
            for tid, *_rest in unknown:
                self.sched.retract([tid])
            return
        for tid, runtime, nbytes, ok, err in unknown:
            found = fns.get(tid)
            if found is None:
                self.sched.retract([tid])
                continue
            f, env = found
            if err is not None and _tenant_of(env):
                err = None  # another user's sandboxed failure teaches nothing about the endpoint (and blocks nothing)
            self.sched.task_completed(tid, now, runtime, result_bytes=nbytes, ok=ok, error=err,
                                      endpoint_id=endpoint_id, function_id=f, payload_bytes=0)

    # ------------------------------------------------------------------ placement at submit
    @staticmethod
    def request_of(t: "TaskIn") -> _Req | None:
        """The selector of one submitted task, or None for a concrete endpoint id."""
        sel = t.endpoint_id
        cons = t.constraints.model_dump() if t.constraints is not None else {"tags": [], "gpu": False, "min_memory_mb": 0}
        if isinstance(sel, str):
            if sel != "auto":
                return None
            return _Req("auto", None, None, cons)
        if isinstance(sel, list):
            return _Req("list", sorted(set(sel)), None, cons)
        return _Req("tags", None, sorted(set(sel.tags)), cons)

    async def _place(self, infos: list[TaskInfo], now: float) -> list[Placement]:
        """``Scheduler.place`` in chunks, yielding to the event loop in between so that a big
        batch does not stall heartbeats and results. List scheduling is sequential anyway: each
        chunk sees the ledger as the previous ones left it. On error nothing stays placed."""
        out: list[Placement] = []
        try:
            for i in range(0, len(infos), _PLACE_CHUNK):
                if i:
                    await asyncio.sleep(0)
                out.extend(self.sched.place(infos[i:i + _PLACE_CHUNK], now))
        except BaseException:
            self.sched.retract(x.task_id for x in infos)
            raise
        return out

    async def place(self, user_id: str, tasks: Sequence["TaskIn"], rows: list[dict[str, Any]], now: float) -> list[tuple[Any, ...]]:
        """Place every selector task of a batch together; fill in ``rows[i]["endpoint_id"]`` and
        return the decision rows to store with them. Raises :class:`PlacementError` (and leaves
        no trace) when a task cannot be placed."""
        infos: list[TaskInfo] = []
        fixed: list[tuple[TaskInfo, str]] = []  # tasks whose caller named the endpoint
        reqs: dict[str, _Req] = {}
        index: dict[str, int] = {}
        nodes = self.sched.fleet.nodes
        for i, (t, row) in enumerate(zip(tasks, rows)):
            req = self.request_of(t)
            if req is None:
                self._check_concrete(i, t, row["endpoint_id"])
                if row["endpoint_id"] in nodes:
                    fixed.append((TaskInfo(row["id"], t.function_id, len(t.args)), row["endpoint_id"]))
                continue
            info = req.task_info(user_id, row["id"], t.function_id, len(t.args))
            if getattr(t, "environment", None):
                self._with_environment(info, t.environment)
            if getattr(t, "inputs", None):  # data locality (scheduler/locality.py)
                info.inputs = tuple((e, n) for e, n in t.inputs)
            infos.append(info)
            reqs[row["id"]] = req
            index[row["id"]] = i
        if infos:
            self._apply_allow_lists(infos, user_id, reqs, index)
            self._check_eligible(user_id, infos, reqs, index)
        # Named endpoints first: they are fixed, and the rest of the batch should see their queues.
        for info, eid in fixed:
            self.sched.assign(info, eid, now)
        if not infos:
            return []
        try:
            placements = await self._place(infos, now)
        except BaseException as exc:
            self.sched.retract(info.task_id for info, _ in fixed)
            if not isinstance(exc, NoEligibleEndpoint):
                raise
            # Every endpoint the selector allows has blocked the function (it failed there
            # with a missing module or out of memory); the scheduler's message names the task.
            self.stats["refused"] += 1
            raise PlacementError(409, f"no eligible endpoint for task {index.get(exc.task_id, '?')}: "
                                      "the function failed with a missing module or out of memory on every endpoint it may use") from None
        by_id = {r["id"]: r for r in rows}
        # Late binding moves a task on run-time predictions alone: one whose inputs lie on some
        # endpoints (locality) or that needs an environment built is placed once, as before.
        movable = {row["id"] for t, row in zip(tasks, rows) if not getattr(t, "inputs", None) and not getattr(t, "environment", None)}
        out = []
        for pl in placements:
            by_id[pl.task_id]["endpoint_id"] = pl.endpoint_id
            if pl.task_id in movable:
                by_id[pl.task_id]["placed"] = 1  # may move while it waits in the hub (late binding)
            out.append(self._decision_row(user_id, pl, reqs[pl.task_id]))
            pl.raw_compared = ()  # stored with the decision; the hub need not keep it in memory
        self.stats["placed"] += len(out)
        return out

    def predict(self, function_id: str, endpoint_ids: Sequence[str], payload_bytes: int, horizon_s: float | None,
                now: float) -> list[dict[str, Any]]:
        """What the scheduler predicts for ``function_id`` on each endpoint, placing nothing:
        seconds to completion (with its parts and where the runtime came from) and the chance
        the endpoint stays online until then (from its outage history). FL client selection
        asks this (``POST /v1/scheduler/predict``). Callers check ownership first."""
        from scheduler.predict import Predictor

        pred = Predictor(self.sched.profiles)
        nodes = self.sched.fleet.nodes
        out: list[dict[str, Any]] = []
        for eid in endpoint_ids:
            node = nodes.get(eid)
            if node is None:  # enrolled but never connected: nothing known
                out.append({"endpoint_id": eid, "known": False, "online": False, "predicted_s": None, "run_s": None,
                            "source": "prior", "exploration": True, "p_online": None, "share_online": None})
                continue
            p = pred.estimate(TaskInfo(f"predict:{eid}", function_id, int(payload_bytes)), node, now, outage_aware=True)
            end = now + (horizon_s if horizon_s is not None else max(p.total, 0.0))
            av = node.avail
            p_on = None if av is None else 1.0 - av.p_offline(now, end)
            out.append({"endpoint_id": eid, "known": True, "online": bool(node.ep.online),
                        "predicted_s": _finite(p.total), "run_s": _finite(p.run), "source": p.source,
                        "exploration": bool(p.exploration),
                        "p_online": None if p_on is None else _finite(max(0.0, min(1.0, p_on))),
                        "share_online": None if av is None else _finite(av.share_online(now))})
        return out

    def retract(self, task_ids: Iterable[str]) -> None:
        """The batch was not stored after all: forget its placements (and named-endpoint tasks)."""
        self.sched.retract(task_ids)

    @staticmethod
    def writer(decisions: list[tuple[Any, ...]]) -> Callable[[sqlite3.Connection], None] | None:
        """Stores the decisions inside the transaction that inserts their tasks."""
        if not decisions:
            return None

        def q(db: sqlite3.Connection) -> None:
            scheduling.write_decisions(db, decisions)

        return q

    def _decision_row(self, user_id: str, pl: Placement, req: _Req) -> tuple[Any, ...]:
        pred = pl.predicted
        compared = pl.compared[:MAX_COMPARED]
        detail = {  # "p"/"c": predictions as arrays, see _pred_row
            "selector": req.selector(),
            "constraints": req.constraints,
            "reason": pl.reason,
            "exploration": pl.exploration,
            "pruned": pl.pruned,
            "p": _pred_row(pred) if pred is not None else None,
            "c": [_pred_row(p) for p in compared],
        }
        return (pl.task_id, user_id, pl.function_id, pl.endpoint_id, pl.policy, pl.placed_at,
                _finite(pred.total) if pred is not None else None, json.dumps(detail, separators=(",", ":")))

    def _check_concrete(self, i: int, t: "TaskIn", endpoint_id: str) -> None:
        """A concrete endpoint with constraints: refuse if it is known not to satisfy them."""
        c = t.constraints
        nodes = self.sched.fleet.nodes
        if c is None or endpoint_id not in nodes:
            return
        cons = Constraints(frozenset(c.tags), c.gpu, c.min_memory_mb)
        if not cons.allows(nodes[endpoint_id].ep):
            self.stats["refused"] += 1
            raise PlacementError(409, f"task {i}: endpoint {endpoint_id} does not satisfy the constraints {cons.describe()}")

    def _apply_allow_lists(self, infos: list[TaskInfo], user_id: str | None = None, reqs: dict[str, _Req] | None = None,
                           index: dict[str, int] | None = None) -> None:
        """Endpoints whose owner restricted them to other functions are not candidates: such a
        task gets an id list without them (``TaskInfo.endpoints``). Raises a 403
        :class:`PlacementError` (with ``user_id``) when that leaves a task nowhere to go."""
        nodes = self.sched.fleet.nodes
        lists = {e: a for e in nodes if (a := self.allow_list(e)) is not None}
        if not lists:
            return
        allowed_for: dict[str, frozenset[str] | None] = {}
        for info in infos:
            f = info.function_id
            if f not in allowed_for:
                excluded = {e for e, a in lists.items() if f not in a}
                allowed_for[f] = frozenset(nodes) - excluded if excluded else None
            ok = allowed_for[f]
            if ok is None:
                continue
            before = info.endpoints
            info.endpoints = ok if before is None else before & ok
            if user_id is None or reqs is None or index is None:
                continue
            cons_ok = [n for n in self.sched.fleet.eligible(info.constraints) if before is None or n.id in before]
            if cons_ok and not any(n.id in info.endpoints for n in cons_ok):
                self.stats["refused"] += 1
                raise PlacementError(403, f"task {index[info.task_id]}: function {f} is not on the allow-list of any endpoint "
                                          f"its endpoint_id ({reqs[info.task_id].kind}) allows")

    def _check_eligible(self, user_id: str, infos: list[TaskInfo], reqs: dict[str, _Req], index: dict[str, int]) -> None:
        """A clear 409 naming the first task nothing can run, before anything is placed."""
        fleet = self.sched.fleet
        mine = fleet.eligible(Constraints(frozenset({owner_tag(user_id)})))
        seen: set[tuple[Constraints, frozenset[str] | None]] = set()
        for info in infos:
            key = (info.constraints, info.endpoints)
            if key in seen:
                continue
            seen.add(key)
            nodes = fleet.eligible(info.constraints)
            if info.endpoints is not None:
                nodes = [n for n in nodes if n.id in info.endpoints]
            if nodes:
                continue
            self.stats["refused"] += 1
            req = reqs[info.task_id]
            want = Constraints(info.constraints.tags - {owner_tag(user_id)}, info.constraints.gpu, info.constraints.min_memory_mb)
            if not mine:
                why = "none of your endpoints has connected to the hub yet (start an agent first)"
            elif req.kind == "list":
                known = [e for e in req.endpoints or () if e in fleet]
                if not known:
                    why = f"none of the listed endpoints has connected to the hub yet: {', '.join(req.endpoints or ())}"
                else:
                    why = f"none of the listed endpoints satisfies {want.describe()}"
            else:
                why = f"none of your {len(mine)} endpoints satisfies {want.describe()}"
            raise PlacementError(409, f"no eligible endpoint for task {index[info.task_id]} (endpoint_id {req.kind}): {why}")

    # ------------------------------------------------------------------ late binding
    def lookahead(self, endpoint_id: str, capacity: int) -> int | None:
        """Placed tasks an endpoint may hold without a result: enough per worker to cover one
        turn-around (link both ways and the hub's own time) at its measured task rate, so late
        binding costs no throughput, at least ``_LOOKAHEAD_MIN`` per worker, at most
        ``_LOOKAHEAD_MAX``. The rest wait in the hub, where they can still move."""
        if not self.cfg.late_binding or not self.sched.in_flight:
            return None  # no task the scheduler placed is out: nothing to cap (named work reads no extra rows)
        workers = max(1, capacity)
        node = self.sched.fleet.nodes.get(endpoint_id)
        if node is None:
            return 2 * workers
        task_s = node.mean_work(workers) if (node.n_out or node.tp is not None) else 1.0
        # a result's way back and the next task's way out: the link both ways, the time frames
        # wait in this hub, and the lease itself (its transaction, the frame's signature)
        turn = 2.0 * node.one_way + self.hub_lag.get(endpoint_id, 0.0) + _TURN_S
        per_worker = 1 + math.ceil(turn / max(task_s, 1e-3))
        return workers * min(_LOOKAHEAD_MAX, max(_LOOKAHEAD_MIN, per_worker))

    def endpoint_starving(self, endpoint_id: str, now: float) -> None:
        """An endpoint ran out of work: look (at most every ``_STEAL_EVERY_S``, one look at a
        time) for placed tasks still in the hub on the endpoints with the longest predicted
        queues, and place the newest of them again; those that now finish sooner here move."""
        if not self.cfg.late_binding or self._stealing or not self.sched.in_flight:
            return  # nothing placed by the scheduler is out: no queue to take from (and no scan of the fleet)
        node = self.sched.fleet.nodes.get(endpoint_id)
        if node is None or not node.ep.online:
            return
        mono = time.monotonic()
        if mono - self._starved_at.get(endpoint_id, 0.0) < _STEAL_EVERY_S:
            return
        self._starved_at[endpoint_id] = mono
        donors = heapq.nlargest(3, (n for n in self.sched.fleet.nodes.values() if n is not node and n.ep.online and n.wait > 0),
                                key=lambda n: n.wait)
        if donors:
            self._stealing = True
            self._spawn(self._steal(endpoint_id, [d.id for d in donors]))

    async def _steal(self, endpoint_id: str, donors: list[str]) -> None:
        try:
            limit = self.lookahead(endpoint_id, self.sched.fleet.nodes[endpoint_id].ep.workers) or 2
            for donor in donors:
                if await self._replace(donor, "rebalanced", limit=limit, newest=True):
                    return
        finally:
            self._stealing = False

    # ------------------------------------------------------------------ outages
    async def _replace_stranded(self, endpoint_id: str) -> None:
        """Tasks placed on a lost endpoint that never left the hub go where they can run now."""
        await self._replace(endpoint_id, "lost")

    async def _replace(self, endpoint_id: str, why: str, *, limit: int = _MOVE_LIMIT, newest: bool = False) -> int:
        """Place again the scheduler's tasks of ``endpoint_id`` that never left the hub (the
        oldest ``limit``, or the newest: the tail of its queue); move those placed elsewhere.
        ``why``: "lost" (only while the endpoint is offline) or "rebalanced" (another endpoint ran
        out of work). Returns how many moved."""

        def find(db: sqlite3.Connection) -> list[tuple[str, str, str, str, int, str | None]]:
            return scheduling.stranded_tasks(db, endpoint_id, limit, newest)

        rows = await self.store.tx(find, durable=False)
        if not rows:
            return 0
        node = self.sched.fleet.nodes.get(endpoint_id)
        if node is None or (why == "lost" and node.ep.online):  # it came back meanwhile: leave them
            return 0
        now = time.time()
        infos, reqs, users, envs = [], {}, {}, {}
        for tid, uid, fid, detail, nbytes, env in rows:
            d = json.loads(detail)
            sel = d["selector"]
            req = _Req(sel["kind"], sel.get("endpoints"), sel.get("tags"), d.get("constraints") or {})
            self.sched.task_requeued(tid, now)
            infos.append(req.task_info(uid, tid, fid, nbytes or 0))
            reqs[tid], users[tid], envs[tid] = req, uid, env
        self._apply_allow_lists(infos)  # where nothing else is allowed, placement fails: they wait
        try:
            placements = await self._place(infos, now)
        except NoEligibleEndpoint:
            if why != "lost":  # they stay where they were: back in the ledger there
                for info in infos:
                    self.sched.assign(info, endpoint_id, now)
            return 0  # nowhere else allowed (the function is blocked elsewhere): they wait
        moves = [pl for pl in placements if pl.endpoint_id != endpoint_id]
        if not moves:
            return 0
        decisions = [self._decision_row(users[pl.task_id], pl, reqs[pl.task_id]) for pl in moves]
        # The sandbox rule of the submit path holds on the new endpoint too: a task that ran
        # unsandboxed on its submitter's own endpoint is sandboxed on an endpoint someone else owns.
        from cloud_hub.service.environments import env_for
        from mesh_agent.protocol.environment import decode

        owners = await self.store.endpoint_owners_of({pl.endpoint_id for pl in moves})
        new_env = [env_for(decode(envs[pl.task_id]), users[pl.task_id], owners.get(pl.endpoint_id)) for pl in moves]

        def move(db: sqlite3.Connection) -> list[int]:
            ok = []
            for i, pl in enumerate(moves):
                n = scheduling.move_task(db, pl.task_id, pl.endpoint_id, new_env[i], endpoint_id)
                if n:
                    scheduling.mark_moved(db, pl.task_id)
                    scheduling.write_decision(db, decisions[i])
                    ok.append(i)
            return ok

        moved = set(await self.store.tx(move))
        lost = [pl.task_id for i, pl in enumerate(moves) if i not in moved]
        if lost:  # leased meanwhile (the endpoint came back, or took them): those placements never happened
            self.sched.retract(lost)
        self.stats["moved" if why == "lost" else "rebalanced"] += len(moved)
        if why == "lost":
            log.info("endpoint %s lost: %d queued tasks placed again elsewhere", endpoint_id, len(moved), extra={"endpoint_id": endpoint_id})
        else:
            log.debug("%d queued tasks of %s placed again elsewhere (%s)", len(moved), endpoint_id, why, extra={"endpoint_id": endpoint_id})
        for ep in {moves[i].endpoint_id for i in moved}:
            self.kick(ep)
        return len(moved)

    # ------------------------------------------------------------------ state API
    def state(self, user_id: str) -> dict[str, Any]:
        """What the scheduler believes about each of the caller's endpoints (``GET
        /v1/scheduler/state``): link, clock offset, throughput, learned cold starts, and the
        calibration of its predictions per term (issue 27)."""
        sched = self.sched
        p = sched.profiles
        out = []
        for eid, node in sched.fleet.nodes.items():
            if self._owner.get(eid) != user_id:
                continue
            ln = p.links.get(eid)
            clock = getattr(ln, "clock", None) if ln is not None else None
            tp = p.endpoint_rate(eid)
            colds = {f: _finite(d.mean) for (f, e), d in p.cold_pair.items() if e == eid}
            out.append({
                "endpoint_id": eid,
                "online": bool(node.ep.online),
                "workers": node.ep.workers,
                "hardware": node.ep.hardware,
                "latency_s": _finite(node.one_way),
                "bandwidth_bps": _finite(node.bw),
                "link": clock.to_report() if clock is not None else None,
                "hub_lag_s": _finite(self.hub_lag.get(eid)),
                "throughput_per_s": _finite(tp) if tp is not None else None,
                "queue_s": _finite(node.wait),
                "in_flight": node.n_out,
                "warm": sorted(node.hot)[:100],
                "cold_start_s": dict(sorted(colds.items())[:100]),
                "calibration": {k: ({kk: _finite(vv) if isinstance(vv, float) else vv for kk, vv in v.items()} if isinstance(v, dict) else _finite(v))
                                for k, v in sched.calibration_report(eid).items()},
            })
        err = sched.prediction_error()
        return {"policy": sched.policy.name, "endpoints": out,
                "prediction_error": {k: _finite(v) if isinstance(v, float) else v for k, v in err.items()}}

    # ------------------------------------------------------------------ decisions API
    async def decisions(self, user_id: str, limit: int, before: int | None = None, task_id: str | None = None,
                        endpoint_id: str | None = None, function_id: str | None = None) -> dict[str, Any]:
        def q(db: sqlite3.Connection) -> dict[str, Any]:
            rows = scheduling.decisions_page(db, user_id, limit + 1, before, task_id, endpoint_id, function_id)
            more = len(rows) > limit
            rows = rows[:limit]
            n, n_done, n_moved, mae, mre = scheduling.decision_summary(db, user_id)
            return {
                "decisions": [_decision_out(r) for r in rows],
                "next_before": rows[-1][0] if more and rows else None,
                "summary": {"decisions": n, "completed": n_done, "moved": n_moved, "mean_abs_error_s": _finite(mae),
                            "mean_rel_error": _finite(mre)},
            }

        return await self.store.tx(q, durable=False)


def _decision_out(r: tuple[Any, ...]) -> dict[str, Any]:
    seq, tid, fid, eid, policy, placed, pred_s, state, completed, actual, runtime, ok, detail = r
    d = json.loads(detail)
    return {
        "seq": seq,
        "task_id": tid,
        "function_id": fid,
        "endpoint_id": eid,
        "policy": policy,
        "selector": d.get("selector"),
        "constraints": d.get("constraints"),
        "reason": d.get("reason", ""),
        "exploration": bool(d.get("exploration")),
        "placed_at": placed,
        "predicted_s": pred_s,
        "predicted": _pred_out(d.get("p")),
        "compared": [_pred_out(c) for c in d.get("c", [])],
        "pruned": d.get("pruned", 0),
        "state": state,
        "completed_at": completed,
        "actual_s": _finite(actual),
        "runtime_s": _finite(runtime),
        "error_s": _finite(actual - pred_s) if actual is not None and pred_s is not None else None,
        "ok": None if ok is None else bool(ok),
    }
