"""MQTT links over a real broker (Mosquitto): QoS 1, persistent sessions, one topic pair per endpoint.

Topics: ``{prefix}/ep/{endpoint}/down`` (hub to agent) and ``{prefix}/ep/{endpoint}/up`` (agent to
hub). TCP_NODELAY is set on our sockets: without it every QoS 1 hop waits 40-90 ms on Nagle and
delayed ACKs (the broker needs ``set_tcp_nodelay true`` too; see cloud_hub.broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any, AsyncIterator

import aiomqtt

from mesh_agent.backoff import Backoff
from mesh_agent.transport import FrameHandler, LinkError
from mesh_agent.transport.brokers import BrokerList

__all__ = ["MqttAgentLink", "MqttHubLink", "down_topic", "up_topic"]

log = logging.getLogger(__name__)
_NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
#: The hub's MQTT link reconnecting to its broker (mesh_agent/backoff.py): 0.2 s doubling to 5 s, no
#: jitter (one hub, not a fleet), back to 0.2 s after a good connection; it reconnects until stop().
_LINK_RETRY = Backoff(base=0.2, cap=5.0, jitter=(1.0, 1.0))


def down_topic(prefix: str, endpoint_id: str) -> str:
    return f"{prefix}/ep/{endpoint_id}/down"


def up_topic(prefix: str, endpoint_id: str) -> str:
    return f"{prefix}/ep/{endpoint_id}/up"


class _Client(aiomqtt.Client):
    """aiomqtt, except that a connection lost during the handshake fails the connect at once.

    aiomqtt ignores a disconnect that comes before CONNACK and waits out its whole timeout
    (10 s), so an agent whose link came back after an outage, or whose broker was restarting,
    sat idle that long per attempt (found by ``mesh-sim run``: p99 delay after reconnect)."""

    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        # aiomqtt applies socket_options only to a plain socket, so under WebSockets (wss) Nagle
        # stayed on and every QoS 1 hop waited ~40 ms (bench/tls.py found it): set it on the
        # socket inside paho's WebSocket wrapper, before CONNECT goes out.
        raw = getattr(sock, "_socket", sock)
        if isinstance(raw, socket.socket):
            with contextlib.suppress(OSError):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super()._on_socket_open(client, userdata, sock)

    def _on_disconnect(self, *args: Any, **kwargs: Any) -> None:
        pending = getattr(self, "_connected", None)
        if isinstance(pending, asyncio.Future) and not pending.done():
            pending.set_exception(aiomqtt.MqttError("connection lost before the broker's CONNACK"))
            return
        super()._on_disconnect(*args, **kwargs)


def _client(host: str, port: int, identifier: str, username: str | None, password: str | None, keepalive: int, *,
            tls_context: ssl.SSLContext | None = None, transport: str = "tcp", websocket_path: str | None = None,
            will: aiomqtt.Will | None = None) -> aiomqtt.Client:
    """``tls_context``: MQTT over TLS (mesh_agent.tls.client_context); ``transport="websockets"``: over (secure) WebSockets.
    ``will``: what the broker publishes for us when our keepalive lapses or the connection breaks."""
    return _Client(
        will=will,
        hostname=host,
        port=port,
        tls_context=tls_context,
        transport=transport,  # type: ignore[arg-type]
        websocket_path=websocket_path if transport == "websockets" else None,
        identifier=identifier,
        username=username,
        password=password,
        keepalive=keepalive,
        clean_session=False,  # the broker keeps our subscription and QoS 1 messages across short drops
        socket_options=_NODELAY,
        timeout=10,
        max_queued_outgoing_messages=100_000,
        max_inflight_messages=1000,  # paho's default of 20 throttles QoS 1 to a trickle
    )


class MqttAgentLink:
    def __init__(
        self,
        endpoint_id: str,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        keepalive: int = 30,
        prefix: str = "mesh",
        tls_context: ssl.SSLContext | None = None,
        transport: str = "tcp",
        websocket_path: str | None = None,
        brokers: BrokerList | None = None,
    ) -> None:
        """``brokers``: the nodes of a clustered broker; this connection goes to ``brokers.current``
        (not ``host``/``port``), and a refused or lost connection moves the list on, so the agent's
        next connection (after its backoff) tries the next node. TLS settings apply to each."""
        self._brokers = brokers
        if brokers is not None:
            host, port = brokers.current
        self._down = down_topic(prefix, endpoint_id)
        self._up = up_topic(prefix, endpoint_id)
        self._args = (host, port, f"agent-{endpoint_id}", username, password, keepalive)
        self._tls = {"tls_context": tls_context, "transport": transport, "websocket_path": websocket_path}
        self._will: aiomqtt.Will | None = None
        self._client: aiomqtt.Client

    def configure(self, *, will: bytes | None = None, keepalive: int | None = None) -> None:
        """Before connecting: the frame the broker publishes on our up topic if this connection dies
        without a DISCONNECT (keepalive lapsed, link black-holed, process killed), and the keepalive
        that bounds how long that takes (the broker waits 1.5 x keepalive)."""
        self._will = None if will is None else aiomqtt.Will(self._up, will, qos=1, retain=False)
        if keepalive is not None:
            self._args = (*self._args[:5], int(keepalive))

    async def __aenter__(self) -> "MqttAgentLink":
        self._client = _client(*self._args, **self._tls, will=self._will)  # type: ignore[arg-type]  # aiomqtt binds to the running loop at construction
        try:
            await self._client.__aenter__()
            await self._client.subscribe(self._down, qos=1)
        except aiomqtt.MqttError as exc:
            self._lost()
            raise LinkError(f"MQTT connect failed: {await asyncio.to_thread(self._why, exc)}") from None
        return self

    @property
    def address(self) -> str:
        """host:port of the broker this link uses (one node of a cluster): for log lines."""
        return f"{self._args[0]}:{self._args[1]}"

    def _lost(self) -> None:
        """This connection failed: with a broker list, the next connection goes to the next node."""
        if self._brokers is not None:
            self._brokers.failed((self._args[0], self._args[1]))

    def _why(self, exc: BaseException) -> str:
        """One line naming the problem: a TLS failure by name, or a plaintext client on a TLS port."""
        from mesh_agent.tls import describe_tls_error, probe_tls

        where = f"{self._args[0]}:{self._args[1]}"
        line = describe_tls_error(exc, where)
        if line:
            return line
        if self._tls["tls_context"] is None and "CONNACK" in str(exc) and probe_tls(self._args[0], self._args[1]):
            return f"{where} is a TLS port but this agent speaks plaintext MQTT: configure mqtt.tls"
        if self._tls["tls_context"] is not None and ("reset by peer" in str(exc) or "EOF" in str(exc)) and not probe_tls(self._args[0], self._args[1]):
            # Mosquitto's plain listener drops a TLS ClientHello without a word.
            return f"TLS: the server does not speak TLS: is this a plaintext port? ({where})"
        return f"{exc} ({where})"

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self._client.__aexit__(None, None, None)

    async def send(self, frame: bytes) -> None:
        try:
            await self._client.publish(self._up, frame, qos=1)
        except aiomqtt.MqttError as exc:
            self._lost()
            raise LinkError(f"MQTT publish failed: {exc}") from None

    async def frames(self) -> AsyncIterator[bytes]:
        try:
            async for msg in self._client.messages:
                if isinstance(msg.payload, (bytes, bytearray)):
                    yield bytes(msg.payload)
        except aiomqtt.MqttError as exc:
            self._lost()
            raise LinkError(f"MQTT connection lost: {exc}") from None
        raise LinkError("MQTT message stream ended")


class MqttHubLink:
    """One persistent broker connection for all MQTT endpoints; reconnects by itself (broker restarts)."""

    name = "mqtt"
    shared = True  # every hub replica on the broker reaches every endpoint through it

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        prefix: str = "mesh",
        identifier: str = "mesh-hub",
        tls_context: ssl.SSLContext | None = None,
        brokers: BrokerList | None = None,
        first_attempt_wait_s: float = 10.0,
    ) -> None:
        """``brokers``: the nodes of a clustered broker, tried in order from the first; a lost or
        refused connection moves to the next one (``host``/``port`` are then not used).
        ``first_attempt_wait_s``: how long ``start`` waits for the first connect attempt to end
        (0: not at all; the hub's own link, whose REST API must not wait on the broker)."""
        self._brokers = brokers or BrokerList([(host, port)])
        self._first_wait = first_attempt_wait_s
        host, port = self._brokers.current
        self._args = (host, port, identifier, username, password, 30)
        self._tls_context = tls_context  # a broker on another machine: MQTT over TLS
        self._prefix = prefix
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._attempted = asyncio.Event()  # the first connect attempt ended, either way
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        #: why the link is down (None while connected): for /readyz
        self.last_error: str | None = f"broker {self.address}: not connected yet (first connect attempt under way)"

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def attempted(self) -> bool:
        """The first connect attempt ended, either way."""
        return self._attempted.is_set()

    @property
    def address(self) -> str:
        return f"mqtt://{self._args[0]}:{self._args[1]}"

    async def start(self, on_frame: FrameHandler) -> None:
        """Start connecting; wait for the first attempt only (at most ``first_attempt_wait_s``), not
        for success; the link keeps retrying in the background.

        The hub passes 0: its REST API must come up at once even when the broker silently drops
        packets (a first attempt then lasts the whole 10 s connect timeout), and /readyz says why
        it is not ready. An agent whose first hello came before the hub's link subscribed is told
        to say hello again at its next heartbeat."""
        self._task = asyncio.create_task(self._run(on_frame), name="mqtt-hub-link")
        if self._first_wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._attempted.wait(), self._first_wait)

    async def _run(self, on_frame: FrameHandler) -> None:
        failed = 0  # tries since the last good connection; no bound on them: the link lives until stop()
        sub = f"{self._prefix}/ep/+/up"
        while not self._stopping:
            delay = _LINK_RETRY.delay(failed)
            self._args = (*self._brokers.current, *self._args[2:])
            client = _client(*self._args, tls_context=self._tls_context)
            try:
                async with client:
                    await client.subscribe(sub, qos=1)
                    self._client = client
                    self._connected.set()
                    self._attempted.set()
                    self.last_error = None
                    failed, delay = 0, _LINK_RETRY.delay(0)
                    log.info("hub MQTT link up: %s as %s", self.address, self._args[3] or "anonymous")
                    async for msg in client.messages:
                        parts = str(msg.topic).split("/")
                        if len(parts) != 4 or not isinstance(msg.payload, (bytes, bytearray)):
                            continue
                        try:
                            await on_frame(parts[2], bytes(msg.payload), self)
                        except Exception:  # one bad frame must never stop the link
                            log.exception("frame handler failed")
            except aiomqtt.MqttError as exc:
                if self._stopping:
                    # stop() cancelled us inside `async with client`, and aiomqtt's exit turned the
                    # cancellation into an MqttError (its DISCONNECT failed): without this check the
                    # loop reconnected and the hub's shutdown waited on it forever.
                    return
                self._brokers.failed((self._args[0], self._args[1]))
                self.last_error = f"broker {self.address}: {exc}"
                log.warning("hub MQTT link down (%s: %s); retrying in %.1fs", self.address, exc, delay)
            finally:
                self._client = None
                self._connected.clear()
                self._attempted.set()
            await asyncio.sleep(delay)
            failed += 1

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        client = self._client
        if client is None:
            raise LinkError("MQTT broker not connected")
        try:
            await client.publish(down_topic(self._prefix, endpoint_id), frame, qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT publish failed: {exc}") from None

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                # bounded: a link that still will not end must not hold the hub's shutdown hostage
                await asyncio.wait_for(asyncio.shield(self._task), 15)
