"""The dispatcher: moves tasks from the hub's durable per-endpoint queues to agents and results back.

- Credit-based: an endpoint gets only as many tasks as its agent asked for (``fetch``), leased
  for ``lease_s``; an agent's ``ack`` means "stored on the device", after which the task waits
  there even through week-long outages. Leases that expire go back to the queue.
- Transport-blind: each endpoint's session remembers the link it last spoke on.
- Results are stored once per task id (duplicates from re-execution are acked, not stored),
  then waiters (long-poll and stream requests) are woken.
- Liveness: every verified frame is proof of life. ZeroMQ agents and agents on the ``lan`` profile
  beat every ``heartbeat_s`` and are lost after ``lost_after_s`` of silence. Metered MQTT agents
  beat only on change; their MQTT will (a signed ``gone`` frame the broker publishes when their
  keepalive lapses) ends the session within ``mqtt_lost_after_s``, and silence beyond
  ``beat_max_s + mqtt_lost_after_s`` does if the will never came (docs/protocol.md, "Liveness").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from cloud_hub.config import HubConfig
from cloud_hub.lanes import Lanes
from cloud_hub.observer import DispatchObserver
from cloud_hub.site_frames import SiteDownLink, split_site_up
from cloud_hub.site_lease import ConfirmClock
from cloud_hub.store import SqliteStore
from cloud_hub.store.availability import close_stale_sessions, prune_events
from cloud_hub.store.sqlite import check_results
from mesh_agent import costs
from mesh_agent.protocol import (
    UP_KINDS,
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    Replayed,
    ReplayGuard,
    Stale,
    check_freshness,
    encode,
    open_frame,
    peek_endpoint,
    serialize,
)
from mesh_agent.protocol.bodies import validate_body
from mesh_agent.protocol.site import site_body, stored_upto, summary_rows
from mesh_agent.transport import HubLink, LinkError

__all__ = ["Dispatcher", "ResultBus"]

log = logging.getLogger("cloud_hub.dispatcher")

#: A replayed results frame is acknowledged again at most this often (Dispatcher._reack); the
#: gateway re-sends at least mesh_agent.gateway.RESEND_UP_S apart.
_REACK_EVERY_S = 5.0
#: Hub frames that carry an echo stamp (``"t"``): the ones an agent answers soon with a frame of
#: its own (results after tasks, the next results or beat after a result_ack), so the echo rides
#: on a frame that is sent anyway.
_ECHOED = frozenset({Kind.TASKS, Kind.RESULT_ACK})
_REACK_REMEMBER = 20_000
#: A frame from an endpoint without a session is answered hello_required at most this often.
_HELLO_REQUIRED_EVERY_S = 2.0

#: Why a frame from an endpoint's channel was refused, as ``mesh_frames_rejected_total`` labels it
#: (cloud_hub/metrics.py, docs/security.md): forged or damaged (``bad_mac``), too old or from the
#: future (``stale``), seen before (``replay``), not a frame or a body of the wrong shape
#: (``malformed``), past the size limit (``oversize``), a hub kind sent back at the hub
#: (``wrong_direction``), another endpoint's frame on this channel (``wrong_channel``), a channel no
#: enrolled endpoint has (``unknown_endpoint``).
REJECT_REASONS = ("bad_mac", "stale", "replay", "malformed", "oversize", "wrong_direction", "wrong_channel", "unknown_endpoint",
                  "foreign_device")
#: Endpoint label values of the rejected-frame counter: past this many, "other" (a label per
#: endpoint is affordable for the few that misbehave, not for a fleet of 10,000 all at once).
#: A channel no enrolled endpoint has is always "unknown", so no sender can mint labels.
REJECT_LABELS_MAX = 500


def reject_reason(exc: BaseException) -> str:
    """The counter's reason for a refused frame (one of :data:`REJECT_REASONS`)."""
    marked = getattr(exc, "counter_reason", None)
    if marked in REJECT_REASONS:
        return str(marked)
    if isinstance(exc, Replayed):
        return "replay"
    if isinstance(exc, Stale):
        return "stale"
    if isinstance(exc, BadSignature):
        return "bad_mac"
    text = str(exc)
    if "exceeds" in text or "inflates past" in text:  # mesh_agent/protocol/envelope.py's size checks
        return "oversize"
    return "malformed"


def _refused(exc: ProtocolError, reason: str) -> ProtocolError:
    exc.counter_reason = reason  # type: ignore[attr-defined]
    return exc


_LEASE_BATCH = 2000
#: A cancel sent to an agent and not confirmed (``ack.c``) is sent again after this long; a new session gets it at once.
_CANCEL_RESEND_S = 10.0
#: How often the watchdog re-reads which endpoints have cancels to send (other replicas' cancels too).
_CANCEL_SCAN_S = 10.0
_LEASE_BYTES = 8 * 2**20
_EVENTS_KEEP_S = 90 * 86400  # availability history kept for the console and the scheduler


class Inbox:
    """A result stream's copy of the results stored for its user since it last looked, in the
    stream's own row format, so it can send them without reading them back (issue 30). It is
    only a shortcut: ``take`` returns None whenever the store must be read instead (a result
    stored without rows, such as a memo hit or an expiry; a gap in the numbers; too many held)."""

    __slots__ = ("rows", "stale")
    MAX_ROWS = 2000

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.stale = True  # the stream reads the store first

    def take(self, cursor: int) -> list[dict[str, Any]] | None:
        """The rows right after ``cursor`` (numbers with no gap), [] for none, or None: read the store."""
        rows, self.rows = self.rows, []
        if self.stale:
            self.stale = False
            return None
        rows = [r for r in rows if r["seq"] > cursor]
        for i, r in enumerate(rows):
            if r["seq"] != cursor + 1 + i:
                return None
        return rows

    def add(self, rows: list[dict[str, Any]]) -> None:
        if self.stale:
            return
        if len(self.rows) + len(rows) > self.MAX_ROWS:  # a slow client: the store has them
            self.rows, self.stale = [], True
            return
        self.rows.extend(rows)


class ResultBus:
    """Wakes waiters when results for a user arrive. Grab ``event(user)`` *before* querying the
    store, then wait on it: a result stored in between has already set that event (no lost wake-up).
    A result stream also holds an :class:`Inbox`, which ``stored`` fills with the rows themselves."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._early: list[Any] = []  # SDK streams that take results before they are stored (cloud_hub/api/stream.py)
        self._inboxes: dict[str, list[Inbox]] = {}

    def inbox(self, user_id: str) -> Inbox:
        box = Inbox()
        self._inboxes.setdefault(user_id, []).append(box)
        return box

    def drop_inbox(self, user_id: str, box: Inbox) -> None:
        boxes = self._inboxes.get(user_id, [])
        if box in boxes:
            boxes.remove(box)
        if not boxes:
            self._inboxes.pop(user_id, None)

    def stored(self, rows_by_user: dict[str, list[dict[str, Any]]]) -> None:
        """Results just stored, with their rows (``Fresh.rows``): into every inbox of their user, then wake."""
        for u, rows in rows_by_user.items():
            for box in self._inboxes.get(u, ()):
                box.add(rows)
        self._wake(set(rows_by_user))

    def listen_early(self, cb: Any) -> None:
        """``cb(endpoint_id, results)`` with each verified ``results`` body, before the hub stores
        it. Safe to pass on: the agent keeps a result until the hub's ``result_ack``, which follows
        the commit, so one the hub loses is sent and stored again (and the SDK drops repeats)."""
        self._early.append(cb)

    def unlisten_early(self, cb: Any) -> None:
        with contextlib.suppress(ValueError):
            self._early.remove(cb)

    def early(self, endpoint_id: str, results: list[dict[str, Any]]) -> None:
        for cb in list(self._early):
            try:
                cb(endpoint_id, results)
            except Exception:  # a listener's bug must not cost the results their storage
                log.exception("early result listener failed")

    def event(self, user_id: str) -> asyncio.Event:
        ev = self._events.get(user_id)
        if ev is None:
            ev = self._events[user_id] = asyncio.Event()
        return ev

    def notify(self, user_ids: set[str]) -> None:
        """Results were stored for these users (rows not at hand): waiters read the store."""
        for u in user_ids:
            for box in self._inboxes.get(u, ()):
                box.stale = True
        self._wake(user_ids)

    def _wake(self, user_ids: set[str]) -> None:
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
    again: bool = False  # a kick came while the pump (or a claim, InsertLeases) held the session: go round again
    again_new: bool = False  # ... and it said new work may be queued: the queue is not known to be drained
    starved: int = 0  # heartbeats in a row that wanted work while the hub had no credit for it
    conn: str | None = None  # the agent's connection id (its will names it), from the hello
    compress: bool = False  # the agent reads compressed bodies
    bound: float = 0.0  # silence after which the session is lost (0: the hub's lost_after_s)
    retry_credit: int = 0  # credit of a tasks frame that failed to send, given back after retry_at
    retry_at: float = 0.0
    site_hold: int = 0  # a site gateway: how many tasks for its devices it holds ahead of time (docs/sites.md)
    site_broker: tuple[str, int] | None = None  # a site gateway: where its devices dial it on the LAN
    site_pumping: bool = False
    site_cache: bool = False  # a site gateway that caches function bodies: each crosses the uplink once
    site_have: set[str] = field(default_factory=set)  # function ids that gateway holds
    # A site gateway back after its session ended (an uplink outage): until this time, work that
    # went back to the queue from its unconfirmed leases is not sent to it again. It probably holds
    # those frames, or the broker is delivering them now (its session is persistent), and its
    # confirmations re-claim them (docs/sites.md); what it does not confirm goes out again after.
    site_wait_until: float = 0.0
    # Echoed timestamps (docs/protocol.md, "Link timing"): the number of our last stamped frame
    # and when each recent one left (hub clock), to match the agent's echo against.
    echo_seq: int = 0
    echo_sent: dict[int, float] = field(default_factory=dict)
    # Tasks the scheduler placed that this session was sent and that have no result yet (id ->
    # when sent): what counts against the endpoint's lookahead (docs/scheduler.md, "Late binding").
    placed_out: dict[str, float] = field(default_factory=dict)
    metered: bool = False  # the agent runs the metered profile (adaptive beats): every frame costs it money
    # The last lease found the endpoint's queue empty (``drained``), or no task in it that must
    # start at once (``now_drained``): until a kick says new work may be there, a kick for room
    # (a fetch, a result) does not ask the database again (issue 30). Never with replicas: another
    # replica queues work for our endpoints without kicking us.
    drained: bool = False
    now_drained: bool = False
    # The safety net under those flags: a path that queues work without kicking would strand it.
    # The watchdog looks again at ``recheck_at`` (0: not due), after 1 s, then 2, 4... up to 60 s
    # while nothing new is kicked; the looks due in one watchdog pass are one read together
    # (``_recheck_due``), so an idle endpoint costs one indexed probe a minute.
    recheck_at: float = 0.0
    recheck_wait: float = 1.0
    site_frames: bool = False  # a site gateway that reads and sends site_up/site_down (cloud_hub/site_frames.py)
    # A site-frames gateway that reports its devices' LAN reconnects in their liveness rows (hello.site.resume)
    site_resume: bool = False
    site_bin: bool = False  # a site-frames gateway that reads binary ids in a site_down's device table (hello.site.bin)
    # A device told in its welcome to resume after a LAN reconnect without a hello: its session
    # outlives a short LAN absence (Dispatcher._site_rows, docs/sites.md "LAN reconnects")
    resume: bool = False
    resume_withdrawn: bool = False  # ... and its gateway no longer reports reconnects: asked for a hello


def per_day(t: list[float], now: float | None = None) -> dict[str, float]:
    """Counters ``[bytes in, bytes out, frames in, frames out, since]`` scaled to a day (over at least
    an hour's worth of time, so a fresh start does not extrapolate one hello)."""
    span = max(3600.0, (now or time.time()) - t[4])
    return {"in": t[0] * 86400 / span, "out": t[1] * 86400 / span, "frames": (t[2] + t[3]) * 86400 / span,
            "bytes_in": t[0], "bytes_out": t[1], "since": t[4]}


def keepalive_for(bound_s: float) -> int:
    """The MQTT keepalive that keeps an offline bound: the broker gives up on a client 1.5 keepalives
    after its last packet and publishes its will at once. The slack covers Mosquitto's whole-second
    keepalive arithmetic and check interval (measured: up to ~2 s) and the will's trip to the hub."""
    slack = max(3.0, min(5.0, bound_s * 0.1))
    return max(1, int((bound_s - slack) / 1.5))


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
        #: (endpoint label, reason) -> frames refused (reject_reason, REJECT_LABELS_MAX): /metrics
        self.rejected: Counter[tuple[str, str]] = Counter()
        self.stats = {"rejected_frames": 0, "tasks_sent": 0, "results_stored": 0, "duplicate_results": 0, "wills": 0, "goodbyes": 0,
                      "results_reacked": 0}
        #: When a replayed results frame was last answered with a result_ack (see _reack), bounded.
        self._reacked: OrderedDict[str, float] = OrderedDict()
        #: Frame bytes per endpoint since this hub started: [in, out, frames in, frames out, since].
        self.traffic: dict[str, list[float]] = {}
        #: Frame bytes by (out?, kind) since this hub started (kind_bytes_by_name() for reports). A
        #: site_up's or site_down's bytes are counted under that kind (what crossed the uplink,
        #: compressed) and each inner frame again under its own kind (what it carried): sum one or the
        #: other, not both.
        self.kind_bytes: Counter[tuple[bool, Kind]] = Counter()
        self._resumed: set[str] = set()  # endpoints whose kept counters this hub has read back
        self.observer = DispatchObserver()  # the hub plugs in its placement service
        # Replicas (several hubs on one PostgreSQL database and one broker): every replica hears
        # every MQTT frame; only the one holding an endpoint's row in endpoint_owners answers it.
        self.replicated = cfg.database_url is not None
        self.replica_id = cfg.replica_id or uuid.uuid4().hex[:12]
        self._owned: dict[str, float] = {}  # endpoint -> our hold expires (wall clock)
        self._elsewhere: dict[str, float] = {}  # endpoint -> don't ask the database again before
        self._stopping = False
        self._takeovers: set[asyncio.Task[None]] = set()
        # Endpoints whose heartbeat changed last_seen/info since the watchdog last wrote them: one
        # transaction per watchdog pass instead of one durable transaction per heartbeat.
        self._beat_dirty: set[str] = set()
        self._site_of: dict[str, str] = {}  # device -> the site gateway that relays its frames
        self._site_links: dict[str, SiteDownLink] = {}  # gateway -> its devices' site_down batcher
        #: device -> whether its gateway's last liveness row had it on the site's LAN (site frames):
        #: such a device's session lives as long as its gateway's does (Dispatcher._watch)
        self._on_lan: dict[str, bool] = {}
        #: gateway -> how long its confirmations take (cloud_hub/site_lease.py), kept across its sessions
        self._site_clocks: dict[str, ConfirmClock] = {}
        #: endpoint -> when it was last told hello_required: at most once per _HELLO_REQUIRED_EVERY_S
        self._hello_asked: OrderedDict[str, float] = OrderedDict()
        self._sites = hasattr(store, "lease_site")  # site leasing ahead: SQLite only for now (docs/sites.md)
        # Incoming frames: different endpoints concurrently, each endpoint's in arrival order
        # (cloud_hub/lanes.py), so a slow hello does not hold up everyone's acks.
        self.lanes = Lanes()
        # Cancellation (docs/protocol.md, "Cancellation"): endpoints with cancels their agents have
        # not confirmed, when each was last sent to it (a new session sends all again), the
        # endpoints whose cancel sender runs, and recently cancelled task ids (early results of
        # theirs are not passed on: the task's one result is the cancelled one).
        self._cancel_eps: set[str] = set()
        self._cancel_sent: dict[str, dict[str, float]] = {}
        self._cancelling: set[str] = set()
        self._cancel_again: set[str] = set()
        self._recent_cancels: OrderedDict[str, None] = OrderedDict()

    def _observe(self, hook: str, *args: Any) -> None:
        try:
            with costs.stage("hub.observe"):  # the scheduler's bookkeeping (cloud_hub/placement.py)
                getattr(self.observer, hook)(*args)
        except Exception:
            log.exception("observer hook %s failed", hook)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, links: list[HubLink]) -> None:
        from cloud_hub.store.access import AccessStore

        self._keys = await self.store.endpoint_keys()
        self._allow = await AccessStore(self.store).allow_lists()
        if hasattr(self.store, "site_devices"):  # site gateways: SQLite only for now (docs/sites.md)
            self._site_of = await self.store.site_devices()
        # Leases from before a restart may or may not have reached their agents: re-queue them;
        # an agent that did get one de-duplicates by task id. With replicas, others' leases are
        # live: only expired ones go back (the watchdog keeps doing that).
        n = await self.store.requeue(expired_before=time.time() if self.replicated else float("inf"))
        if n:
            log.info("re-queued %d tasks leased before the restart", n)
        if not self.replicated:  # availability history: nobody has a session yet (replicas may)
            await self.store.tx(close_stale_sessions)
        self._cancel_eps = await self.store.cancel_endpoints()  # sent to each on its next session
        for link in links:
            await link.start(self.enqueue_frame)
            self.links.append(link)
        self._watchdog = asyncio.create_task(self._watch(), name="dispatcher-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._takeovers):
            t.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        # Frames already received get a moment to finish (their acks still go out on live links);
        # frames arriving meanwhile are dropped: nothing of them was acked, agents send them again.
        await self.lanes.close()
        for link in self.links:
            await link.stop()
        with contextlib.suppress(Exception):  # the last beats' info and traffic counters, kept across the restart
            await self._flush_beats()
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

    def _count(self, endpoint_id: str, nbytes: int, out: bool, kind: Kind | None = None) -> None:
        if kind is not None:  # frame bytes by direction and kind, hub-wide: what crosses the links, attributed
            self.kind_bytes[(out, kind)] += nbytes
        t = self.traffic.get(endpoint_id)
        if t is None:
            t = self.traffic[endpoint_id] = [0, 0, 0, 0, time.time()]
        t[1 if out else 0] += nbytes
        t[3 if out else 2] += 1

    def kind_bytes_by_name(self) -> dict[str, int]:
        """``kind_bytes`` as {"in:<kind>" / "out:<kind>": bytes}."""
        return {f"{'out' if out else 'in'}:{kind.value}": n for (out, kind), n in self.kind_bytes.items()}

    def bytes_per_day(self, endpoint_id: str, now: float | None = None) -> dict[str, float] | None:
        """Frame bytes to and from an endpoint, scaled to a day from what was counted since
        ``since`` (this hub's start, or earlier: the counters persist in the endpoint's info)."""
        t = self.traffic.get(endpoint_id)
        return None if t is None else per_day(t, now)

    def traffic_counters(self, endpoint_id: str) -> dict[str, float]:
        """This endpoint's counters as kept in its info JSON (``traffic``), so a restarted hub, or
        another replica, goes on from them."""
        t = self.traffic.get(endpoint_id)
        if t is None:
            return {}
        return {"traffic": {"bytes_in": t[0], "bytes_out": t[1], "frames_in": t[2], "frames_out": t[3], "since": t[4]}}

    async def _resume_traffic(self, endpoint_id: str) -> None:
        """Go on from the counters kept in the endpoint's info when they hold more than ours (a hub
        restart, or a session another replica held meanwhile)."""
        info = await self.store.endpoint_info(endpoint_id)
        kept = (info or {}).get("traffic")
        if not isinstance(kept, dict):
            return
        try:
            was = [float(kept[k]) for k in ("bytes_in", "bytes_out", "frames_in", "frames_out", "since")]
        except (KeyError, TypeError, ValueError):
            return
        t = self.traffic.get(endpoint_id)
        if t is None or was[0] + was[1] > t[0] + t[1]:
            self.traffic[endpoint_id] = [*was[:4], min(was[4], t[4] if t else was[4])]

    def silence_bound(self, adaptive: bool) -> float:
        """Silence after which an endpoint is offline: ``lost_after_s``, or for an MQTT agent that
        beats on change (it announced ``beats: adaptive``) ``beat_max_s + mqtt_lost_after_s`` (its will
        normally ends the session much sooner). One rule for the replica that holds the session and
        for the others, which judge from the shared row (cloud_hub/service/hub.py endpoint_out)."""
        return self.cfg.mqtt_lost_after_s + self.cfg.beat_max_s if adaptive else self.cfg.lost_after_s

    # ------------------------------------------------------------------ outgoing
    async def _send(self, s: _Session, kind: Kind, body: dict[str, Any], msg_id: str | None = None) -> None:
        seq = 0
        if kind in _ECHOED:  # a few bytes: the agent echoes it in its next frame (link timing)
            seq = s.echo_seq = s.echo_seq % 0xFFFF + 1
            body = {**body, "t": seq}
        with costs.stage("hub.sign"):
            env = Envelope(kind, s.endpoint_id, body) if msg_id is None else Envelope(kind, s.endpoint_id, body, id=msg_id)
            frame = encode(env, self._keys[s.endpoint_id], ttl=self.cfg.frame_ttl_s, compress=s.compress)
        if seq:
            sent = s.echo_sent
            sent[seq] = time.time()  # as late as we can: only the transport's own queueing follows
            if len(sent) > 16:
                del sent[next(iter(sent))]
        await s.link.send(s.endpoint_id, frame)
        self._count(s.endpoint_id, len(frame), out=True, kind=kind)

    def _echo(self, s: _Session, echo: Any, agent_ts: float, received: float) -> None:
        """The agent echoed ``[seq, hold_us]``: our stamp ``seq`` reached it, and it held it
        ``hold_us`` microseconds (read to send) before this frame. The round trip is the time
        from our send to our read of this frame minus that hold: neither side's queueing after
        the read counts, so a busy hub does not read as a slow link. NTP offset of the exchange:
        ``((T2 - T1) + (T3 - T4)) / 2`` with T3 = the frame's stamp and T2 = T3 - hold."""
        if not (type(echo) is list and len(echo) == 2 and type(echo[0]) is int and type(echo[1]) is int and echo[1] >= 0):
            return
        t1 = s.echo_sent.pop(echo[0], None)
        if t1 is None:
            return
        hold = echo[1] / 1e6
        rtt = received - t1 - hold
        if rtt < 0.0:  # clocks do not run backwards: a hold the agent misreported
            return
        offset = ((agent_ts - hold - t1) + (agent_ts - received)) / 2.0
        self._observe("link_echo", s.endpoint_id, rtt, offset, received, time.time() - received)

    # ------------------------------------------------------------------ sites (docs/sites.md)
    async def add_site_device(self, device_id: str, gateway_id: str) -> None:
        """A device enrolled behind a gateway: lease its work to the site from now on, and make the
        gateway say hello again so that its welcome lists the device (its broker login)."""
        self._site_of[device_id] = gateway_id
        g = self._sessions.get(gateway_id)
        if g is not None:
            with contextlib.suppress(LinkError):
                await self._send(g, Kind.ERROR, {"code": "hello_required", "message": "your site changed; say hello"})

    async def move_site_device(self, device_id: str, old: str | None, new: str | None) -> None:
        """A device re-homed (``PUT /v1/endpoints/{id}/gateway``): both gateways say hello again, so
        their welcomes list their devices; the device's work is leased the new way from now on."""
        if new is None:
            self._site_of.pop(device_id, None)
        else:
            self._site_of[device_id] = new
        self._on_lan.pop(device_id, None)  # the old gateway's word about it no longer counts
        d = self._sessions.get(device_id)
        if d is not None and d.resume:
            # It would resume without a hello on its new LAN: end its session, so the new gateway's
            # row (or its next frame) asks it for a hello, whose welcome says what it may do there.
            await self._lose(device_id, d, time.time(), "moved to another gateway", level=logging.INFO)
        for gw in {old, new} - {None}:
            g = self._sessions.get(gw)  # type: ignore[arg-type]
            if g is not None:
                with contextlib.suppress(LinkError):
                    await self._send(g, Kind.ERROR, {"code": "hello_required", "message": "your site changed; say hello"})
        self.kick(device_id)

    def site_broker(self, gateway_id: str) -> tuple[str, int] | None:
        """Where the devices of this gateway's site dial it (from its hello), if it is online."""
        g = self._sessions.get(gateway_id)
        return None if g is None else g.site_broker

    def gateway_of(self, device_id: str) -> str | None:
        return self._site_of.get(device_id)

    def site_devices(self, gateway_id: str) -> list[str]:
        return sorted(d for d, g in self._site_of.items() if g == gateway_id)

    async def _site_welcome(self, gateway_id: str) -> list[dict[str, str]]:
        """The devices a gateway relays, with the Mosquitto hash of each one's broker password:
        its site broker then takes the same per-device logins (it never learns a password)."""
        from cloud_hub.broker_auth import hash_part
        from cloud_hub.store.access import AccessStore

        devices = set(self.site_devices(gateway_id))
        accounts = await AccessStore(self.store).broker_accounts()
        return [{"id": a.endpoint_id, "user": a.username, "hash": h} for a in accounts
                if a.endpoint_id in devices and (h := hash_part(a.password_hash, "mosquitto"))]

    def _site_signer(self, gateway_id: str) -> Any:
        """Signs a site_down for ``gateway_id`` with its key, compressed (it said it reads z), its
        device table in binary ids when the gateway's current session said it reads them."""
        def sign(frames: list[tuple[str, bytes]], seq: int, epoch: str, floor: int) -> bytes:
            g = self._sessions.get(gateway_id)
            body = site_body(frames, seq=seq, epoch=epoch, floor=floor, binary_ids=g is not None and g.site_bin)
            env = Envelope(Kind.SITE_DOWN, gateway_id, body)
            frame = encode(env, self._keys[gateway_id], ttl=self.cfg.frame_ttl_s, compress=True)
            self._count(gateway_id, len(frame), out=True, kind=Kind.SITE_DOWN)
            return frame
        return sign

    def kick_site(self, gateway_id: str) -> None:
        g = self._sessions.get(gateway_id)
        if g is None or g.site_hold <= 0 or g.site_pumping:
            return
        g.site_pumping = True
        asyncio.create_task(self._pump_site(g))

    async def _pump_site(self, g: _Session) -> None:
        """Lease queued work of the site's devices to its gateway ahead of time, up to the hold it
        announced: each task goes in a ``tasks`` frame signed with its *device's* key and valid for
        ``site_hold_s``, on the device's own down topic, which the gateway's login may read. The
        gateway stores it and hands it on when the device asks, with the uplink up or down; it
        cannot forge or alter it. The lease lasts ``site_hold_s``: a gateway that dies strands
        nothing for longer than that.

        With site frames the work goes in numbered site_down batches and nothing expires on a
        timer while the gateway's session lives (cloud_hub/site_lease.py, PendingBatches); how much
        is in flight unconfirmed is paced in bytes by the uplink's measured throughput."""
        try:
            devices = self.site_devices(g.endpoint_id)
            while self._sessions.get(g.endpoint_id) is g and devices:
                room = g.site_hold - await self.store.count_site_leased(g.endpoint_id)
                if room <= 0:
                    break
                link = self._site_links.get(g.endpoint_id) if g.site_frames else None
                clock = self._site_clocks.get(g.endpoint_id)
                max_bytes = _LEASE_BYTES
                if isinstance(link, SiteDownLink) and clock is not None:
                    # Settled by number or on evidence, never by a timer, while the session lives;
                    # at most what the uplink carries in a few seconds in flight unconfirmed.
                    unconfirmed_s = self.cfg.site_hold_s
                    max_bytes = min(max_bytes, clock.window_bytes() - link.inflight_bytes)
                    if max_bytes <= 0:
                        break  # the next confirmation kicks the pump again (_site_confirmed)
                else:
                    # A few times the gateway's measured confirmation delay (at least lease_s) until it
                    # confirms it stored them (its own ack), then site_hold_s: a frame lost on the way (the
                    # gateway died before its commit) is sent again soon, and a slow uplink is not flooded
                    # with re-sends of batches whose confirmation is merely late.
                    unconfirmed_s = self._site_grace(g.endpoint_id)
                by_dev, bodies = await self.store.lease_site(g.endpoint_id, devices, min(room, _LEASE_BATCH), unconfirmed_s, max_bytes,
                                                             skip_returned=time.time() < g.site_wait_until)
                if not by_dev:
                    break
                if g.site_cache:
                    # Content-addressed, once per site: bodies the gateway lacks go to the gateway
                    # itself (its own key, an empty tasks batch it stores); each device's frame names
                    # them in ``at_site`` (signed), and the device takes the gateway's copy only if its
                    # SHA-256 is that function id.
                    new = {f: b for f, b in bodies.items() if f not in g.site_have}
                    if new:
                        try:
                            await self._send(g, Kind.TASKS, {"tasks": [], "functions": new})
                        except LinkError as exc:
                            n = sum([await self.store.unlease(d, [t["id"] for t in ts]) for d, ts in by_dev.items()])
                            log.warning("sending bodies to site %s failed (%s); %d tasks re-queued", g.endpoint_id, exc, n, extra={"endpoint_id": g.endpoint_id})
                            return
                        g.site_have.update(new)
                        self.stats["site_bodies"] = self.stats.get("site_bodies", 0) + len(new)
                for dev, tasks in by_dev.items():
                    fids = {t["fn"] for t in tasks}
                    if g.site_cache:
                        body = {"tasks": tasks, "functions": {}, "at_site": sorted(fids), "allow": self._allow_field(dev)}
                    else:
                        body = {"tasks": tasks, "functions": {f: b for f, b in bodies.items() if f in fids}, "allow": self._allow_field(dev)}
                    frame = encode(Envelope(Kind.TASKS, dev, body), self._keys[dev], ttl=self.cfg.site_hold_s)
                    try:
                        site_link = self._site_links.get(g.endpoint_id)
                        if site_link is not None:  # confirmed by the gateway's "stored up to" its batch
                            await site_link.send(dev, frame, [t["id"] for t in tasks])
                        else:
                            await g.link.send(dev, frame)
                    except LinkError as exc:
                        n = await self.store.unlease(dev, [t["id"] for t in tasks])
                        log.warning("leasing ahead to site %s failed (%s); %d tasks re-queued", g.endpoint_id, exc, n, extra={"endpoint_id": g.endpoint_id})
                        return
                    self._count(dev, len(frame), out=True, kind=Kind.TASKS)
                    if clock is not None and site_link is None:  # numbered batches time themselves
                        clock.sent([t["id"] for t in tasks], time.monotonic())
                    self.stats["tasks_sent"] += len(tasks)
                    self.stats["site_leased"] = self.stats.get("site_leased", 0) + len(tasks)
        except Exception:
            log.exception("leasing ahead to site %s failed", g.endpoint_id)
        finally:
            g.site_pumping = False

    def served_by_site(self, device_id: str) -> bool:
        """Whether a device's work goes only through its gateway's lease-ahead: its gateway has a
        session and holds work ahead (``site_hold`` > 0). Its own FETCH credit then leases nothing
        directly: such a direct lease would cross the uplink again with its function bodies
        (bypassing the site's cache), go back to the queue whenever the device's session ends (at
        every uplink outage) or the device's ack comes back over the uplink later than ``lease_s``,
        and be sent again each time (measured in village.yaml, docs/sites.md). Direct dispatch
        resumes when the gateway's session ends or the device is moved off it; a gateway that
        holds nothing ahead (``hold: 0``) leaves its devices on the direct path."""
        gw = self._site_of.get(device_id)
        if gw is None or not self._sites:
            return False
        g = self._sessions.get(gw)
        return g is not None and g.site_hold > 0

    # ------------------------------------------------------------------ cancellation
    def note_cancelled(self, task_ids: list[str], endpoints: set[str] | list[str]) -> None:
        """Tasks were cancelled (cloud_hub/service/cancel.py, an expired lease): send the cancel to the
        agents that hold them now, or on their next session."""
        for t in task_ids:
            self._recent_cancels[t] = None
        while len(self._recent_cancels) > 100_000:
            self._recent_cancels.popitem(last=False)
        for ep in endpoints:
            self._cancel_eps.add(ep)
            self._kick_cancels(ep)

    def _kick_cancels(self, endpoint_id: str) -> None:
        if endpoint_id in self._cancelling:
            self._cancel_again.add(endpoint_id)
            return
        self._cancelling.add(endpoint_id)
        asyncio.create_task(self._send_cancels(endpoint_id))

    async def _send_cancels(self, ep: str) -> None:
        """Send an endpoint's unconfirmed cancels in a ``tasks`` frame (``tasks: []``, ``cancel``):
        on its session, or for a device behind a site gateway that holds its work, signed with the
        device's key through the gateway (which drops the cancelled tasks it still holds). None
        (offline): they go on its next session; the hub already holds each task's one result."""
        try:
            for _ in range(100):  # bounded: 2,000 ids a frame
                self._cancel_again.discard(ep)
                ids = await self.store.pending_cancels(ep, 20_000)
                if not ids:
                    self._cancel_eps.discard(ep)
                    self._cancel_sent.pop(ep, None)
                    return
                now = time.time()
                sent = self._cancel_sent.setdefault(ep, {})
                due = [i for i in ids if now - sent.get(i, 0.0) >= _CANCEL_RESEND_S][:2000]
                if not due:
                    return
                body = {"tasks": [], "functions": {}, "cancel": due}
                gw = self._site_of.get(ep)
                g = self._sessions.get(gw) if gw is not None else None
                s = self._sessions.get(ep)
                if g is not None and self.served_by_site(ep) and ep in self._keys:
                    frame = encode(Envelope(Kind.TASKS, ep, body), self._keys[ep], ttl=self.cfg.site_hold_s)
                    await self._site_links.get(g.endpoint_id, g.link).send(ep, frame)
                    self._count(ep, len(frame), out=True, kind=Kind.TASKS)
                elif s is not None:
                    await self._send(s, Kind.TASKS, body)
                else:
                    return
                for i in due:
                    sent[i] = now
                self.stats["cancels_sent"] = self.stats.get("cancels_sent", 0) + len(due)
                if len(due) < 2000 and ep not in self._cancel_again:
                    return
        except LinkError as exc:
            log.warning("sending cancels to %s failed (%s); sent again later", ep, exc, extra={"endpoint_id": ep})
        except Exception:
            log.exception("sending cancels to %s failed", ep)
        finally:
            self._cancelling.discard(ep)

    def kick(self, endpoint_id: str, *, new_work: bool = True, start_now: bool = True) -> None:
        """New work for an endpoint, or room for it: send it now if its agent has credit (coalesced
        per endpoint). ``new_work=False``: only room changed (credit, a result), no task was queued,
        so a queue the last lease found empty is not read again, and a pump running now may still
        conclude from a short lease that the queue is drained (``again_new``); ``start_now=False``:
        none of the new tasks must start at once. Both default to what is always safe."""
        s = self._sessions.get(endpoint_id)
        if s is not None:
            if new_work:
                s.drained = False
                s.recheck_wait, s.recheck_at = 1.0, 0.0
            if start_now:
                s.now_drained = False
        if endpoint_id in self._cancel_eps:
            self._kick_cancels(endpoint_id)
        gw = self._site_of.get(endpoint_id)
        if gw is not None:
            self.kick_site(gw)
            if self.served_by_site(endpoint_id):
                return
        s = self._sessions.get(endpoint_id)
        if s is None:
            return  # with no credit the pump still sends tasks that must start now (outside the credit)
        if s.pumping:
            s.again = True
            s.again_new = s.again_new or new_work
            return
        s.pumping = True
        asyncio.create_task(self._pump(s))

    def claim_insert_leases(self, endpoint_ids: Iterable[str]) -> "InsertLeases | None":
        """For a submit about to insert tasks for these endpoints: the sessions that could take
        work now (credit, no pump running, not behind a site gateway, a single hub) have their
        pump claimed, and their lease runs inside the submit's own transaction (``InsertLeases``):
        the tasks leave in the frame that follows the commit, with no lease transaction of their
        own (issue 30, "one transaction per direction"). The caller must end the claim with
        ``committed`` or ``failed``."""
        if self.replicated or not hasattr(self.store, "lease_query"):
            return None
        claims = []
        for ep in endpoint_ids:
            s = self._sessions.get(ep)
            if s is None or s.pumping or s.credit <= 0 or ep in self._site_of or self.served_by_site(ep):
                continue
            s.pumping = True  # no other pump for this session until the claim ends
            s.again = s.again_new = False  # kicks from now on reach the pump that follows the claim
            claims.append(_Claim(s, min(s.credit, _LEASE_BATCH), self._placed_room(s)))
        return InsertLeases(self, claims) if claims else None

    async def _pump(self, s: _Session, first: "_Claim | None" = None) -> None:
        """Lease and send while the session has credit and its queue has work. ``first``: a lease
        already made in a submit's transaction (``claim_insert_leases``), sent before any other."""
        try:
            if s.drained and s.credit > 0:  # still out of work: the scheduler may move placed tasks here (late binding)
                self._observe("endpoint_starving", s.endpoint_id, time.time())
            claimed_round = first is not None  # kicks during a claim's transaction count in its first round
            while True:
                if not claimed_round:
                    s.again = s.again_new = False
                claimed_round = False
                while s.credit > 0 and not s.drained and self._sessions.get(s.endpoint_id) is s and not self.served_by_site(s.endpoint_id):
                    if first is not None and first.got is not None:
                        (tasks, bodies), asked, room = first.got, first.asked, first.room
                        first = None
                    else:
                        room = self._placed_room(s)
                        asked = min(s.credit, _LEASE_BATCH)
                        tasks, bodies = await self.store.lease(s.endpoint_id, asked, self.cfg.lease_s, _LEASE_BYTES,
                                                               placed_max=room)
                    if not tasks:
                        if room is None or room > 0:  # it could take work and the hub has none for it
                            s.drained = not s.again_new and not self.replicated  # a kick while leasing may have queued more
                            self._recheck_later(s)
                            self._observe("endpoint_starving", s.endpoint_id, time.time())
                        break
                    sent_at = time.time()
                    for t in tasks:
                        if t.pop("_placed", None):
                            s.placed_out[t["id"]] = sent_at
                    s.credit -= len(tasks)
                    try:
                        await self._send(s, Kind.TASKS, {"tasks": tasks, "functions": bodies, "allow": self._allow_field(s.endpoint_id)})
                        self.stats["tasks_sent"] += len(tasks)
                    except LinkError as exc:
                        # Not handed to the transport (a ZeroMQ peer gone, the broker away): back in
                        # the queue now rather than after lease_s; a copy that did get out is
                        # de-duplicated by the agent.
                        n = await self.store.unlease(s.endpoint_id, [t["id"] for t in tasks])
                        for t in tasks:  # not with the agent: they no longer count against its lookahead
                            s.placed_out.pop(t["id"], None)
                        log.warning("sending to %s failed (%s); %d tasks re-queued", s.endpoint_id, exc, n, extra={"endpoint_id": s.endpoint_id})
                        # The agent still counts on this credit and, beating only on change, may not
                        # say so for a long time: the watchdog gives it back after a pause.
                        s.retry_credit = max(s.retry_credit, s.credit + len(tasks))
                        s.retry_at = time.time() + 2.0
                        s.credit = 0
                        break
                    if (len(tasks) < asked and (room is None or len(tasks) < room) and not s.again_new and not self.replicated
                            and _small(tasks, bodies)):
                        s.drained = True  # fewer than asked, not for the lookahead or the frame size: that was all
                        self._recheck_later(s)
                        break
                await self._send_now(s)
                if not s.again:
                    break
            if first is not None and first.got and first.got[0]:
                # The claimed lease was never sent: the session ended meanwhile (a hello replaced it),
                # the credit went (a fetch wanting 0), or the endpoint is now served through its site.
                # Back to the queue now, not after lease_s.
                await self.store.unlease(s.endpoint_id, [t["id"] for t in first.got[0]])
                if self._sessions.get(s.endpoint_id) is not s:
                    self.kick(s.endpoint_id)  # its successor may have drained already: it takes them now
        except Exception:
            log.exception("dispatch to %s failed", s.endpoint_id)
        finally:
            s.pumping = False

    @staticmethod
    def _recheck_later(s: _Session) -> None:
        """Schedule the watchdog's next look at a drained session (see ``_Session.recheck_at``)."""
        if (s.drained or s.now_drained) and not s.recheck_at:
            s.recheck_at = time.time() + s.recheck_wait
            s.recheck_wait = min(60.0, s.recheck_wait * 2)

    def _recheck_drained(self, ep: str, s: _Session, now: float, due: list[tuple[str, _Session]]) -> None:
        """The watchdog's look at a drained session: if its recheck is due, it goes in ``due``,
        which ``_recheck_due`` reads for all at once at the end of the pass (it stays due until then,
        so a pass that fails before that looks at it again in the next)."""
        if s.recheck_at and now >= s.recheck_at and (s.drained or s.now_drained):
            due.append((ep, s))

    async def _recheck_due(self, due: list[tuple[str, _Session]]) -> None:
        """Sessions (``drained`` or ``now_drained``) whose recheck came due in this pass: one read
        says which of them have queued work (a path that forgot its kick), and only those are
        kicked, as new work (a pump running now must not call that queue drained). Why: each
        recheck used to be a lease (two queries and a database hop) that almost always found
        nothing; an idle hub at 5,000 endpoints ran about 80 a second. The others keep their flags
        and their next look backs off further; a drained one with credit, no pump running and room
        in its lookahead is reported starving to the placement service, as its empty lease was
        (late binding may move placed work to it)."""
        if not due:
            return
        now = time.time()
        try:
            queued = await self.store.endpoints_with_queued([ep for ep, _ in due])
        except Exception:
            log.exception("the recheck of %d drained sessions could not read the queue; leasing each", len(due))
            queued = {ep for ep, _ in due}
        for ep, s in due:
            if self._sessions.get(ep) is not s or not s.recheck_at or s.recheck_at > now or not (s.drained or s.now_drained):
                continue  # gone, or a kick meanwhile (new work) leased on its own
            s.recheck_at = 0.0
            if ep in queued:
                self.kick(ep)  # clears both flags; while a pump runs, tells it the queue is not drained
                continue
            self._recheck_later(s)
            if s.credit > 0 and s.drained and not s.pumping:
                room = self._placed_room(s)
                if room is None or room > 0:
                    self._observe("endpoint_starving", ep, now)

    def _placed_room(self, s: _Session) -> int | None:
        """How many more scheduler-placed tasks this session may be sent now: the endpoint's
        lookahead (the placement service's, None: no cap) minus what it holds without a result.
        Entries older than the lease are dropped (a result lost with a session, a cancel): that
        errs towards sending, as without a cap. A metered agent is never capped: its share goes
        in as few frames as its credit allows, since every frame costs it bytes."""
        if s.metered:
            return None
        ahead = self.observer.lookahead(s.endpoint_id, s.capacity)
        if ahead is None:
            return None
        if len(s.placed_out) >= ahead:
            old = time.time() - self.cfg.lease_s
            for tid in [t for t, at in s.placed_out.items() if at < old]:
                del s.placed_out[tid]
        return max(0, ahead - len(s.placed_out))

    async def _send_now(self, s: _Session) -> None:
        """Tasks that must start at once (``start: "now"``, a multiprocessing Process) go to the
        agent outside its fetch credit: credit counts its pool's slots and prefetch, and such a
        task must never wait behind them. The agent starts each on a free worker or on one more
        (up to its cap) and otherwise fails it at once, saying why (docs/multiprocessing.md)."""
        while not s.now_drained and self._sessions.get(s.endpoint_id) is s and not self.served_by_site(s.endpoint_id):
            tasks, bodies = await self.store.lease(s.endpoint_id, _LEASE_BATCH, self.cfg.lease_s, _LEASE_BYTES, only_now=True)
            if not tasks:
                s.now_drained = not s.again and not self.replicated
                self._recheck_later(s)
                return
            try:
                await self._send(s, Kind.TASKS, {"tasks": tasks, "functions": bodies, "allow": self._allow_field(s.endpoint_id)})
                self.stats["tasks_sent"] += len(tasks)
            except LinkError as exc:
                n = await self.store.unlease(s.endpoint_id, [t["id"] for t in tasks])
                log.warning("sending to %s failed (%s); %d tasks re-queued", s.endpoint_id, exc, n, extra={"endpoint_id": s.endpoint_id})
                return

    # ------------------------------------------------------------------ incoming
    def _count_rejected(self, claimed: str, exc: BaseException) -> None:
        """Count a refused frame by endpoint and reason (``mesh_frames_rejected_total``). The label
        is the channel's endpoint only when it is enrolled (a forger cannot mint label values), and
        "other" past REJECT_LABELS_MAX distinct endpoints."""
        self.stats["rejected_frames"] += 1
        label = claimed if claimed in self._keys else "unknown"
        if label != "unknown" and (label, reject_reason(exc)) not in self.rejected:
            seen = {e for e, _ in self.rejected}
            if label not in seen and len(seen - {"unknown", "other"}) >= REJECT_LABELS_MAX:
                label = "other"
        self.rejected[(label, reject_reason(exc))] += 1

    async def enqueue_frame(self, claimed: str, frame: bytes, link: HubLink) -> None:
        """What the links call: queue the frame in its channel's lane (handled after that
        endpoint's earlier frames, alongside other endpoints' frames) and return."""
        received = time.time()  # read from the link now; the lane may hold it a while (hub lag, not link)
        await self.lanes.submit(claimed, lambda: self.on_frame(claimed, frame, link, received))

    async def on_frame(self, claimed: str, frame: bytes, link: HubLink, received: float | None = None) -> None:
        """Verify and handle one frame, to the end (the store's commit included). ``received``:
        when the link read it (link timing counts from there, not from the end of the queue)."""
        try:
            endpoint_id = peek_endpoint(frame)
            if endpoint_id != claimed:
                raise _refused(ProtocolError(f"frame for {endpoint_id} arrived on {claimed}'s channel"), "wrong_channel")
            key = self._keys.get(endpoint_id)
            if key is None and self.replicated:  # enrolled through another replica
                key = await self.store.endpoint_key(endpoint_id)
                if key is not None:
                    self._keys[endpoint_id] = key
            if key is None:
                raise _refused(ProtocolError(f"unknown endpoint {endpoint_id}"), "unknown_endpoint")
            with costs.stage("hub.verify"):
                sealed = open_frame(frame, key)
                if sealed.kind not in UP_KINDS:
                    raise _refused(BadFrame(f"a {sealed.kind.value} frame cannot come from an agent (reflected?)"), "wrong_direction")
                # A hello is answered with a nonce-bound welcome that tells the agent our clock, so it
                # may come from a device whose clock is off (a Pi after a power cut has no RTC). A gone
                # frame is the agent's MQTT will, signed when it connected and published by the broker
                # whenever the connection dies: it acts only on the session whose hello named its conn.
                if sealed.kind is not Kind.HELLO and sealed.kind is not Kind.GONE:
                    check_freshness(sealed)
                self._replay.check(sealed)
                env = sealed.open()  # the body is parsed only after MAC, freshness and replay passed
        except Replayed as exc:
            if sealed.kind is Kind.RESULTS and (not self.replicated or await self._holds(endpoint_id)):
                # A results frame sent again verbatim (a site gateway re-sends until acked): benign,
                # answered, so not in the per-endpoint counter the alert watches.
                self.stats["rejected_frames"] += 1
                await self._reack(endpoint_id, sealed, link)
            else:
                self._count_rejected(claimed, exc)
                log.warning("rejected frame on %s channel %s: %s: %s", link.name, claimed, exc.reason, exc, extra={"endpoint_id": claimed})
            return
        except ProtocolError as exc:
            self._count_rejected(claimed, exc)
            log.warning("rejected frame on %s channel %s: %s: %s", link.name, claimed, exc.reason, exc, extra={"endpoint_id": claimed})
            return
        if self.replicated and not await self._holds(endpoint_id):
            return  # another replica answers this endpoint
        self._count(endpoint_id, len(frame), out=False, kind=env.kind)
        if env.kind is Kind.HELLO:
            await self._on_hello(env, link, received)
            return
        if env.kind is Kind.GONE:
            await self._on_gone(endpoint_id, env.body)
            return
        s = self._sessions.get(endpoint_id)
        if s is None:
            tmp = _Session(endpoint_id, link, time.time())
            if env.kind is Kind.SITE_UP:
                # Each inner frame stands on its own (verified as if direct): a gateway's results
                # and acks count even before its hello (the hub restarted, the session was lost).
                await self._on_site_up(tmp, env.body)
            elif env.kind in (Kind.RESULTS, Kind.ACK):
                # Authentic and fresh: keep it even without a session. A site gateway forwards a
                # device's results and acks long after the device's session ended (the uplink was
                # down), possibly with the device itself dead; dropping them would leave the
                # results to wait for the device (docs/sites.md). Both are idempotent by task id.
                handler = _HANDLERS[env.kind]
                with contextlib.suppress(LinkError):
                    await handler(self, tmp, env.body)
            if self._may_ask_hello(endpoint_id):
                with contextlib.suppress(LinkError):
                    await self._send(tmp, Kind.ERROR, {"code": "hello_required", "message": "no session; say hello"})
            return
        s.last_seen = time.time()
        s.link = link
        if "e" in env.body:
            self._echo(s, env.body["e"], env.ts, received if received is not None else s.last_seen)
        self._observe("frame_received", endpoint_id, env.kind.value, len(frame), env.ts,
                      received if received is not None else s.last_seen)
        handler = _HANDLERS.get(env.kind)
        if handler is not None:
            await handler(self, s, env.body)

    def _may_ask_hello(self, endpoint_id: str) -> bool:
        """Whether to answer a frame without a session with hello_required now: at most once per
        ``_HELLO_REQUIRED_EVERY_S`` per endpoint. A device behind a gateway can have many frames
        in flight (a site_up after an outage carries them all); one answer is enough."""
        now = time.monotonic()
        if now - self._hello_asked.get(endpoint_id, -1e9) < _HELLO_REQUIRED_EVERY_S:
            self.stats["hello_required_held"] = self.stats.get("hello_required_held", 0) + 1
            return False
        self._hello_asked[endpoint_id] = now
        self._hello_asked.move_to_end(endpoint_id)
        while len(self._hello_asked) > _REACK_REMEMBER:
            self._hello_asked.popitem(last=False)
        return True

    async def _on_site_up(self, s: _Session, body: dict[str, Any]) -> None:
        """A gateway's batch of its devices' frames (cloud_hub/site_frames.py): each inner frame is
        handled as if it had come on its own, in its device's lane, and answered through the
        gateway's site_down batcher; one that is not for a device of this gateway is refused."""
        gateway = s.endpoint_id
        mine = set(self.site_devices(gateway))
        link = self._site_links.get(gateway, s.link)
        # The rows first: they are the gateway's state now, and an inner hello below may open a
        # session that an older "off the LAN" must not end.
        await self._site_rows(gateway, summary_rows(body), mine, link)
        upto = stored_upto(body)
        if upto is not None and isinstance(link, SiteDownLink):
            ids, samples = link.confirmed_upto(*upto)
            await self._site_confirmed(s, ids, samples)
            if upto[0] == link.epoch and upto[1] <= link.seq:
                lost = link.pending.not_stored(upto[1], time.monotonic(), self._site_grace(gateway))
                if lost:
                    await self._site_given_up(gateway, lost, f"the gateway's summary says it stored up to site_down {upto[1]}")
        refused: list[BadFrame] = []
        for device, frame in split_site_up(body, mine):
            if isinstance(frame, BadFrame):
                exc = _refused(frame, "foreign_device")
                self._count_rejected(gateway, exc)
                refused.append(exc)
                continue
            await self.enqueue_frame(device, frame, link)
        if refused:  # one line per batch, not per frame: a batch may carry 4,096 of them
            log.warning("rejected %d inner frame(s) of site %s: %s%s", len(refused), gateway, refused[0],
                        f" (and {len(refused) - 1} more)" if len(refused) > 1 else "", extra={"endpoint_id": gateway})

    async def _site_rows(self, gateway: str, rows: list[tuple[str, dict[str, int]]], mine: set[str], link: HubLink) -> None:
        """A gateway's liveness rows (docs/sites.md, "One liveness summary per site") stand in for
        its devices' heartbeats, fetches and LAN gones: a row on the LAN updates the session as a
        heartbeat would and keeps it alive with the gateway's; a row off the LAN ends it; a device
        on the LAN without a session is asked to say hello. The rows are the gateway's word, not
        the device's: a lying gateway can make the hub think a device idle, busy or gone, which
        delays work (it could drop the device's frames anyway); it cannot make anything run."""
        now = time.time()
        for device, row in rows:
            if device not in mine:
                self._count_rejected(gateway, _refused(BadFrame(f"liveness row for {device[:64]}"), "foreign_device"))
                continue
            was = self._on_lan.get(device)
            self._on_lan[device] = bool(row["lan"])
            d = self._sessions.get(device)
            if d is not None and not row["lan"]:
                if not d.resume:  # it says hello when it is back: nothing to keep
                    await self._lose(device, d, now, "off its site's LAN (its gateway's summary)", level=logging.INFO)
                elif was is not False:
                    # It resumes without a hello after a LAN reconnect: kept for its offline bound
                    # from now (the watchdog, _off_lan_bound), so a LAN flap costs no hello and no
                    # welcome over the uplink; a device that stays away is lost then, as if silent.
                    d.last_seen = now
            elif d is not None:
                d.last_seen = now
                d.link = link  # back on this gateway's LAN (it may have moved here)
                if d.resume_withdrawn:  # it may resume still, behind a gateway that no longer tells us of it
                    await self._ask_site_device_hello(device, link, now)
                beat = {k: v for k, v in row.items() if k not in ("lan", "epoch", "conn")}
                try:
                    validate_body(Kind.HEARTBEAT, beat)  # the device's other fields, as the gateway relays them
                except BadFrame as exc:
                    self._count_rejected(gateway, exc)
                    beat = {k: row[k] for k in ("capacity", "running", "queued", "stored", "outbox", "want")}
                await self._on_heartbeat(d, beat)
            elif row["lan"]:
                await self._ask_site_device_hello(device, link, now)

    async def _ask_site_device_hello(self, device: str, link: HubLink, now: float) -> None:
        """A device its gateway reports on the LAN has no session here (the hub restarted, or lost it
        during an uplink outage): its beats no longer cross the uplink, so nothing else would make
        it say hello. Asked again by the watchdog, at most once per _HELLO_REQUIRED_EVERY_S, until it does."""
        if self._may_ask_hello(device):
            with contextlib.suppress(LinkError):
                await self._send(_Session(device, link, now), Kind.ERROR, {"code": "hello_required", "message": "no session; say hello"})

    async def _resume_withdrawn(self, gateway: str, now: float) -> None:
        """A gateway came back without ``site.resume`` (an older version, site frames off): it no
        longer reports its devices' LAN reconnects, and would judge the will of a device's new
        connection against the old one. Devices told to resume are asked for a hello now (and again
        at their next rows on the LAN, at most every 2 s, until they say it): its welcome no longer
        says resume. Their sessions go on meanwhile, and a row off the LAN ends them at once again."""
        g = self._sessions.get(gateway)
        if g is None:
            return
        for dev in self.site_devices(gateway):
            d = self._sessions.get(dev)
            if d is not None and d.resume:
                d.resume, d.resume_withdrawn = False, True
                await self._ask_site_device_hello(dev, self._site_links.get(gateway, g.link), now)

    def _resumes_behind(self, device: str) -> bool:
        """Whether the device's gateway reports its LAN reconnects in its liveness rows (its hello
        said ``site.resume``): the device may then resume after a reconnect without a hello."""
        g = self._sessions.get(self._site_of.get(device) or "")
        return g is not None and g.site_resume

    def _off_lan_bound(self, s: _Session) -> float:
        """How long a device its gateway reports off the LAN keeps its session (it resumes without a
        hello when it is back): its offline bound, ``lost_after_s``, or ``mqtt_lost_after_s`` for a
        device that beats on change, the bound within which the hub sees a direct one's dead link.
        Not ``beat_max_s`` on top: its will has come already (that is what the row says)."""
        return min(s.bound or self.cfg.lost_after_s, self.cfg.mqtt_lost_after_s)

    def _kept_by_site(self, device: str, now: float) -> float | None:
        """When a device behind a site-frames gateway counts as last seen: its gateway's last_seen,
        while its gateway's session lives and its last row had it on the LAN (else None)."""
        if not self._on_lan.get(device):
            return None
        g = self._sessions.get(self._site_of.get(device) or "")
        if g is None or not g.site_frames or now - g.last_seen > (g.bound or self.cfg.lost_after_s):
            return None
        return g.last_seen

    async def _reack(self, endpoint_id: str, sealed: Any, link: HubLink) -> None:
        """A results frame we handled already came again, verbatim: a site gateway re-sends the very
        frame it holds (it cannot sign a new one) until our result_ack reaches it, and that ack may
        have been lost on its uplink. Nothing is stored again; the ids are acknowledged again, as
        the first time, so the gateway stops re-sending. Authentic and fresh (checked before the
        replay check); at most once per frame per ``_REACK_EVERY_S``, so a replayer gains nothing."""
        now = time.time()
        key = f"{endpoint_id}\0{sealed.id}"
        if now - self._reacked.get(key, 0.0) < _REACK_EVERY_S:
            return
        self._reacked[key] = now
        self._reacked.move_to_end(key)
        while len(self._reacked) > _REACK_REMEMBER:
            self._reacked.popitem(last=False)
        try:
            results = sealed.open().body.get("results", [])
            check_results(results)
        except (ProtocolError, ValueError):
            return  # the first arrival was refused for the same reason, and nothing was acked then either
        self.stats["results_reacked"] += 1
        s = self._sessions.get(endpoint_id) or _Session(endpoint_id, link, now)
        with contextlib.suppress(LinkError):
            await self._send(s, Kind.RESULT_ACK, {"ids": [r["id"] for r in results]})

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
            log.info("endpoint %s is now served by another replica", endpoint_id, extra={"endpoint_id": endpoint_id})
        self._elsewhere[endpoint_id] = now + min(2.0, self.cfg.lost_after_s / 3)
        return False

    def on_released(self, endpoint_id: str) -> None:
        """Another replica let go of an endpoint (it stopped, or lost the agent): claim it now.

        Without this an endpoint stays unowned until its agent's next frame reaches a replica
        whose ``_elsewhere`` back-off has run out (up to a heartbeat plus 2 s), and work queued
        for it waits that long. The claim is the same compare-and-set as on a frame, so when
        several replicas hear the release exactly one wins."""
        if self._stopping or not self.replicated or endpoint_id in self._sessions:
            return
        self._elsewhere.pop(endpoint_id, None)
        task = asyncio.create_task(self._take_over(endpoint_id), name=f"take-over-{endpoint_id}")
        self._takeovers.add(task)
        task.add_done_callback(self._takeovers.discard)

    async def _take_over(self, endpoint_id: str) -> None:
        try:
            transport = await self.store.endpoint_transport(endpoint_id)
            link = next((lk for lk in self.links if lk.name == transport and getattr(lk, "shared", False)), None)
            if link is None:
                return  # a ZeroMQ agent dials one replica's socket: we cannot reach it, leave it
            key = self._keys.get(endpoint_id) or await self.store.endpoint_key(endpoint_id)
            if key is None:
                return  # revoked meanwhile
            self._keys[endpoint_id] = key
            if not await self._holds(endpoint_id) or endpoint_id in self._sessions:
                return
            # Ask the agent to say hello to us; its hello re-queues what the old replica leased.
            tmp = _Session(endpoint_id, link, time.time())
            await self._send(tmp, Kind.ERROR, {"code": "hello_required", "message": "this hub replica took the endpoint over; say hello"})
            log.info("took over endpoint %s released by another replica", endpoint_id, extra={"endpoint_id": endpoint_id})
        except (LinkError, asyncio.CancelledError):
            pass  # the agent's next frame reaches us (or another replica) and claims it then
        except Exception:
            log.exception("taking over endpoint %s failed", endpoint_id)

    async def _on_hello(self, env: Envelope, link: HubLink, received: float | None = None) -> None:
        b = env.body
        now = time.time()
        s = _Session(env.endpoint, link, now, capacity=int(b.get("capacity", 1)))
        conn = b.get("conn")
        s.conn = conn if isinstance(conn, str) else None
        s.compress = b.get("z") == 1
        adaptive = b.get("beats") == "adaptive" and link.name == "mqtt" and s.conn is not None
        s.metered = b.get("beats") == "adaptive"
        s.bound = self.silence_bound(adaptive)
        old = self._sessions.get(env.endpoint)
        if old is not None:
            s.credit = old.credit  # a repeated (or replayed) hello must not starve the agent
            s.placed_out = old.placed_out  # what it holds still counts against its lookahead
        s.info = {k: b.get(k) for k in ("host", "version", "engine", "pid", "prefetch", "tags", "hardware", "gpu", "gpus", "memory_mb")}
        if self._site_of.get(env.endpoint):  # behind a site gateway: the scheduler models its uplink apart (docs/sites.md)
            s.info["gateway"] = self._site_of[env.endpoint]
        site = b.get("site")
        if isinstance(site, dict):  # a site gateway (docs/sites.md)
            hold = site.get("hold")
            s.site_hold = max(0, min(int(hold), 100_000)) if isinstance(hold, int) and not isinstance(hold, bool) else 0
            if s.site_hold > 0:  # per gateway, not per session: an uplink outage does not forget its confirmation delay
                clock = self._site_clocks.get(env.endpoint)
                if clock is None:
                    clock = self._site_clocks[env.endpoint] = ConfirmClock(min(self.cfg.lease_s, self.cfg.site_hold_s), self.cfg.site_hold_s)
                # Back after its session ended (it reconnects and confirms all it holds at once):
                # give that confirmation the time of an unconfirmed lease before re-sending work
                # that went back to the queue from its leases meanwhile.
                s.site_wait_until = old.site_wait_until if old is not None else now + clock.lease_s()
            where = site.get("broker")
            if isinstance(where, str) and where.count(":") == 1 and where.rsplit(":", 1)[1].isdigit():
                s.site_broker = (where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1]))
            s.info["site"] = {"hold": s.site_hold, "broker": where, "devices": len(self.site_devices(env.endpoint))}
            blobs = site.get("store")  # the site's blob store on its LAN (hierarchical FL, docs/sites.md)
            if isinstance(blobs, str) and len(blobs) < 300 and blobs.count(":") == 1 and blobs.rsplit(":", 1)[1].isdigit():
                s.info["site"]["store"] = blobs
            s.site_cache = site.get("cache") == 1
            s.site_frames = site.get("frames") == 1  # it then reads compressed site_down bodies too
            s.site_resume = s.site_frames and site.get("resume") == 1
            s.site_bin = s.site_frames and site.get("bin") == 1
            have = site.get("functions")
            if isinstance(have, list):
                s.site_have = {f for f in have[:10_000] if isinstance(f, str) and len(f) == 64}
        if adaptive:  # kept in the shared row: other replicas judge its silence by the same bound
            s.info["beats"] = "adaptive"
        if self.replicated or env.endpoint not in self._resumed:  # alone, once per endpoint: then ours are the newest
            await self._resume_traffic(env.endpoint)
            self._resumed.add(env.endpoint)
        self._sessions[env.endpoint] = s
        self._cancel_sent.pop(env.endpoint, None)  # cancels not confirmed yet go again on this session
        for d in self.site_devices(env.endpoint) if s.site_hold > 0 else ():
            self._cancel_sent.pop(d, None)
        held = set(b.get("have", []))
        # One transaction (one fsync, shared with whatever else is committing): re-queue, reconcile,
        # online with its info, and the availability transition for a new session.
        _, lost = await self.store.open_session(env.endpoint, held, now, {**s.info, "capacity": s.capacity, **self.traffic_counters(env.endpoint)},
                                                transition=old is None)
        if lost:
            log.warning("%s no longer holds %d acked tasks; re-queued", env.endpoint, lost, extra={"endpoint_id": env.endpoint})
            s.drained = s.now_drained = False  # a kick while open_session ran may have found the queue without them
        self._observe("endpoint_online", env.endpoint, now, {**s.info, "capacity": s.capacity})
        # The welcome's message id is the hello's nonce: the agent matches it before parsing the body.
        # "hold": how long the hello waited here (its database work): the agent takes it out of the
        # round trip, NTP-style, instead of reading it as half link, half clock offset.
        t_now = time.time()
        welcome = {"reply_to": b["nonce"], "hub_time": t_now, "hold": round(max(0.0, t_now - (received if received is not None else now)), 6),
                   "heartbeat_s": self.cfg.heartbeat_s, "allow": self._allow_field(env.endpoint),
                   # liveness: how long an agent that beats on change may stay silent, and (MQTT) the
                   # keepalive under which the broker's will arrives within our bound
                   "beat_max_s": self.cfg.beat_max_s if adaptive else self.cfg.heartbeat_s, "z": 1,
                   **({"keepalive_s": keepalive_for(self.cfg.mqtt_lost_after_s)} if adaptive else {})}
        if isinstance(site, dict):
            welcome["site"] = {"devices": await self._site_welcome(env.endpoint), "hold_s": self.cfg.site_hold_s}
            if s.site_frames:
                welcome["site"]["frames"] = 1
                welcome["site"]["bin"] = 1  # we read binary ids in a site_up's device table (mesh_agent/protocol/site.py)
                kept = self._site_links.get(env.endpoint)
                if kept is not None:  # a re-hello keeps the numbering its "stored up to" refers to
                    kept.base, kept.name = link, link.name
                    await self._site_hello_stored(s, kept, site.get("stored"))
                else:
                    gw = env.endpoint

                    async def lost(ids: list[str], gw: str = gw) -> None:
                        await self._site_given_up(gw, ids, "their site_down could not be sent")
                    self._site_links[gw] = SiteDownLink(gw, link, self._site_signer(gw), on_lost=lost)
            else:
                self._site_links.pop(env.endpoint, None)
        gw = self._sessions.get(self._site_of.get(env.endpoint) or "")
        if gw is not None and isinstance((gw.info.get("site") or {}).get("store"), str):
            # a device behind a gateway with a LAN blob store: shared data refs are read there first (cloud_hub/client/refs.py)
            welcome["site_store"] = gw.info["site"]["store"]
        if not isinstance(site, dict) and self._resumes_behind(env.endpoint):
            s.resume = True
            welcome["resume"] = 1
        try:
            await self._send(s, Kind.WELCOME, welcome, msg_id=b["nonce"])
        except LinkError as exc:
            # Not sent (a broker too busy to ack in time, a link down): end the session, so the
            # agent's next frame is answered hello_required and it says hello again. Kept, it would
            # beat into a session whose welcome it never got, and never fetch.
            await self._lose(env.endpoint, s, time.time(), f"its welcome could not be sent ({exc})")
            return
        if isinstance(site, dict) and not s.site_resume:
            await self._resume_withdrawn(env.endpoint, now)
        self.kick_site(env.endpoint)
        for d in [env.endpoint, *(self.site_devices(env.endpoint) if s.site_hold > 0 else ())]:
            if d in self._cancel_eps:
                self._kick_cancels(d)
        log.info("endpoint %s online via %s (capacity %d)", env.endpoint, link.name, s.capacity, extra={"endpoint_id": env.endpoint})

    async def _on_gone(self, endpoint_id: str, body: dict[str, Any]) -> None:
        """The agent's will (its connection died) or its goodbye (a clean stop). Only the session
        its hello opened is ended: a will from an older connection, arriving after the agent
        already reconnected, names another conn and changes nothing."""
        s = self._sessions.get(endpoint_id)
        if s is None or s.conn is None or body.get("conn") != s.conn:
            return
        if body.get("bye"):
            self.stats["goodbyes"] += 1
            await self._lose(endpoint_id, s, time.time(), "it stopped cleanly (goodbye)", level=logging.INFO)
            return
        self.stats["wills"] += 1
        await self._lose(endpoint_id, s, time.time(), "its connection died (the broker published its will)")

    async def _lose(self, ep: str, s: _Session, now: float, why: str, *, level: int = logging.WARNING) -> None:
        """End a session: its leased tasks go back to the queue; acked ones stay on the device."""
        if self._sessions.get(ep) is not s:
            return
        del self._sessions[ep]
        n = await self.store.close_session(ep, s.last_seen, {**s.info, "capacity": s.capacity, **self.traffic_counters(ep)})
        if self.replicated:
            self._owned.pop(ep, None)
            await self.store.release_endpoint(ep, self.replica_id)
        self._observe("endpoint_lost", ep, now, s.last_seen)
        link = self._site_links.get(ep)
        if s.site_hold > 0 and isinstance(link, SiteDownLink) and self._sites:
            # Now the timer runs: what it has not confirmed waits the unconfirmed lease, as before
            # site frames (its hello, or its confirmation after reconnecting, settles it earlier).
            await self._site_unconfirmed(ep, link.pending.ids())
        if s.site_hold > 0:  # its devices' own credit leases to them directly again (served_by_site)
            for d in self.site_devices(ep):
                self.kick(d)
        log.log(level, "endpoint %s offline: %s (silent %.1fs); %d leased tasks re-queued", ep, why, now - s.last_seen, n,
                extra={"endpoint_id": ep})

    async def _on_fetch(self, s: _Session, body: dict[str, Any]) -> None:
        s.credit = max(0, int(body.get("want", 0)))
        self.kick(s.endpoint_id, new_work=False, start_now=False)

    async def _on_ack(self, s: _Session, body: dict[str, Any]) -> None:
        applied = body.get("c")
        if applied:  # the agent stored these cancels: stop sending them
            await self.store.cancels_applied(s.endpoint_id, applied)
            sent = self._cancel_sent.get(s.endpoint_id)
            if sent is not None:
                for i in applied:
                    sent.pop(i, None)
        await self.store.ack(s.endpoint_id, body.get("ids", []))
        await self._site_confirmed(s, body.get("ids") or [])
        gw = self._site_of.get(s.endpoint_id)
        if gw is not None:  # room at the site again
            self.kick_site(gw)

    async def _site_confirmed(self, s: _Session, ids: list[str], samples: list[tuple[int, float]] | None = None) -> None:
        """A gateway confirms it holds these tasks for its devices (its own ack of their ids, or its
        "stored up to" of site_down batches): their lease lasts site_hold_s from now. Also without
        a session: right after reconnecting, its confirmation may reach us before its hello.

        With site frames, an id confirmation also settles its batch, and a batch the gateway
        stepped over (it stored a later one) is given up: its tasks go back to the queue and out
        again (PendingBatches.holes). Either way the pump may send more now."""
        gw = s.endpoint_id
        live = self._sessions.get(gw) is s
        if not (ids and self._sites and (s.site_hold > 0 or (not live and gw in self._site_of.values()))):
            return
        await self.store.hold_site(gw, ids, time.time() + self.cfg.site_hold_s, frame_ttl_s=self.cfg.site_hold_s)
        clock = self._site_clocks.get(gw)
        now = time.monotonic()
        link = self._site_links.get(gw)
        if isinstance(link, SiteDownLink):
            if clock is not None:
                for inflight, seconds in [*(samples or ()), *link.pending.confirmed(ids, now)]:
                    clock.batch_confirmed(inflight, seconds)
            await self._site_holes(gw)
        elif clock is not None:
            clock.confirmed(ids, now)
        self.kick_site(gw)

    async def _site_hello_stored(self, s: _Session, link: SiteDownLink, stored: Any) -> None:
        """A gateway's hello says it stored every site_down of our numbering up to n: those are
        confirmed, and whatever went out after n did not arrive (or is still on its way, and the
        gateway de-duplicates by task id): re-queued at once, so it goes out again now instead of
        after a timer. Without a usable "stored" (another numbering, or a gateway that restarted)
        its confirmation by id after reconnecting settles what it holds, and what it does not confirm
        goes back on the unconfirmed lease's timer, as before site frames."""
        if not (isinstance(stored, list) and len(stored) == 2 and stored[0] == link.epoch and type(stored[1]) is int
                and 0 <= stored[1] <= link.seq):
            await self._site_unconfirmed(s.endpoint_id, link.pending.forget())
            return
        ids, samples = link.confirmed_upto(link.epoch, stored[1])
        await self._site_confirmed(s, ids, samples)
        lost = link.pending.past(stored[1])
        if lost:
            await self._site_given_up(s.endpoint_id, lost, f"the gateway's hello says it stored up to site_down {stored[1]}")
        s.site_wait_until = 0.0  # what it holds is known: nothing to wait for before leasing again

    def _site_grace(self, gateway: str) -> float:
        """How long a site's unconfirmed work may wait before the hub acts: the gateway's measured
        unconfirmed lease (a few confirmation delays, at least lease_s; cloud_hub/site_lease.py)."""
        clock = self._site_clocks.get(gateway)
        return clock.lease_s() if clock is not None else self.cfg.lease_s

    async def _site_unconfirmed(self, gateway: str, ids: list[str]) -> None:
        """Nothing will settle these by number any more (the gateway's session ended, or it came
        back without its count): they wait the unconfirmed lease, as before site frames."""
        if ids and self._sites:
            await self.store.hold_site(gateway, ids, time.time() + self._site_grace(gateway))

    async def _site_holes(self, gateway: str) -> None:
        """Give up batches the gateway stepped over (it confirmed a later one) once older than the
        grace. Checked on every confirmation and by the watchdog as batches age: a batch too young
        when the later one was confirmed goes out again within a pass of its grace, not at the
        gateway's next full summary."""
        link = self._site_links.get(gateway)
        if not isinstance(link, SiteDownLink) or not len(link.pending):
            return
        lost = link.pending.holes(time.monotonic(), self._site_grace(gateway))
        if lost:
            await self._site_given_up(gateway, lost, "the gateway stored later site_down batches but not theirs")

    async def _site_given_up(self, gateway_id: str, ids: list[str], why: str) -> None:
        """Tasks leased ahead in site_down batches that will not be confirmed: back to the queue now."""
        n = await self.store.unlease_site(gateway_id, ids)
        if n:
            self.stats["site_given_up"] = self.stats.get("site_given_up", 0) + n
            log.info("%d tasks leased ahead to site %s re-queued: %s", n, gateway_id, why, extra={"endpoint_id": gateway_id})
        self.kick_site(gateway_id)

    async def _on_results(self, s: _Session, body: dict[str, Any]) -> None:
        results = body.get("results", [])
        try:
            with costs.stage("hub.results"):
                check_results(results)
        except ValueError as exc:  # authentic but malformed (a broken agent): nothing of it is stored or acked
            self._count_rejected(s.endpoint_id, exc)
            log.warning("rejected results frame from %s: %s", s.endpoint_id, exc, extra={"endpoint_id": s.endpoint_id})
            return
        if self.bus._early:
            with costs.stage("hub.push"):
                recent = self._recent_cancels
                self.bus.early(s.endpoint_id, [r for r in results if r["id"] not in recent] if recent else results)
        if s.placed_out:
            held = len(s.placed_out)
            for r in results:
                s.placed_out.pop(r["id"], None)
            if len(s.placed_out) < held:
                self.kick(s.endpoint_id, new_work=False, start_now=False)  # room in its lookahead: the next placed tasks go now
        fresh = await self.store.store_results(s.endpoint_id, results)
        with costs.stage("hub.results"):
            self.stats["results_stored"] += len(fresh)
            self.stats["duplicate_results"] += len(results) - len(fresh)
            # Ack all, duplicates too: the agent must stop re-sending them either way.
            if fresh:
                if fresh.rows:
                    self.bus.stored(fresh.rows)
                else:
                    self.bus.notify({u for _, u in fresh})
        self._observe("results_stored", s.endpoint_id, time.time(), results, {t for t, _ in fresh})
        await self._send(s, Kind.RESULT_ACK, {"ids": [r["id"] for r in results]})

    async def _on_heartbeat(self, s: _Session, body: dict[str, Any]) -> None:
        if isinstance(body.get("conn"), str):  # a device that resumed on a new connection: its will names this one
            s.conn = body["conn"]
        # An agent that beats on change sends only what changed: keep the rest.
        s.info.update({k: body[k] for k in ("running", "queued", "stored", "outbox", "cpu", "mem_used", "mem_avail_mb", "want",
                                                "rs", "df", "tx", "sk") if k in body})
        if "warm" in body or "warm" not in s.info:
            s.info["warm"] = body.get("warm", [])
        if "envs" in body:  # environment ids it holds (docs/environments.md), sent when they change
            s.info["envs"] = body["envs"]
        if "eb" in body:  # what its recent environment builds cost: seconds, bytes fetched
            s.info["eb"] = body["eb"]
        if isinstance(body.get("capacity"), int) and not isinstance(body["capacity"], bool):
            s.capacity = body["capacity"]
        self._beat_dirty.add(s.endpoint_id)  # written by the watchdog's next pass (_flush_beats), not one transaction per beat
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
    async def _flush_beats(self) -> None:
        """Write the live info of every endpoint that beat since the last pass, in one transaction
        (at most a second stale; ``endpoint_out`` prefers the live session anyway)."""
        dirty, self._beat_dirty = self._beat_dirty, set()
        rows = [(s.last_seen, {**s.info, "capacity": s.capacity, **self.traffic_counters(ep)}, ep)
                for ep in dirty if (s := self._sessions.get(ep)) is not None]
        await self.store.touch_endpoints(rows)

    async def _expire_leases(self, now: float) -> None:
        """Task groups whose driver stopped renewing its lease (docs/multiprocessing.md, "Lease"):
        their unfinished tasks are cancelled now, and the cancels sent to the agents holding them."""
        if not hasattr(self.store, "expire_group_leases"):
            return
        for g in await self.store.expire_group_leases(now):
            if g["fresh"]:
                self.bus.notify({g["user"]})
                self._observe("tasks_expired", g["fresh"], now)
            self.note_cancelled(g["fresh"], g["endpoints"])
            log.info("the lease of task group %s expired (its program stopped renewing it): %d tasks cancelled",
                     g["group"], len(g["fresh"]))

    async def _watch(self) -> None:
        last_prune = 0.0
        last_cancel_scan = time.time()
        while True:
            await asyncio.sleep(min(1.0, self.cfg.heartbeat_s / 2))
            try:
                now = time.time()
                await self._flush_beats()
                due: list[tuple[str, _Session]] = []
                for ep, s in list(self._sessions.items()):
                    if now - s.last_seen > (s.bound or self.cfg.lost_after_s) and (kept := self._kept_by_site(ep, now)) is not None:
                        s.last_seen = max(s.last_seen, kept)  # its gateway vouches for it (liveness rows)
                    if self._on_lan.get(ep) is False and s.resume and now - s.last_seen > self._off_lan_bound(s):
                        await self._lose(ep, s, now, "off its site's LAN past its offline bound (its gateway's summary)", level=logging.INFO)
                        continue
                    if now - s.last_seen > (s.bound or self.cfg.lost_after_s):
                        await self._lose(ep, s, now, "silent")
                        continue
                    if self.replicated and self._owned.get(ep, 0.0) - now < self.cfg.lost_after_s / 3 and not await self._holds(ep):
                        continue  # a quiet session (a metered agent sends nothing for minutes) renews its hold here, not on frames
                    if s.retry_credit and s.credit == 0 and now >= s.retry_at:
                        s.credit, s.retry_credit = s.retry_credit, 0
                        self.kick(ep)
                    self._recheck_drained(ep, s, now, due)
                await self._recheck_due(due)
                for dev, up in list(self._on_lan.items()):  # site devices on their LAN without a session: ask again
                    g = self._sessions.get(self._site_of.get(dev) or "")
                    if up and dev not in self._sessions and g is not None and g.site_frames:
                        await self._ask_site_device_hello(dev, self._site_links.get(g.endpoint_id, g.link), now)
                if await self.store.requeue(expired_before=now):
                    for ep in self._sessions:
                        self.kick(ep)
                for ep, s in list(self._sessions.items()):
                    if s.site_hold > 0:  # work submitted for a site's devices while none of them is online
                        await self._site_holes(ep)
                        self.kick_site(ep)
                await self._expire_leases(now)
                if now - last_cancel_scan > _CANCEL_SCAN_S:  # re-send unconfirmed cancels; other replicas' too
                    last_cancel_scan = now
                    self._cancel_eps |= await self.store.cancel_endpoints()
                    for ep in list(self._cancel_eps):
                        if ep in self._sessions or self.served_by_site(ep):
                            self._kick_cancels(ep)
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


@dataclass(slots=True)
class _Claim:
    """One session's pump, claimed for a lease inside a submit's transaction."""

    s: _Session
    asked: int
    room: int | None
    got: tuple[list[dict[str, Any]], dict[str, bytes]] | None = None


class InsertLeases:
    """Leases that run in the transaction inserting a submit's tasks (``Dispatcher.claim_insert_leases``).

    Why: a task submitted to an endpoint that has credit used to cost two transactions before it
    left the hub, the submit's insert and then the lease (a database hop each, with the thread
    wake-ups around them). The same lease query now runs last in the insert's transaction: the
    tasks are committed and leased together, with the same fairness and lookahead as any lease,
    and the frame goes out after that one commit. Durability is unchanged: a lease was never
    durable on its own (a hub that dies before sending finds them leased and re-queues them after
    ``lease_s``, as for any lease whose frame never left)."""

    def __init__(self, d: "Dispatcher", claims: list[_Claim]) -> None:
        self._d, self.claims = d, claims
        self.endpoints = {c.s.endpoint_id for c in claims}

    def query(self, db: Any) -> None:
        """Inside the insert's transaction, after everything else it writes."""
        d = self._d
        with costs.stage("db.lease"):  # in the ledger as a lease, not as part of the insert
            for c in self.claims:
                c.got = d.store.lease_query(c.s.endpoint_id, c.asked, d.cfg.lease_s, _LEASE_BYTES, placed_max=c.room)(db)

    def committed(self, start_now: set[str]) -> None:
        """The transaction committed: each claimed session's pump goes on from its lease (new work
        was queued, so its drained flags are cleared as a kick would)."""
        for c in self.claims:
            s = c.s
            s.drained = False
            s.recheck_wait, s.recheck_at = 1.0, 0.0
            if s.endpoint_id in start_now:
                s.now_drained = False
            if s.endpoint_id in self._d._cancel_eps:
                self._d._kick_cancels(s.endpoint_id)
            asyncio.create_task(self._d._pump(s, c))

    def failed(self) -> None:
        """The transaction did not commit: nothing was leased; the pumps are free again."""
        for c in self.claims:
            c.got = None
            c.s.pumping = False
            if c.s.again:  # a kick came while the claim held the pump
                self._d.kick(c.s.endpoint_id, new_work=False, start_now=False)


def _small(tasks: list[dict[str, Any]], bodies: dict[str, bytes]) -> bool:
    """Whether a leased batch is well under the frame's byte cap (so the cap did not cut it short)."""
    return sum(len(t["args"]) for t in tasks) + sum(len(b) for b in bodies.values()) < _LEASE_BYTES // 2


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
    Kind.SITE_UP: Dispatcher._on_site_up,
    Kind.FETCH: Dispatcher._on_fetch,
    Kind.ACK: Dispatcher._on_ack,
    Kind.RESULTS: Dispatcher._on_results,
    Kind.HEARTBEAT: Dispatcher._on_heartbeat,
}
