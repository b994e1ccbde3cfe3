"""Admission control and fair share: pure logic, no I/O (the store and the API feed it counts).

Why here and not in the store: the rules (who may queue how much, who runs next on a shared
endpoint) are policy an operator configures and a test can check without a database; the store
only counts rows and leases the tasks this module picks.

Three rules, after the OpenWhisk scheduling proposal:

* **Queue bound** (``max_queued``, per user and per function): a submit that would push the
  user's (or the function's) queued tasks past the bound is refused whole with HTTP 429 and a
  ``Retry-After`` estimated from how fast that user's work drains. Nothing was stored; the SDK
  retries the same batch with the same idempotency key.
* **Concurrency limit** (``max_running``, per user and per function): tasks dispatched to
  endpoints and not finished. Past it, the dispatcher leaves the user's (function's) work queued at
  the hub; it is never refused or dropped.
* **Fair share** on an endpoint several users submit to: dispatch slots go, one at a time, to the
  user whose running work on that endpoint divided by their share is smallest (weighted
  max-min fairness, i.e. DRF with the worker slot as the one resource; for unit-sized tasks it is
  weighted fair queueing). A user who floods an endpoint with 50,000 tasks therefore holds at most
  their share of its workers once someone else submits; the other user's first task goes out with
  the next lease instead of behind the flood.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["Limits", "AdmissionPolicy", "Flow", "Refusal", "parse_policy", "check_queue", "too_big", "plan_lease", "retry_after_s"]

_LIMIT_KEYS = ("max_queued", "max_running")


@dataclass(frozen=True)
class Limits:
    """Bounds for one user or one function; None means no bound."""

    max_queued: int | None = None
    max_running: int | None = None


@dataclass(frozen=True)
class AdmissionPolicy:
    """The hub's limits and shares. Users are named by user name or user id (both are tried);
    functions by function id. ``fair=False`` dispatches in plain arrival order (the baseline
    ``bench/fairness.py`` compares against)."""

    user: Limits = Limits(max_queued=1_000_000)
    users: Mapping[str, Limits] = field(default_factory=dict)
    function: Limits = Limits()
    functions: Mapping[str, Limits] = field(default_factory=dict)
    shares: Mapping[str, float] = field(default_factory=dict)
    fair: bool = True

    def user_limits(self, user_id: str, name: str | None = None) -> Limits:
        return self.users.get(user_id) or (self.users.get(name) if name else None) or self.user

    def function_limits(self, function_id: str) -> Limits:
        return self.functions.get(function_id) or self.function

    def share(self, user_id: str, name: str | None = None) -> float:
        got = self.shares.get(user_id)
        if got is None and name:
            got = self.shares.get(name)
        return 1.0 if got is None else got

    @property
    def caps_running(self) -> bool:
        """Whether any concurrency limit is set (the store then counts running work hub-wide)."""
        return any(x.max_running is not None for x in (self.user, self.function, *self.users.values(), *self.functions.values()))


def _limits(where: str, raw: Any) -> Limits:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected an object like {{\"max_queued\": 10000, \"max_running\": 8}}, got {type(raw).__name__}")
    unknown = set(raw) - set(_LIMIT_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; use {', '.join(_LIMIT_KEYS)}")
    out: dict[str, int | None] = {}
    for k in _LIMIT_KEYS:
        v = raw.get(k)
        if v is None:
            out[k] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}.{k}: must be a whole number >= 1 or null (no bound), got {v!r}")
        out[k] = v
    return Limits(**out)


def parse_policy(limits: Mapping[str, Any] | None = None, shares: Mapping[str, Any] | None = None, fair: bool = True) -> AdmissionPolicy:
    """The policy from the hub's ``limits`` and ``shares`` settings, or a ValueError naming the
    bad entry (the hub refuses to start rather than run with limits it misread).

    ``limits``: ``{"user": {...}, "users": {"alice": {...}}, "function": {...}, "functions":
    {"<function id>": {...}}}``, each ``{...}`` being ``{"max_queued": N, "max_running": N}``.
    ``shares``: ``{"alice": 3, "bob": 1}`` (default 1 each)."""
    limits = dict(limits or {})
    unknown = set(limits) - {"user", "users", "function", "functions"}
    if unknown:
        raise ValueError(f"limits: unknown key(s) {sorted(unknown)}; use user, users, function, functions")
    default = AdmissionPolicy()
    user = _limits("limits.user", limits["user"]) if "user" in limits else default.user
    function = _limits("limits.function", limits["function"]) if "function" in limits else default.function
    per: dict[str, dict[str, Limits]] = {}
    for key in ("users", "functions"):
        raw = limits.get(key) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"limits.{key}: expected an object of name -> limits, got {type(raw).__name__}")
        if key == "functions":
            for fid in raw:
                if not (isinstance(fid, str) and len(fid) == 64 and all(c in "0123456789abcdef" for c in fid)):
                    raise ValueError(f"limits.functions: {fid!r} is not a function id (64 hex characters, as register_function returns)")
        per[key] = {str(k): _limits(f"limits.{key}.{k}", v) for k, v in raw.items()}
    if shares is not None and not isinstance(shares, Mapping):
        raise ValueError(f"shares: expected an object of user -> weight, got {type(shares).__name__}")
    checked: dict[str, float] = {}
    for k, v in (shares or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"shares.{k}: a share is a number > 0 (default 1), got {v!r}")
        checked[str(k)] = float(v)
    return AdmissionPolicy(user=user, users=per["users"], function=function, functions=per["functions"], shares=checked, fair=fair)


@dataclass(frozen=True)
class Refusal:
    """Why a submit is refused (HTTP 429) and when to try again."""

    detail: str
    retry_after_s: int


def check_queue(policy: AdmissionPolicy, user_id: str, user_name: str | None, incoming: Mapping[str, int],
                user_queued: int, function_queued: Mapping[str, int], drain_per_s: float) -> Refusal | None:
    """Whether a submit of ``incoming`` (function id -> tasks) fits under the queue bounds, given
    what the user already has queued (``user_queued``, and per function). None: admit it."""
    lim = policy.user_limits(user_id, user_name)
    n = sum(incoming.values())
    if lim.max_queued is not None and user_queued + n > lim.max_queued:
        over = user_queued + n - lim.max_queued
        return Refusal(f"too many queued tasks: you have {user_queued} queued and submitted {n}, over your bound of "
                       f"{lim.max_queued}; retry after the queue drains", retry_after_s(over, drain_per_s))
    for fid, k in sorted(incoming.items()):
        flim = policy.function_limits(fid)
        have = function_queued.get(fid, 0)
        if flim.max_queued is not None and have + k > flim.max_queued:
            return Refusal(f"too many queued tasks of function {fid}: {have} queued and {k} submitted, over its bound of "
                           f"{flim.max_queued}; retry after the queue drains", retry_after_s(have + k - flim.max_queued, drain_per_s))
    return None


def too_big(policy: AdmissionPolicy, user_id: str, user_name: str | None, incoming: Mapping[str, int]) -> str | None:
    """A batch that could never fit, however long it waited (larger than a bound by itself): a
    clear error (413), not a 429 the client would retry forever."""
    lim = policy.user_limits(user_id, user_name)
    n = sum(incoming.values())
    if lim.max_queued is not None and n > lim.max_queued:
        return f"a batch of {n} tasks exceeds your queue bound of {lim.max_queued}: submit smaller batches"
    for fid, k in sorted(incoming.items()):
        flim = policy.function_limits(fid)
        if flim.max_queued is not None and k > flim.max_queued:
            return f"a batch of {k} tasks of function {fid} exceeds its queue bound of {flim.max_queued}: submit smaller batches"
    return None


def retry_after_s(excess: int, drain_per_s: float, lo: int = 1, hi: int = 60) -> int:
    """Seconds until about ``excess`` of the user's tasks have finished at the measured drain rate,
    within [lo, hi]: long enough that a retry is likely to fit, short enough not to idle workers."""
    if drain_per_s <= 0:
        return min(hi, max(lo, 5))
    return int(min(hi, max(lo, math.ceil(excess / drain_per_s))))


@dataclass(frozen=True)
class Flow:
    """Queued work of one user and one function on one endpoint, as the store counted it
    (``queued`` may be capped at what one lease could take)."""

    user_id: str
    function_id: str
    queued: int
    oldest: float


def plan_lease(n: int, flows: Iterable[Flow], running: Mapping[str, int], *, weights: Mapping[str, float] | None = None,
               user_room: Mapping[str, int | None] | None = None, function_room: Mapping[str, int | None] | None = None,
               fair: bool = True) -> list[tuple[str, str, int]]:
    """How many tasks of each flow to lease, ``n`` at most: ``[(user, function, count)]``.

    ``running``: tasks each user has dispatched to this endpoint and not finished. ``weights``:
    shares (default 1). ``user_room`` / ``function_room``: how many more may run under a
    concurrency limit (None or absent: no limit). With ``fair``, each slot goes to the user with
    the least ``(running + given) / weight`` among users with eligible work (ties: the user whose
    oldest task is oldest, then by id), and within a user to its functions in turn, oldest first.
    Without it, slots follow arrival order (flows by their oldest task); limits hold either way."""
    weights = weights or {}
    user_room = dict(user_room or {})
    function_room = dict(function_room or {})
    by_user: dict[str, list[list[Any]]] = {}
    for f in sorted(flows, key=lambda f: (f.oldest, f.user_id, f.function_id)):
        if f.queued > 0:
            by_user.setdefault(f.user_id, []).append([f.function_id, f.queued, f.oldest, 0])
    out: dict[tuple[str, str], int] = {}

    def room(u: str, fid: str) -> bool:
        ur, fr = user_room.get(u), function_room.get(fid)
        return (ur is None or ur > 0) and (fr is None or fr > 0)

    def take(u: str, flow: list[Any]) -> None:
        flow[1] -= 1
        flow[3] += 1
        out[(u, flow[0])] = out.get((u, flow[0]), 0) + 1
        if user_room.get(u) is not None:
            user_room[u] -= 1  # type: ignore[operator]
        if function_room.get(flow[0]) is not None:
            function_room[flow[0]] -= 1  # type: ignore[operator]

    if not fair:
        # Arrival order: the flows' oldest tasks decide (the store reads each flow oldest first).
        left = n
        for u, fl in sorted(((u, fl) for u, fls in by_user.items() for fl in fls), key=lambda x: x[1][2]):
            while left > 0 and fl[1] > 0 and room(u, fl[0]):
                take(u, fl)
                left -= 1
        return [(u, f, k) for (u, f), k in out.items()]

    heap: list[tuple[float, float, str]] = []
    given: dict[str, int] = {}
    for u, fls in by_user.items():
        w = weights.get(u, 1.0)
        heapq.heappush(heap, (running.get(u, 0) / w, fls[0][2], u))
    turn: dict[str, int] = {}
    left = n
    while left > 0 and heap:
        _, oldest, u = heapq.heappop(heap)
        fls = by_user[u]
        # Within a user, its functions take turns (round robin over flows with work and room).
        pick = None
        for i in range(len(fls)):
            fl = fls[(turn.get(u, 0) + i) % len(fls)]
            if fl[1] > 0 and room(u, fl[0]):
                pick = fl
                turn[u] = (turn.get(u, 0) + i + 1) % len(fls)
                break
        if pick is None:
            continue  # nothing of this user may go now: it leaves the heap for this lease
        take(u, pick)
        left -= 1
        given[u] = given.get(u, 0) + 1
        w = weights.get(u, 1.0)
        heapq.heappush(heap, ((running.get(u, 0) + given[u]) / w, oldest, u))
    return [(u, f, k) for (u, f), k in out.items()]
