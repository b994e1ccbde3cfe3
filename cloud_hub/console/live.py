"""Live updates: one small JSON snapshot per user, pushed to signed-in browsers by server-sent events.

Why snapshots and not an event log: a browser that reconnects after a flaky phone link needs
the current state, not the history it missed, and a snapshot is idempotent. The snapshot is
computed at most once per ``SNAPSHOT_TTL_S`` per user, however many tabs watch, so an open
console costs the store a few cheap reads a second, not one per tab. Each stream sends a
snapshot only when its digest changes, a comment line as a heartbeat otherwise, re-checks its
session now and then (sign-out elsewhere ends it), and ends after ``STREAM_LIFETIME_S`` (the
browser's EventSource reconnects by itself). Streams are bounded per session and in total.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from cloud_hub.console import queries

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub

__all__ = ["Live", "TooManyStreams", "BUCKET_S", "BUCKETS", "endpoint_view"]

SNAPSHOT_TTL_S = 1.0
#: A snapshot is reused for at least this many times its own compute time: on a huge task table
#: live updates slow down instead of the console eating the hub (5% of one core per user at most).
SNAPSHOT_COST_FACTOR = 20.0
PUSH_EVERY_S = 1.0
KEEPALIVE_S = 15.0
RECHECK_SESSION_S = 10.0
STREAM_LIFETIME_S = 600.0
MAX_STREAMS_PER_SESSION = 4
MAX_STREAMS = 200
BUCKET_S = 10.0
BUCKETS = 60

#: Extra snapshot sections (e.g. counts of scheduler decisions or FL runs): name -> async fn(hub, user).
Extra = Callable[["Hub", str], Awaitable[Any]]


class TooManyStreams(RuntimeError):
    pass


def endpoint_view(hub: "Hub", e: dict[str, Any]) -> tuple[bool, dict[str, Any], float | None]:
    """(online, info, last seen) of a store row, exactly as ``GET /v1/endpoints`` reports them
    (the live session when this hub holds it; with replicas, the shared row while it is fresh)."""
    from cloud_hub.service.hub import endpoint_out as _endpoint_out

    out = _endpoint_out(hub, e)
    return out.online, out.info, out.last_seen


class _Stream:
    def __init__(self) -> None:
        self.evicted = asyncio.Event()


class Live:
    def __init__(self, hub: "Hub", extras: dict[str, Extra] | None = None) -> None:
        self.hub = hub
        self.extras = extras or {}
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}  # user -> (reuse until, snapshot)
        self._locks: dict[str, asyncio.Lock] = {}
        self._streams: dict[str, list[_Stream]] = {}

    @property
    def open_streams(self) -> int:
        return sum(len(v) for v in self._streams.values())

    # ------------------------------------------------------------------ snapshots
    async def snapshot(self, user_id: str) -> dict[str, Any]:
        hit = self._cache.get(user_id)
        if hit and time.monotonic() < hit[0]:
            return hit[1]
        lock = self._locks.setdefault(user_id, asyncio.Lock())
        async with lock:
            hit = self._cache.get(user_id)
            if hit and time.monotonic() < hit[0]:
                return hit[1]
            t0 = time.monotonic()
            snap = await self._compute(user_id)
            cost = time.monotonic() - t0
            snap["cost_ms"] = round(cost * 1e3, 1)
            self._cache[user_id] = (time.monotonic() + max(SNAPSHOT_TTL_S, SNAPSHOT_COST_FACTOR * cost), snap)
            if len(self._cache) > 1000:  # users who stopped watching
                cutoff = time.monotonic() - 60
                for u in [u for u, (t, _) in self._cache.items() if t < cutoff]:
                    self._cache.pop(u, None)
                    self._locks.pop(u, None)
            return snap

    async def _compute(self, user_id: str) -> dict[str, Any]:
        hub = self.hub
        now = time.time()
        eps = []
        for e in await hub.store.list_endpoints(user_id=user_id):
            online, info, last_seen = endpoint_view(hub, e)
            eps.append({
                "id": e["id"], "name": e["name"], "online": online, "last_seen": last_seen,
                "queued": e["queued"], "in_flight": e["in_flight"],
                "running": info.get("running"), "capacity": info.get("capacity"),
            })
        counts = await hub.store.read_parallel(queries.state_counts, user_id)
        series = await hub.store.read_parallel(queries.throughput, user_id, now, BUCKET_S, BUCKETS)
        extra = {}
        for name, fn in self.extras.items():
            try:
                extra[name] = await fn(hub, user_id)
            except Exception as exc:  # a page's optional data must not break the live stream
                extra[name] = {"error": str(exc)}
        online = sum(1 for e in eps if e["online"])
        snap: dict[str, Any] = {
            "endpoints": eps, "online": online, "offline": len(eps) - online, "counts": counts,
            "total": sum(counts.values()), "throughput": series, "bucket_s": BUCKET_S, "extra": extra,
        }
        stable = {k: v for k, v in snap.items() if k != "endpoints"}
        stable["endpoints"] = [{k: v for k, v in e.items() if k != "last_seen"} for e in eps]
        snap["rev"] = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]
        snap["now"] = now
        return snap

    # ------------------------------------------------------------------ streams
    def _register(self, session_hash: str) -> _Stream:
        mine = self._streams.setdefault(session_hash, [])
        while len(mine) >= MAX_STREAMS_PER_SESSION:  # oldest tab's stream yields to the newest
            mine.pop(0).evicted.set()
        s = _Stream()
        mine.append(s)
        return s

    def _unregister(self, session_hash: str, s: _Stream) -> None:
        mine = self._streams.get(session_hash, [])
        if s in mine:
            mine.remove(s)
        if not mine:
            self._streams.pop(session_hash, None)

    def open(self, session_hash: str, user_id: str, still_valid: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        """The body generator of a new stream; raises ``TooManyStreams`` when the hub is at its limit.
        The stream registers when the response starts sending, so one never sent leaks nothing."""
        if self.open_streams >= MAX_STREAMS:
            raise TooManyStreams(f"the hub serves at most {MAX_STREAMS} live streams; try again later")
        return self._run(session_hash, user_id, still_valid)

    async def _run(self, session_hash: str, user_id: str, still_valid: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
        s = self._register(session_hash)
        try:
            yield "retry: 2000\n\n"
            started = last_sent = last_check = time.monotonic()
            last_rev = None
            while not s.evicted.is_set():
                now = time.monotonic()
                if now - started > STREAM_LIFETIME_S:
                    return
                if now - last_check > RECHECK_SESSION_S:
                    last_check = now
                    if not await still_valid():
                        yield "event: signout\ndata: {}\n\n"
                        return
                snap = await self.snapshot(user_id)
                if snap["rev"] != last_rev:
                    last_rev = snap["rev"]
                    last_sent = now
                    yield f"event: snapshot\ndata: {json.dumps(snap, default=str)}\n\n"
                elif now - last_sent > KEEPALIVE_S:
                    last_sent = now
                    yield ": keepalive\n\n"
                try:
                    await asyncio.wait_for(s.evicted.wait(), PUSH_EVERY_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._unregister(session_hash, s)
