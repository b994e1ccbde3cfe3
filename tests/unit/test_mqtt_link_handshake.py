"""Regression (found by ``mesh-sim run``): an MQTT link whose TCP connection is reset during the
handshake must fail at once, not after aiomqtt's whole 10 s timeout; otherwise every reconnect
into a link that just came back, or to a broker that is restarting, idles that long."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from mesh_agent.transport import LinkError
from mesh_agent.transport.mqtt import MqttAgentLink


async def test_connect_fails_at_once_when_reset_before_connack() -> None:
    async def reset_after_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the client's CONNECT arrives; the path dies before any CONNACK
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(reset_after_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        link = MqttAgentLink("ep-0123456789ab", "127.0.0.1", port)
        with pytest.raises(LinkError, match="before the broker's CONNACK"):
            await asyncio.wait_for(link.__aenter__(), 30)
    finally:
        server.close()
        await server.wait_closed()
