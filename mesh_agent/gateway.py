"""A site gateway: one machine on a farm's or village's LAN that relays its devices' frames over one
uplink to the hub, and keeps them moving while that uplink is down (docs/sites.md).

What it is made of, all of it the agent's own parts:

- an :class:`~mesh_agent.agent.Agent` for its own endpoint (it may run tasks itself), whose hello
  announces the site (``site: {hold, broker}``); the hub then leases work for the site's devices
  to it ahead of time, up to ``hold`` tasks, each in a ``tasks`` frame signed with the *device's*
  key and valid for the hub's ``site_hold_s``;
- its one MQTT connection to the hub's broker (the uplink, TLS when ``mqtt.tls`` is set): the
  agent's link, which also reads its devices' down topics and writes their up topics (the hub's
  ACL lets the gateway's login do exactly that, for exactly its devices);
- a Mosquitto on the LAN that the devices dial, with the same per-device logins as the hub's broker
  (the hub sends the gateway their ``$7$`` hashes, never a password) and per-device ACLs;
- the agent's SQLite queue (:class:`~mesh_agent.store.AgentStore`, table ``relay``) as the
  store-and-forward queue in both directions: tasks frames for a device are kept until that
  device's ``ack`` passes by, its results frames until the hub's ``result_ack`` does.

Security: the gateway holds no device key. It moves whole frames and never re-signs one; a device
still checks MAC, direction, freshness and replay on each (a task is also de-duplicated by id), so
a compromised gateway can delay or drop work, never make a device run anything. What it reads
from bodies (task ids in ``ack``, ``results`` and ``result_ack``) only decides when it may forget
its own copy of a frame.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, AsyncIterator

import aiomqtt
import msgpack

from mesh_agent.agent import SITE_BODY_MAGIC
from mesh_agent.backoff import AckTimeout
from mesh_agent.protocol import Kind, ProtocolError
from mesh_agent.protocol.envelope import _inflate, _parse_header, peek_kind
from mesh_agent.protocol.site import ROW_FIELDS, SiteBatch, inner_frames, settled_below, site_body
from mesh_agent.reload import reload_process
from mesh_agent.site_store import SiteStore
from mesh_agent.store import AgentStore, StoreError
from mesh_agent.transport import LinkError
from mesh_agent.transport.mqtt import MqttAgentLink, MqttHubLink, down_topic, up_topic

__all__ = ["Gateway", "frame_task_ids", "site_broker_conf"]

log = logging.getLogger("mesh_agent.gateway")

#: A tasks frame not yet acked by its device is handed to it again after this long, when the device is heard from.
REDELIVER_S = 15.0
#: Results sent up and not yet acked by the hub are sent again after at least this long (the device
#: does the same); longer on an uplink whose acks come slower (AckTimeout, measured per gateway).
RESEND_UP_S = 10.0
#: Frames relayed up without being kept (heartbeats, hellos, fetches) that may wait for their PUBACK at once.
MAX_IN_FLIGHT = 1000
#: Held frames sent up in one site_up at most (before compression), when the uplink is back.
_SITE_UP_CHUNK = 64 * 1024
#: A full liveness summary goes up at least this often (more often only on change), and at most
#: as rarely as the gateway's own longest beat interval.
_FULL_SUMMARY_MIN_S = 60.0
_COUNTERS = ROW_FIELDS[2:]  # capacity ... want: what a device's heartbeat tells
_SITE_USER = "mesh-gateway"


def frame_task_ids(kind: Kind, frame: bytes, end: int, compressed: bool) -> list[str]:
    """Task ids a ``tasks``, ``ack``, ``results`` or ``result_ack`` frame is about, read from its
    (unverified) body: they only tell the gateway when it may forget its copy, never what anyone runs.
    A body that does not parse yields no ids (the frame is still relayed; the receiver judges it)."""
    body = frame[end + 32 :]
    try:
        data = msgpack.unpackb(_inflate(body) if compressed else body, raw=False, strict_map_key=True)
        if kind is Kind.TASKS:
            return [str(t["id"]) for t in data.get("tasks", [])]
        if kind is Kind.RESULTS:
            return [str(r["id"]) for r in data.get("results", [])]
        return [str(i) for i in data.get("ids", [])] + [str(i) for i in data.get("c", [])]  # an ack's cancels applied too
    except Exception:
        return []


def frame_cancel_ids(frame: bytes, end: int, compressed: bool) -> list[str]:
    """Task ids a hub ``tasks`` frame cancels (``cancel``, docs/protocol.md "Cancellation"), read from
    its unverified body: they only decide which of our held copies may go."""
    body = frame[end + 32 :]
    try:
        data = msgpack.unpackb(_inflate(body) if compressed else body, raw=False, strict_map_key=True)
        return [str(i) for i in data.get("cancel") or []]
    except Exception:
        return []


def _mosquitto_hash(password: str) -> str:
    """``$7$`` (PBKDF2-SHA512), the format of ``mosquitto_passwd``, for the gateway's own site login."""
    salt = os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, 101, 64)
    return f"$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def _check_name(name: str) -> str:
    if not name or any(c in name for c in ":#+/ \n\r\t"):
        raise ValueError(f"not a usable broker name: {name!r}")
    return name


def site_broker_conf(workdir: Path, host: str, port: int, prefix: str, gateway_pw_hash: str, devices: list[dict[str, str]]) -> str:
    """Write the site Mosquitto's password and ACL files into ``workdir``; return its config text.

    Per-device logins with the device's own hash from the hub; each device may read only its down
    topic and write only its up topic, as on the hub's broker. No persistence: the gateway's SQLite
    queue is the durable copy (it hands a device its tasks again until the device acks them), so
    the SD card is not written a second time for every frame."""
    pw = [f"{_SITE_USER}:{gateway_pw_hash}"] + [f"{_check_name(d['user'])}:{d['hash']}" for d in devices]
    acl = [f"user {_SITE_USER}", "topic readwrite #", ""]
    for d in devices:
        acl += [f"user {_check_name(d['user'])}", f"topic read {prefix}/ep/{_check_name(d['id'])}/down",
                f"topic write {prefix}/ep/{d['id']}/up", ""]
    for name, text in (("password_file", "\n".join(pw) + "\n"), ("acl_file", "\n".join(acl))):
        tmp = workdir / f".{name}.tmp"
        tmp.write_text(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, workdir / name)
    import pwd

    # Started as root, Mosquitto drops to user 'mosquitto', which cannot read our private files: stay us.
    return (f"listener {port} {host}\nuser {pwd.getpwuid(os.getuid()).pw_name}\nallow_anonymous false\npassword_file {workdir}/password_file\nacl_file {workdir}/acl_file\n"
            "set_tcp_nodelay true\nmax_queued_messages 100000\nmax_inflight_messages 1000\npersistence false\n"
            f"log_dest file {workdir}/mosquitto.log\nlog_type error\nlog_type warning\n")


class _SiteBroker:
    """The site's Mosquitto, a child of the gateway (a power cut takes both; the queue survives)."""

    def __init__(self, workdir: Path, host: str, port: int, prefix: str, exe: str) -> None:
        self.workdir, self.host, self.port, self.prefix, self.exe = workdir, host, port, prefix, exe
        self.password = secrets.token_urlsafe(24)
        self._hash = _mosquitto_hash(self.password)
        self.proc: subprocess.Popen[bytes] | None = None
        self.devices: list[dict[str, str]] = []

    def _write(self) -> Path:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(site_broker_conf(self.workdir, self.host, self.port, self.prefix, self._hash, self.devices))
        return conf

    def prepare(self) -> None:
        """Before anything starts: end our own Mosquitto left from a SIGKILL of the gateway alone,
        then make sure the port is free (someone else's broker there would take our devices)."""
        pid_file = self.workdir / "mosquitto.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            # Only if that pid is still our Mosquitto (pids are reused): its command line names our config.
            if str(self.workdir / "mosquitto.conf").encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
        with contextlib.suppress(OSError):
            with socket.create_connection((self.host, self.port), timeout=0.5):
                raise RuntimeError(f"site.listen_port: {self.host}:{self.port} is already in use by another program; "
                                   "choose a free port for the site broker")

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pid_file = self.workdir / "mosquitto.pid"
        conf = self._write()
        self.proc = subprocess.Popen([self.exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid_file.write_text(f"{self.proc.pid}\n")
        for _ in range(100):  # bounded: 10 s
            if self.proc.poll() is not None:
                raise RuntimeError(f"site broker exited with {self.proc.returncode}; see {self.workdir}/mosquitto.log")
            with contextlib.suppress(OSError):
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"site broker did not listen on {self.host}:{self.port} within 10 s")

    def set_devices(self, devices: list[dict[str, str]]) -> None:
        if devices != self.devices:
            self.devices = devices
            self._write()
            if self.proc is not None and self.proc.poll() is None:
                # Not before it catches SIGHUP: this can run while start() waits for it to listen.
                reload_process(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        with contextlib.suppress(OSError):
            (self.workdir / "mosquitto.pid").unlink()


class _Uplink(MqttAgentLink):
    """The gateway's one connection to the hub's broker: its own endpoint's topics (for its Agent)
    and its devices' topics (for the relay), on the same TCP/TLS session and keepalive."""

    def __init__(self, relay: "Gateway", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._relay = relay
        self._prefix = kwargs.get("prefix", "mesh")

    async def __aenter__(self) -> "_Uplink":
        await super().__aenter__()
        try:
            for d in self._relay.devices:
                await self._client.subscribe(down_topic(self._prefix, d), qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT subscribe failed: {exc}") from None
        self._relay.uplink_up(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._relay.uplink_down(self)
        await super().__aexit__(*exc)

    async def subscribe_devices(self, devices: list[str]) -> None:
        for d in devices:
            await self._client.subscribe(down_topic(self._prefix, d), qos=1)

    async def send_for(self, device: str, frame: bytes) -> None:
        try:
            await self._client.publish(up_topic(self._prefix, device), frame, qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT publish failed: {exc}") from None

    async def frames(self) -> AsyncIterator[bytes]:
        try:
            async for msg in self._client.messages:
                if not isinstance(msg.payload, (bytes, bytearray)):
                    continue
                if str(msg.topic) == self._down:
                    if peek_kind(bytes(msg.payload)) is Kind.SITE_DOWN:
                        await self._relay.from_site_down(bytes(msg.payload))
                    else:
                        yield bytes(msg.payload)
                    continue
                parts = str(msg.topic).split("/")
                if len(parts) == 4 and parts[3] == "down":
                    await self._relay.from_hub(parts[2], bytes(msg.payload))
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT connection lost: {exc}") from None
        raise LinkError("MQTT message stream ended")


class Gateway:
    """Relay between the site broker and the uplink, over the agent's durable queue."""

    def __init__(self, cfg: Any, creds: Any) -> None:
        from mesh_agent.agent import Agent, _mqtt_tls

        if cfg.transport != "mqtt":
            raise ValueError("a site gateway's uplink is MQTT (transport: mqtt)")
        if cfg.site is None:
            raise ValueError("no site: section in the config; a gateway needs site.listen_port (docs/sites.md)")
        self.cfg, self.creds = cfg, creds
        self.prefix = cfg.mqtt.topic_prefix
        site = cfg.site
        self.devices: list[str] = []
        self._uplink: _Uplink | None = None
        self._site = _SiteBroker(cfg.data_dir / "site-broker", site.listen_host, site.listen_port, self.prefix, site.mosquitto)

        def uplink_factory(c: Any, cr: Any) -> _Uplink:
            return _Uplink(self, c.endpoint_id, c.mqtt.host, c.mqtt.port, username=cr.mqtt_username, password=cr.mqtt_password,
                           keepalive=c.mqtt.keepalive or 60, prefix=self.prefix, **_mqtt_tls(c))

        self.agent = Agent(cfg, creds, link_factory=uplink_factory)
        self.agent.hello_extra = {"site": {"hold": int(site.hold), "broker": f"{site.public_host or site.listen_host}:{site.listen_port}",
                                           **({"cache": 1} if site.cache_bodies else {}),
                                           # resume: a device's LAN reconnect is told by its row, not a hello (docs/sites.md)
                                           # bin: we read binary ids in a site_down's device table
                                           **({"frames": 1, "resume": 1, "bin": 1} if site.frames else {})}}
        store_port = site.listen_port + 1 if site.store_port is None else site.store_port
        self.blob_store_port = store_port if store_port and store_port <= 65535 else 0
        if self.blob_store_port:  # hierarchical FL: models and updates on the LAN (mesh_agent/site_store.py)
            self.agent.hello_extra["site"]["store"] = f"{site.public_host or site.listen_host}:{self.blob_store_port}"
        self.blobs: SiteStore | None = None
        self.agent.on_site = self._on_site
        self.store: AgentStore = self.agent.store  # one SQLite file: the agent's queue and the relay's
        self._lan: MqttHubLink | None = None
        self._up_wake = asyncio.Event()
        self._confirm = True  # tell the hub about every task we hold (after reconnecting)
        self._to_confirm: set[str] = set()  # ... and about these, stored since the last confirmation
        self._in_flight: set[asyncio.Task[None]] = set()  # relayed frames waiting for their PUBACK
        self.ack_timeout = AckTimeout(floor=RESEND_UP_S)
        #: task id -> (when its results frame was first sent up, whether it was sent again): the ack
        #: delays AckTimeout learns from. Bounded; lost on restart (the next sends count as first).
        self._results_sent: dict[str, tuple[float, bool]] = {}
        #: Site frames (docs/sites.md): on once the hub's welcome says it reads them. Device frames
        #: that are not kept (beats, hellos, fetches) wait here up to site.batch_s for company.
        self.site_frames = False
        self.site_bin = False  # the hub reads binary ids in a site_up's device table (its welcome says so)
        self._out = SiteBatch()
        self._out_timer: asyncio.TimerHandle | None = None
        #: Liveness rows (ROW_FIELDS) per device, from what the gateway sees on its LAN: they go up
        #: instead of the devices' heartbeats, fetches and gones (docs/sites.md). Changed rows go in
        #: the next site_up; all of them after each welcome and every _full_every_s().
        self._rows: dict[str, list[int]] = {}
        self._info: dict[str, dict[str, Any]] = {}  # device -> its other heartbeat fields, as last heard
        self._info_dirty: dict[str, set[str]] = {}  # device -> which of them changed since they went up
        self._dirty: set[str] = set()
        self._full_due = True
        self._last_full = 0.0
        self._conns: dict[str, str] = {}  # device -> the conn of its last hello (a will naming another is stale)
        #: (numbering, n): every site_down of that numbering up to n is stored here; told to the hub
        #: in the next site_up ("s.c") instead of the ids of the tasks it leased ahead
        self._stored: tuple[str, int] = ("", 0)
        self._stored_dirty = False
        self.stats = {"site_up": 0, "site_down": 0, "up_frames": 0, "down_frames": 0, "up_bytes": 0, "down_bytes": 0, "dropped": 0, "redelivered": 0, "bodies_to_devices": 0,
                      "results_resent": 0}

    # ------------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.to_thread(self._site.prepare)  # a taken port fails here, before we go online
        # The Agent opens the store; the relay waits for it.
        agent = asyncio.create_task(self.agent.run(stop), name="gateway-agent")
        for _ in range(200):  # bounded: 20 s
            if self.store._db is not None or agent.done():
                break
            await asyncio.sleep(0.1)
        if agent.done():
            await agent
            return
        if self.cfg.site.cache_bodies:  # tell the hub which bodies we hold: it sends each only once
            cur = await self.store.db.execute("SELECT id FROM functions ORDER BY stored_at DESC LIMIT 10000")
            self.agent.hello_extra["site"]["functions"] = [r[0] for r in await cur.fetchall()]
        kept = await self.store.get_meta("site_devices")
        if kept:
            devices = json.loads(kept)
            self.devices = [d["id"] for d in devices]
            self._site.devices = devices
        await asyncio.to_thread(self._site.start)
        if self.blob_store_port:
            self.blobs = SiteStore(self.store, self._site.host, self.blob_store_port)
            try:
                await self.blobs.start()
            except OSError as exc:  # the relay still works; FL falls back to sending models through the hub
                log.error("site blob store not started on %s:%d: %s", self._site.host, self.blob_store_port, exc)
                self.blobs = None
        await self.store.relay_sent([s for s, *_ in await self.store.relay_pending("down", limit=100_000)], 0.0)  # all due again
        self._lan = MqttHubLink(self._site.host, self._site.port, username=_SITE_USER, password=self._site.password,
                                prefix=self.prefix, identifier=f"gateway-{self.cfg.endpoint_id}")
        await self._lan.start(self._from_device)
        pump = asyncio.create_task(self._pump_up(stop), name="gateway-up")
        log.info("site gateway %s: devices dial %s:%d (%d devices); uplink %s", self.cfg.endpoint_id, self._site.host,
                 self._site.port, len(self.devices), f"{self.cfg.mqtt.host}:{self.cfg.mqtt.port}")
        try:
            await agent
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await self._lan.stop()
            if self.blobs is not None:
                await self.blobs.stop()
            self._site.stop()

    def uplink_up(self, link: _Uplink) -> None:
        self._uplink = link
        self._confirm = True
        self._up_wake.set()

    def uplink_down(self, link: _Uplink) -> None:
        if self._uplink is link:
            self._uplink = None

    async def _on_site(self, site: dict[str, Any]) -> None:
        """The hub's welcome lists the site's devices with their broker hashes."""
        self.site_frames = site.get("frames") == 1 and bool(self.cfg.site.frames)
        self.site_bin = self.site_frames and site.get("bin") == 1
        if self.site_frames:  # a new session at the hub: it learns every device's state again
            self._full_due = True
            self._flush_out()
        raw = site.get("devices")
        if not isinstance(raw, list):
            return
        devices = [{"id": str(d["id"]), "user": str(d["user"]), "hash": str(d["hash"])} for d in raw
                   if isinstance(d, dict) and {"id", "user", "hash"} <= d.keys()]
        new = [d["id"] for d in devices if d["id"] not in self.devices]
        self.devices = [d["id"] for d in devices]
        with contextlib.suppress(StoreError):
            await self.store.set_meta("site_devices", json.dumps(devices))
        try:
            await asyncio.to_thread(self._site.set_devices, devices)
        except (ValueError, OSError) as exc:  # a name the broker files cannot hold, or a full disk: keep the old files
            log.error("site broker files not updated: %s", exc)
        if self._uplink is not None:  # all of them: a subscription made before the hub's ACL listed a device was refused
            with contextlib.suppress(LinkError, aiomqtt.MqttError):
                await self._uplink.subscribe_devices(self.devices)
        if new:
            log.info("site: %d devices (%d new)", len(devices), len(new))

    # ------------------------------------------------------------------ hub -> device
    async def from_site_down(self, frame: bytes) -> None:
        """A batch of hub frames for our devices: the batch checked with our own key (freshness and
        replay as any hub frame), then each inner frame handled as if it had come on its device's
        topic. Inner frames are not verified here: each device checks its own with its key."""
        try:
            env = self.agent.open_site_down(frame)
            frames = inner_frames(env.body)
        except (ProtocolError, KeyError, TypeError) as exc:
            self.stats["dropped"] += 1
            log.warning("rejected site_down from hub: %s", exc)
            return
        self.stats["site_down"] += 1
        epoch, n = env.body.get("e"), env.body.get("n")
        # "Stored up to n" confirms every batch of this numbering up to n at once: only when this
        # batch follows the last one we stored (a gap, or a batch we could not store, leaves the
        # number where it was; those tasks are confirmed by id, as without site frames). The hub's
        # floor ("b": every batch below it is settled there) lets the number step over a batch the
        # hub gave up on and sent again, and picks up a numbering after we restarted.
        upto = self._stored[1] if epoch == self._stored[0] else 0
        floor = settled_below(env.body)
        if floor is not None and floor - 1 > upto:
            upto = floor - 1
        in_order = isinstance(epoch, str) and isinstance(n, int) and n == upto + 1
        stored_all = True
        for device, inner in frames:
            stored_all &= await self.from_hub(device, inner, by_seq=in_order) is not False
        if in_order and stored_all and isinstance(n, int):
            upto = n
        if isinstance(epoch, str) and (epoch, upto) != self._stored and upto > 0:
            self._stored = (epoch, upto)
            self._stored_dirty = True
            # the hub's answer to our next hello: re-send only what lies past this (docs/sites.md)
            self.agent.hello_extra["site"]["stored"] = [epoch, upto]
            self._queue_up(None, b"", at_once=False)

    async def from_hub(self, device: str, frame: bytes, *, by_seq: bool = False) -> bool | None:
        """A frame for one of our devices came down the uplink: keep tasks until the device acks
        them, drop our copy of results the hub acknowledged, hand everything on. False: a tasks
        frame we could not keep; None: not a frame for us."""
        if device not in self.devices:
            return None
        try:
            kind, ep, mid, _ts, exp, end, z = _parse_header(frame)
        except Exception:
            self.stats["dropped"] += 1
            return None
        if ep != device:
            self.stats["dropped"] += 1
            return None
        self.stats["down_frames"] += 1
        self.stats["down_bytes"] += len(frame)
        if kind is Kind.TASKS:
            ids = frame_task_ids(kind, frame, end, z)
            cancel = frame_cancel_ids(frame, end, z)
            try:
                if cancel:
                    # Cancelled tasks we still hold for the device are not handed over: a held frame
                    # whose tasks are all cancelled goes now. The cancel itself is kept until the
                    # device's ack names it (``ack.c``), and handed over like a tasks frame.
                    await self.store.relay_release("down", device, cancel)
                await self.store.relay_put("down", device, kind.value, mid, frame, exp, ids + cancel)
            except StoreError as exc:
                log.error("could not keep a tasks frame for %s (the hub re-sends after its lease): %s", device, exc)
                return False
            if not by_seq:  # confirmed by id (a batch out of order, or no site frames)
                self._to_confirm.update(ids)
                self._up_wake.set()
        elif kind is Kind.RESULT_ACK:
            acked = frame_task_ids(kind, frame, end, z)
            self._ack_delays(acked, time.time())
            with contextlib.suppress(StoreError):
                await self.store.relay_release("up", device, acked)
        elif kind is Kind.WELCOME and self.site_frames and self._info.get(device):
            # A new session for the device at the hub starts from its hello: every heartbeat field
            # we know goes up once more, not only those that change from now on (a counter that
            # stays 0 would otherwise be missing there until the next full summary).
            self._info_dirty[device] = set(self._info[device])
            self._dirty.add(device)
            self._queue_up(None, b"", at_once=False)
        await self._to_device(device, frame)
        return True

    async def _site_bodies_for(self, device: str, frame: bytes) -> bool:
        """Before a tasks frame that names ``at_site`` bodies: hand the device each body from our
        store (content-addressed; the device checks the hash). False: one is missing here."""
        try:
            _kind, _ep, _mid, _ts, _exp, end, z = _parse_header(frame)
            body = frame[end + 32 :]
            data = msgpack.unpackb(_inflate(body) if z else body, raw=False, strict_map_key=True)
            fids = [str(f) for f in data.get("at_site") or []]
        except Exception:
            return True
        if not fids:
            return True
        have = await self.store.function_bodies(fids)
        for fid in fids:
            if fid not in have:
                log.error("function %s named for %s is not in this gateway's store", fid, device)
                return False
            if not await self._send_lan(device, SITE_BODY_MAGIC + fid.encode() + have[fid]):
                return False
            self.stats["bodies_to_devices"] += 1
        return True

    async def _to_device(self, device: str, frame: bytes) -> bool:
        if peek_kind(frame) is Kind.TASKS and not await self._site_bodies_for(device, frame):
            return False
        return await self._send_lan(device, frame)

    async def _send_lan(self, device: str, frame: bytes) -> bool:
        lan = self._lan
        if lan is None:
            return False
        try:
            await lan.send(device, frame)
            return True
        except LinkError:
            return False

    # ------------------------------------------------------------------ device -> hub
    async def _from_device(self, device: str, frame: bytes, _link: Any) -> None:
        if device not in self.devices:
            self.stats["dropped"] += 1
            return
        try:
            kind, ep, mid, _ts, exp, end, z = _parse_header(frame)
        except Exception:
            self.stats["dropped"] += 1
            return
        if ep != device or kind in (Kind.WELCOME, Kind.TASKS, Kind.RESULT_ACK, Kind.ERROR):
            self.stats["dropped"] += 1  # the site broker's ACL already stops this; defence in depth
            return
        if self.site_frames:
            folded, reconnected = await self._into_row(device, kind, frame, end, z)
            if folded:
                # a device back on a new connection without a hello may have missed what we handed
                # it while its link was dying: all of it again (it de-duplicates by task id)
                await self._hand_held(device, again=reconnected)
                return
        if kind is Kind.ACK:  # the device has these tasks: our copy of their frames may go
            with contextlib.suppress(StoreError):
                await self.store.relay_release("down", device, frame_task_ids(kind, frame, end, z))
        if kind in (Kind.ACK, Kind.RESULTS):
            try:
                await self.store.relay_put("up", device, kind.value, mid, frame, exp,
                                           frame_task_ids(kind, frame, end, z) if kind is Kind.RESULTS else ())
            except StoreError as exc:
                log.error("could not keep a %s frame of %s (the device sends it again): %s", kind.value, device, exc)
            self._up_wake.set()
        else:  # hello, fetch, heartbeat, gone: worth sending only now (they are re-sent or go stale)
            up = self._uplink
            if up is not None and self.site_frames:
                self._queue_up(device, frame, at_once=kind is Kind.HELLO)
            elif up is not None and len(self._in_flight) < MAX_IN_FLIGHT:
                # Not awaited here: a QoS 1 publish waits one uplink round trip for its PUBACK, and
                # a satellite or LTE uplink's round trip would otherwise pace every device's frames.
                t = asyncio.create_task(self._send_now(up, device, frame))
                self._in_flight.add(t)
                t.add_done_callback(self._in_flight.discard)
            elif up is not None:
                self.stats["dropped"] += 1  # the uplink is that far behind: a beat or hello is re-sent anyway
        await self._hand_held(device, again=kind is Kind.HELLO)

    async def _into_row(self, device: str, kind: Kind, frame: bytes, end: int, z: bool) -> tuple[bool, bool]:
        """Fold a device frame into its liveness row. First: True when the row replaces the frame on
        the uplink (a heartbeat; a gone of its current connection; a fetch while the hub serves the
        site's devices only through our hold, where it ignores their credit). A hello is noted
        (on the LAN, a new epoch) and still goes up: the device waits for its welcome. Second: True
        when the frame is a heartbeat naming a new connection, a device that resumed after a LAN
        reconnect without a hello: its row takes a new epoch, as for a hello."""
        if kind not in (Kind.HEARTBEAT, Kind.GONE, Kind.FETCH, Kind.HELLO):
            return False, False
        try:
            body = frame[end + 32 :]
            data = msgpack.unpackb(_inflate(body) if z else body, raw=False, strict_map_key=True)
            if not isinstance(data, dict):
                return False, False
        except Exception:
            return False, False  # unparsable: relayed as it is, the hub judges it
        row = self._rows.setdefault(device, [0] * len(ROW_FIELDS))
        before = list(row)
        reconnected = kind is Kind.HEARTBEAT and _new_conn(data.get("conn"), self._conns.get(device))
        if kind is Kind.HELLO or reconnected:
            # The will the site broker publishes for this connection names it: one naming an older
            # connection is stale (the device is back already). Only the device's own broker login
            # may publish on its up topic (the site broker's ACL), as for the hello.
            row[0], row[1] = 1, min(row[1] + 1, 2**31 - 1)
            if isinstance(data.get("conn"), str):
                self._conns[device] = data["conn"]
            if isinstance(data.get("capacity"), int):
                row[2] = _small(data["capacity"], row[2])
        if kind is Kind.GONE:
            if data.get("conn") != self._conns.get(device):
                return True, False  # the will of an older connection: the device is back already
            row[0] = 0
        elif kind is Kind.FETCH:
            if int(self.cfg.site.hold) <= 0:
                return False, False  # the hub leases to it directly on this credit: the fetch goes up
            row[0], row[-1] = 1, _small(data.get("want"), row[-1])
        elif kind is Kind.HELLO:
            pass  # noted above; the hello itself goes up
        else:
            row[0] = 1
            for i, name in enumerate(_COUNTERS, start=2):
                row[i] = _small(data.get(name), row[i])
            info = self._info.setdefault(device, {})
            for k, v in data.items():
                if k not in _COUNTERS and k not in ("e", "t", "conn") and isinstance(k, str) and info.get(k) != v:
                    info[k] = v
                    self._info_dirty.setdefault(device, set()).add(k)
        if row != before:
            self._dirty.add(device)
            if kind is not Kind.HELLO:
                self._queue_up(None, b"", at_once=False)
        # Resource figures and device counters alone (cpu, disk, bytes sent) are worth no site_up
        # of their own: they ride on the next one (a change above, a frame, the full summary).
        return kind is not Kind.HELLO, reconnected

    def _take_rows(self) -> tuple[dict[str, list[int]], dict[str, dict[str, Any]]]:
        """The rows (and changed heartbeat fields) to send now: all of them when a full summary is due."""
        if self._full_due:
            self._full_due, self._dirty, self._info_dirty = False, set(), {}
            self._last_full = time.monotonic()
            rows = {d: list(r) for d, r in self._rows.items() if d in self.devices}
            return rows, {d: dict(self._info[d]) for d in rows if self._info.get(d)}
        dirty, self._dirty = self._dirty | set(self._info_dirty), set()
        changed, self._info_dirty = self._info_dirty, {}
        rows = {d: list(self._rows[d]) for d in dirty if d in self._rows and d in self.devices}
        return rows, {d: {k: self._info[d][k] for k in keys} for d, keys in changed.items() if d in rows}

    def _full_every_s(self) -> float:
        beat = getattr(self.agent, "_beat_max", None) or getattr(self.agent, "_heartbeat_s", 0.0) or 0.0
        return max(_FULL_SUMMARY_MIN_S, float(beat))

    def _queue_up(self, device: str | None, frame: bytes, *, at_once: bool) -> None:
        """A device frame that is not kept goes in the next site_up: now for a hello (its device
        waits for the welcome) or a full batch, else within ``site.batch_s``."""
        full = self._out.add(device, frame) if device is not None else False
        if full or at_once or self.cfg.site.batch_s <= 0:
            self._flush_out()
        elif self._out_timer is None:
            self._out_timer = asyncio.get_running_loop().call_later(self.cfg.site.batch_s, self._flush_out)

    def _flush_out(self) -> None:
        if self._out_timer is not None:
            self._out_timer.cancel()
            self._out_timer = None
        frames = self._out.take()
        rows, info = self._take_rows()
        moved, self._stored_dirty = self._stored_dirty, False
        if not frames and not rows and not moved:
            return  # only a change of "stored up to" is worth a site_up of its own
        # "stored up to" rides on every site_up once there is one (about 15 bytes): the hub re-sends
        # a batch past it that it sent long enough before (cloud_hub/site_lease.py,
        # PendingBatches.not_stored), so a lost last batch waits for the next site_up of any kind,
        # not for the next full summary.
        stored = self._stored if self._stored[0] else None
        if self._uplink is None or len(self._in_flight) >= MAX_IN_FLIGHT:
            # The uplink is down or that far behind: beats and hellos are re-sent anyway, and the
            # rows go in full once a welcome comes.
            self.stats["dropped"] += len(frames)
            self._full_due = True
            self._stored_dirty = moved
            return
        t = asyncio.ensure_future(self._send_site_up(frames, rows=rows, info=info, stored=stored, quiet=True))
        self._in_flight.add(t)
        t.add_done_callback(self._in_flight.discard)

    async def _send_site_up(self, frames: list[tuple[str, bytes]], *, rows: dict[str, list[int]] | None = None,
                            info: dict[str, dict[str, Any]] | None = None, stored: tuple[str, int] | None = None,
                            quiet: bool = False) -> None:
        """One site_up signed with our key, compressed; raises LinkError unless ``quiet``."""
        try:
            body = site_body(frames, rows=rows, info=info, stored=stored, binary_ids=self.site_bin)
            await self.agent._send(Kind.SITE_UP, body, compress=True)
        except LinkError:
            if rows:
                self._full_due = True  # the hub may not have them: all of them next time
            if stored is not None:
                self._stored_dirty = True
            if not quiet:
                raise
            self.stats["dropped"] += len(frames)
            return
        self.stats["site_up"] += 1
        self.stats["rows_up"] = self.stats.get("rows_up", 0) + len(rows or ())
        for _dev, f in frames:
            self._count_up(f)

    async def _send_now(self, up: "_Uplink", device: str, frame: bytes) -> None:
        with contextlib.suppress(LinkError):
            await up.send_for(device, frame)
            self._count_up(frame)

    async def _confirm_held(self) -> None:
        """Our own signed ``ack`` of the device tasks we hold, committed: the hub then keeps their
        lease for ``site_hold_s`` instead of ``lease_s``. Until it hears this (a frame lost before
        our commit, the uplink down), it re-sends them after ``lease_s``; devices de-duplicate."""
        # All of them after a reconnect (a confirmation may have been lost with the session), else only
        # what arrived since the last one: re-sending every held id per new frame would fill a slow uplink.
        full, self._confirm = self._confirm, False
        new, self._to_confirm = self._to_confirm, set()
        ids = await _held_ids(self.store) if full else sorted(new)
        try:
            for i in range(0, len(ids), 2000):
                await self.agent._send(Kind.ACK, {"ids": ids[i : i + 2000]})
        except BaseException:
            self._confirm = True  # not all went: all again once the uplink is back
            raise

    def _count_up(self, frame: bytes) -> None:
        self.stats["up_frames"] += 1
        self.stats["up_bytes"] += len(frame)

    async def _hand_held(self, device: str, again: bool) -> None:
        """The device asked (any frame from it): hand it the tasks held for it that it has not acked,
        unless handed within REDELIVER_S (a hello: all of them, it may have restarted)."""
        now = time.time()
        try:
            held = await self.store.relay_pending("down", endpoint=device, sent_before=now + 1 if again else now - REDELIVER_S)
        except StoreError:
            return
        done = [seq for seq, _ep, _k, frame in held if await self._to_device(device, frame)]
        self.stats["redelivered"] += len(done)
        with contextlib.suppress(StoreError):
            await self.store.relay_sent(done, now)

    async def _pump_up(self, stop: asyncio.Event) -> None:
        """Send held acks and results up whenever the uplink is there: acks are forgotten once the
        hub's broker took them, results only when the hub's result_ack comes down."""
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up_wake.wait(), RESEND_UP_S / 2)
            self._up_wake.clear()
            up = self._uplink
            if up is None:
                continue
            if self.site_frames and time.monotonic() - self._last_full >= self._full_every_s():
                self._full_due = True
                self._flush_out()
            try:
                await self.store.relay_expire(time.time())
                if self._confirm or self._to_confirm:
                    await self._confirm_held()
                now = time.time()
                resent = False
                for _ in range(100):  # bounded per pass
                    rows = await self.store.relay_pending("up", sent_before=now - self.ack_timeout.timeout, limit=200)
                    if not rows:
                        break
                    acks, results = [], []
                    # All of them in flight at once: each QoS 1 publish waits one uplink round trip for
                    # its PUBACK, so one after the other would pace the site at one frame per round trip.
                    if self.site_frames:
                        await asyncio.gather(*(self._send_site_up(chunk) for chunk in _chunks(rows)))
                    else:
                        await asyncio.gather(*(up.send_for(ep, frame) for _seq, ep, _kind, frame in rows))
                        for _seq, _ep, _kind, frame in rows:
                            self._count_up(frame)
                    for seq, ep, kind, frame in rows:
                        if kind == Kind.ACK.value:
                            acks.append(seq)
                        else:
                            results.append(seq)
                            resent |= self._note_sent(frame, now)
                    await self.store.relay_sent(acks, now, drop=True)
                    await self.store.relay_sent(results, now)
                if resent:
                    self.ack_timeout.backoff()
            except (LinkError, StoreError) as exc:
                log.warning("forwarding up paused: %s", exc)


    def _note_sent(self, frame: bytes, now: float) -> bool:
        """Remember when a results frame went up; True when it had gone up before (a re-send)."""
        try:
            kind, _ep, _mid, _ts, _exp, end, z = _parse_header(frame)
            ids = frame_task_ids(kind, frame, end, z)
        except Exception:  # our own stored frame: cannot happen, and timing is not worth failing over
            return False
        again = any(t in self._results_sent for t in ids)
        for t in ids:
            first = self._results_sent.pop(t, (now, False))[0]
            self._results_sent[t] = (first, again)
        while len(self._results_sent) > 50_000:
            self._results_sent.pop(next(iter(self._results_sent)))
        if again:
            self.stats["results_resent"] += 1
        return again

    def _ack_delays(self, ids: list[str], now: float) -> None:
        """The hub acked these results: learn the uplink's ack delay from frames sent only once."""
        delays = []
        for t in ids:
            sent = self._results_sent.pop(t, None)
            if sent is not None and not sent[1]:
                delays.append(now - sent[0])
        if delays:
            self.ack_timeout.sample(max(delays))


def _new_conn(conn: Any, known: str | None) -> bool:
    """Whether a heartbeat's ``conn`` names a connection other than the one we last saw the device
    on: a device that resumed on a new LAN connection without a hello (docs/sites.md)."""
    return isinstance(conn, str) and 0 < len(conn) <= 64 and conn != known


def _small(v: Any, old: int) -> int:
    """A row value from an unverified body: an int in [0, 2**31), else the old value."""
    return v if type(v) is int and 0 <= v < 2**31 else old


def _chunks(rows: list[tuple[int, str, str, bytes]]) -> list[list[tuple[str, bytes]]]:
    """Held rows as site_up contents of at most _SITE_UP_CHUNK bytes each (at least one frame each)."""
    out: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for _seq, ep, _kind, frame in rows:
        if out[-1] and size + len(frame) > _SITE_UP_CHUNK:
            out.append([])
            size = 0
        out[-1].append((ep, frame))
        size += len(frame)
    return [c for c in out if c]


async def _held_ids(store: AgentStore, limit: int = 50_000) -> list[str]:
    cur = await store.db.execute(
        "SELECT DISTINCT i.task_id FROM relay_ids i JOIN relay r ON r.seq = i.seq WHERE r.dir='down' LIMIT ?", (limit,))
    return [r[0] for r in await cur.fetchall()]


def run_gateway(cfg: Any, creds: Any) -> None:
    """Run the gateway in the foreground until SIGTERM or SIGINT."""
    gw = Gateway(cfg, creds)

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await gw.run(stop)

    asyncio.run(go())
