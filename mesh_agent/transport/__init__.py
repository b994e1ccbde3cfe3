"""Links between agent and hub: one small interface, two implementations (MQTT, ZeroMQ).

A link only moves opaque, already-signed frames. It knows nothing of tasks, keys or queues, so
the dispatcher and the agent runtime do not care which transport an endpoint uses, and durability
never depends on a broker's queue (the hub and the agent keep their own).
"""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, Protocol

__all__ = ["LinkError", "AgentLink", "HubLink", "FrameHandler"]


class LinkError(ConnectionError):
    """The link is down or refused; the caller reconnects (agent) or keeps the task leased (hub)."""


class AgentLink(Protocol):
    """The agent's side: one connection to the hub, used as ``async with link: ...``."""

    async def __aenter__(self) -> "AgentLink": ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def send(self, frame: bytes) -> None: ...
    def frames(self) -> AsyncIterator[bytes]:
        """Frames from the hub, in order; raises LinkError when the connection drops."""
        ...


#: Called by a hub link for every frame: (endpoint id claimed by the transport, frame, the link).
FrameHandler = Callable[[str, bytes, "HubLink"], Awaitable[None]]


class HubLink(Protocol):
    """The hub's side: many endpoints over one broker connection or one bound socket."""

    name: str

    async def start(self, on_frame: FrameHandler) -> None: ...
    async def send(self, endpoint_id: str, frame: bytes) -> None: ...
    async def stop(self) -> None: ...
