"""ZeroMQ links for LAN/HPC endpoints: hub ROUTER bound, agents DEALER with routing id = endpoint id.

No broker in between, so high throughput; ROUTER drops what it cannot deliver, which is why
the hub sends only against the agent's credit and re-sends after a lease expires. ZMTP
heartbeats (``HEARTBEAT_IVL``) notice a dead peer without waiting for TCP timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import zmq
import zmq.asyncio

from mesh_agent.transport import FrameHandler, LinkError

__all__ = ["ZmqAgentLink", "ZmqHubLink"]

log = logging.getLogger(__name__)


def _common(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


class ZmqAgentLink:
    def __init__(self, endpoint_id: str, address: str) -> None:
        self._id = endpoint_id.encode()
        self._address = address
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None

    async def __aenter__(self) -> "ZmqAgentLink":
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._id)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        _common(sock)
        try:
            sock.connect(self._address)
        except zmq.ZMQError as exc:
            sock.close()
            raise LinkError(f"ZeroMQ connect to {self._address} failed: {exc}") from None
        self._sock = sock
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def send(self, frame: bytes) -> None:
        if self._sock is None:
            raise LinkError("ZeroMQ link closed")
        try:
            await self._sock.send(frame, copy=False)
        except zmq.ZMQError as exc:
            raise LinkError(f"ZeroMQ send failed: {exc}") from None

    async def frames(self) -> AsyncIterator[bytes]:
        while self._sock is not None:
            try:
                yield await self._sock.recv(copy=True)
            except zmq.ZMQError as exc:
                raise LinkError(f"ZeroMQ receive failed: {exc}") from None
        raise LinkError("ZeroMQ link closed")


class ZmqHubLink:
    name = "zmq"

    def __init__(self, bind: str) -> None:
        self.bind = bind
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_frame: FrameHandler) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable agent is an error, not a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting agent takes over its identity
        _common(sock)
        # libzmq releases a closed socket's port on its I/O thread, a moment later: a hub that
        # restarts in-process can find its own old address still taken. Retry briefly.
        for attempt in range(50):
            try:
                sock.bind(self.bind)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or attempt == 49:
                    sock.close(linger=0)
                    raise
                await asyncio.sleep(0.1)
        self.bind = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = sock
        self._task = asyncio.create_task(self._run(on_frame), name="zmq-hub-link")

    async def _run(self, on_frame: FrameHandler) -> None:
        assert self._sock is not None
        while True:
            try:
                parts = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                log.warning("ZeroMQ receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(parts) != 2:
                continue
            try:
                await on_frame(parts[0].decode("ascii", "replace"), parts[1], self)
            except Exception:
                log.exception("frame handler failed")

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        if self._sock is None:
            raise LinkError("ZeroMQ hub link not started")
        try:
            await self._sock.send_multipart([endpoint_id.encode(), frame], copy=False)
        except zmq.ZMQError as exc:
            raise LinkError(f"ZeroMQ send to {endpoint_id} failed: {exc}") from None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.unbind(self.bind)
            self._sock.close(linger=0)
            self._sock = None
