"""The hub's end of site frames (mesh_agent/protocol/site.py, docs/sites.md "Site frames").

Up: a gateway's ``site_up`` has passed the gateway's MAC, freshness and replay checks in the
dispatcher like any frame; :func:`split_site_up` then yields the inner frames that may be handled
at all (the inner endpoint is a device of this gateway, and the frame's clear header names that
device), and the dispatcher verifies and handles each one exactly as a direct frame.

Down: :class:`SiteDownLink` is the link the hub answers such devices on. It looks like any hub
link to the dispatcher (``send(endpoint_id, frame)``), but gathers the frames for one gateway's
devices for a short window and sends them as one ``site_down`` signed with the gateway's key, on
the gateway's own topic. Welcomes and errors go at once (a device waits for its welcome).

Delivery is what it was frame by frame: a frame is handed to the broker (QoS 1) when its batch
goes. A batch that cannot be sent (the uplink is down) is logged and dropped, as a per-device
publish to an offline link would have failed: every frame the hub sends is re-sent by the
protocol when it matters (results are acked again on the next copy, a device without a welcome
says hello again, and the tasks a dropped batch leased ahead are handed to ``on_lost`` to go back
to the queue at once).

Each batch is numbered; the tasks each one leased ahead wait in :class:`PendingBatches`
(cloud_hub/site_lease.py) until the gateway confirms them, and every batch carries the floor
below which all are settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from cloud_hub.site_lease import PendingBatches
from mesh_agent.protocol import Kind
from mesh_agent.protocol.envelope import BadFrame, peek_endpoint, peek_kind
from mesh_agent.protocol.site import SiteBatch, inner_frames
from mesh_agent.transport import HubLink, LinkError

__all__ = ["SiteDownLink", "split_site_up", "DOWN_WINDOW_S"]

log = logging.getLogger("cloud_hub.site_frames")

#: How long a frame for a site's device may wait for others to share its site_down.
DOWN_WINDOW_S = 0.2
_AT_ONCE = frozenset({Kind.WELCOME, Kind.ERROR})


def split_site_up(body: dict[str, Any], devices: set[str]) -> Iterator[tuple[str, bytes] | tuple[str, BadFrame]]:
    """Each inner frame of a checked ``site_up`` body: (device, frame) when it may be handled, or
    (device, BadFrame) when it must not (a device of another gateway, a header naming another
    endpoint). Nothing here trusts an inner frame: the dispatcher verifies each."""
    for device, frame in inner_frames(body):
        if device not in devices:
            yield device, BadFrame(f"inner frame for {device[:64]}, which is not a device of this gateway")
            continue
        try:
            named = peek_endpoint(frame)
        except BadFrame as exc:
            yield device, exc
            continue
        if named != device:
            yield device, BadFrame(f"inner frame listed for {device} names {named[:64]}")
            continue
        yield device, frame


class SiteDownLink:
    """A hub link to one gateway's devices through ``site_down`` batches (see the module doc)."""

    def __init__(self, gateway_id: str, base: HubLink, sign: Callable[[list[tuple[str, bytes]], int, str, int], bytes],
                 window_s: float = DOWN_WINDOW_S, on_lost: Callable[[list[str]], Awaitable[None]] | None = None) -> None:
        self.gateway_id = gateway_id
        self.base = base
        self.name = base.name  # the dispatcher reads the transport's name (MQTT liveness)
        self._sign = sign
        self.window_s = window_s
        self._batch = SiteBatch()
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task[None]] = set()
        self.seq = 0
        #: Names this link's numbering: a gateway's "stored up to n" counts only for the numbering
        #: it names. The link, and so its numbering, lives as long as this hub process: it is kept
        #: across the gateway's sessions, and a restarted hub numbers afresh.
        self.epoch = os.urandom(4).hex()
        self._open_tasks: list[str] = []  # task ids of tasks frames in the batch being gathered
        self._open_task_bytes = 0
        #: the batches whose leased-ahead tasks the gateway has not confirmed (bounded)
        self.pending = PendingBatches()
        #: called with the task ids of a batch that could not be sent: they go back to the queue
        self.on_lost = on_lost
        self.stats = {"batches": 0, "frames": 0, "bytes": 0, "failed": 0}

    async def start(self, on_frame: Any) -> None:  # HubLink's shape; the base link is already running
        return None

    async def stop(self) -> None:
        await self.flush()

    async def send(self, endpoint_id: str, frame: bytes, task_ids: list[str] | None = None) -> None:
        """Queue ``frame`` for ``endpoint_id`` (a device of this gateway); a welcome or an error, or a
        full batch, goes at once and raises LinkError when it cannot. ``task_ids``: the tasks a
        tasks frame leases ahead, which the gateway's "stored up to" will confirm."""
        if task_ids:
            self._open_tasks.extend(task_ids)
            self._open_task_bytes += len(frame)
        full = self._batch.add(endpoint_id, frame)
        if full or peek_kind(frame) in _AT_ONCE:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._flush_later)

    def _flush_later(self) -> None:
        self._timer = None
        t = asyncio.ensure_future(self._flush_quietly())
        self._flushing.add(t)
        t.add_done_callback(self._flushing.discard)

    async def _flush_quietly(self) -> None:
        with contextlib.suppress(LinkError):
            await self.flush()

    async def flush(self) -> None:
        """Send everything queued as one site_down (several when the batch is over its size)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        frames = self._batch.take()
        tasks, self._open_tasks, self._open_task_bytes = self._open_tasks, [], 0
        if not frames:
            return
        self.seq += 1
        seq = self.seq
        out = self._sign(frames, seq, self.epoch, self.pending.floor(seq))
        self.pending.sent(seq, tasks, len(out), time.monotonic())
        try:
            await self.base.send(self.gateway_id, out)
        except LinkError as exc:
            self.stats["failed"] += 1
            log.info("site_down for %s not sent (%d frames): %s", self.gateway_id, len(frames), exc,
                     extra={"endpoint_id": self.gateway_id})
            lost = self.pending.give_up(seq)
            if lost and self.on_lost is not None:
                await self.on_lost(lost)
            raise
        self.stats["batches"] += 1
        self.stats["frames"] += len(frames)
        self.stats["bytes"] += len(out)

    def unconfirmed_ids(self) -> list[str]:
        """Task ids leased ahead through this link that the gateway has not confirmed: in a batch
        sent or in the one being gathered."""
        return [*self.pending.ids(), *self._open_tasks]

    @property
    def inflight_bytes(self) -> int:
        """Bytes of leased-ahead work sent or about to go, and not confirmed yet (the pacing window's use)."""
        return self.pending.inflight_bytes + self._open_task_bytes

    def confirmed_upto(self, epoch: str, seq: int) -> tuple[list[str], list[tuple[int, float]]]:
        """The gateway stored every batch of this link up to ``seq``: the task ids those batches
        leased ahead, each returned once (an older or another link's confirmation returns none),
        and throughput samples (see PendingBatches.upto)."""
        if epoch != self.epoch or seq > self.seq:  # another numbering, or a batch not sent yet: a lie
            return [], []
        return self.pending.upto(seq, time.monotonic())

