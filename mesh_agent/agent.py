"""The agent runtime: durable queue + warm engine + one link to the hub, in one asyncio loop.

Durability rules (DESIGN invariants 1 and 2):
- a task is written to SQLite *before* the hub is told it was received (ack);
- a result is written *before* it is sent, and its payload dropped only after the hub acks it;
- after a crash, every stored task without a result runs again (at least once), and every
  stored result not yet acked is sent again (the hub de-duplicates by task id).

Flow control is credit based: the agent asks for ``workers + prefetch`` tasks minus what it
holds, so neither the broker nor ZeroMQ ever has to buffer an unbounded backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from mesh_agent import __version__, costs
from mesh_agent.backoff import reconnect_delay
from mesh_agent.clock import HubClock
from mesh_agent.engine import EngineResult, EngineTask, LocalEngine, error_result
from mesh_agent.profile import PROVISIONAL_KEEPALIVE_S, LAN_KEEPALIVE_S, resolve
from mesh_agent.protocol import (
    DOWN_KINDS,
    MAX_FRAME_BYTES,
    BadFrame,
    Envelope,
    Kind,
    ProtocolError,
    ReplayGuard,
    Stale,
    check_freshness,
    encode,
    open_frame,
)
from mesh_agent.store import AgentStore, StoredResult, StoreError
from mesh_agent.transport import AgentLink, LinkError

from mesh_agent.settings import plain

if TYPE_CHECKING:
    # Annotations only: the running agent gets light views of these (mesh_agent.settings), and never
    # imports pydantic (mesh_agent.run).
    from mesh_agent.config import AgentConfig, Credentials
    from mesh_agent.engine.parsl_engine import ParslEngine

__all__ = ["Agent", "make_link"]

log = logging.getLogger("mesh_agent")

#: Results per ``results`` frame; keeps frames well under broker limits.
_RESULTS_PER_FRAME = 2000
_RESEND_AFTER_S = 10.0
#: Behind a site gateway, which keeps our results until the hub acks them (docs/sites.md): they
#: are sent again after a welcome (a restart, a reconnect, a hello the hub asked for), and on a
#: timer only this rarely, as a safety net; a blind 10 s timer re-signed each one every 10 s of
#: an uplink outage, and every copy crossed the uplink afterwards.
_RELAYED_RESEND_S = 300.0
_FRAME_BUDGET = 8 * 2**20
_MAX_RESULT_BYTES = MAX_FRAME_BYTES // 2
#: After a failed queue write (full disk) the agent takes no new tasks for this long, then tries again.
_STORE_RETRY_S = 5.0
#: A function body handed over by a site gateway: this prefix, the function id (64 hex), the body.
SITE_BODY_MAGIC = b"CMFN"
_SITE_BODIES_MAX = 16 * 2**20
#: Validity of results and acks sent through a site gateway, which may hold them through an outage.
_RELAYED_TTL_S = 7 * 86400.0


def _mqtt_tls(cfg: AgentConfig) -> dict[str, Any]:
    """TLS context and WebSocket transport for the MQTT link, from ``mqtt.tls`` / ``mqtt.transport``."""
    ctx = None
    if cfg.mqtt.tls is not None:
        from mesh_agent.tls import TlsError, client_context

        t = cfg.mqtt.tls
        try:
            ctx = client_context(t.ca_file, cert_file=t.cert_file, key_file=t.key_file, server_name=t.server_name, pin_sha256=t.pin_sha256)
        except TlsError as exc:
            raise LinkError(f"mqtt.tls: {exc}") from None
    return {"tls_context": ctx, "transport": cfg.mqtt.transport, "websocket_path": cfg.mqtt.websocket_path}


def link_address(cfg: AgentConfig) -> str:
    """Where the agent's link goes, as a URL for log lines: mqtt(s)://host:port, ws(s)://..., tcp://..."""
    if cfg.transport != "mqtt":
        return cfg.zmq.address
    secure = getattr(cfg.mqtt, "tls", None) is not None
    if getattr(cfg.mqtt, "transport", "tcp") == "websockets":
        return f"{'wss' if secure else 'ws'}://{cfg.mqtt.host}:{cfg.mqtt.port}{getattr(cfg.mqtt, 'websocket_path', '') or ''}"
    return f"{'mqtts' if secure else 'mqtt'}://{cfg.mqtt.host}:{cfg.mqtt.port}"


def _node_address(where: str, link: object) -> str:
    """``where`` with the host:port of the broker node this link uses (mqtt.hosts: a cluster's node)."""
    node = getattr(link, "address", None)
    if not isinstance(node, str) or "//" not in where:
        return where
    scheme, rest = where.split("//", 1)
    path = rest[rest.find("/"):] if "/" in rest else ""
    return f"{scheme}//{node}{path}"


def make_link(cfg: AgentConfig, creds: Credentials) -> AgentLink:
    if cfg.transport == "mqtt":
        from mesh_agent.transport.mqtt import MqttAgentLink

        return MqttAgentLink(
            cfg.endpoint_id,
            cfg.mqtt.host,
            cfg.mqtt.port,
            username=creds.mqtt_username,
            password=creds.mqtt_password,
            keepalive=cfg.mqtt.keepalive or LAN_KEEPALIVE_S,  # the agent sets the one in force (configure)
            prefix=cfg.mqtt.topic_prefix,
            brokers=cfg.mqtt.broker_list(),  # mqtt.hosts: the nodes of a cluster, failed over in order
            **_mqtt_tls(cfg),
        )
    from mesh_agent.transport.zmq import ZmqAgentLink

    if not (creds.hub_curve_key and creds.curve_public and creds.curve_secret):
        raise LinkError("no ZeroMQ CURVE keys in the credentials file: run `mesh-agent init` again")
    return ZmqAgentLink(cfg.endpoint_id, cfg.zmq.address, server_key=creds.hub_curve_key, public_key=creds.curve_public, secret_key=creds.curve_secret)


class _HelloRequired(Exception):
    """The hub lost our session (it restarted): say hello again on the same link."""


class _Reconnect(LinkError):
    """End this connection and open a new one at once (a new MQTT keepalive takes a new CONNECT)."""


def _psutil() -> Any:
    """psutil, imported on first use: only the hello and heartbeats need it."""
    import psutil

    return psutil


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        creds: Credentials,
        link_factory: Callable[[AgentConfig, Credentials], AgentLink] = make_link,
        worker_env: Mapping[str, str] | None = None,
    ) -> None:
        """``cfg``/``creds``: the pydantic models, or their light views (mesh_agent.settings).
        ``worker_env``: what workers must inherit (endpoint identity, datasets), computed where the
        dataset models are at hand (``mesh-agent start``, before it execs the light runner);
        None: computed here, from ``cfg.datasets``."""
        self.cfg = cfg
        self._worker_env = worker_env
        self.footprint = resolve(cfg)  # metered or lan: beats, keepalive, compression, workers on demand
        self.endpoint_id = cfg.endpoint_id
        self._key = creds.key_bytes
        self._creds = creds
        self._link_factory = link_factory
        self.store = AgentStore(cfg.queue_path, cfg.durable_sync, cfg.queue_max_mb)
        if cfg.globus is not None:  # workers (spawned later, they inherit it) stage Globus files
            os.environ["MESH_STAGING"] = json.dumps({**plain(cfg.globus), "credentials_file": str(cfg.credentials_file)})
        self.engine: LocalEngine | ParslEngine
        if cfg.engine == "parsl":  # HPC: same interface and result semantics, work on batch-job workers
            from mesh_agent.engine.parsl_engine import ParslEngine

            self.engine = ParslEngine(self._on_results, cfg.parsl, cfg.data_dir / "parsl", workers=cfg.workers,
                                      task_timeout=cfg.task_timeout, memory_limit_mb=cfg.memory_limit_mb)
        else:
            envs_cfg = getattr(cfg, "environments", None)
            self.engine = LocalEngine(
                self._on_results,
                workers=cfg.workers,
                task_timeout=cfg.task_timeout,
                memory_limit_mb=cfg.memory_limit_mb,
                max_batch=cfg.max_batch,
                idle_s=self.footprint.worker_idle_s,
                environments=_environments(cfg) if envs_cfg is None or envs_cfg.enabled else None,
                env_idle_s=envs_cfg.keep_warm_s if envs_cfg is not None else 300.0,
                prewarm=list(getattr(envs_cfg, "prewarm", None) or []) if envs_cfg is not None and envs_cfg.enabled else [],
                now_max=_start_now_max(cfg),
            )
        self._replay = ReplayGuard()
        self._heartbeat_s = cfg.heartbeat_s
        self._clock = HubClock()  # the hub's clock, learned from signed welcomes
        self._link: AgentLink | None = None
        self._welcomed = asyncio.Event()
        self._pending: list[EngineResult] = []
        self._retry: list[EngineResult] = []  # results whose write failed (disk full), written again later
        self._pending_event = asyncio.Event()
        self._sent_at: dict[str, float] = {}  # results sent, not yet acked
        self._in_engine: set[str] = set()
        self._cancelled: dict[str, None] = {}  # task ids cancelled by their submitter (bounded, oldest first out)
        self._received_since_fetch = 0
        self._granted = 0
        self._hello_nonces: dict[str, float] = {}  # hellos awaiting their welcome, nonce -> sent at
        self._local_allow = None if cfg.allowed_functions is None else frozenset(cfg.allowed_functions)
        self._hub_allow: frozenset[str] | None = None  # the hub's allow-list for us, kept in the queue's meta
        self._store_blocked_until = 0.0  # monotonic; set when the queue could not be written (disk full)
        self._relayed = bool(getattr(cfg, "gateway_id", None))  # behind a site gateway (docs/sites.md)
        #: Behind a gateway that keeps our session through LAN flaps (the hub's welcome says
        #: ``resume: 1``): a new connection of this process resumes instead of saying hello. Cleared
        #: by every hello until its welcome comes, so a reconnect while the hub waits for one says it again.
        self._resume = False
        self.hello_extra: dict[str, Any] = {}
        # Behind a gateway: function bodies it handed us (checked by hash), until the signed tasks
        # frame right after names them in ``at_site``; bounded (16 MiB), oldest dropped first (docs/sites.md).
        self._site_bodies: dict[str, bytes] = {}
        self.on_site: Callable[[dict[str, Any]], Any] | None = None  # a gateway: the welcome's ``site``
        # Liveness (docs/protocol.md, "Liveness and idle cost"): what the hub's welcome asked for.
        self._conn: str | None = None  # this connection's id, in our hello and our will
        self._keepalive: int | None = None  # MQTT keepalive of the current connection
        self._beat_max: float | None = None  # adaptive heartbeats: the longest the hub lets us stay silent
        self._hub_reads_z = False  # the hub reads compressed bodies (it said so in its welcome)
        self._last_frame = 0.0  # monotonic, last frame we sent: any frame is proof of life to the hub
        # The hub's last echo stamp ("t" in its frame) and when we read it (monotonic): echoed with
        # our hold time in our next frame, so the hub measures the link's round trip (docs/protocol.md).
        self._echo: tuple[int, float] | None = None
        self._last_beat: dict[str, Any] = {}  # body of the last heartbeat sent (adaptive: only changes go)
        self._beat_state: tuple[Any, ...] | None = None
        self._confirm_beat = False  # send one more beat if nothing arrives (the hub's credit re-sync needs two)
        self._gpus: list[dict[str, Any]] = []  # this machine's GPUs, found at start (run())
        self.stats = {"tasks_received": 0, "results_sent": 0, "rejected_frames": 0, "reconnects": 0, "store_failures": 0, "refused_tasks": 0}
        self._bytes_sent = 0  # frame bytes this process sent the hub (device counters, docs/protocol.md)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; survives any number of link losses."""
        await self.store.open()
        if self._worker_env is None:
            from mesh_agent.datasets import worker_env  # pydantic's dataset models: not on the runner's path

            self._worker_env = worker_env(self.cfg.endpoint_id, self.cfg.name, self.cfg.datasets, self.cfg.data_dir)
        os.environ.update(self._worker_env)  # before workers spawn: they inherit it
        from mesh_agent.gpu import detect_gpus  # (nvidia-smi, never torch)

        self._gpus = await asyncio.to_thread(detect_gpus)
        allow = await self.store.get_meta("hub_allow")
        self._hub_allow = None if allow is None else frozenset(json.loads(allow))
        await self.engine.start()
        flusher = asyncio.create_task(self._flush_results_forever(), name="flush-results")
        try:
            await self._resume_stored_tasks()
            await self._connect_forever(stop)
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self.engine.stop()
            # Results that finished during shutdown are still written: nothing finished is lost.
            with contextlib.suppress(Exception):
                await self._save_pending()
            await self.store.close()

    async def _resume_stored_tasks(self) -> None:
        tasks = await self.store.queued_tasks(exclude=self._in_engine)
        if tasks:
            log.info("resuming %d stored tasks", len(tasks))
            bodies = await self.store.function_bodies(t.function_id for t in tasks)
            self._submit([(t.id, t.function_id, t.args, t.timeout, t.expires, t.env, t.now) for t in tasks], bodies)

    async def _connect_forever(self, stop: asyncio.Event) -> None:
        attempt = 0
        where = link_address(self.cfg)
        lost_at: float | None = None  # when the last session ended: "reconnected after 42 s"
        while not stop.is_set():
            connected = quick = False
            try:
                async with await self._new_link() as link:
                    self._link = link
                    connected, self._announced = True, False
                    where = _node_address(where, link)
                    if lost_at is None:
                        log.info("connected to %s", where)
                    else:
                        log.info("reconnected to %s after %.0fs offline (%d attempts)", where, time.monotonic() - lost_at, attempt)
                    attempt, lost_at = 0, None
                    await self._session(link, stop)
            except LinkError as exc:
                reason, quick = str(exc), isinstance(exc, _Reconnect)
            else:
                reason = "stopping" if stop.is_set() else "session ended"
            finally:
                self._link = None
                self._welcomed.clear()
            if stop.is_set():
                if connected:
                    log.info("disconnected from %s: agent stopping", where)
                break
            attempt += 1
            self.stats["reconnects"] += 1
            # Exponential backoff with jitter: a fleet coming back after a regional outage
            # must not reconnect in lockstep.
            delay = 0.0 if quick else reconnect_delay(attempt)
            if connected:
                lost_at = time.monotonic()
                log.warning("disconnected from %s: %s; reconnecting in %.1fs", where, reason, delay)
            else:  # repeated every attempt while the hub is unreachable: rate-limited by mesh_agent._logs
                lost_at = lost_at or time.monotonic()
                log.warning("cannot reach %s: %s; retrying in %.1fs", where, reason, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _new_link(self) -> AgentLink:
        """A link for one connection. Over MQTT it carries a will: a signed ``gone`` frame naming this
        connection, which the broker publishes if the connection dies without a goodbye (keepalive
        lapsed on a black-holed link, process killed), so the hub learns of it within its bound
        without the agent beating every few seconds. The keepalive is what the hub's last welcome
        asked for (kept in the queue's meta across restarts)."""
        link = self._link_factory(self.cfg, self._creds)
        self._conn = None
        configure = getattr(link, "configure", None)
        if configure is not None:
            self._conn = os.urandom(8).hex()
            self._keepalive = await self._keepalive_to_use()
            configure(will=self._gone_frame(), keepalive=self._keepalive)
        return link

    async def _keepalive_to_use(self) -> int:
        if self.footprint.keepalive is not None:  # set by the user
            return self.footprint.keepalive
        if not self.footprint.adaptive:  # lan: heartbeats every heartbeat_s prove we are alive
            return LAN_KEEPALIVE_S
        hub = await self.store.get_meta("hub_keepalive_s")
        return int(hub) if hub and hub.isdigit() else PROVISIONAL_KEEPALIVE_S

    def _gone_frame(self, *, bye: bool = False) -> bytes:
        """Long-lived on purpose (the will may wait months in the broker): the hub does not check its
        freshness, only its MAC, and acts on it only for the session whose hello named this ``conn``.
        ``bye``: a clean stop, which the hub logs as such rather than as a lost device."""
        ts = self._now()
        body: dict[str, Any] = {"conn": self._conn, **({"bye": 1} if bye else {})}
        return encode(Envelope(Kind.GONE, self.endpoint_id, body, ts=ts, exp=ts + 86400.0), self._key)

    async def _session(self, link: AgentLink, stop: asyncio.Event) -> None:
        if self._resume:
            await self._resume_session()
        else:
            await self._send_hello()
        reader = asyncio.create_task(self._read(link))
        beat = asyncio.create_task(self._heartbeats())
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({reader, beat, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopper and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if stopper in done and self._conn is not None:
                # A clean stop sends no will (the client says DISCONNECT): say goodbye, so the hub
                # marks us offline now rather than after its bound. Also before this connection's
                # welcome: the hub reads our hello first (one connection, in order), so a session it
                # opened for it is closed; a hello it refused makes the goodbye a no-op. (Waiting for
                # the welcome left the hub's session open for its whole bound when a stop came right
                # after a reconnect, e.g. the one that applies the welcome's keepalive.)
                with contextlib.suppress(LinkError, asyncio.TimeoutError):
                    await asyncio.wait_for(link.send(self._gone_frame(bye=True)), 2.0)
        finally:
            for t in (reader, beat, stopper):
                t.cancel()
            await asyncio.gather(reader, beat, stopper, return_exceptions=True)

    # ------------------------------------------------------------------ sending
    def _now(self) -> float:
        return self._clock.now()

    async def _send(self, kind: Kind, body: dict[str, Any], *, compress: bool | None = None) -> None:
        link = self._link
        if link is None:
            raise LinkError("not connected")
        echo = self._echo
        if echo is not None and kind is not Kind.HELLO:  # rides on a frame sent anyway: a few bytes
            body = {**body, "e": [echo[0], int((time.monotonic() - echo[1]) * 1e6)]}
            self._echo = None
        ts = self._now()
        # Behind a site gateway (docs/sites.md) results and acks may wait at the gateway through a long
        # uplink outage: they stay valid for a week (both are idempotent by task id at the hub).
        exp = ts + _RELAYED_TTL_S if self._relayed and kind in (Kind.RESULTS, Kind.ACK) else 0.0
        with costs.stage("agent.sign"):
            frame = encode(Envelope(kind, self.endpoint_id, body, ts=ts, exp=exp), self._key,
                           compress=self._hub_reads_z and (self.footprint.compress if compress is None else compress))
        await link.send(frame)
        self._bytes_sent += len(frame)  # frame bytes, reported in heartbeats (device counters)
        self._last_frame = time.monotonic()

    async def _resume_session(self) -> None:
        """A new LAN connection of this process, behind a gateway whose hub keeps our session through
        a LAN absence (docs/sites.md, "LAN reconnects"): no hello, which would cross the uplink with
        every held task id and bring a welcome back down. One full heartbeat naming this connection
        tells the gateway we are back (its liveness row takes a new connection epoch; it hands us
        every frame it holds for us again and judges the will of this connection from now on).
        Then as after a welcome: stored tasks resume, credit is told again, and unacked results go
        again (an ack lost while the link was down; the gateway keeps one copy per task, so only
        what it no longer holds crosses the uplink). Should the hub have ended our session
        meanwhile, its ``hello_required`` comes through the gateway and we say hello then."""
        self._welcomed.set()
        self._last_beat, self._beat_state, self._confirm_beat = {}, None, False
        body = await self._beat_body(compact=self._beat_max is not None)
        self._last_beat = body
        await self._send(Kind.HEARTBEAT, {**body, **({"conn": self._conn} if self._conn is not None else {})})
        await self._resume_stored_tasks()
        await self._maybe_fetch(force=True)
        await self._resend_stale_results(all_of_them=True)

    async def _send_hello(self) -> None:
        self._resume = False  # until this hello's welcome: a reconnect meanwhile says hello again
        nonce = os.urandom(8).hex()
        self._hello_nonces[nonce] = time.time()
        while len(self._hello_nonces) > 8:
            self._hello_nonces.pop(next(iter(self._hello_nonces)))
        await self._send(
            Kind.HELLO,
            {
                "nonce": nonce,
                "capacity": self._capacity,
                "prefetch": self.cfg.prefetch,
                "have": await self.store.held_ids(),
                "engine": self.cfg.engine,
                "host": socket.gethostname(),
                "version": __version__,
                "pid": os.getpid(),
                # for placement: selectors, constraints, pooled profiles
                "tags": list(self.cfg.tags),
                "hardware": self.cfg.hardware,
                "gpu": self.cfg.gpu,  # placement's flag: as configured (mesh-agent init --gpu)
                "gpus": self._gpus,  # what nvidia-smi found: [{"index", "name", "memory_mb", "uuid", "driver"}] (mesh_agent/gpu.py)
                "memory_mb": _psutil().virtual_memory().total // 2**20,
                # liveness and footprint: our will names this connection; we read compressed
                # bodies; we beat on change (the hub then bounds our silence by its MQTT setting)
                **({"conn": self._conn} if self._conn is not None else {}),
                **({"z": 1} if self.footprint.compress else {}),
                **({"beats": "adaptive"} if self.footprint.adaptive else {}),
                **self.hello_extra,  # a site gateway announces its site (mesh_agent/gateway.py)
            },
        )

    @property
    def _capacity(self) -> int:
        """Tasks we run at once: the configured pool, even while on-demand workers are not up."""
        return int(getattr(self.engine, "capacity", self.engine.workers))

    def _want(self) -> int:
        if time.monotonic() < self._store_blocked_until:
            return 0  # the queue cannot take more right now (disk full): let the hub keep them
        return max(0, self._capacity + self.cfg.prefetch - self.engine.queued - self.engine.running)

    async def _maybe_fetch(self, force: bool = False) -> None:
        """Tell the hub how many more tasks we can take, when that changed enough to matter."""
        if not self._welcomed.is_set():
            return
        want = self._want()
        full = self._capacity + self.cfg.prefetch
        # What the hub still believes it may send us: our last grant minus what arrived since.
        hub_credit = max(0, self._granted - self._received_since_fetch)
        gap = want - hub_credit
        if force or (gap > 0 and (gap >= max(1, full // 4) or self.engine.running == 0)):
            self._granted = want
            self._received_since_fetch = 0
            await self._send(Kind.FETCH, {"want": want})

    async def _heartbeats(self) -> None:
        """Beat every ``heartbeat_s`` (lan, or a hub that predates adaptive beats), or adaptively:
        look at our state every ``heartbeat_min_s`` (no bytes) and beat only when it changed, when
        ``beat_max_s`` would otherwise pass without any frame from us, or once more after going
        idle with ``want > 0`` (the hub re-syncs lost credit after two such beats in a row)."""
        _psutil().cpu_percent(None)
        last_prune = 0.0
        while True:
            if time.monotonic() - last_prune > 3600:
                last_prune = time.monotonic()
                try:
                    await self.store.prune()
                except Exception as exc:  # housekeeping only; never worth the session
                    log.warning("pruning old task ids failed: %s", exc)
            beat_max = self._beat_max
            tick = self._heartbeat_s if beat_max is None else min(self.footprint.beat_min_s, beat_max)
            await asyncio.sleep(tick)
            if beat_max is not None:
                state = (self._capacity, self.engine.running, self.engine.queued, self._want())
                changed = state != self._beat_state
                due = time.monotonic() - self._last_frame + tick > beat_max
                if not (changed or due or self._confirm_beat):
                    if self._sent_at:
                        await self._resend_stale_results()
                    await self._maybe_fetch()  # safety net should a fetch have been lost
                    continue
                self._confirm_beat = changed and state[3] > 0 and state[1] == 0 and state[2] == 0
                self._beat_state = state
            body = await self._beat_body(compact=beat_max is not None)
            if beat_max is not None:  # only what changed since the last beat; want always (credit re-sync)
                sent = {k: v for k, v in body.items() if k == "want" or self._last_beat.get(k) != v}
            else:
                sent = body
            self._last_beat = body
            await self._send(Kind.HEARTBEAT, sent)
            await self._resend_stale_results()
            await self._maybe_fetch()  # safety net should a fetch have been lost

    async def _beat_body(self, compact: bool) -> dict[str, Any]:
        """The full heartbeat body. Compact (adaptive) rounds resource figures so that noise alone
        does not count as a change worth bytes."""
        counts = await self.store.counts()
        with costs.stage("agent.heartbeat"):
            ps = _psutil()
            mem = ps.virtual_memory()
            cpu = ps.cpu_percent(None)
            return {
                "capacity": self._capacity,
                "running": self.engine.running,
                "queued": self.engine.queued,
                "stored": counts["queued"],
                "outbox": counts["done"],
                "want": self._want(),
                "warm": self.engine.warm_functions()[:100],
                **self._held_envs(),
                "cpu": round(cpu) if compact else cpu,
                "mem_used": round(mem.percent) if compact else mem.percent,
                "mem_avail_mb": (mem.available // 2**24) * 16 if compact else mem.available // 2**20,
                **self._device_counters(compact),
            }

    def _device_counters(self, compact: bool) -> dict[str, int]:
        """What the hub exports for this device (cloud_hub/metrics.py), riding on the heartbeat
        instead of a port on the device: worker restarts, free disk under the queue (MiB), frame
        bytes sent (KiB) and the clock offset to the hub (ms). Two-letter keys and integers keep
        them near 30 bytes; compact (adaptive) beats round disk to 64 MiB and skew to 100 ms, so
        they change, and cost bytes, only when it matters. They never cause a beat of their own."""
        import shutil

        try:
            free = shutil.disk_usage(self.cfg.data_dir).free // 2**20
        except OSError:
            free = -1
        skew = self._clock.offset * 1000
        return {
            "rs": int(getattr(self.engine, "stats", {}).get("worker_deaths", 0)),
            "df": (free // 64) * 64 if compact and free >= 0 else free,
            "tx": self._bytes_sent // 1024,
            "sk": int(round(skew, -2)) if compact else int(round(skew)),
        }

    def _held_envs(self) -> dict[str, Any]:
        """``envs``: ids of the environment specs this endpoint can start without a build or pull
        (specs with a venv, and container specs whose image is staged here; 16 hex digits each,
        at most 32, most recent first):
        the scheduler's cold-start term prefers endpoints that hold a task's environment. Absent
        when none: no bytes on a metered link for endpoints that never built one."""
        held = getattr(self.engine, "held_environments", None)
        envs = held()[:32] if held is not None else []
        out: dict[str, Any] = {"envs": envs} if envs else {}
        builds = getattr(self.engine, "environment_builds", None)
        eb = builds() if builds is not None else {}
        if eb:  # what the recent builds cost (seconds, bytes fetched): the scheduler learns from it
            out["eb"] = {sid: [round(s, 1), int(b)] for sid, (s, b) in eb.items()}
        return out

    # ------------------------------------------------------------------ receiving
    async def _read(self, link: AgentLink) -> None:
        async for frame in link.frames():
            try:
                await self._handle(frame)
            except StoreError as exc:
                # The queue could not be written (disk full): nothing was acked, so nothing is
                # lost; the link stays up and the hub re-sends after its lease.
                log.error("%s", exc)
            except _HelloRequired:
                # Many frames may bounce while the hub restarts: one hello per second is enough.
                recent = max(self._hello_nonces.values(), default=0.0)
                if time.time() - recent > 1.0:
                    await self._send_hello()

    def _site_body(self, blob: bytes) -> None:
        """A function body from our site gateway: ``CMFN`` + function id (64 hex) + body. Kept (in
        memory, bounded) only if its SHA-256 is that id; it is used only for a task of a signed
        frame that names the id, so a gateway cannot make us run anything else."""
        import hashlib

        fid, body = blob[4:68].decode("ascii", "replace"), bytes(blob[68:])
        if len(blob) < 68 or hashlib.sha256(body).hexdigest() != fid:
            self.stats["rejected_frames"] += 1
            log.warning("rejected function body from the gateway: its hash is not %s", fid)
            return
        self._site_bodies.pop(fid, None)
        self._site_bodies[fid] = body
        total = sum(len(b) for b in self._site_bodies.values())
        while total > _SITE_BODIES_MAX and len(self._site_bodies) > 1:
            total -= len(self._site_bodies.pop(next(iter(self._site_bodies))))

    def open_site_down(self, frame: bytes) -> Envelope:
        """A site gateway's check of a ``site_down`` (mesh_agent/gateway.py): our key, our endpoint,
        fresh by our estimate of the hub's clock, not a replay; then its body. Raises ProtocolError.
        Each inner frame is still checked by its device, with the device's key."""
        sealed = open_frame(frame, self._key)
        if sealed.endpoint != self.endpoint_id or sealed.kind is not Kind.SITE_DOWN:
            raise BadFrame(f"not a site_down for {self.endpoint_id}")
        now = self._now()
        check_freshness(sealed, now=now)
        self._replay.check(sealed, now=now)
        return sealed.open()

    async def _handle(self, frame: bytes) -> None:
        """Trust before parsing (invariant 3): header and MAC, direction, freshness (for a welcome:
        the nonce of one of our hellos) and replay are all checked on the fixed binary header; the
        body is handed to msgpack only after every check passed."""
        read_at = time.monotonic()  # before any of our own work: the hub takes our hold out of its round trip
        if self._relayed and frame[:4] == SITE_BODY_MAGIC:
            self._site_body(frame)
            return
        try:
            with costs.stage("agent.verify"):  # MAC, header, freshness, replay, then the body
                sealed = open_frame(frame, self._key)
                if sealed.endpoint != self.endpoint_id:
                    raise BadFrame(f"frame addressed to {sealed.endpoint}")
                if sealed.kind not in DOWN_KINDS:
                    raise BadFrame(f"a {sealed.kind.value} frame cannot come from the hub (reflected?)")
                if sealed.kind is Kind.WELCOME:
                    # No freshness check: our clock may be wrong until this very welcome sets it.
                    # A welcome carries the nonce of the hello it answers as its message id instead.
                    if sealed.id not in self._hello_nonces:
                        raise ProtocolError("welcome does not answer a hello of ours")
                else:
                    now = self._now()
                    check_freshness(sealed, now=now)
                    self._replay.check(sealed, now=now)
                env = sealed.open()
                if env.kind is Kind.WELCOME and env.body["reply_to"] != sealed.id:
                    raise BadFrame("welcome reply_to differs from its message id")
        except ProtocolError as exc:
            self.stats["rejected_frames"] += 1
            log.warning("rejected frame from hub: %s: %s", exc.reason, exc)
            if isinstance(exc, Stale) and sealed.ts > self._now():
                # Authentic (its MAC passed) and from the hub's future: our estimate of the hub's
                # clock is behind. Say hello (at most once a second) to learn it again.
                raise _HelloRequired() from None
            return
        stamp = env.body.get("t")
        if type(stamp) is int:
            self._echo = (stamp, read_at)
        # Hub time -> ours: when the hub signed this frame (a task re-sent after its result was acked runs again only if signed later).
        self._frame_signed_at = sealed.ts - self._clock.offset
        handler = _HANDLERS.get(env.kind)
        if handler is not None:
            try:
                done = await handler(self, env.body)
            except BaseException:
                if env.kind is Kind.TASKS:  # not stored (cancelled with the link, ...): it may come again
                    self._replay.forget(sealed)
                raise
            if done is False and env.kind is Kind.TASKS:
                self._replay.forget(sealed)

    async def _on_welcome(self, body: dict[str, Any]) -> None:
        now = time.time()
        sent = self._hello_nonces.get(body["reply_to"], now)
        self._hello_nonces.clear()
        hold: Any = body.get("hold")  # how long our hello waited in the hub (a hub that predates it: 0)
        again = self._clock.sample(sent, now, float(body["hub_time"]),
                                   float(hold) if type(hold) in (int, float) and 0 <= hold < 60 else 0.0)
        hub_beat = body.get("heartbeat_s")
        if isinstance(hub_beat, (int, float)) and 0 < hub_beat < self.cfg.heartbeat_s:
            self._heartbeat_s = float(hub_beat)  # the hub declares us lost on its own period
        await self._adopt_liveness(body)
        await self._set_hub_allow(body)
        self._note_site_store(body.get("site_store"))
        if self.on_site is not None and isinstance(body.get("site"), dict):
            await self.on_site(body["site"])
        self._welcomed.set()
        # Only after everything above held: a welcome cut short (a reconnect to apply its keepalive)
        # leaves the next connection to say hello again.
        self._resume = self._relayed and body.get("resume") == 1
        if not getattr(self, "_announced", True):  # once per connection: the operator's "it works" line
            self._announced = True
            log.info("online: %s via %s to %s (hub %s)", self.endpoint_id, self.cfg.transport, link_address(self.cfg), self.cfg.hub_url)
        await self._resume_stored_tasks()  # anything stored but not running (a session cut mid-batch)
        await self._maybe_fetch(force=True)
        await self._resend_stale_results(all_of_them=True)
        if again:  # that welcome waited somewhere (a broker queue, an outage): measure again
            log.warning("welcome came %.0fs after its hello; measuring the hub's clock again", now - sent)
            await self._send_hello()

    def _note_site_store(self, addr: Any) -> None:
        """Where our site's LAN blob store is (the welcome says so behind a gateway that runs one),
        in a file of our data directory that tasks' workers read (cloud_hub.client.refs): shared
        data refs are then fetched over the uplink once per site. Written only when it changes
        (one small SD-card write per change of gateway), removed when the welcome names none."""
        from mesh_agent.site_store import SITE_STORE_FILE

        path = Path(self.cfg.data_dir) / SITE_STORE_FILE
        want = addr if isinstance(addr, str) and addr.count(":") == 1 and len(addr) < 300 else None
        try:
            have = path.read_text() if path.exists() else None
            if want is None and have is not None:
                path.unlink()
            elif want is not None and want != have:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(want)
                os.replace(tmp, path)
        except OSError as exc:  # shared refs are then read from the shared store, as without a site
            log.warning("could not record the site store %s: %s", want, exc)

    async def _adopt_liveness(self, body: dict[str, Any]) -> None:
        """What the welcome says about liveness: ``beat_max_s`` (adaptive beats allowed, this long
        at most), ``keepalive_s`` (the MQTT keepalive that keeps the hub's offline bound: the broker
        publishes our will 1.5 keepalives after the link went silent) and ``z`` (reads compressed
        bodies). A keepalive other than the one in force is kept and, when it matters, applied by
        reconnecting at once (MQTT fixes it at CONNECT)."""
        self._hub_reads_z = bool(body.get("z"))
        self._last_beat, self._beat_state, self._confirm_beat = {}, None, False  # a new session gets a full beat
        bm: Any = body.get("beat_max_s")
        ok = isinstance(bm, (int, float)) and not isinstance(bm, bool) and bm > 0
        self._beat_max = float(bm) if ok and self.footprint.adaptive else None
        ka = body.get("keepalive_s")
        if self._conn is None or self.footprint.keepalive is not None or not isinstance(ka, int) or isinstance(ka, bool) or ka < 1:
            return
        if await self.store.get_meta("hub_keepalive_s") != str(ka):
            try:
                await self.store.set_meta("hub_keepalive_s", str(ka))
            except StoreError as exc:
                log.error("could not save the hub's keepalive: %s", exc)
        wanted = await self._keepalive_to_use()
        now = self._keepalive
        if now is not None and (now > wanted or (self.footprint.adaptive and now < wanted / 2)):
            raise _Reconnect(f"reconnecting with the hub's MQTT keepalive of {wanted}s (this connection has {now}s)")

    async def _set_hub_allow(self, body: dict[str, Any]) -> None:
        if "allow" not in body:
            return
        allow = None if body["allow"] is None else frozenset(body["allow"])
        if allow != self._hub_allow:
            self._hub_allow = allow  # in force at once; kept on disk for tasks resumed after a restart
            log.info("hub allow-list: %s", "none" if allow is None else f"{len(allow)} functions")
            try:
                await self.store.set_meta("hub_allow", None if allow is None else json.dumps(sorted(allow)))
            except StoreError as exc:
                log.error("could not save the hub's allow-list: %s", exc)

    async def _on_tasks(self, body: dict[str, Any]) -> bool:
        """False: the batch was not stored (and not acked)."""
        cancel = body.get("cancel")
        if cancel and not body.get("tasks") and not body.get("functions"):
            return await self._on_cancel(cancel)  # a cancel alone: no tasks to store
        with costs.stage("agent.tasks"):
            tasks: list[dict[str, Any]] = body.get("tasks", [])
            functions: dict[str, bytes] = body.get("functions") or {}
            for fid in body.get("at_site") or []:  # bodies our gateway handed us, checked by hash, stored with these tasks
                if isinstance(fid, str) and fid not in functions and fid in self._site_bodies:
                    functions[fid] = self._site_bodies.pop(fid)  # stored with these tasks: no longer held in memory
            self._received_since_fetch += len(tasks)
            by_id = {t["id"]: t for t in tasks}
            missing: list[tuple[str, str, bytes, float | None, float | None, str | None, Any]] = []

        def start(fresh: list[str]) -> None:
            # Called inside the store's transaction, before its commit: tasks whose function came
            # with this frame start now; the rest wait for their stored body (below).
            with costs.stage("agent.tasks"):  # (a callback on the loop: agent.submit nests inside)
                self.stats["tasks_received"] += len(fresh)
                ready: list[tuple[str, str, bytes, float | None, float | None, str | None, Any]] = []
                for i in fresh:
                    t = by_id[i]
                    row = (i, t["fn"], t["args"], t.get("timeout"), t.get("exp"), t.get("env"), t.get("now"))
                    (ready if t["fn"] in functions else missing).append(row)
                self._submit(ready, functions)

        await self._set_hub_allow(body)  # before any of these tasks is considered for running
        try:
            # 2 s: more than the error of our estimate of the hub's clock (half a short round trip).
            held_back: list[str] = []
            await self.store.add_tasks(functions, tasks, on_fresh=start, rerun_acked_before=getattr(self, "_frame_signed_at", 0.0) - 2.0,
                                       held_back=held_back)
        except StoreError as exc:
            # Not stored, so not acknowledged: the hub keeps them and sends them again. (Tasks
            # already started above still run; their results reach the hub, which keeps one.)
            self.stats["store_failures"] += 1
            self._store_blocked_until = time.monotonic() + _STORE_RETRY_S
            log.error("could not store %d tasks from the hub, so they are not acknowledged (the hub keeps them "
                      "and sends them again): %s", len(tasks), exc)
            with contextlib.suppress(LinkError):
                self._granted, self._received_since_fetch = 0, 0
                await self._send(Kind.FETCH, {"want": 0})
            return False
        if missing:
            bodies = await self.store.function_bodies({fid for _, fid, *_ in missing})
            self._submit(missing, bodies)  # before the ack: a link that fails now must not strand them
        # Ack everything, duplicates included (the hub may have missed our earlier ack), except
        # finished tasks held back by the store (see MeshStore.add_tasks): the hub signs them again.
        with costs.stage("agent.tasks"):
            skip = set(held_back)
            ids = [t["id"] for t in tasks if t["id"] not in skip]
        await self._send(Kind.ACK, {"ids": ids})
        if cancel:
            return await self._on_cancel(cancel)
        return True

    async def _on_cancel(self, ids: list[str]) -> bool:
        """The submitter cancelled these tasks (``tasks.cancel``, docs/protocol.md "Cancellation"):
        the hub holds their one ``cancelled`` result already. Stored first (a task without a result
        is finished without one, an unknown id is remembered: neither runs, not after a restart
        either), then the engine drops those queued and kills the workers running the others
        (replaced by fresh ones), then the hub hears ``ack.c`` and stops re-sending the cancel.
        Not stored (disk full): not acked, and the hub sends it again."""
        try:
            stopped = await self.store.cancel_tasks(ids, time.time())
        except StoreError as exc:
            self.stats["store_failures"] += 1
            log.error("could not store the cancel of %d tasks (the hub sends it again): %s", len(ids), exc)
            return False
        for i in ids:
            self._cancelled[i] = None
        while len(self._cancelled) > 100_000:
            self._cancelled.pop(next(iter(self._cancelled)))
        stop = getattr(self.engine, "cancel", None)  # the Parsl engine lets a running task end; its result is dropped
        held = [i for i in ids if i in self._in_engine]
        ended = stop(held) if stop is not None and held else []
        self.stats["cancelled"] = self.stats.get("cancelled", 0) + len(stopped)
        if stopped:
            log.info("cancelled %d tasks by their submitter (%d queued or running in the engine)", len(stopped), len(ended))
        await self._send(Kind.ACK, {"ids": [], "c": list(ids)})
        return True

    async def _on_result_ack(self, body: dict[str, Any]) -> None:
        ids = body.get("ids", [])
        try:
            await self.store.mark_acked(ids)
        except StoreError as exc:  # the results stay stored; they are re-sent and acked again later
            log.error("could not record result acks: %s", exc)
            return
        for i in ids:
            self._sent_at.pop(i, None)

    async def _on_error(self, body: dict[str, Any]) -> None:
        if body.get("code") == "hello_required":
            raise _HelloRequired()
        log.error("hub refused: %s", body.get("message", body))

    # ------------------------------------------------------------------ execution
    def _submit(self, rows: list[tuple[str, str, bytes, float | None, float | None, str | None, Any]], bodies: dict[str, bytes]) -> None:
        """``rows``: (id, function id, args, timeout, expiry, environment spec[, start now])."""
        with costs.stage("agent.submit"):  # the local engine dispatches to its workers inside
            now = self._now()
            batch: list[EngineTask] = []
            for task_id, fid, args, timeout, exp, env_text, *more in rows:
                start_now = more[0] if more else None
                if task_id in self._in_engine:
                    continue
                refusal = self._refusal(fid)
                if refusal is not None:
                    self.stats["refused_tasks"] += 1
                    log.warning("refused task %s: %s", task_id, refusal, extra={"task_id": task_id, "function_id": fid})
                    self._on_results([error_result(task_id, "mesh_agent.FunctionNotAllowed", refusal)])
                elif fid not in bodies:
                    self._on_results([error_result(task_id, "mesh_agent.FunctionMissing", f"function {fid} not stored")])
                elif exp and now > exp:
                    self._on_results([error_result(task_id, "mesh_agent.TaskExpired", f"task expired {now - exp:.0f}s before it could run")])
                elif env_text is not None and (bad := self._env_refusal(env_text)) is not None:
                    self._on_results([error_result(task_id, "mesh_agent.engine.EnvError", bad)])
                else:
                    self._in_engine.add(task_id)
                    task = EngineTask(task_id, fid, bodies[fid], args, timeout, _env_spec(env_text))
                    if start_now and isinstance(self.engine, LocalEngine):
                        task.now = True  # a Process: a free worker or one more (up to the cap), never the queue
                    batch.append(task)
            if batch:
                self.engine.submit(batch)

    def _env_refusal(self, env_text: str) -> str | None:
        """Why a task's environment spec cannot run here, or None (checked again: a hub is not trusted)."""
        from mesh_agent.protocol.environment import EnvSpecError, decode

        try:
            decode(env_text)
        except EnvSpecError as exc:
            return f"bad environment spec: {exc}"
        if not isinstance(self.engine, LocalEngine):
            return f"the {self.cfg.engine} engine does not run tasks in environments (venv, container, sandbox)"
        return None

    def _refusal(self, fid: str) -> str | None:
        """Why this function may not run here (allow-lists), or None. Checked before any code is loaded."""
        if self._local_allow is not None and fid not in self._local_allow:
            return f"function {fid} is not on this device's allow-list (allowed_functions in its config)"
        if self._hub_allow is not None and fid not in self._hub_allow:
            return f"function {fid} is not on endpoint {self.endpoint_id}'s allow-list"
        return None

    def _on_results(self, results: list[EngineResult]) -> None:
        self._pending.extend(results)
        self._pending_event.set()

    async def _save_pending(self) -> list[StoredResult]:
        batch, self._pending = self._retry + self._pending, []
        self._retry = []
        self._pending_event.clear()
        if not batch:
            return []
        with costs.stage("agent.collect"):
            if self._cancelled:  # the engine's result of a cancelled task: the hub has that task's one result already
                for r in batch:
                    if r.task_id in self._cancelled:
                        self._in_engine.discard(r.task_id)
                batch = [r for r in batch if r.task_id not in self._cancelled]
                if not batch:
                    return []
            stored = [StoredResult(r.task_id, r.ok, r.data, r.started, r.finished, r.worker_pid) for r in map(_fit, batch)]
        try:
            await self.store.save_results(stored)
        except StoreError:
            self._retry = batch
            raise
        for r in batch:
            self._in_engine.discard(r.task_id)
        return stored

    async def _flush_results_forever(self) -> None:
        while True:
            await self._pending_event.wait()
            try:
                stored = await self._save_pending()
            except StoreError as exc:
                # Not written, so not sent (a result is stored before it leaves). Keep them in
                # memory and retry; should the agent die meanwhile, their tasks are still stored
                # without a result and run again on restart.
                self.stats["store_failures"] += 1
                log.error("could not store %d results, holding them and retrying in %.0fs: %s", len(self._retry), _STORE_RETRY_S, exc)
                await asyncio.sleep(_STORE_RETRY_S)
                self._pending_event.set()
                continue
            if not stored or not (self._welcomed.is_set() or (self._relayed and self._link is not None)):
                continue  # (behind a gateway: sent at once, the gateway keeps them until the hub acks)
            try:
                await self._send_results(stored)
                await self._maybe_fetch()
            except LinkError:
                pass  # stored; re-sent after reconnect

    async def _send_results(self, results: list[StoredResult]) -> None:
        now = time.time()
        for chunk in _frames_of(results):
            await self._send(
                Kind.RESULTS,
                {"results": [{"id": r.id, "ok": r.ok, "data": r.data, "started": r.started, "finished": r.finished, "pid": r.worker_pid} for r in chunk]},
            )
            for r in chunk:
                self._sent_at[r.id] = now
            self.stats["results_sent"] += len(chunk)

    async def _resend_stale_results(self, all_of_them: bool = False) -> None:
        cutoff = time.time() - (_RELAYED_RESEND_S if self._relayed else _RESEND_AFTER_S)
        stale = [
            r for r in await self.store.unacked_results(limit=50_000)
            if all_of_them or self._sent_at.get(r.id, 0.0) < cutoff
        ]
        if stale:
            await self._send_results(stale)


def _fit(r: EngineResult) -> EngineResult:
    """A result too big for one frame becomes a clear error instead of a frame re-sent forever."""
    if len(r.data) <= _MAX_RESULT_BYTES:
        return r
    return error_result(
        r.task_id, "mesh_agent.ResultTooLarge",
        f"result of {len(r.data)} bytes exceeds the {_MAX_RESULT_BYTES}-byte limit; return a reference to staged data instead",
        started=r.started, worker_pid=r.worker_pid,
    )


def _frames_of(results: list[StoredResult]) -> list[list[StoredResult]]:
    """Split by count and by bytes, so no frame comes near MAX_FRAME_BYTES."""
    frames: list[list[StoredResult]] = [[]]
    size = 0
    for r in results:
        if frames[-1] and (len(frames[-1]) >= _RESULTS_PER_FRAME or size + len(r.data) > _FRAME_BUDGET):
            frames.append([])
            size = 0
        frames[-1].append(r)
        size += len(r.data)
    return [f for f in frames if f]


_HANDLERS = {
    Kind.WELCOME: Agent._on_welcome,
    Kind.TASKS: Agent._on_tasks,
    Kind.RESULT_ACK: Agent._on_result_ack,
    Kind.ERROR: Agent._on_error,
}


def _start_now_max(cfg: Any) -> int | None:
    """How many workers beyond the pool this agent starts for tasks that must start at once (a
    multiprocessing Process; docs/multiprocessing.md, "Start"): ``start_now_max`` in the config, or
    ``MESH_START_NOW_MAX``; None: the engine's default (4 per pool worker, at least 8)."""
    v = getattr(cfg, "start_now_max", None)
    if v is None:
        v = os.environ.get("MESH_START_NOW_MAX")
    try:
        return None if v is None else max(0, int(v))
    except ValueError:
        log.error("MESH_START_NOW_MAX=%r is not a whole number; using the default", v)
        return None


def _environments(cfg: Any) -> Any:
    """The engine's environment builder (mesh_agent/engine/environments.py) under ``<data_dir>/envs``.
    A sandboxed worker sees neither the data directory nor the directory of the key file."""
    from pathlib import Path

    from mesh_agent.engine.environments import Environments

    envs = getattr(cfg, "environments", None)
    return Environments(
        Path(cfg.data_dir) / "envs",
        hidden=[Path(cfg.data_dir), Path(cfg.credentials_file).parent],
        disk_budget_mb=envs.disk_budget_mb if envs is not None else 2048,
        index_url=envs.index_url if envs is not None else None,
        find_links=list(envs.find_links) if envs is not None else [],
        no_index=envs.no_index if envs is not None else False,
        **({"sandbox_tmp_mb": envs.sandbox_tmp_mb, "sandbox_nproc": envs.sandbox_nproc, "sandbox_uid": envs.sandbox_uid,
            "tenant_network": envs.tenant_network} if envs is not None else {}),
    )


def _env_spec(env_text: str | None) -> dict[str, Any] | None:
    """The normalized spec of a stored task (already checked by ``_env_refusal``)."""
    if env_text is None:
        return None
    from mesh_agent.protocol.environment import decode

    return decode(env_text)
