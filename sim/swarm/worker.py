"""One swarm process: thousands of endpoints in one asyncio loop, each with its own real connection.

Run by the harness as ``python -m sim.swarm.worker SPEC.json``. SPEC holds the endpoints'
credentials (from bulk enrollment) and the settings. The process reports one JSON line a second
on stdout (counters, how many are connected and welcomed, its own CPU and RSS) and takes commands
on stdin, one per line: ``mark`` (remember every endpoint's connection generation: "reconnected"
from now on means welcomed on a newer connection) and ``stop``.

Links are the agent's own (``MqttAgentLink``: one aiomqtt client per endpoint; ``ZmqAgentLink``:
one CURVE DEALER per endpoint), reconnecting with the agent's backoff and jitter. Heartbeats come
from one ticker per process, not one task per endpoint, each endpoint on a random phase so the
beats are spread over the period as a real fleet's are.

Hellos are the agent's: one per connection, another when the hub answers a frame with
``hello_required`` (at most one a second) and when a welcome took longer than the agent's clock
trusts. There is no timer that says hello again while a welcome is late: an earlier 3 s retry
(doubling) multiplied a herd (36,587 hellos for 10,000 endpoints) beyond what real agents send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mesh_agent.protocol import ReplayGuard
from mesh_agent.transport import LinkError
from sim.swarm.core import Counters, Creds, SwarmEndpoint, reconnect_delay

__all__ = ["raise_nofile", "main"]


def raise_nofile() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit: a process holding thousands of sockets needs it
    (and children, such as the test Mosquitto, inherit it). Returns (soft, hard) in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class _Slot:
    """An endpoint with its live link (None while disconnected) and its heartbeat schedule."""

    __slots__ = ("ep", "link", "next_beat", "mark_gen")

    def __init__(self, ep: SwarmEndpoint, phase: float) -> None:
        self.ep = ep
        self.link: Any = None
        self.next_beat = phase
        self.mark_gen = 0


def _link(c: Creds, keepalive: int) -> Any:
    if c.transport == "mqtt":
        from mesh_agent.transport.mqtt import MqttAgentLink

        return MqttAgentLink(c.endpoint_id, c.mqtt_host or "127.0.0.1", int(c.mqtt_port or 1883), username=c.mqtt_username,
                             password=c.mqtt_password, keepalive=keepalive, prefix=c.mqtt_prefix)
    from mesh_agent.transport.zmq import ZmqAgentLink

    assert c.zmq_address and c.zmq_server_key and c.curve_public and c.curve_secret
    return ZmqAgentLink(c.endpoint_id, c.zmq_address, server_key=c.zmq_server_key, public_key=c.curve_public, secret_key=c.curve_secret)


class Swarm:
    def __init__(self, creds: list[Creds], *, heartbeat_s: float, capacity: int, prefetch: int, keepalive: int, connect_concurrency: int,
                 seed: int) -> None:
        self.counters = Counters()
        replay = ReplayGuard()  # keyed per endpoint inside: one per process serves all
        self.rng = random.Random(seed)
        now = time.monotonic()
        self.slots = [_Slot(SwarmEndpoint(c, self.counters, replay, capacity=capacity, prefetch=prefetch), now + self.rng.uniform(0, heartbeat_s))
                      for c in creds]
        self.heartbeat_s = heartbeat_s
        self.keepalive = keepalive
        self.connect_sem = asyncio.Semaphore(connect_concurrency)
        self.stop = asyncio.Event()
        self.reconnects = 0
        self.connect_failures = 0

    async def _send(self, s: _Slot, frames: list[bytes]) -> None:
        link = s.link
        if link is None:
            return
        for f in frames:
            await link.send(f)

    async def run_endpoint(self, s: _Slot) -> None:
        """Connect, hello, answer frames; on any link loss back off (the agent's formula) and again."""
        attempt = 0
        while not self.stop.is_set():
            link = _link(s.ep.creds, self.keepalive)
            try:
                async with self.connect_sem:
                    await link.__aenter__()
            except (LinkError, OSError) as exc:
                self.connect_failures += 1
                del exc
                attempt += 1
                await self._sleep(reconnect_delay(attempt, self.rng))
                continue
            try:
                s.link = link
                attempt = 0
                await self._send(s, s.ep.connected())
                async for frame in link.frames():
                    replies = s.ep.on_frame(frame)
                    if replies:
                        await self._send(s, replies)
            except (LinkError, OSError):
                pass
            finally:
                s.link = None
                s.ep.welcomed = False
                with contextlib.suppress(Exception):
                    await link.__aexit__(None, None, None)
            if self.stop.is_set():
                break
            self.reconnects += 1
            attempt += 1
            await self._sleep(reconnect_delay(attempt, self.rng))

    async def _sleep(self, delay: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), delay)

    async def ticker(self) -> None:
        """Heartbeats every heartbeat_s per connected endpoint (random phase), welcomed or not, as
        the agent beats: a beat without a session brings ``hello_required``, and with it a hello."""
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
            now = time.monotonic()
            sends = []
            for s in self.slots:
                if s.link is None:
                    continue
                if now >= s.next_beat:
                    s.next_beat = now + self.heartbeat_s
                    frames = s.ep.heartbeat()
                    if frames:
                        sends.append(self._safe_send(s, frames))
            if sends:
                await asyncio.gather(*sends)

    async def _safe_send(self, s: _Slot, frames: list[bytes]) -> None:
        with contextlib.suppress(LinkError, OSError):
            await self._send(s, frames)

    def status(self) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        try:
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            rss = ru.ru_maxrss * 1024
        return {
            "t": time.time(), "endpoints": len(self.slots), "connected": sum(1 for s in self.slots if s.link is not None),
            "online": sum(1 for s in self.slots if s.ep.welcomed),
            "reconnected": sum(1 for s in self.slots if s.ep.welcomed and s.ep.welcomed_gen > s.mark_gen),
            "unacked_results": sum(len(s.ep.unacked) for s in self.slots),
            "reconnects": self.reconnects, "connect_failures": self.connect_failures,
            "cpu_s": ru.ru_utime + ru.ru_stime, "rss": rss, **asdict(self.counters),
        }

    def mark(self) -> None:
        for s in self.slots:
            s.mark_gen = s.ep.conn_gen

    async def reporter(self) -> None:
        while not self.stop.is_set():
            print(json.dumps(self.status()), flush=True)
            await self._sleep(1.0)
        print(json.dumps({**self.status(), "final": True}), flush=True)

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            line = await loop.run_in_executor(None, sys.stdin.readline)
            cmd = line.strip()
            if cmd == "mark":
                self.mark()
                print(json.dumps({"marked": True, "t": time.time()}), flush=True)
            elif cmd == "stop" or not line:  # EOF: the harness went away
                self.stop.set()


async def _amain(spec: dict[str, Any]) -> None:
    creds = [Creds.from_json(c) for c in spec["creds"]]
    if any(c.transport == "zmq" for c in creds):
        import zmq
        import zmq.asyncio

        zmq.asyncio.Context.instance().set(zmq.MAX_SOCKETS, len(creds) + 64)  # libzmq's default is 1023
    sw = Swarm(creds, heartbeat_s=float(spec["heartbeat_s"]), capacity=int(spec.get("capacity", 1)), prefetch=int(spec.get("prefetch", 16)),
               keepalive=int(spec.get("keepalive", 30)), connect_concurrency=int(spec.get("connect_concurrency", 100)),
               seed=int(spec.get("seed", 0)))
    tasks = [asyncio.create_task(sw.run_endpoint(s)) for s in sw.slots]
    aux = [asyncio.create_task(sw.ticker()), asyncio.create_task(sw.reporter())]
    cmd = asyncio.create_task(sw.commands())
    await sw.stop.wait()
    for t in tasks + aux:
        t.cancel()
    await asyncio.gather(*tasks, *aux, return_exceptions=True)
    print(json.dumps({**sw.status(), "final": True}), flush=True)
    cmd.cancel()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m sim.swarm.worker SPEC.json", file=sys.stderr)
        raise SystemExit(2)
    raise_nofile()
    spec = json.loads(Path(args[0]).read_text())
    asyncio.run(_amain(spec))
    os._exit(0)  # the stdin reader thread may still block in readline: do not wait for it


if __name__ == "__main__":
    main()
