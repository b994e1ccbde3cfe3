"""A fault-injecting TCP proxy (asyncio): one per agent, between the agent and its broker port
(MQTT) or the hub's ZeroMQ port, so the agent's real link can be cut, slowed and throttled
while the agent, the broker and the hub run unmodified.

Link states:

* ``up``: bytes flow, each chunk delayed by ``latency ± jitter`` and paced to ``bandwidth``
  (shared by all connections of the link, per direction, like one radio).
* ``reset``: every open connection is reset (RST on both sides) and every new one is reset as
  soon as it is accepted: what a device sees when its router reboots or the carrier drops it.
* ``blackhole``: connections are accepted but nothing passes, in either direction, until the
  link comes back; then what was held is delivered, as TCP retransmission would. No side is
  told anything: only keepalives (MQTT PINGREQ, ZMTP heartbeats) and timeouts find out. This is
  the nasty case of a rural link that is "up" at the radio and passes no packets.

Packets are counted by the kernel: at the end of each connection (and on :meth:`FaultProxy.segments`)
the device-side socket's ``TCP_INFO`` gives the TCP segments it received and sent, pure ACKs
included, so a report can add real TCP/IP header bytes to the bytes the link carried (with TLS on,
those bytes already hold every TLS record and handshake). Loopback segments are up to 64 KiB, a
radio's about 1,448 bytes of payload: ``split_*`` counts the extra segments such an MSS needs.

A link can be cut by several causes at once (its own Markov process, its region's mast, a
scheduled night): it is down while any cause is; ``reset`` wins over ``blackhole``. Every state
change is logged with its wall-clock time, which is what the report's timeline draws.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FaultProxy", "LinkShape", "CutMode", "tcp_segments", "WIRE_MSS", "TCPIP_HEADER_B"]

log = logging.getLogger("sim.proxy")

CutMode = Literal["reset", "blackhole"]
#: TCP payload per segment on a 1,500-byte MTU link with TCP timestamps (a radio, not loopback)
WIRE_MSS = 1448
#: IPv4 (20) + TCP with the timestamp option (32): what each segment adds on the wire
TCPIP_HEADER_B = 52


def tcp_segments(sock: socket.socket | None) -> tuple[int, int]:
    """(segments in, segments out) of a TCP socket, from the kernel's TCP_INFO (Linux >= 4.2;
    (0, 0) where it cannot be read)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return 0, 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return 0, 0
    if len(info) < 144:
        return 0, 0
    segs_out, segs_in = struct.unpack_from("<II", info, 136)  # tcpi_segs_out, tcpi_segs_in
    return int(segs_in), int(segs_out)
_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 32  # per direction and connection: beyond this the reader stops (backpressure)


@dataclass(frozen=True)
class LinkShape:
    """How an up link behaves: one-way latency and jitter (seconds), bandwidth (bits/s)."""

    latency_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN: the peer sees 'connection reset'."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)  # identity semantics: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    task: asyncio.Task[None] | None = None
    last_due: list[float] = field(default_factory=lambda: [0.0, 0.0])
    counted: tuple[int, int] = (0, 0)  # TCP segments (in, out) of the client socket already in the stats

    def count_segments(self, stats: dict[str, int]) -> None:
        """Add the client socket's segments since the last count: in = up the link, out = down."""
        sock = self.client.get_extra_info("socket")
        segs_in, segs_out = tcp_segments(sock)
        if segs_in or segs_out:
            stats["segs_up"] += max(0, segs_in - self.counted[0])
            stats["segs_down"] += max(0, segs_out - self.counted[1])
            self.counted = (max(segs_in, self.counted[0]), max(segs_out, self.counted[1]))

    def abort(self) -> None:
        _rst(self.client)
        _rst(self.upstream)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class FaultProxy:
    """``await FaultProxy(name, (host, port)).start()``; then ``cut(cause, mode)`` / ``restore(cause)``."""

    def __init__(self, name: str, upstream: tuple[str, int], shape: LinkShape = LinkShape(), *, seed: int | str = 0,
                 host: str = "127.0.0.1") -> None:
        self.name = name
        self.upstream = upstream
        self.shape = shape
        self.host = host
        self._rng = random.Random(f"proxy/{seed}/{name}")
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._causes: dict[str, CutMode] = {}
        self._open = asyncio.Event()
        self._open.set()
        self._free_at = [0.0, 0.0]  # bandwidth: when each direction of the link is next free
        self.state: Literal["up", "reset", "blackhole"] = "up"
        self.transitions: list[tuple[float, str]] = []  # (wall time, new state)
        # reads_*: chunks read per direction; with TCP_NODELAY senders and small messages, about one
        # TCP segment each (bench/footprint.py estimates packets from them)
        self.stats = {"connections": 0, "refused": 0, "resets": 0, "bytes_up": 0, "bytes_down": 0, "reads_up": 0, "reads_down": 0,
                      "segs_up": 0, "segs_down": 0, "split_up": 0, "split_down": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self, port: int = 0) -> "FaultProxy":
        self._server = await asyncio.start_server(self._accept, self.host, port, reuse_address=True)
        self.transitions.append((time.time(), self.state))
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self._conns):
                c.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def segments(self) -> dict[str, int]:
        """The stats with every open connection's TCP segments counted up to now."""
        for c in list(self._conns):
            c.count_segments(self.stats)
        return dict(self.stats)

    def wire_bytes(self, st: dict[str, int] | None = None) -> dict[str, int]:
        """Bytes on a 1,500-MTU wire per direction: what the link carried (TLS included when the
        link speaks it) plus 52 bytes of TCP/IP per segment the kernel counted, plus the segments
        a radio's MSS would add to loopback's large ones. ``st``: a :meth:`segments` taken already."""
        st = self.segments() if st is None else st
        return {d: st[f"bytes_{d}"] + TCPIP_HEADER_B * (st[f"segs_{d}"] + st[f"split_{d}"]) for d in ("up", "down")}

    # ------------------------------------------------------------------ faults
    def cut(self, cause: str, mode: CutMode) -> None:
        """Take the link down for ``cause`` (it stays down until every cause is restored)."""
        if mode not in ("reset", "blackhole"):
            raise ValueError(f"cut mode must be 'reset' or 'blackhole', not {mode!r}")
        self._causes[cause] = mode
        self._apply()

    def restore(self, cause: str) -> None:
        self._causes.pop(cause, None)
        self._apply()

    def restore_all(self) -> None:
        self._causes.clear()
        self._apply()

    def _apply(self) -> None:
        new: Literal["up", "reset", "blackhole"]
        if not self._causes:
            new = "up"
        elif "reset" in self._causes.values():
            new = "reset"
        else:
            new = "blackhole"
        if new == self.state:
            return
        self.state = new
        self.transitions.append((time.time(), new))
        if new == "up":
            self._open.set()
            return
        self._open.clear()
        if new == "reset":
            for c in list(self._conns):
                self.stats["resets"] += 1
                c.count_segments(self.stats)
                c.abort()
            self._conns.clear()

    # ------------------------------------------------------------------ data path
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.state == "reset":
            self.stats["refused"] += 1
            _rst(writer)
            return
        with contextlib.suppress(OSError):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(writer)
        conn.task = asyncio.current_task()
        self._conns.add(conn)
        self.stats["connections"] += 1
        try:
            await self._open.wait()  # a blackholed link holds new connections too
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
            except (OSError, asyncio.TimeoutError):
                _rst(writer)  # upstream down (broker or hub restarting): the agent sees a reset
                return
            conn.upstream = up_writer
            with contextlib.suppress(OSError):
                up_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(self._pump(conn, reader, up_writer, 0), self._pump(conn, up_reader, writer, 1))
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a pump failed: reset both sides, as a broken path would
            log.debug("%s: connection ended: %r", self.name, exc)
        finally:
            conn.count_segments(self.stats)
            self._conns.discard(conn)
            conn.abort() if self.state == "reset" else _close(conn)

    async def _pump(self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: int) -> None:
        """Move one direction: read, stamp with a due time (latency, jitter, bandwidth), deliver."""
        q: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(_QUEUE_CHUNKS)
        writer = asyncio.create_task(self._deliver(q, dst))
        loop = asyncio.get_running_loop()
        sh = self.shape
        try:
            while True:
                await self._open.wait()
                data = await src.read(_CHUNK)
                if not data:
                    await q.put((0.0, None))
                    break
                self.stats["bytes_up" if direction == 0 else "bytes_down"] += len(data)
                self.stats["reads_up" if direction == 0 else "reads_down"] += 1
                self.stats["split_up" if direction == 0 else "split_down"] += (len(data) - 1) // WIRE_MSS
                due = loop.time() + max(0.0, sh.latency_s + (self._rng.uniform(-sh.jitter_s, sh.jitter_s) if sh.jitter_s else 0.0))
                due = max(due, conn.last_due[direction])  # TCP is in order: jitter never reorders
                if sh.bandwidth_bps:
                    start = max(due, self._free_at[direction])
                    due = self._free_at[direction] = start + len(data) * 8.0 / sh.bandwidth_bps
                conn.last_due[direction] = due
                await q.put((due, data))
            await writer
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    async def _deliver(self, q: "asyncio.Queue[tuple[float, bytes | None]]", dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await q.get()
            if data is None:
                if dst.can_write_eof():
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._open.wait()
            dst.write(data)
            await dst.drain()


def _close(conn: _Conn) -> None:
    for w in (conn.client, conn.upstream):
        if w is not None:
            with contextlib.suppress(Exception):
                w.close()
