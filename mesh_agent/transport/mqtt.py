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
from typing import Any, AsyncIterator

import aiomqtt

from mesh_agent.transport import FrameHandler, LinkError

__all__ = ["MqttAgentLink", "MqttHubLink", "down_topic", "up_topic"]

log = logging.getLogger(__name__)
_NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def down_topic(prefix: str, endpoint_id: str) -> str:
    return f"{prefix}/ep/{endpoint_id}/down"


def up_topic(prefix: str, endpoint_id: str) -> str:
    return f"{prefix}/ep/{endpoint_id}/up"


class _Client(aiomqtt.Client):
    """aiomqtt, except that a connection lost during the handshake fails the connect at once.

    aiomqtt ignores a disconnect that comes before CONNACK and waits out its whole timeout
    (10 s), so an agent whose link came back after an outage, or whose broker was restarting,
    sat idle that long per attempt (found by ``mesh-sim run``: p99 delay after reconnect)."""

    def _on_disconnect(self, *args: Any, **kwargs: Any) -> None:
        pending = getattr(self, "_connected", None)
        if isinstance(pending, asyncio.Future) and not pending.done():
            pending.set_exception(aiomqtt.MqttError("connection lost before the broker's CONNACK"))
            return
        super()._on_disconnect(*args, **kwargs)


def _client(host: str, port: int, identifier: str, username: str | None, password: str | None, keepalive: int) -> aiomqtt.Client:
    return _Client(
        hostname=host,
        port=port,
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
    ) -> None:
        self._down = down_topic(prefix, endpoint_id)
        self._up = up_topic(prefix, endpoint_id)
        self._args = (host, port, f"agent-{endpoint_id}", username, password, keepalive)
        self._client: aiomqtt.Client

    async def __aenter__(self) -> "MqttAgentLink":
        self._client = _client(*self._args)  # aiomqtt binds to the running loop at construction
        try:
            await self._client.__aenter__()
            await self._client.subscribe(self._down, qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT connect failed: {exc}") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self._client.__aexit__(None, None, None)

    async def send(self, frame: bytes) -> None:
        try:
            await self._client.publish(self._up, frame, qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT publish failed: {exc}") from None

    async def frames(self) -> AsyncIterator[bytes]:
        try:
            async for msg in self._client.messages:
                if isinstance(msg.payload, (bytes, bytearray)):
                    yield bytes(msg.payload)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT connection lost: {exc}") from None
        raise LinkError("MQTT message stream ended")


class MqttHubLink:
    """One persistent broker connection for all MQTT endpoints; reconnects by itself (broker restarts)."""

    name = "mqtt"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str | None = None,
        password: str | None = None,
        prefix: str = "mesh",
        identifier: str = "mesh-hub",
    ) -> None:
        self._args = (host, port, identifier, username, password, 30)
        self._prefix = prefix
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_frame: FrameHandler) -> None:
        self._task = asyncio.create_task(self._run(on_frame), name="mqtt-hub-link")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._connected.wait(), 10)

    async def _run(self, on_frame: FrameHandler) -> None:
        delay = 0.2
        sub = f"{self._prefix}/ep/+/up"
        while True:
            client = _client(*self._args)
            try:
                async with client:
                    await client.subscribe(sub, qos=1)
                    self._client = client
                    self._connected.set()
                    delay = 0.2
                    log.info("hub MQTT link up")
                    async for msg in client.messages:
                        parts = str(msg.topic).split("/")
                        if len(parts) != 4 or not isinstance(msg.payload, (bytes, bytearray)):
                            continue
                        try:
                            await on_frame(parts[2], bytes(msg.payload), self)
                        except Exception:  # one bad frame must never stop the link
                            log.exception("frame handler failed")
            except aiomqtt.MqttError as exc:
                log.warning("hub MQTT link down (%s); retrying in %.1fs", exc, delay)
            finally:
                self._client = None
                self._connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        client = self._client
        if client is None:
            raise LinkError("MQTT broker not connected")
        try:
            await client.publish(down_topic(self._prefix, endpoint_id), frame, qos=1)
        except aiomqtt.MqttError as exc:
            raise LinkError(f"MQTT publish failed: {exc}") from None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
