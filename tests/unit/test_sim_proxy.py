"""The fault-injecting proxy over real loopback TCP: it relays, delays, resets and black-holes."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import pytest

from sim.emulate.proxy import FaultProxy, LinkShape


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


async def _roundtrip(port: int, data: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.readexactly(len(data)), 10)
    finally:
        w.close()


async def test_relays_both_ways_and_never_delivers_before_the_configured_delay(echo_port: int) -> None:
    p = await FaultProxy("a", ("127.0.0.1", echo_port), LinkShape(latency_s=0.05, jitter_s=0.01, bandwidth_bps=800_000)).start()
    try:
        data = bytes(range(256)) * 80  # 20 KiB: 0.2 s at 800 kbit/s, each way
        t = time.monotonic()
        assert await _roundtrip(p.port, data) == data
        # A lower bound, not a performance assertion: the bytes cannot arrive before the link lets them.
        assert time.monotonic() - t >= 2 * (0.04 + len(data) * 8 / 800_000)
        assert p.stats["bytes_up"] == p.stats["bytes_down"] == len(data)
    finally:
        await p.stop()


async def test_reset_kills_open_connections_and_refuses_new_ones(echo_port: int) -> None:
    p = await FaultProxy("a", ("127.0.0.1", echo_port)).start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"hi")
        assert await r.readexactly(2) == b"hi"
        p.cut("test", "reset")
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(10), 5)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await _roundtrip(p.port, b"x")
        p.restore("test")
        assert await _roundtrip(p.port, b"back") == b"back"
        assert [s for _, s in p.transitions] == ["up", "reset", "up"]
    finally:
        await p.stop()


async def test_blackhole_holds_everything_until_the_link_returns(echo_port: int) -> None:
    p = await FaultProxy("a", ("127.0.0.1", echo_port)).start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        p.cut("night", "blackhole")
        w.write(b"one,")
        w.write(b"two")
        await w.drain()
        r2, w2 = await asyncio.open_connection("127.0.0.1", p.port)  # accepted, but nothing passes
        w2.write(b"new")
        await w2.drain()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.read(10), 0.5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r2.read(10), 0.1)
        p.restore("night")
        assert await asyncio.wait_for(r.readexactly(7), 5) == b"one,two"  # intact and in order
        assert await asyncio.wait_for(r2.readexactly(3), 5) == b"new"
        w.close()
        w2.close()
    finally:
        await p.stop()


async def test_down_while_any_cause_is_down_and_reset_wins(echo_port: int) -> None:
    p = await FaultProxy("a", ("127.0.0.1", echo_port)).start()
    try:
        p.cut("mast", "blackhole")
        p.cut("own", "blackhole")
        p.restore("own")
        assert p.state == "blackhole"
        p.cut("router", "reset")
        assert p.state == "reset"
        p.restore("router")
        assert p.state == "blackhole"
        p.restore("mast")
        assert p.state == "up"
        with pytest.raises(ValueError, match="cut mode"):
            p.cut("x", "drop")  # type: ignore[arg-type]
        assert p.state == "up"
    finally:
        await p.stop()


async def test_upstream_down_looks_like_a_reset_to_the_client() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()
    p = await FaultProxy("a", ("127.0.0.1", port)).start()
    try:
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await _roundtrip(p.port, b"x")
    finally:
        await p.stop()


async def test_the_kernel_counts_the_links_tcp_segments(echo_port: int) -> None:
    """Packets come from the client socket's TCP_INFO (pure ACKs and the handshake included), so a
    report adds real TCP/IP headers; a radio's MSS splits loopback's 64 KiB segments further."""
    p = await FaultProxy("a", ("127.0.0.1", echo_port)).start()
    try:
        data = b"x" * 10_000
        assert await _roundtrip(p.port, data) == data
        live = p.segments()
        assert live["segs_up"] >= 2 and live["segs_down"] >= 2  # the handshake's and the data's, at least
        for _ in range(100):  # bounded: the proxy counts a closed connection's rest when it ends
            if not p._conns:
                break
            await asyncio.sleep(0.02)
        st = p.segments()
        assert st["segs_up"] >= live["segs_up"] and st["segs_down"] >= live["segs_down"]
        assert st["split_up"] >= 10_000 // 1448 - 1  # a 1,500-MTU link needs at least 7 segments for 10,000 B
        wire = p.wire_bytes()
        assert wire["up"] == st["bytes_up"] + 52 * (st["segs_up"] + st["split_up"]) and wire["up"] > len(data)
    finally:
        await p.stop()
