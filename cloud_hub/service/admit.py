"""The submit path's admission control and memoization, and the hooks they need in the dispatcher.

``accept`` (cloud_hub/service/submit.py) calls :meth:`Admission.check` before placing anything, and
:meth:`Admission.memo_split` to answer cache hits without dispatch. The rules are in
cloud_hub/admission.py (pure); the memo rows in cloud_hub/store/memo.py. Both REST and any other
submit path that goes through ``accept`` get the same answers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from cloud_hub.admission import AdmissionPolicy, check_queue, too_big
from cloud_hub.observer import DispatchObserver
from cloud_hub.service.errors import ServiceError, TooManyTasks
from cloud_hub.store import admission as admission_rows
from cloud_hub.store import memo as memo_rows
from cloud_hub.store.memo import Hit, MemoSettings

if TYPE_CHECKING:
    from cloud_hub.config import HubConfig
    from cloud_hub.dispatcher import Dispatcher

__all__ = ["Admission", "TooManyTasks"]

_ESTIMATE_S = 2.0


class _Chain:
    """Forwards every hook to the placement service (any hook, present or added later: by
    ``__getattr__``), and on results lets the dispatcher try the endpoints again when concurrency
    limits may have held work back (a finished task frees room)."""

    def __init__(self, inner: DispatchObserver, on_results: Callable[[], None]) -> None:
        self.inner = inner
        self._on_results = on_results

    def results_stored(self, *a: Any) -> None:
        try:
            self.inner.results_stored(*a)
        finally:
            self._on_results()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Admission:
    """Limits, shares and the memo settings of one hub."""

    def __init__(self, cfg: "HubConfig", store: Any, dispatcher: "Dispatcher") -> None:
        self.policy: AdmissionPolicy = cfg.admission_policy()
        self.memo = MemoSettings(ttl_s=min(cfg.memo_ttl_s, cfg.result_ttl_s), max_entries=cfg.memo_max_entries,
                                 max_result_bytes=cfg.memo_max_result_bytes)
        self.store = store
        self.dispatcher = dispatcher
        store.admission = self.policy  # leases take turns between users (cloud_hub/store/fair.py)
        store.memo = self.memo  # results of cached submits are remembered (cloud_hub/store/memo.py)
        self._rate: dict[str, float] = {}  # user -> queued tasks dispatched per second (for Retry-After)
        self._queued: dict[str, tuple[int, float]] = {}  # user -> (queued tasks, at most; monotonic time counted)
        self._names: dict[str, str | None] = {}
        self.stats = {"refused": 0, "memo_hits": 0, "memo_misses": 0}

    def observer(self, inner: DispatchObserver) -> DispatchObserver:
        return cast(DispatchObserver, _Chain(inner, self._results_arrived))

    def _results_arrived(self) -> None:
        if self.policy.caps_running:  # work held back by a concurrency limit may go now
            for ep in list(self.dispatcher._sessions):
                self.dispatcher.kick(ep)

    # ------------------------------------------------------------------ queue bounds
    async def check(self, user: str, tasks: Sequence[Any]) -> None:
        """Raise 429 (with Retry-After) when these tasks would push the user or a function past its
        queue bound, 413 when the batch alone is larger than the bound. Reads only; stores nothing."""
        incoming: dict[str, int] = {}
        for t in tasks:
            incoming[t.function_id] = incoming.get(t.function_id, 0) + 1
        if not incoming:
            return
        pol = self.policy
        fids = sorted(f for f in incoming if pol.function_limits(f).max_queued is not None)
        name = await self._name(user)
        big = too_big(pol, user, name, incoming)
        if big is not None:
            raise ServiceError(413, big)
        lim = pol.user_limits(user, name)
        total = sum(incoming.values())
        # Counting a user's queue costs an index range as long as the queue (7 ms at 50,000 queued,
        # on the database thread): skip it while an estimate made less than 2 s ago, plus what was
        # admitted since, is under half the bound. Tasks leave the queue far more often than they
        # come back to it (an expired lease), so the estimate errs high; the bound is exact near it.
        now = time.monotonic()
        est = self._queued.get(user)
        if not fids and (lim.max_queued is None or (est is not None and now - est[1] < _ESTIMATE_S and est[0] + total <= lim.max_queued // 2)):
            if est is not None:
                self._queued[user] = (est[0] + total, est[1])
            return

        def q(db: Any) -> tuple[int, dict[str, int]]:
            n = 0
            if lim.max_queued is not None:  # counted no further than the bound needs
                n = admission_rows.queued(db, user, lim.max_queued + 1)
            per: dict[str, int] = {}
            for fid in fids:
                cap = int(pol.function_limits(fid).max_queued or 0)
                per[fid] = admission_rows.queued_of_function(db, user, fid, cap + 1)
            return int(n), per

        queued, per = await self.store.read(q)
        self._measure_drain(user, queued, now)
        refusal = check_queue(pol, user, name, incoming, queued, per, self._rate.get(user, 0.0))
        if refusal is None:
            self._queued[user] = (queued + total, now)
            return
        self._queued[user] = (queued, now)
        self.stats["refused"] += 1
        raise TooManyTasks(refusal.detail, refusal.retry_after_s)

    def _measure_drain(self, user: str, queued: int, now: float) -> None:
        """How fast the user's queue drains (tasks dispatched per second), from two counts: the
        last one plus what was admitted since, against this one. Free (the counts are made
        anyway) and it is the figure Retry-After needs: when will this much room be free."""
        prev = self._queued.get(user)
        if prev is None or now - prev[1] < 0.05:
            return
        rate = max(0.0, (prev[0] - queued) / (now - prev[1]))
        old = self._rate.get(user)
        self._rate[user] = rate if old is None else 0.5 * old + 0.5 * rate

    async def _name(self, user: str) -> str | None:
        """The user's name (limits and shares may name users by name); users are never renamed."""
        if user not in self._names:
            self._names[user] = await self.store.read(lambda db: admission_rows.user_name(db, user))
        return self._names[user]

    # ------------------------------------------------------------------ memoization
    async def memo_split(self, user: str, tasks: Sequence[Any], now: float) -> dict[int, Hit]:
        """Which tasks (by index) a cached result answers: no placement, no dispatch for those."""
        keys = [t.cache_key for t in tasks if getattr(t, "cache_key", None)]
        if not keys:
            return {}
        def q(db: Any) -> dict[str, Hit]:
            got = memo_rows.lookup(db, user, keys, now)
            rest = [k for k in keys if k not in got]
            if rest:  # the same call still queued or running: join it rather than run it twice
                got.update(memo_rows.pending(db, user, rest))
            return got

        found = await self.store.read(q)
        out = {i: found[t.cache_key] for i, t in enumerate(tasks) if getattr(t, "cache_key", None) in found}
        self.stats["memo_hits"] += len(out)
        self.stats["memo_misses"] += len(keys) - len(out)
        return out

    @staticmethod
    def memo_writer(user: str, hits: Sequence[tuple[dict[str, Any], Hit]], misses: dict[str, int], now: float) -> Callable[[Any], None] | None:
        """What the submit's transaction writes for cached submits (hit tasks and their results, counters)."""
        if not hits and not misses:
            return None
        return lambda db: memo_rows.write_hits(db, user, hits, misses, now)
