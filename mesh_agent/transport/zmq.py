"""ZeroMQ links for LAN/HPC endpoints: hub ROUTER bound, agents DEALER, every connection CURVE.

No broker in between, so high throughput; ROUTER drops what it cannot deliver, which is why
the hub sends only against the agent's credit and re-sends after a lease expires. ZMTP
heartbeats (``HEARTBEAT_IVL``) notice a dead peer without waiting for TCP timeouts.

Security (docs/security.md): the hub's ROUTER is a CURVE server with the hub's keypair; each
agent is a CURVE client with its own keypair and the hub's public key (from enrollment), so the
link is encrypted and the hub knows the agent's public key. A ZAP handler admits only public keys
of enrolled endpoints and names the connection after its endpoint (ZAP User-Id). Agents do not set
a routing id: the hub routes to the connection whose *authenticated* endpoint last spoke, so a
device cannot claim another device's identity (as it could with client-chosen routing ids and
``ROUTER_HANDOVER``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, cast

import zmq
import zmq.asyncio
import zmq.utils.z85

from mesh_agent.backoff import Backoff, aretry
from mesh_agent.transport import FrameHandler, LinkError

__all__ = ["ZmqAgentLink", "ZmqHubLink", "curve_keypair"]

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"continuum-mesh"
#: Binding the hub's ROUTER while libzmq still holds the port of a socket closed a moment ago (a hub
#: restarted in-process): every 0.1 s, 50 tries (5 s), then the EADDRINUSE is raised.
_BIND_RETRY = Backoff(base=0.1, cap=0.1, factor=1.0, jitter=(1.0, 1.0), max_tries=50)


def curve_keypair() -> tuple[str, str]:
    """A new CURVE keypair as z85 text: (public, secret)."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")

log = logging.getLogger(__name__)


def _common(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


class ZmqAgentLink:
    def __init__(self, endpoint_id: str, address: str, *, server_key: str, public_key: str, secret_key: str) -> None:
        """``server_key``: the hub's CURVE public key; ``public_key``/``secret_key``: this agent's (z85)."""
        self._endpoint_id = endpoint_id
        self._address = address
        self._curve = (server_key.encode("ascii"), public_key.encode("ascii"), secret_key.encode("ascii"))
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None

    async def __aenter__(self) -> "ZmqAgentLink":
        sock = self._ctx.socket(zmq.DEALER)
        server, public, secret = self._curve
        try:
            sock.curve_serverkey = server
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        except (zmq.ZMQError, ValueError) as exc:
            sock.close(linger=0)
            raise LinkError(f"ZeroMQ CURVE keys unusable: {exc}") from None
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
    shared = False  # an agent dials one replica's socket: no other replica can reach it

    def __init__(self, bind: str, *, secret_key: str, clients: dict[str, str] | None = None) -> None:
        """``secret_key``: the hub's CURVE secret (z85); ``clients``: enrolled public key (z85) -> endpoint id."""
        self.bind = bind
        self._secret = secret_key.encode("ascii")
        self.public_key = zmq.curve_public(self._secret).decode("ascii")
        self._clients: dict[bytes, str] = {k.encode("ascii"): ep for k, ep in (clients or {}).items()}
        # A context of our own: the ZAP handler is per context, and must not judge other sockets.
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._routes: dict[str, bytes] = {}  # endpoint id -> routing id of its latest authenticated connection
        self.stats = {"refused_connections": 0}

    def allow_client(self, public_key: str, endpoint_id: str) -> None:
        """Admit a newly enrolled endpoint's CURVE key (takes effect on its next handshake)."""
        self._clients[public_key.encode("ascii")] = endpoint_id

    def revoke_client(self, endpoint_id: str) -> None:
        for k in [k for k, ep in self._clients.items() if ep == endpoint_id]:
            del self._clients[k]
        self._routes.pop(endpoint_id, None)

    async def _serve_zap(self) -> None:
        """ZAP (RFC 27): admit enrolled CURVE keys only; the User-Id is the endpoint id."""
        assert self._zap is not None
        while True:
            try:
                msg = await self._zap.recv_multipart()
            except zmq.ZMQError:
                return
            if len(msg) < 6:  # libzmq always sends at least these six frames; never trust it blindly
                continue
            version, request_id, _domain, address, _identity, mechanism = msg[:6]
            key = zmq.utils.z85.encode(msg[6]) if mechanism == b"CURVE" and len(msg) > 6 and len(msg[6]) == 32 else b""
            endpoint = self._clients.get(key)
            if endpoint is None:
                self.stats["refused_connections"] += 1
                log.warning("refused ZeroMQ connection from %s: unknown CURVE key %s", address.decode(errors="replace"), key.decode() or "(none)")
                reply = [version, request_id, b"400", b"unknown CURVE key", b"", b""]
            else:
                reply = [version, request_id, b"200", b"OK", endpoint.encode("ascii"), b""]
            await self._zap.send_multipart(reply)

    async def start(self, on_frame: FrameHandler) -> None:
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)
        self._tasks.append(asyncio.create_task(self._serve_zap(), name="zmq-zap"))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable agent is an error, not a silent drop
        sock.curve_server = True
        sock.curve_secretkey = self._secret
        sock.zap_domain = _ZAP_DOMAIN
        _common(sock)

        async def bind() -> None:
            sock.bind(self.bind)

        # libzmq releases a closed socket's port on its I/O thread, a moment later: a hub that
        # restarts in-process can find its own old address still taken. Retry briefly.
        try:
            await aretry(bind, retry_on=lambda e: isinstance(e, zmq.ZMQError) and e.errno == zmq.EADDRINUSE, policy=_BIND_RETRY)
        except BaseException:
            sock.close(linger=0)
            raise
        self.bind = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._tasks.append(asyncio.create_task(self._run(on_frame), name="zmq-hub-link"))

    async def _run(self, on_frame: FrameHandler) -> None:
        assert self._sock is not None
        while True:
            try:
                parts = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                log.warning("ZeroMQ receive failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(parts) != 2:
                continue
            try:
                endpoint = cast(str, parts[1].get("User-Id"))  # set by our ZAP handler from the CURVE key
            except zmq.ZMQError:
                continue
            if not endpoint:
                continue
            self._routes[endpoint] = parts[0].bytes
            try:
                await on_frame(endpoint, parts[1].bytes, self)
            except Exception:
                log.exception("frame handler failed")

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        if self._sock is None:
            raise LinkError("ZeroMQ hub link not started")
        route = self._routes.get(endpoint_id)
        if route is None:
            raise LinkError(f"ZeroMQ: no connection from {endpoint_id}")
        try:
            await self._sock.send_multipart([route, frame], copy=False)
        except zmq.ZMQError as exc:
            raise LinkError(f"ZeroMQ send to {endpoint_id} failed: {exc}") from None

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.unbind(self.bind)
            self._sock.close(linger=0)
            self._sock = None
        if self._zap is not None:
            self._zap.close(linger=0)
            self._zap = None
        self._ctx.term()
