"""The dispatcher: moves tasks from the hub's durable per-endpoint queues to agents and results back.

- Credit-based: an endpoint gets only as many tasks as its agent asked for (``fetch``), leased
  for ``lease_s``; an agent's ``ack`` means "stored on the device", after which the task waits
  there even through week-long outages. Leases that expire go back to the queue.
- Transport-blind: each endpoint's session remembers the link it last spoke on.
- Results are stored once per task id (duplicates from re-execution are acked, not stored),
  then waiters (long-poll and stream requests) are woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from cloud_hub.config import HubConfig
from cloud_hub.observer import DispatchObserver
from cloud_hub.store import SqliteStore
from cloud_hub.store.availability import close_stale_sessions, prune_events, record_transition
from mesh_agent.protocol import (
    UP_KINDS,
    BadFrame,
    Envelope,
    Kind,
    ProtocolError,
    ReplayGuard,
    check_freshness,
    encode,
    open_frame,
    peek_endpoint,
    serialize,
)
from mesh_agent.transport import HubLink, LinkError

__all__ = ["Dispatcher", "ResultBus"]

log = logging.getLogger("cloud_hub.dispatcher")

_LEASE_BATCH = 2000
_LEASE_BYTES = 8 * 2**20
_EVENTS_KEEP_S = 90 * 86400  # availability history kept for the console and the scheduler


class ResultBus:
    """Wakes waiters when results for a user arrive. Grab ``event(user)`` *before* querying the
    store, then wait on it: a result stored in between has already set that event (no lost wake-up)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def event(self, user_id: str) -> asyncio.Event:
        ev = self._events.get(user_id)
        if ev is None:
            ev = self._events[user_id] = asyncio.Event()
        return ev

    def notify(self, user_ids: set[str]) -> None:
        for u in user_ids:
            ev = self._events.pop(u, None)
            if ev is not None:
                ev.set()


@dataclass
class _Session:
    endpoint_id: str
    link: HubLink
    last_seen: float
    credit: int = 0
    capacity: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    pumping: bool = False
    again: bool = False
    starved: int = 0  # heartbeats in a row that wanted work while the hub had no credit for it


class Dispatcher:
    def __init__(self, cfg: HubConfig, store: SqliteStore, bus: ResultBus) -> None:
        self.cfg = cfg
        self.store = store
        self.bus = bus
        self.links: list[HubLink] = []
        self._keys: dict[str, bytes] = {}
        self._sessions: dict[str, _Session] = {}
        self._replay = ReplayGuard()
        self._allow: dict[str, frozenset[str]] = {}  # endpoints with a function allow-list
        self._watchdog: asyncio.Task[None] | None = None
        self.stats = {"rejected_frames": 0, "tasks_sent": 0, "results_stored": 0, "duplicate_results": 0}
        self.observer = DispatchObserver()  # the hub plugs in its placement service
        # Replicas (several hubs on one PostgreSQL database and one broker): every replica hears
        # every MQTT frame; only the one holding an endpoint's row in endpoint_owners answers it.
        self.replicated = cfg.database_url is not None
        self.replica_id = cfg.replica_id or uuid.uuid4().hex[:12]
        self._owned: dict[str, float] = {}  # endpoint -> our hold expires (wall clock)
        self._elsewhere: dict[str, float] = {}  # endpoint -> don't ask the database again before

    def _observe(self, hook: str, *args: Any) -> None:
        try:
            getattr(self.observer, hook)(*args)
        except Exception:
            log.exception("observer hook %s failed", hook)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, links: list[HubLink]) -> None:
        from cloud_hub.store.access import AccessStore

        self._keys = await self.store.endpoint_keys()
        self._allow = await AccessStore(self.store).allow_lists()
        # Leases from before a restart may or may not have reached their agents: re-queue them;
        # an agent that did get one de-duplicates by task id. With replicas, others' leases are
        # live: only expired ones go back (the watchdog keeps doing that).
        n = await self.store.requeue(expired_before=time.time() if self.replicated else float("inf"))
        if n:
            log.info("re-queued %d tasks leased before the restart", n)
        if not self.replicated:  # availability history: nobody has a session yet (replicas may)
            await self.store.tx(close_stale_sessions)
        for link in links:
            await link.start(self.on_frame)
            self.links.append(link)
        self._watchdog = asyncio.create_task(self._watch(), name="dispatcher-watchdog")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for link in self.links:
            await link.stop()
        if self.replicated:  # hand our endpoints over now rather than after lost_after_s
            for ep in list(self._owned):
                with contextlib.suppress(Exception):
                    await self.store.release_endpoint(ep, self.replica_id)
            self._owned.clear()

    def add_endpoint_key(self, endpoint_id: str, key: bytes) -> None:
        self._keys[endpoint_id] = key

    def allow_list(self, endpoint_id: str) -> frozenset[str] | None:
        return self._allow.get(endpoint_id)

    def set_allow_list(self, endpoint_id: str, allowed: frozenset[str] | None) -> None:
        """The agent learns the new list with its next tasks frame (or welcome)."""
        if allowed is None:
            self._allow.pop(endpoint_id, None)
        else:
            self._allow[endpoint_id] = allowed

    def revoke(self, endpoint_id: str) -> None:
        """Forget the endpoint's key: from now on every frame of it fails as from an unknown endpoint."""
        self._keys.pop(endpoint_id, None)
        self._sessions.pop(endpoint_id, None)
        self._allow.pop(endpoint_id, None)
        for link in self.links:
            revoke = getattr(link, "revoke_client", None)
            if revoke is not None:
                revoke(endpoint_id)

    def _allow_field(self, endpoint_id: str) -> list[str] | None:
        allowed = self._allow.get(endpoint_id)
        return None if allowed is None else sorted(allowed)

    def online(self, endpoint_id: str) -> bool:
        return endpoint_id in self._sessions

    def session_info(self, endpoint_id: str) -> dict[str, Any] | None:
        s = self._sessions.get(endpoint_id)
        if s is None:
            return None
        return {"credit": s.credit, "capacity": s.capacity, "last_seen": s.last_seen, "transport": s.link.name, **s.info}

    # ------------------------------------------------------------------ outgoing
    async def _send(self, s: _Session, kind: Kind, body: dict[str, Any], msg_id: str | None = None) -> None:
        env = Envelope(kind, s.endpoint_id, body) if msg_id is None else Envelope(kind, s.endpoint_id, body, id=msg_id)
        frame = encode(env, self._keys[s.endpoint_id], ttl=self.cfg.frame_ttl_s)
        await s.link.send(s.endpoint_id, frame)

    def kick(self, endpoint_id: str) -> None:
        """New work for an endpoint: send it now if its agent has credit (coalesced per endpoint)."""
        s = self._sessions.get(endpoint_id)
        if s is None or s.credit <= 0:
            return
        if s.pumping:
            s.again = True
            return
        s.pumping = True
        asyncio.create_task(self._pump(s))

    async def _pump(self, s: _Session) -> None:
        try:
            while True:
                s.again = False
                while s.credit > 0 and self._sessions.get(s.endpoint_id) is s:
                    tasks, bodies = await self.store.lease(s.endpoint_id, min(s.credit, _LEASE_BATCH), self.cfg.lease_s, _LEASE_BYTES)
                    if not tasks:
                        break
                    s.credit -= len(tasks)
                    try:
                        await self._send(s, Kind.TASKS, {"tasks": tasks, "functions": bodies, "allow": self._allow_field(s.endpoint_id)})
                        self.stats["tasks_sent"] += len(tasks)
                    except LinkError as exc:
                        # Not handed to the transport (a ZeroMQ peer gone, the broker away): back in
                        # the queue now rather than after lease_s; a copy that did get out is
                        # de-duplicated by the agent.
                        n = await self.store.unlease(s.endpoint_id, [t["id"] for t in tasks])
                        log.warning("sending to %s failed (%s); %d tasks re-queued", s.endpoint_id, exc, n)
                        s.credit = 0
                        break
                if not s.again:
                    break
        except Exception:
            log.exception("dispatch to %s failed", s.endpoint_id)
        finally:
            s.pumping = False

    # ------------------------------------------------------------------ incoming
    async def on_frame(self, claimed: str, frame: bytes, link: HubLink) -> None:
        try:
            endpoint_id = peek_endpoint(frame)
            if endpoint_id != claimed:
                raise ProtocolError(f"frame for {endpoint_id} arrived on {claimed}'s channel")
            key = self._keys.get(endpoint_id)
            if key is None and self.replicated:  # enrolled through another replica
                key = await self.store.endpoint_key(endpoint_id)
                if key is not None:
                    self._keys[endpoint_id] = key
            if key is None:
                raise ProtocolError(f"unknown endpoint {endpoint_id}")
            sealed = open_frame(frame, key)
            if sealed.kind not in UP_KINDS:
                raise BadFrame(f"a {sealed.kind.value} frame cannot come from an agent (reflected?)")
            # A hello is answered with a nonce-bound welcome that tells the agent our clock, so it
            # may come from a device whose clock is off (a Pi after a power cut has no RTC).
            if sealed.kind is not Kind.HELLO:
                check_freshness(sealed)
            self._replay.check(sealed)
            env = sealed.open()  # the body is parsed only after MAC, freshness and replay passed
        except ProtocolError as exc:
            self.stats["rejected_frames"] += 1
            log.warning("rejected frame on %s channel %s: %s: %s", link.name, claimed, exc.reason, exc)
            return
        if self.replicated and not await self._holds(endpoint_id):
            return  # another replica answers this endpoint
        if env.kind is Kind.HELLO:
            await self._on_hello(env, link)
            return
        s = self._sessions.get(endpoint_id)
        if s is None:
            tmp = _Session(endpoint_id, link, time.time())
            with contextlib.suppress(LinkError):
                await self._send(tmp, Kind.ERROR, {"code": "hello_required", "message": "no session; say hello"})
            return
        s.last_seen = time.time()
        s.link = link
        self._observe("frame_received", endpoint_id, env.kind.value, len(frame), env.ts, s.last_seen)
        handler = _HANDLERS.get(env.kind)
        if handler is not None:
            await handler(self, s, env.body)

    async def _holds(self, endpoint_id: str) -> bool:
        """Whether this replica holds the endpoint's session, claiming it when nobody does.

        Renewed in the database at most every ``lost_after_s / 3``; a replica that dies stops
        renewing, and after ``lost_after_s`` the next frame the agent sends lets another replica
        claim it (the agent is told to say hello again, its leased tasks go back to the queue).
        """
        now = time.time()
        held = self._owned.get(endpoint_id, 0.0)
        if held - now > self.cfg.lost_after_s * 2 / 3:
            return True
        if self._elsewhere.get(endpoint_id, 0.0) > now:
            return False
        until = now + self.cfg.lost_after_s
        if await self.store.claim_endpoint(endpoint_id, self.replica_id, until, now):
            self._owned[endpoint_id] = until
            self._elsewhere.pop(endpoint_id, None)
            return True
        self._owned.pop(endpoint_id, None)
        if self._sessions.pop(endpoint_id, None) is not None:
            log.info("endpoint %s is now served by another replica", endpoint_id)
        self._elsewhere[endpoint_id] = now + min(2.0, self.cfg.lost_after_s / 3)
        return False

    async def _on_hello(self, env: Envelope, link: HubLink) -> None:
        b = env.body
        now = time.time()
        s = _Session(env.endpoint, link, now, capacity=int(b.get("capacity", 1)))
        old = self._sessions.get(env.endpoint)
        if old is not None:
            s.credit = old.credit  # a repeated (or replayed) hello must not starve the agent
        s.info = {k: b.get(k) for k in ("host", "version", "engine", "pid", "prefetch", "tags", "hardware", "gpu", "memory_mb")}
        self._sessions[env.endpoint] = s
        held = set(b.get("have", []))
        await self.store.requeue(endpoint_id=env.endpoint)
        lost = await self.store.requeue(endpoint_id=env.endpoint, not_in=held)
        if lost:
            log.warning("%s no longer holds %d acked tasks; re-queued", env.endpoint, lost)
        await self.store.set_endpoint_state(env.endpoint, True, now, {**s.info, "capacity": s.capacity})
        self._observe("endpoint_online", env.endpoint, now, {**s.info, "capacity": s.capacity})
        if old is None:
            await self.store.tx(record_transition, env.endpoint, True, now)
        # The welcome's message id is the hello's nonce: the agent matches it before parsing the body.
        welcome = {"reply_to": b["nonce"], "hub_time": time.time(), "heartbeat_s": self.cfg.heartbeat_s, "allow": self._allow_field(env.endpoint)}
        await self._send(s, Kind.WELCOME, welcome, msg_id=b["nonce"])
        log.info("endpoint %s online via %s (capacity %d)", env.endpoint, link.name, s.capacity)

    async def _on_fetch(self, s: _Session, body: dict[str, Any]) -> None:
        s.credit = max(0, int(body.get("want", 0)))
        self.kick(s.endpoint_id)

    async def _on_ack(self, s: _Session, body: dict[str, Any]) -> None:
        await self.store.ack(s.endpoint_id, body.get("ids", []))

    async def _on_results(self, s: _Session, body: dict[str, Any]) -> None:
        results = body.get("results", [])
        fresh = await self.store.store_results(s.endpoint_id, results)
        self.stats["results_stored"] += len(fresh)
        self.stats["duplicate_results"] += len(results) - len(fresh)
        # Ack all, duplicates too: the agent must stop re-sending them either way.
        if fresh:
            self.bus.notify({u for _, u in fresh})
        self._observe("results_stored", s.endpoint_id, time.time(), results, {t for t, _ in fresh})
        await self._send(s, Kind.RESULT_ACK, {"ids": [r["id"] for r in results]})

    async def _on_heartbeat(self, s: _Session, body: dict[str, Any]) -> None:
        s.info.update({k: body.get(k) for k in ("running", "queued", "stored", "outbox", "cpu", "mem_used", "mem_avail_mb", "want")})
        s.info["warm"] = body.get("warm", [])
        await self.store.set_endpoint_state(s.endpoint_id, True, s.last_seen, {**s.info, "capacity": s.capacity})
        self._observe("heartbeat", s.endpoint_id, s.last_seen, {**s.info, "capacity": s.capacity})
        await self._resync_credit(s, body.get("want"))

    async def _resync_credit(self, s: _Session, want: Any) -> None:
        """Recover from a lost ``tasks`` frame. Sending one spends the session's credit; if the
        frame never arrives (a ZeroMQ peer that reconnected mid-send, a crashed broker), the agent
        still counts it as owed and does not fetch again, and over ZeroMQ it never reconnects:
        the endpoint would starve with tasks queued for it. Its heartbeats carry ``want``: when two
        in a row want work while the hub has no credit and nothing leased to it (on its way),
        the two sides have lost sync, and ``want`` becomes the credit."""
        if s.credit > 0 or not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            s.starved = 0
            return
        if await self.store.count_leased(s.endpoint_id):
            s.starved = 0
            return
        s.starved += 1
        if s.starved >= 2:
            s.starved = 0
            s.credit = want
            self.kick(s.endpoint_id)

    # ------------------------------------------------------------------ watchdog
    async def _watch(self) -> None:
        last_prune = 0.0
        while True:
            await asyncio.sleep(min(1.0, self.cfg.heartbeat_s / 2))
            try:
                now = time.time()
                for ep, s in list(self._sessions.items()):
                    if now - s.last_seen > self.cfg.lost_after_s:
                        del self._sessions[ep]
                        n = await self.store.requeue(endpoint_id=ep)
                        await self.store.set_endpoint_state(ep, False, s.last_seen)
                        if self.replicated:
                            self._owned.pop(ep, None)
                            await self.store.release_endpoint(ep, self.replica_id)
                        self._observe("endpoint_lost", ep, now, s.last_seen)
                        await self.store.tx(record_transition, ep, False, s.last_seen)
                        log.warning("endpoint %s lost (silent %.0fs); %d leased tasks re-queued", ep, now - s.last_seen, n)
                if await self.store.requeue(expired_before=now):
                    for ep in self._sessions:
                        self.kick(ep)
                expired = await self.store.expire_tasks(now, _expired_blob)
                if expired:
                    self.bus.notify({u for _, u in expired})
                    self._observe("tasks_expired", [t for t, _ in expired], now)
                if now - last_prune > 60:
                    last_prune = now
                    await self.store.prune_results(now - self.cfg.result_ttl_s)
                    await self.store.tx(prune_events, now - _EVENTS_KEEP_S)
            except Exception:
                log.exception("watchdog pass failed")


def _expired_blob(task_id: str) -> bytes:
    return serialize(
        {
            "type": "cloud_hub.TaskExpired",
            "message": f"task {task_id} expired at the hub before any endpoint ran it",
            "traceback": "",
            "exception": None,
        }
    )


_HANDLERS = {
    Kind.FETCH: Dispatcher._on_fetch,
    Kind.ACK: Dispatcher._on_ack,
    Kind.RESULTS: Dispatcher._on_results,
    Kind.HEARTBEAT: Dispatcher._on_heartbeat,
}
