"""The agent runtime: durable queue + warm engine + one link to the hub, in one asyncio loop.

Durability rules (DESIGN invariants 1 and 2):
- a task is written to SQLite *before* the hub is told it was received (ack);
- a result is written *before* it is sent, and its payload dropped only after the hub acks it;
- after a crash, every stored task without a result runs again (at least once), and every
  stored result not yet acked is sent again (the hub de-duplicates by task id).

Flow control is credit based: the agent asks for ``workers + prefetch`` tasks minus what it
holds, so neither the broker nor ZeroMQ ever has to buffer an unbounded backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import psutil

from mesh_agent import __version__
from mesh_agent.clock import HubClock
from mesh_agent.config import AgentConfig, Credentials
from mesh_agent.datasets import export_worker_env
from mesh_agent.engine import EngineResult, EngineTask, LocalEngine, error_result
from mesh_agent.protocol import (
    DOWN_KINDS,
    MAX_FRAME_BYTES,
    BadFrame,
    Envelope,
    Kind,
    ProtocolError,
    ReplayGuard,
    Stale,
    check_freshness,
    encode,
    open_frame,
)
from mesh_agent.store import AgentStore, StoredResult, StoreError
from mesh_agent.transport import AgentLink, LinkError

if TYPE_CHECKING:
    from mesh_agent.engine.parsl_engine import ParslEngine

__all__ = ["Agent", "make_link"]

log = logging.getLogger("mesh_agent")

#: Results per ``results`` frame; keeps frames well under broker limits.
_RESULTS_PER_FRAME = 2000
_RESEND_AFTER_S = 10.0
_FRAME_BUDGET = 8 * 2**20
_MAX_RESULT_BYTES = MAX_FRAME_BYTES // 2
#: After a failed queue write (full disk) the agent takes no new tasks for this long, then tries again.
_STORE_RETRY_S = 5.0


def make_link(cfg: AgentConfig, creds: Credentials) -> AgentLink:
    if cfg.transport == "mqtt":
        from mesh_agent.transport.mqtt import MqttAgentLink

        return MqttAgentLink(
            cfg.endpoint_id,
            cfg.mqtt.host,
            cfg.mqtt.port,
            username=creds.mqtt_username,
            password=creds.mqtt_password,
            keepalive=cfg.mqtt.keepalive,
            prefix=cfg.mqtt.topic_prefix,
        )
    from mesh_agent.transport.zmq import ZmqAgentLink

    if not (creds.hub_curve_key and creds.curve_public and creds.curve_secret):
        raise LinkError("no ZeroMQ CURVE keys in the credentials file: run `mesh-agent init` again")
    return ZmqAgentLink(cfg.endpoint_id, cfg.zmq.address, server_key=creds.hub_curve_key, public_key=creds.curve_public, secret_key=creds.curve_secret)


class _HelloRequired(Exception):
    """The hub lost our session (it restarted): say hello again on the same link."""


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        creds: Credentials,
        link_factory: Callable[[AgentConfig, Credentials], AgentLink] = make_link,
    ) -> None:
        self.cfg = cfg
        self.endpoint_id = cfg.endpoint_id
        self._key = creds.key_bytes
        self._creds = creds
        self._link_factory = link_factory
        self.store = AgentStore(cfg.queue_path, cfg.durable_sync, cfg.queue_max_mb)
        if cfg.globus is not None:  # workers (spawned later, they inherit it) stage Globus files
            os.environ["MESH_STAGING"] = json.dumps({**json.loads(cfg.globus.model_dump_json()), "credentials_file": str(cfg.credentials_file)})
        self.engine: LocalEngine | ParslEngine
        if cfg.engine == "parsl":  # HPC: same interface and result semantics, work on batch-job workers
            from mesh_agent.engine.parsl_engine import ParslEngine

            self.engine = ParslEngine(self._on_results, cfg.parsl, cfg.data_dir / "parsl", workers=cfg.workers,
                                      task_timeout=cfg.task_timeout, memory_limit_mb=cfg.memory_limit_mb)
        else:
            self.engine = LocalEngine(
                self._on_results,
                workers=cfg.workers,
                task_timeout=cfg.task_timeout,
                memory_limit_mb=cfg.memory_limit_mb,
                max_batch=cfg.max_batch,
            )
        self._replay = ReplayGuard()
        self._heartbeat_s = cfg.heartbeat_s
        self._clock = HubClock()  # the hub's clock, learned from signed welcomes
        self._link: AgentLink | None = None
        self._welcomed = asyncio.Event()
        self._pending: list[EngineResult] = []
        self._retry: list[EngineResult] = []  # results whose write failed (disk full), written again later
        self._pending_event = asyncio.Event()
        self._sent_at: dict[str, float] = {}  # results sent, not yet acked
        self._in_engine: set[str] = set()
        self._received_since_fetch = 0
        self._granted = 0
        self._hello_nonces: dict[str, float] = {}  # hellos awaiting their welcome, nonce -> sent at
        self._local_allow = None if cfg.allowed_functions is None else frozenset(cfg.allowed_functions)
        self._hub_allow: frozenset[str] | None = None  # the hub's allow-list for us, kept in the queue's meta
        self._store_blocked_until = 0.0  # monotonic; set when the queue could not be written (disk full)
        self.stats = {"tasks_received": 0, "results_sent": 0, "rejected_frames": 0, "reconnects": 0, "store_failures": 0, "refused_tasks": 0}

    # ------------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; survives any number of link losses."""
        await self.store.open()
        export_worker_env(self.cfg.endpoint_id, self.cfg.name, self.cfg.datasets, self.cfg.data_dir)  # before workers spawn
        allow = await self.store.get_meta("hub_allow")
        self._hub_allow = None if allow is None else frozenset(json.loads(allow))
        await self.engine.start()
        flusher = asyncio.create_task(self._flush_results_forever(), name="flush-results")
        try:
            await self._resume_stored_tasks()
            await self._connect_forever(stop)
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            await self.engine.stop()
            # Results that finished during shutdown are still written: nothing finished is lost.
            with contextlib.suppress(Exception):
                await self._save_pending()
            await self.store.close()

    async def _resume_stored_tasks(self) -> None:
        tasks = await self.store.queued_tasks(exclude=self._in_engine)
        if tasks:
            log.info("resuming %d stored tasks", len(tasks))
            bodies = await self.store.function_bodies(t.function_id for t in tasks)
            self._submit([(t.id, t.function_id, t.args, t.timeout, t.expires) for t in tasks], bodies)

    async def _connect_forever(self, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            try:
                async with self._link_factory(self.cfg, self._creds) as link:
                    self._link = link
                    attempt = 0
                    await self._session(link, stop)
            except LinkError as exc:
                log.warning("link to hub lost: %s", exc)
            finally:
                self._link = None
                self._welcomed.clear()
            if stop.is_set():
                break
            attempt += 1
            self.stats["reconnects"] += 1
            # Exponential backoff with jitter: a fleet coming back after a regional outage
            # must not reconnect in lockstep.
            delay = min(30.0, 0.2 * 2 ** min(attempt, 8)) * random.uniform(0.5, 1.5)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _session(self, link: AgentLink, stop: asyncio.Event) -> None:
        await self._send_hello()
        reader = asyncio.create_task(self._read(link))
        beat = asyncio.create_task(self._heartbeats())
        stopper = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({reader, beat, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopper and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in (reader, beat, stopper):
                t.cancel()
            await asyncio.gather(reader, beat, stopper, return_exceptions=True)

    # ------------------------------------------------------------------ sending
    def _now(self) -> float:
        return self._clock.now()

    async def _send(self, kind: Kind, body: dict[str, Any]) -> None:
        link = self._link
        if link is None:
            raise LinkError("not connected")
        await link.send(encode(Envelope(kind, self.endpoint_id, body, ts=self._now()), self._key))

    async def _send_hello(self) -> None:
        nonce = os.urandom(8).hex()
        self._hello_nonces[nonce] = time.time()
        while len(self._hello_nonces) > 8:
            self._hello_nonces.pop(next(iter(self._hello_nonces)))
        await self._send(
            Kind.HELLO,
            {
                "nonce": nonce,
                "capacity": self.engine.workers,
                "prefetch": self.cfg.prefetch,
                "have": await self.store.held_ids(),
                "engine": self.cfg.engine,
                "host": socket.gethostname(),
                "version": __version__,
                "pid": os.getpid(),
                # for placement: selectors, constraints, pooled profiles
                "tags": list(self.cfg.tags),
                "hardware": self.cfg.hardware,
                "gpu": self.cfg.gpu,
                "memory_mb": psutil.virtual_memory().total // 2**20,
            },
        )

    def _want(self) -> int:
        if time.monotonic() < self._store_blocked_until:
            return 0  # the queue cannot take more right now (disk full): let the hub keep them
        return max(0, self.engine.workers + self.cfg.prefetch - self.engine.queued - self.engine.running)

    async def _maybe_fetch(self, force: bool = False) -> None:
        """Tell the hub how many more tasks we can take, when that changed enough to matter."""
        if not self._welcomed.is_set():
            return
        want = self._want()
        full = self.engine.workers + self.cfg.prefetch
        # What the hub still believes it may send us: our last grant minus what arrived since.
        hub_credit = max(0, self._granted - self._received_since_fetch)
        gap = want - hub_credit
        if force or (gap > 0 and (gap >= max(1, full // 4) or self.engine.running == 0)):
            self._granted = want
            self._received_since_fetch = 0
            await self._send(Kind.FETCH, {"want": want})

    async def _heartbeats(self) -> None:
        psutil.cpu_percent(None)
        last_prune = 0.0
        while True:
            if time.monotonic() - last_prune > 3600:
                last_prune = time.monotonic()
                try:
                    await self.store.prune()
                except Exception as exc:  # housekeeping only; never worth the session
                    log.warning("pruning old task ids failed: %s", exc)
            await asyncio.sleep(self._heartbeat_s)
            counts = await self.store.counts()
            mem = psutil.virtual_memory()
            await self._send(
                Kind.HEARTBEAT,
                {
                    "capacity": self.engine.workers,
                    "running": self.engine.running,
                    "queued": self.engine.queued,
                    "stored": counts["queued"],
                    "outbox": counts["done"],
                    "want": self._want(),
                    "warm": self.engine.warm_functions()[:100],
                    "cpu": psutil.cpu_percent(None),
                    "mem_used": mem.percent,
                    "mem_avail_mb": mem.available // 2**20,
                },
            )
            await self._resend_stale_results()
            await self._maybe_fetch()  # safety net should a fetch have been lost

    # ------------------------------------------------------------------ receiving
    async def _read(self, link: AgentLink) -> None:
        async for frame in link.frames():
            try:
                await self._handle(frame)
            except StoreError as exc:
                # The queue could not be written (disk full): nothing was acked, so nothing is
                # lost; the link stays up and the hub re-sends after its lease.
                log.error("%s", exc)
            except _HelloRequired:
                # Many frames may bounce while the hub restarts: one hello per second is enough.
                recent = max(self._hello_nonces.values(), default=0.0)
                if time.time() - recent > 1.0:
                    await self._send_hello()

    async def _handle(self, frame: bytes) -> None:
        """Trust before parsing (invariant 3): header and MAC, direction, freshness (for a welcome:
        the nonce of one of our hellos) and replay are all checked on the fixed binary header; the
        body is handed to msgpack only after every check passed."""
        try:
            sealed = open_frame(frame, self._key)
            if sealed.endpoint != self.endpoint_id:
                raise BadFrame(f"frame addressed to {sealed.endpoint}")
            if sealed.kind not in DOWN_KINDS:
                raise BadFrame(f"a {sealed.kind.value} frame cannot come from the hub (reflected?)")
            if sealed.kind is Kind.WELCOME:
                # No freshness check: our clock may be wrong until this very welcome sets it.
                # A welcome carries the nonce of the hello it answers as its message id instead.
                if sealed.id not in self._hello_nonces:
                    raise ProtocolError("welcome does not answer a hello of ours")
            else:
                now = self._now()
                check_freshness(sealed, now=now)
                self._replay.check(sealed, now=now)
            env = sealed.open()
            if env.kind is Kind.WELCOME and env.body["reply_to"] != sealed.id:
                raise BadFrame("welcome reply_to differs from its message id")
        except ProtocolError as exc:
            self.stats["rejected_frames"] += 1
            log.warning("rejected frame from hub: %s: %s", exc.reason, exc)
            if isinstance(exc, Stale) and sealed.ts > self._now():
                # Authentic (its MAC passed) and from the hub's future: our estimate of the hub's
                # clock is behind. Say hello (at most once a second) to learn it again.
                raise _HelloRequired() from None
            return
        handler = _HANDLERS.get(env.kind)
        if handler is not None:
            await handler(self, env.body)

    async def _on_welcome(self, body: dict[str, Any]) -> None:
        now = time.time()
        sent = self._hello_nonces.get(body["reply_to"], now)
        self._hello_nonces.clear()
        again = self._clock.sample(sent, now, float(body["hub_time"]))
        hub_beat = body.get("heartbeat_s")
        if isinstance(hub_beat, (int, float)) and 0 < hub_beat < self.cfg.heartbeat_s:
            self._heartbeat_s = float(hub_beat)  # the hub declares us lost on its own period
        await self._set_hub_allow(body)
        self._welcomed.set()
        await self._resume_stored_tasks()  # anything stored but not running (a session cut mid-batch)
        await self._maybe_fetch(force=True)
        await self._resend_stale_results(all_of_them=True)
        if again:  # that welcome waited somewhere (a broker queue, an outage): measure again
            log.warning("welcome came %.0fs after its hello; measuring the hub's clock again", now - sent)
            await self._send_hello()

    async def _set_hub_allow(self, body: dict[str, Any]) -> None:
        if "allow" not in body:
            return
        allow = None if body["allow"] is None else frozenset(body["allow"])
        if allow != self._hub_allow:
            self._hub_allow = allow  # in force at once; kept on disk for tasks resumed after a restart
            log.info("hub allow-list: %s", "none" if allow is None else f"{len(allow)} functions")
            try:
                await self.store.set_meta("hub_allow", None if allow is None else json.dumps(sorted(allow)))
            except StoreError as exc:
                log.error("could not save the hub's allow-list: %s", exc)

    async def _on_tasks(self, body: dict[str, Any]) -> None:
        tasks: list[dict[str, Any]] = body.get("tasks", [])
        functions: dict[str, bytes] = body.get("functions") or {}
        self._received_since_fetch += len(tasks)
        by_id = {t["id"]: t for t in tasks}
        missing: list[tuple[str, str, bytes, float | None, float | None]] = []

        def start(fresh: list[str]) -> None:
            # Called inside the store's transaction, before its commit: tasks whose function came
            # with this frame start now; the rest wait for their stored body (below).
            self.stats["tasks_received"] += len(fresh)
            ready = []
            for i in fresh:
                t = by_id[i]
                row = (i, t["fn"], t["args"], t.get("timeout"), t.get("exp"))
                (ready if t["fn"] in functions else missing).append(row)
            self._submit(ready, functions)

        await self._set_hub_allow(body)  # before any of these tasks is considered for running
        try:
            await self.store.add_tasks(functions, tasks, on_fresh=start)
        except StoreError as exc:
            # Not stored, so not acknowledged: the hub keeps them and sends them again. (Tasks
            # already started above still run; their results reach the hub, which keeps one.)
            self.stats["store_failures"] += 1
            self._store_blocked_until = time.monotonic() + _STORE_RETRY_S
            log.error("could not store %d tasks from the hub, so they are not acknowledged (the hub keeps them "
                      "and sends them again): %s", len(tasks), exc)
            with contextlib.suppress(LinkError):
                self._granted, self._received_since_fetch = 0, 0
                await self._send(Kind.FETCH, {"want": 0})
            return
        if missing:
            bodies = await self.store.function_bodies({fid for _, fid, *_ in missing})
            self._submit(missing, bodies)  # before the ack: a link that fails now must not strand them
        # Ack everything, duplicates included: the hub may have missed our earlier ack.
        await self._send(Kind.ACK, {"ids": [t["id"] for t in tasks]})

    async def _on_result_ack(self, body: dict[str, Any]) -> None:
        ids = body.get("ids", [])
        try:
            await self.store.mark_acked(ids)
        except StoreError as exc:  # the results stay stored; they are re-sent and acked again later
            log.error("could not record result acks: %s", exc)
            return
        for i in ids:
            self._sent_at.pop(i, None)

    async def _on_error(self, body: dict[str, Any]) -> None:
        if body.get("code") == "hello_required":
            raise _HelloRequired()
        log.error("hub refused: %s", body.get("message", body))

    # ------------------------------------------------------------------ execution
    def _submit(self, rows: list[tuple[str, str, bytes, float | None, float | None]], bodies: dict[str, bytes]) -> None:
        now = self._now()
        batch: list[EngineTask] = []
        for task_id, fid, args, timeout, exp in rows:
            if task_id in self._in_engine:
                continue
            refusal = self._refusal(fid)
            if refusal is not None:
                self.stats["refused_tasks"] += 1
                log.warning("refused task %s: %s", task_id, refusal)
                self._on_results([error_result(task_id, "mesh_agent.FunctionNotAllowed", refusal)])
            elif fid not in bodies:
                self._on_results([error_result(task_id, "mesh_agent.FunctionMissing", f"function {fid} not stored")])
            elif exp and now > exp:
                self._on_results([error_result(task_id, "mesh_agent.TaskExpired", f"task expired {now - exp:.0f}s before it could run")])
            else:
                self._in_engine.add(task_id)
                batch.append(EngineTask(task_id, fid, bodies[fid], args, timeout))
        if batch:
            self.engine.submit(batch)

    def _refusal(self, fid: str) -> str | None:
        """Why this function may not run here (allow-lists), or None. Checked before any code is loaded."""
        if self._local_allow is not None and fid not in self._local_allow:
            return f"function {fid} is not on this device's allow-list (allowed_functions in its config)"
        if self._hub_allow is not None and fid not in self._hub_allow:
            return f"function {fid} is not on endpoint {self.endpoint_id}'s allow-list"
        return None

    def _on_results(self, results: list[EngineResult]) -> None:
        self._pending.extend(results)
        self._pending_event.set()

    async def _save_pending(self) -> list[StoredResult]:
        batch, self._pending = self._retry + self._pending, []
        self._retry = []
        self._pending_event.clear()
        if not batch:
            return []
        stored = [StoredResult(r.task_id, r.ok, r.data, r.started, r.finished, r.worker_pid) for r in map(_fit, batch)]
        try:
            await self.store.save_results(stored)
        except StoreError:
            self._retry = batch
            raise
        for r in batch:
            self._in_engine.discard(r.task_id)
        return stored

    async def _flush_results_forever(self) -> None:
        while True:
            await self._pending_event.wait()
            try:
                stored = await self._save_pending()
            except StoreError as exc:
                # Not written, so not sent (a result is stored before it leaves). Keep them in
                # memory and retry; should the agent die meanwhile, their tasks are still stored
                # without a result and run again on restart.
                self.stats["store_failures"] += 1
                log.error("could not store %d results, holding them and retrying in %.0fs: %s", len(self._retry), _STORE_RETRY_S, exc)
                await asyncio.sleep(_STORE_RETRY_S)
                self._pending_event.set()
                continue
            if not stored or not self._welcomed.is_set():
                continue
            try:
                await self._send_results(stored)
                await self._maybe_fetch()
            except LinkError:
                pass  # stored; re-sent after reconnect

    async def _send_results(self, results: list[StoredResult]) -> None:
        now = time.time()
        for chunk in _frames_of(results):
            await self._send(
                Kind.RESULTS,
                {"results": [{"id": r.id, "ok": r.ok, "data": r.data, "started": r.started, "finished": r.finished, "pid": r.worker_pid} for r in chunk]},
            )
            for r in chunk:
                self._sent_at[r.id] = now
            self.stats["results_sent"] += len(chunk)

    async def _resend_stale_results(self, all_of_them: bool = False) -> None:
        cutoff = time.time() - _RESEND_AFTER_S
        stale = [
            r for r in await self.store.unacked_results(limit=50_000)
            if all_of_them or self._sent_at.get(r.id, 0.0) < cutoff
        ]
        if stale:
            await self._send_results(stale)


def _fit(r: EngineResult) -> EngineResult:
    """A result too big for one frame becomes a clear error instead of a frame re-sent forever."""
    if len(r.data) <= _MAX_RESULT_BYTES:
        return r
    return error_result(
        r.task_id, "mesh_agent.ResultTooLarge",
        f"result of {len(r.data)} bytes exceeds the {_MAX_RESULT_BYTES}-byte limit; return a reference to staged data instead",
        started=r.started, worker_pid=r.worker_pid,
    )


def _frames_of(results: list[StoredResult]) -> list[list[StoredResult]]:
    """Split by count and by bytes, so no frame comes near MAX_FRAME_BYTES."""
    frames: list[list[StoredResult]] = [[]]
    size = 0
    for r in results:
        if frames[-1] and (len(frames[-1]) >= _RESULTS_PER_FRAME or size + len(r.data) > _FRAME_BUDGET):
            frames.append([])
            size = 0
        frames[-1].append(r)
        size += len(r.data)
    return [f for f in frames if f]


_HANDLERS = {
    Kind.WELCOME: Agent._on_welcome,
    Kind.TASKS: Agent._on_tasks,
    Kind.RESULT_ACK: Agent._on_result_ack,
    Kind.ERROR: Agent._on_error,
}
