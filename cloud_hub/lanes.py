"""Per-endpoint lanes for incoming frames: different endpoints concurrently, one endpoint in order.

Why: a hub link (one MQTT subscription, one ZeroMQ ROUTER socket) receives every endpoint's
frames on one stream. Awaiting the dispatcher for one frame at a time meant a slow frame (a
hello: reconciliation and a durable commit) held up every other endpoint's acks and results, and
a herd of 10,000 hellos queued everything for tens of seconds (docs/benchmarks.md, swarm). It
also kept the store's group commit (cloud_hub/store/group.py) from ever having more than one
operation to group.

Order within one endpoint still matters (a hello before the fetch that follows it, results
before the heartbeat that counts them), so each endpoint gets a lane: its frames run one after
another, in arrival order, while other lanes run at the same time. A lane is a task only while
it has frames; an idle endpoint costs nothing here.

Bounds: at most ``max_running`` handlers at once (more only queue on the database anyway), and at
most ``max_queued`` frames waiting in all lanes together; past that :meth:`Lanes.submit` waits,
which stops the link's receive loop and leaves the backlog with the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Awaitable, Callable

__all__ = ["Lanes"]

log = logging.getLogger("cloud_hub.lanes")

Job = Callable[[], Awaitable[None]]


class Lanes:
    def __init__(self, max_running: int = 512, max_queued: int = 20_000) -> None:
        if max_running < 1 or max_queued < 1:
            raise ValueError("max_running and max_queued must be at least 1")
        self._lanes: dict[str, deque[Job]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._running = asyncio.Semaphore(max_running)
        self._max_queued = max_queued
        self._queued = 0
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False
        self.stats = {"frames": 0, "failed": 0, "peak_queued": 0, "peak_lanes": 0}

    @property
    def queued(self) -> int:
        """Frames waiting or running in all lanes."""
        return self._queued

    async def submit(self, key: str, job: Job) -> None:
        """Run ``job`` after every job submitted before it under the same ``key``. Returns once it is
        queued (waiting first while ``max_queued`` frames are queued), not when it has run."""
        while self._queued >= self._max_queued and not self._closed:
            self._room.clear()
            await self._room.wait()
        if self._closed:
            return
        self._queued += 1
        self.stats["peak_queued"] = max(self.stats["peak_queued"], self._queued)
        lane = self._lanes.get(key)
        if lane is not None:
            lane.append(job)
            return
        self._lanes[key] = deque([job])
        self.stats["peak_lanes"] = max(self.stats["peak_lanes"], len(self._lanes))
        worker = asyncio.create_task(self._drain(key), name=f"lane-{key}")
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    async def _drain(self, key: str) -> None:
        lane = self._lanes[key]
        try:
            while lane:
                job = lane[0]
                try:
                    async with self._running:
                        await job()
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad frame must never stop its endpoint's lane
                    self.stats["failed"] += 1
                    log.exception("frame handler failed (lane %s)", key)
                finally:
                    lane.popleft()
                    self._queued -= 1
                    self.stats["frames"] += 1
                    if self._queued < self._max_queued:
                        self._room.set()
        finally:
            if self._lanes.get(key) is lane:
                self._queued -= len(lane)  # cancelled with frames still waiting: they are dropped
                del self._lanes[key]
                if self._queued < self._max_queued:
                    self._room.set()

    async def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every queued frame has been handled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._workers and loop.time() < deadline:
            await asyncio.wait(set(self._workers), timeout=max(0.0, deadline - loop.time()))
        return not self._workers

    async def close(self, timeout: float = 2.0) -> None:
        """Refuse new frames, give queued ones ``timeout`` s to finish, then cancel the rest (their
        endpoints send them again: nothing the agent sent is acknowledged before it is stored)."""
        self._closed = True
        self._room.set()
        await self.drain(timeout)
        workers = list(self._workers)
        for w in workers:
            w.cancel()
        for w in workers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w
