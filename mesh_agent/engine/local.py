"""LocalEngine: a pool of warm worker processes driven from the agent's asyncio event loop.

Design, and why:

* **Warm workers, fresh interpreters.** Starting a process per task costs far more than a no-op
  task, so workers start once and keep deserialized functions cached by id; each body crosses a
  given worker's pipe once. A worker is a fresh ``python`` started with ``subprocess`` (never
  ``fork``: the agent has threads, and forking a threaded process can deadlock the child), talking
  over a socketpair. Not ``multiprocessing``'s ``spawn``: that also starts its resource-tracker
  process (13 MB resident on its own) and re-imports the agent's ``__main__`` in every worker.
* **On demand (small devices).** With ``idle_s`` set, no worker exists until the first task, and
  workers idle that long are ended (``worker_idle_s`` in the agent config). A worker is only
  reaped with nothing dispatched to it, so a task that arrives meanwhile simply starts a new one:
  none is lost. ``capacity`` stays the configured pool size, which is what the hub is told.
* **No thread per worker.** Each worker's pipe is registered with ``loop.add_reader``; the
  parent side is non-blocking with its own output buffer (``add_writer``), so a large argument
  blob never stalls the event loop while a busy worker is not reading.
* **Chunks out, batched reads in.** Tasks go out in chunks of up to ``max_batch``; each result is
  written by the worker as soon as it exists (so a crash never loses a finished result, see
  ``_worker``) and the parent reads whatever has piled up in one go, delivering it as one
  ``on_results`` call. At most two chunks' worth are in flight per worker: enough that a worker
  never waits for the parent, few enough that work stays balanced between workers.
* **Timeouts without start messages.** Workers report results in order, so the task running on
  a worker is the head of its in-flight queue and it started no later than when the previous
  result arrived (or when it was dispatched to an idle worker). That estimate can only be late,
  so a task is never killed early. A single timer, armed only while tasks run, kills a worker
  whose current task overran.
* **Warm pools per environment** (docs/environments.md). A task may carry an environment spec
  (a venv, a container, a sandbox): its workers are a pool of their own kind, built first by
  :class:`~mesh_agent.engine.environments.Environments` while the task waits. All kinds share
  the pool size, as OpenWhisk's invokers share memory between containers: the agent's own kind
  is the prewarmed "stem cell" pool, a kind with queued tasks and no free slot evicts an idle
  worker of another kind, and workers of an environment stay warm for ``env_idle_s`` after their
  last task, then are reaped (and, in a warm pool, the default workers come back).
* **Cancellation** (:meth:`LocalEngine.cancel`). A queued task is dropped; a running one ends
  the way a timeout does: its worker is killed, its other tasks go back to the front of the
  queue, and a fresh worker takes its place. A task already sent to a worker behind the one it
  runs is ended the same way once it comes to run (the timeout timer checks it). Every cancelled
  task the engine held gets one ``mesh_agent.TaskCancelled`` result.
* **Crash isolation.** A dead worker shows up as EOF on its pipe: its current task fails with
  ``WorkerDied``, the rest of its tasks go back to the front of the queue, and a fresh worker
  takes its place. Nothing a task does can take the engine down.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import math
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mesh_agent import costs
from mesh_agent.engine.environments import DEFAULT_KIND, EnvError, Environments, WorkerKind, _bootstrap_dirs, channel_prefix, sandbox_environ
from mesh_agent.engine._channel import MAX_FRAME, ChannelError, decode_worker_frame, encode_chunk
from mesh_agent.protocol.serialize import serialize

__all__ = [
    "ENVIRONMENT_ERROR",
    "TASK_CANCELLED",
    "TASK_TIMEOUT",
    "WORKER_DIED",
    "EngineResult",
    "EngineTask",
    "LocalEngine",
    "TaskTimeout",
    "WorkerDied",
    "error_result",
]

log = logging.getLogger(__name__)

TASK_TIMEOUT = "mesh_agent.engine.TaskTimeout"
WORKER_DIED = "mesh_agent.engine.WorkerDied"
ENVIRONMENT_ERROR = "mesh_agent.engine.EnvError"
#: A task its submitter cancelled (mesh_agent.protocol.bodies.TASK_CANCELLED; a test checks they agree:
#: the engine does not import the envelope code for it).
TASK_CANCELLED = "mesh_agent.TaskCancelled"

_TICK = 0.1  # seconds between timeout checks, only while tasks are running
_READ_SIZE = 1 << 18
_START_TIMEOUT = 120.0  # a Raspberry Pi with a cold SD card can take a while to import
_RESPAWN_DELAY = 1.0  # after a worker died before it was ready: avoid a hot crash loop
_MAX_START_FAILURES = 3  # an environment's workers that die starting this often in a row: its tasks fail
_OUTPUT_PER_TASK = 16 * 1024  # bytes of a task's stdout/stderr the agent's log keeps
_OUTPUT_LINE = 1000  # characters of one output line in the log
_HEADER = struct.Struct("!i")  # multiprocessing.Connection framing, which the worker reads
_BIG = struct.Struct("!Q")


class TaskTimeout(Exception):
    """A task ran past its timeout; its worker was killed."""

    __module__ = "mesh_agent.engine"  # the public name, so the type string and pickles agree


class WorkerDied(Exception):
    """The worker running a task died (crash, signal, out of memory)."""

    __module__ = "mesh_agent.engine"


@dataclass(slots=True)
class EngineTask:
    task_id: str
    function_id: str
    function_body: bytes  # output of serialize_function(fn)
    args: bytes  # output of serialize((args_tuple, kwargs_dict))
    timeout: float | None = None  # seconds; None -> engine default (which may be None: no limit)
    env: dict | None = None  # normalized environment spec (mesh_agent.protocol.environment); None: the agent's Python
    now: bool = False  # start at once: a free pool worker or one more, never behind the queue (a multiprocessing Process)


@dataclass(slots=True)
class EngineResult:
    task_id: str
    ok: bool
    data: bytes  # ok: serialize(return value); not ok: serialize(error dict), see make_error
    started: float  # time.time() when the function started in the worker (or failure detected)
    finished: float  # time.time() when it finished
    worker_pid: int  # 0 if no worker was involved


def error_result(
    task_id: str,
    exc_type: str,
    message: str,
    tb: str = "",
    exception: bytes | None = None,
    started: float | None = None,
    worker_pid: int = 0,
) -> EngineResult:
    """A failed result for an engine-level failure (timeout, dead worker), same dict as user errors."""
    now = time.time()
    error = {"type": exc_type, "message": message, "traceback": tb, "exception": exception}
    return EngineResult(task_id, False, serialize(error), now if started is None else started, now, worker_pid)


def _pickled(exc: BaseException) -> bytes | None:
    try:
        return pickle.dumps(exc, protocol=5)
    except Exception:
        return None


def _describe_exit(pid: int, code: int | None) -> str:
    if code is None:
        return f"worker {pid} closed its pipe and was killed"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"worker {pid} was killed by signal {-code} ({name})"
    return f"worker {pid} exited with code {code}"


#: What a worker interpreter runs first: the parent's import path (so functions pickled by reference
#: to a module the agent can import load there too), then the worker loop. Nothing else is imported.
_BOOT = "import sys,json;a=json.loads(sys.argv[1]);sys.path[:]=a['path'];from mesh_agent.engine._worker import boot;boot(a)"


class _Proc:
    """A worker process started with ``subprocess``, with the few calls the engine makes."""

    __slots__ = ("popen", "pid")

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        """Exit code once it exited (negative: killed by that signal), else None. Never blocks."""
        return self.popen.poll()

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()


@dataclass(eq=False, slots=True)
class _Worker:
    """Parent-side state of one worker process."""

    process: _Proc
    conn: socket.socket
    fd: int
    pid: int
    ready: asyncio.Future[None]  # what start() awaits
    exited: asyncio.Future[int | None]
    is_ready: bool = False  # imported and reported ready: may take tasks
    alive: bool = True
    inflight: deque[EngineTask] = field(default_factory=deque)  # dispatched, in run order
    head_started: float = 0.0  # time.monotonic() by which inflight[0] had started, at the latest
    spawned_at: float = field(default_factory=time.time)  # wall clock when the agent started it
    cached: set[str] = field(default_factory=set)  # function ids whose body this worker got
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    writing: bool = False
    kind: WorkerKind = DEFAULT_KIND
    violation: str | None = None  # why the agent ended it: the frame it sent broke the channel's format
    out_fd: int = -1  # its stdout+stderr pipe
    out_task: str = ""  # the task its output is attributed to
    out_logged: int = 0  # bytes of that task's output written to the agent's log
    out_dropped: int = 0  # and bytes beyond the bound, dropped
    extra: bool = False  # started for one task that must start now, outside the pool's count; ends with it


class LocalEngine:
    """Runs tasks on a pool of warm worker processes; results go to ``on_results`` in batches."""

    def __init__(
        self,
        on_results: Callable[[list[EngineResult]], None],
        workers: int | None = None,
        task_timeout: float | None = None,
        memory_limit_mb: int | None = None,
        max_batch: int = 32,
        idle_s: float | None = None,
        environments: Environments | None = None,
        env_idle_s: float = 300.0,
        prewarm: Sequence[dict] = (),
        now_max: int | None = None,
    ) -> None:
        """``idle_s``: None keeps the whole pool warm from ``start()`` on (LAN, HPC); a number
        starts workers on demand and ends those idle that long (small devices).
        ``environments``: builds venvs and wraps sandboxes/containers for tasks that ask for
        them (None: such tasks fail with a clear error); ``env_idle_s``: keep-warm time of
        an environment's workers after their last task. ``prewarm``: normalized specs built at
        start, each with one worker kept warm (OpenWhisk's prewarmed containers of a kind)."""
        self._on_results = on_results
        self._size = max(1, workers if workers is not None else (os.cpu_count() or 1))
        self._task_timeout = task_timeout
        self._memory_limit_mb = memory_limit_mb
        self._max_batch = max(1, max_batch)
        self._idle_s = idle_s
        #: workers beyond the pool for tasks that must start now (None: 4 per pool worker, at least 8)
        self._now_max = max(8, 4 * self._size) if now_max is None else max(0, now_max)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: list[_Worker] = []
        self._queue: deque[EngineTask] = deque()  # the default kind's queue
        self._queues: dict[str, deque[EngineTask]] = {"": self._queue}  # per worker kind key
        self._envs = environments
        self._env_idle_s = max(0.0, env_idle_s)
        self._kinds: dict[str, WorkerKind] = {}  # spec id -> ready kind
        self._parked: dict[str, list[EngineTask]] = {}  # spec id -> tasks waiting for its build
        self._builds: set[asyncio.Task[None]] = set()
        self._start_failures: dict[str, int] = {}  # environment kind -> workers that died starting, in a row
        self._prewarm: dict[str, dict] = {}  # spec id -> spec: one worker each, never reaped
        if prewarm:
            from mesh_agent.protocol.environment import env_id

            self._prewarm = {env_id(s): s for s in prewarm}
        self._exits: dict[_Proc, asyncio.Future[int | None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._reaper: asyncio.TimerHandle | None = None
        self._idle_since: dict[_Worker, float] = {}  # ready workers with nothing dispatched, since (monotonic)
        self._started = False
        self._stopping = False
        #: Counters for tests, benchmarks and the agent's status page.
        self.stats: dict[str, int] = {
            "tasks_submitted": 0,
            "results": 0,
            "chunks_sent": 0,
            "bodies_sent": 0,
            "workers_spawned": 0,
            "timeouts": 0,
            "worker_deaths": 0,
            "workers_reaped": 0,
            "workers_evicted": 0,
            "env_failures": 0,
            "protocol_violations": 0,
            "started_now_extra": 0,
            "started_now_idle": 0,
            "refused_now": 0,
            "cancelled": 0,
            "cancelled_running": 0,
        }
        #: cancelled tasks already sent to a worker behind the one it runs: ended when they come to run
        self._cancelling: set[str] = set()

    # ------------------------------------------------------------------ public interface

    @property
    def workers(self) -> int:
        """Live worker processes, including replacements still starting."""
        return len(self._workers)

    @property
    def capacity(self) -> int:
        """Tasks this engine runs at once: the pool size, whether or not its workers are up now."""
        return self._size

    @property
    def on_demand(self) -> bool:
        return self._idle_s is not None

    @property
    def worker_pids(self) -> list[int]:
        """Pids of live workers that are ready to take tasks."""
        return [w.pid for w in self._workers if w.is_ready]

    @property
    def running(self) -> int:
        """Tasks dispatched to the pool's workers and not yet reported (not those on extra workers:
        they take none of the pool's slots, so the agent's fetch credit does not count them)."""
        return sum(len(w.inflight) for w in self._workers if not w.extra)

    @property
    def running_extra(self) -> int:
        """Workers started beyond the pool for tasks that must start now, still running them."""
        return sum(1 for w in self._workers if w.extra)

    @property
    def queued(self) -> int:
        """Tasks waiting in the engine for a worker (or for their environment's build)."""
        return sum(len(q) for q in self._queues.values()) + sum(len(p) for p in self._parked.values())

    def held_environments(self) -> list[str]:
        """Spec ids whose venv this endpoint holds (no build needed), most recently used first (heartbeats, scheduler)."""
        return self._envs.held_specs() if self._envs is not None else []

    def environment_builds(self) -> dict[str, tuple[float, int]]:
        """Spec id -> (seconds, bytes fetched) of recent builds here (heartbeats, scheduler)."""
        return dict(self._envs.builds) if self._envs is not None else {}

    def warm_environments(self) -> dict[str, int]:
        """Live workers per environment spec id (the agent's own kind is ``""``)."""
        out: dict[str, int] = {}
        for w in self._workers:
            out[w.kind.key] = out.get(w.kind.key, 0) + 1
        return out

    def warm_functions(self) -> list[str]:
        """Function ids cached in at least one live worker."""
        return sorted(set().union(*(w.cached for w in self._workers)))

    async def start(self) -> None:
        """Spawn all workers and return once every one has imported and reported ready.

        On demand (``idle_s`` set) nothing is spawned here: the first tasks start workers."""
        if self._started:
            raise RuntimeError("engine already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        if not self.on_demand:
            spawned = [self._spawn() for _ in range(self._size)]
            try:
                await asyncio.wait_for(asyncio.gather(*(w.ready for w in spawned)), _START_TIMEOUT)
            except BaseException:
                await self.stop(grace=0)
                raise
            self._pump()
        if self._prewarm and self._envs is not None:  # built in the background: start() does not wait for uv
            for sid, spec in self._prewarm.items():
                self._parked.setdefault(sid, [])
                self._start_build(sid, spec)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting tasks and end all workers: SIGTERM, then SIGKILL after ``grace`` seconds.

        Unfinished tasks are not reported: the agent's durable queue runs them again next start.
        """
        if self._stopping:
            return
        self._stopping = True
        for q in self._queues.values():
            q.clear()
        self._parked.clear()
        for b in list(self._builds):
            b.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for w in list(self._workers):
            self._detach(w)
            w.inflight.clear()
            if not w.ready.done():
                w.ready.set_exception(RuntimeError("engine stopped while the worker was starting"))
                w.ready.exception()  # mark retrieved: nobody may be waiting on it
            with contextlib.suppress(Exception):
                w.process.terminate()
        pending = [fut for fut in self._exits.values() if not fut.done()]
        if not pending:
            return
        _done, late = await asyncio.wait(pending, timeout=max(grace, 0.0))
        if late:
            for proc, fut in list(self._exits.items()):
                if not fut.done():
                    with contextlib.suppress(Exception):
                        proc.kill()
            _done, late = await asyncio.wait(late, timeout=5.0)
            if late:
                log.error("%d worker(s) did not exit after SIGKILL", len(late))

    def submit(self, tasks: list[EngineTask]) -> None:
        """Queue tasks (FIFO) and dispatch what fits; never blocks. Call from the loop thread."""
        if self._stopping:
            raise RuntimeError("engine is stopped")
        self.stats["tasks_submitted"] += len(tasks)
        failed: list[EngineResult] = []
        for t in tasks:
            if t.now and t.env is None:
                refused = self._start_now(t)
                if refused is not None:
                    failed.append(refused)
                continue
            if t.env is None:
                self._queue.append(t)
                continue
            from mesh_agent.protocol.environment import env_id  # hashlib: loaded only once a task names an environment

            sid = env_id(t.env)
            if sid in self._kinds:
                self._queues.setdefault(sid, deque()).append(t)
            elif self._envs is None:
                failed.append(error_result(t.task_id, ENVIRONMENT_ERROR, "this endpoint's engine does not run tasks in "
                                           "environments (no environments configured)"))
            elif sid in self._envs.failed:  # failed before: no rebuild until the spec changes
                self._envs.stats.refused += 1
                failed.append(self._env_failure(t, self._envs.failed[sid]))
            else:
                parked = self._parked.setdefault(sid, [])
                parked.append(t)
                if len(parked) == 1:
                    self._start_build(sid, t.env)
        self._pump()
        if failed:
            self._deliver(failed)

    def _start_now(self, t: EngineTask) -> EngineResult | None:
        """A task that must start at once (a multiprocessing Process, which may be waited for by
        the very tasks that fill the pool: a Barrier). It goes to an idle ready pool worker, else
        to one more worker outside the pool's count, up to ``now_max``; that worker ends with the
        task. Beyond the cap it fails now, with the reason, rather than waiting (as ``fork``
        fails with EAGAIN)."""
        # Never through the queue: a queued task goes to the least-loaded *ready* worker, which
        # may be busy (a pool still growing on demand, replacements booting after a cancel), and
        # would wait there behind a running task. So: straight to an idle ready pool worker, else
        # to a worker of its own.
        idle = [w for w in self._workers if not w.extra and not w.kind.key and w.is_ready and not w.inflight]
        if idle and self._started:
            w = idle[0]
            self._idle_since.pop(w, None)
            self.stats["started_now_idle"] += 1
            w.head_started = time.monotonic()
            body = None if t.function_id in w.cached else t.function_body
            w.cached.add(t.function_id)
            w.inflight.append(t)
            self._send(w, encode_chunk([(t.task_id, t.function_id, body, t.args)]))
            self._arm_timer()
            return None
        extra = self.running_extra
        if extra >= self._now_max or self._loop is None:
            self.stats["refused_now"] += 1
            message = (f"cannot start task {t.task_id} now: all {self._size} worker slots of this endpoint are in use and "
                       f"{extra} extra workers run other tasks that must start at once (cap {self._now_max}: raise "
                       "start_now_max in the agent's config, or MESH_START_NOW_MAX)")
            exc = BlockingIOError(errno.EAGAIN, message)
            return error_result(t.task_id, "BlockingIOError", message, exception=_pickled(exc))
        w = self._spawn()
        w.extra = True
        self.stats["started_now_extra"] += 1
        w.head_started = time.monotonic()
        w.cached.add(t.function_id)
        w.inflight.append(t)
        self._send(w, encode_chunk([(t.task_id, t.function_id, t.function_body, t.args)]))  # read once it has booted
        self._arm_timer()
        return None

    def _pool(self) -> list[_Worker]:
        """The pool's workers (not the extra ones started for tasks that must start now)."""
        return [w for w in self._workers if not w.extra]

    def cancel(self, task_ids: "Sequence[str] | set[str]") -> list[str]:
        """Cancel tasks this engine holds: queued ones (or waiting for their environment) are
        dropped; a running one's worker is killed and replaced, as for a timeout (its other
        tasks go back to the front of the queue). Each gets one ``mesh_agent.TaskCancelled``
        result. Returns the ids found here (running, queued, or sent to a worker behind another
        task: that one is ended when it comes to run). Call from the loop thread."""
        want = set(task_ids)
        if not want or self._stopping:
            return []
        found: list[str] = []
        out: list[EngineResult] = []
        for w in list(self._workers):
            if not w.alive or not any(t.task_id in want for t in w.inflight):
                continue
            if w.inflight[0].task_id in want:
                self._on_readable(w)  # its result may already be waiting in the pipe
            if w.alive and w.inflight and w.inflight[0].task_id in want:
                head = w.inflight[0]
                found.append(head.task_id)
                out.extend(self._kill_for_cancel(w, head))  # the rest of its tasks went back to the queue
            elif w.alive:
                for t in w.inflight:
                    if t.task_id in want:
                        found.append(t.task_id)
                        self._cancelling.add(t.task_id)
        for queue in list(self._queues.values()) + list(self._parked.values()):
            gone = [t for t in queue if t.task_id in want]
            if not gone:
                continue
            keep = [t for t in queue if t.task_id not in want]
            queue.clear()
            queue.extend(keep)
            for t in gone:
                found.append(t.task_id)
                out.append(error_result(t.task_id, TASK_CANCELLED, f"task {t.task_id} was cancelled by its submitter before it ran"))
        self.stats["cancelled"] += len(out)
        self._pump()
        if out:
            self._deliver(out)
        return found

    def _kill_for_cancel(self, w: _Worker, task: EngineTask) -> list[EngineResult]:
        """End the worker running a cancelled task (the timeout path): its other tasks go back to
        the front of the queue (less those cancelled too), a fresh worker takes its place. Returns
        the cancelled tasks' results."""
        started = time.time() - (time.monotonic() - w.head_started)
        self._retire(w)
        self._cancelling.discard(task.task_id)
        self.stats["cancelled_running"] += 1
        message = f"task {task.task_id} was cancelled by its submitter while it ran; worker {w.pid} was killed"
        log.info("%s", message, extra={"task_id": task.task_id, "function_id": task.function_id})
        out = [error_result(task.task_id, TASK_CANCELLED, message, started=started, worker_pid=w.pid)]
        queue = self._queues.get(w.kind.key)
        if self._cancelling and queue:
            gone = [t for t in queue if t.task_id in self._cancelling]
            if gone:
                keep = [t for t in queue if t.task_id not in self._cancelling]
                queue.clear()
                queue.extend(keep)
                for t in gone:
                    self._cancelling.discard(t.task_id)
                    out.append(error_result(t.task_id, TASK_CANCELLED, f"task {t.task_id} was cancelled by its submitter before it ran"))
        self._replace(w)
        return out

    # ------------------------------------------------------------------ environments

    def _env_failure(self, t: EngineTask, message: str) -> EngineResult:
        self.stats["env_failures"] += 1
        return error_result(t.task_id, ENVIRONMENT_ERROR, message, exception=_pickled(EnvError(message)))

    def _start_build(self, sid: str, spec: dict) -> None:
        assert self._loop is not None
        build = self._loop.create_task(self._build(sid, spec), name=f"env-{sid}")
        self._builds.add(build)
        build.add_done_callback(self._builds.discard)

    async def _build(self, sid: str, spec: dict) -> None:
        """Prepare a kind while its tasks wait parked; then queue them, or fail them all."""
        assert self._envs is not None
        in_use = {w.kind.venv for w in self._workers if w.kind.venv}
        try:
            kind = await self._envs.kind(spec, in_use)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EnvError, or a bug: either way the tasks get the message, the engine lives
            message = str(exc) if isinstance(exc, EnvError) else f"environment {sid} could not be prepared: {exc!r}"
            log.warning("environment %s: %s", sid, message)
            parked = self._parked.pop(sid, [])
            if not self._stopping and parked:
                self._deliver([self._env_failure(t, message) for t in parked])
            return
        held = set(self._envs.held())
        for k, v in list(self._kinds.items()):  # kinds whose venv the LRU evicted are built again on next use
            if v.venv is not None and v.venv not in held:
                del self._kinds[k]
        self._kinds[sid] = kind
        parked = self._parked.pop(sid, [])
        if self._stopping:
            return
        self._queues.setdefault(sid, deque()).extend(parked)
        if sid in self._prewarm and not any(w.kind.key == sid for w in self._workers) \
                and (len(self._workers) < self._size or self._evict_idle(sid)):
            self._spawn(kind)  # the prewarmed worker of this kind
        self._pump()

    # ------------------------------------------------------------------ workers

    def _spawn(self, kind: WorkerKind = DEFAULT_KIND) -> _Worker:
        assert self._loop is not None
        parent_sock, child_sock = socket.socketpair()
        path = list(kind.path)
        if kind.python:  # the agent's interpreter or a venv's: our import path behind the venv's own
            # The bootstrap first: with an editable install ``mesh_agent`` is found through a .pth
            # finder that only site.py runs, so a venv worker started from another directory could
            # not import it from the agent's sys.path alone.
            path += [*_bootstrap_dirs(), *(p if p else os.getcwd() for p in sys.path)]
        # Wrapped (bwrap, a container): our pid is not the worker's parent; the wrapper dies with us instead.
        prefix, worker_fd = channel_prefix(kind, child_sock.fileno())
        args = {"fd": worker_fd, "mem": self._memory_limit_mb, "ppid": 0 if kind.wrap else os.getpid(), "path": path}
        argv = [*prefix, *kind.wrap, *([kind.python] if kind.python else []), "-c", _BOOT, json.dumps(args)]
        try:
            popen = subprocess.Popen(
                argv,
                pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL,
                # Its own stdio: a pipe the agent reads, bounded and attributed to the task, never the
                # agent's log file (which /proc/self/fd/1 would otherwise reopen; issue 25).
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=False,  # same process group: a kill of the agent's group ends workers too
                env=sandbox_environ(os.environ, kind.env) if kind.clean_env else ({**os.environ, **dict(kind.env)} if kind.env else None),
                cwd=kind.cwd if kind.cwd and not kind.wrap else None,
            )
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        proc = _Proc(popen)
        fd = parent_sock.fileno()
        os.set_blocking(fd, False)
        w = _Worker(proc, parent_sock, fd, proc.pid, self._loop.create_future(), self._watch_exit(proc), kind=kind)
        assert popen.stdout is not None
        w.out_fd = popen.stdout.fileno()
        os.set_blocking(w.out_fd, False)
        self._workers.append(w)
        self._loop.add_reader(fd, self._on_readable, w)
        self._loop.add_reader(w.out_fd, self._on_output, w)
        self.stats["workers_spawned"] += 1
        return w

    def _grow(self) -> None:
        """Start workers of each kind with queued tasks, within the pool size; when the pool is
        full, an idle worker of another kind makes room (OpenWhisk's eviction of idle containers).
        A warm default pool is full from ``start()``: it only grows back into room it gave up."""
        if self._stopping or not self._started:
            return
        for key, queue in list(self._queues.items()):
            if not queue:
                continue
            if key and key not in self._kinds:
                continue  # evicted meanwhile: rebuilt on its next submit
            idle = sum(1 for w in self._workers if w.kind.key == key and not w.inflight and not w.extra)
            need = len(queue) - idle
            while need > 0 and (len(self._pool()) < self._size or self._evict_idle(key)):
                self._spawn(self._kinds[key] if key else DEFAULT_KIND)
                need -= 1

    def _evict_idle(self, key: str) -> bool:
        """End one idle ready worker of a kind other than ``key``, longest idle first. One whose own
        kind still has queued tasks goes only while ``key`` has no worker at all: every kind with
        work keeps a worker, and two kinds with steady work (a shared endpoint running its owner's
        tasks next to other users' sandboxed ones, dispatched fairly) do not restart a worker for
        almost every task (measured before this rule: 4,184 restarts, 100 short tasks not done in 300 s)."""
        starving = not any(w.kind.key == key for w in self._workers)
        idle = [w for w in self._workers if w.kind.key != key and w.is_ready and not w.inflight and not w.extra
                and (starving or not self._queues.get(w.kind.key))]
        if not idle:
            return False
        w = min(idle, key=lambda x: self._idle_since.get(x, math.inf))
        self._detach(w)
        self.stats["workers_evicted"] += 1
        log.info("engine worker %d (%s) ended to make room for environment %s", w.pid, w.kind.key or "default", key or "default")
        return True

    def _keep_warm(self, w: _Worker) -> float | None:
        """How long ``w`` may idle before it is reaped; None: never (a warm default pool)."""
        if w.kind.key in self._prewarm and sum(1 for x in self._workers if x.kind.key == w.kind.key) <= 1:
            return None  # the one prewarmed worker of its kind stays (it may still be evicted for room)
        if w.kind.key:
            return max(self._env_idle_s, float(self._idle_s or 0.0))
        return self._idle_s

    def _note_idle(self) -> None:
        """Track how long each ready worker has had nothing to do; arm the reaper for those that
        may be reaped (on demand, and any environment's workers)."""
        if self._stopping or self._loop is None:
            return
        now = time.monotonic()
        for w in self._workers:
            if w.is_ready and not w.inflight:
                self._idle_since.setdefault(w, now)
            else:
                self._idle_since.pop(w, None)
        dues = [since + limit for w, since in self._idle_since.items() if (limit := self._keep_warm(w)) is not None]
        if dues and self._reaper is None:
            self._reaper = self._loop.call_at(self._loop.time() + max(0.0, min(dues) - now), self._reap)

    def _reap(self) -> None:
        """End workers idle for ``idle_s``. Only workers with nothing dispatched are ended, and only
        from the event loop, so no task can be on its way to one: none is ever lost."""
        self._reaper = None
        if self._stopping:
            return
        now = time.monotonic()
        for w, since in list(self._idle_since.items()):
            limit = self._keep_warm(w)
            if not w.alive or w.inflight or not w.is_ready:
                self._idle_since.pop(w, None)
            elif limit is not None and now - since >= limit:
                self._idle_since.pop(w, None)
                self._detach(w)  # closing our end is EOF for the worker: it exits by itself
                self.stats["workers_reaped"] += 1
                log.info("engine worker %d (%s) idle for %.0fs: ended", w.pid, w.kind.key or "default", now - since)
        self._refill()
        self._note_idle()

    def _refill(self) -> None:
        """A warm pool prewarms its default workers back into slots environments gave up."""
        if self.on_demand or self._stopping or not self._started:
            return
        while len(self._pool()) < self._size and not any(q for k, q in self._queues.items() if k):
            self._spawn()

    def _replace(self, lost: _Worker) -> None:
        """Keep the pool at full size; a worker that never got ready is replaced after a pause."""
        if self._stopping or not self._started or self._loop is None or lost.extra:
            return  # an extra worker is never replaced: it ran one task that had to start now
        if self.on_demand or lost.kind.key:  # replaced when tasks need one (now, if some wait)
            if lost.is_ready:
                self._grow()
            else:
                self._loop.call_later(_RESPAWN_DELAY, self._grow)
            return
        if lost.is_ready:
            self._grow()
            self._refill()
        else:
            self._loop.call_later(_RESPAWN_DELAY, self._replace_late)

    def _replace_late(self) -> None:
        if not self._stopping:
            self._grow()
            self._refill()

    def _watch_exit(self, proc: _Proc) -> asyncio.Future[int | None]:
        """A future for the exit code, set from the event loop once the process has exited.

        A pidfd (Linux >= 5.3) is readable exactly when the process exits; elsewhere the exit
        code is polled twice a second.
        """
        assert self._loop is not None
        loop = self._loop
        fut: asyncio.Future[int | None] = loop.create_future()
        self._exits[proc] = fut
        try:
            fd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            fd = None

        def check() -> None:
            code = proc.exitcode  # non-blocking waitpid
            if code is None:
                if fd is None:
                    loop.call_later(0.5, check)
                return
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
            self._exits.pop(proc, None)
            if not fut.done():
                fut.set_result(code)

        if fd is not None:
            loop.add_reader(fd, check)
        else:
            loop.call_later(0.5, check)
        return fut

    def _on_output(self, w: _Worker, final: bool = False) -> None:
        """What a worker printed: into the agent's log, each line attributed to the task running
        (the head of its in-flight queue), at most ``_OUTPUT_PER_TASK`` bytes per task, control
        characters escaped so no line can forge another log record. The rest is counted and dropped."""
        for _ in range(64 if final else 1):
            try:
                data = os.read(w.out_fd, _READ_SIZE)
            except (BlockingIOError, OSError):
                return
            if not data:
                self._close_output(w)
                return
            task = w.inflight[0].task_id if w.inflight else ""
            if task != w.out_task:
                self._note_dropped_output(w)
                w.out_task, w.out_logged, w.out_dropped = task, 0, 0
            room = max(0, _OUTPUT_PER_TASK - w.out_logged)
            keep, over = data[:room], max(0, len(data) - room)
            w.out_logged += len(keep)
            for line in keep.decode(errors="replace").splitlines():
                line = line.encode("unicode_escape").decode("ascii")[:_OUTPUT_LINE]
                log.info("worker %d%s: %s", w.pid, f" task {task}" if task else "", line,
                         extra={"task_id": task} if task else None)
            if over and not w.out_dropped:
                log.info("worker %d task %s: output beyond %d bytes is dropped", w.pid, task or "-", _OUTPUT_PER_TASK)
            w.out_dropped += over

    def _note_dropped_output(self, w: _Worker) -> None:
        if w.out_dropped:
            log.info("worker %d task %s: %d more bytes of output dropped (the log keeps %d per task)",
                     w.pid, w.out_task or "-", w.out_dropped, _OUTPUT_PER_TASK)
            w.out_dropped = 0

    def _close_output(self, w: _Worker) -> None:
        if w.out_fd < 0:
            return
        assert self._loop is not None
        self._loop.remove_reader(w.out_fd)
        self._note_dropped_output(w)
        with contextlib.suppress(OSError):
            w.process.popen.stdout.close()  # type: ignore[union-attr]
        w.out_fd = -1

    def _detach(self, w: _Worker) -> None:
        """Forget a worker: no more reads, writes or dispatches to it."""
        assert self._loop is not None
        if not w.alive:
            return
        if w.out_fd >= 0:  # what it printed last (a traceback as it died) still reaches the log
            self._on_output(w, final=True)
            self._close_output(w)
        w.alive = False
        self._loop.remove_reader(w.fd)
        if w.writing:
            self._loop.remove_writer(w.fd)
            w.writing = False
        w.conn.close()
        self._workers.remove(w)
        self._idle_since.pop(w, None)

    def _retire(self, w: _Worker) -> EngineTask | None:
        """Detach and kill a worker; requeue its not-yet-run tasks in front. Returns the running one."""
        self._detach(w)
        with contextlib.suppress(Exception):
            w.process.kill()  # no-op if it already died; ends one that merely closed its pipe
        head = w.inflight.popleft() if w.inflight else None
        self._queues.setdefault(w.kind.key, deque()).extendleft(reversed(w.inflight))
        w.inflight.clear()
        return head

    def _on_worker_lost(self, w: _Worker) -> None:
        """EOF on a worker's pipe: it died. Fail its current task once its exit code is known."""
        head = self._retire(w)
        if w.is_ready:
            self.stats["worker_deaths"] += 1
            log.warning("engine worker %d died", w.pid)
        else:
            log.warning("engine worker %d exited during start-up", w.pid)
            if not w.ready.done():
                w.ready.set_exception(RuntimeError(f"engine worker {w.pid} exited during start-up"))
                w.ready.exception()  # mark retrieved: only start() awaits it, not for replacements
            if w.kind.key and not any(x.kind.key == w.kind.key and x.is_ready for x in self._workers):
                n = self._start_failures[w.kind.key] = self._start_failures.get(w.kind.key, 0) + 1
                if n >= _MAX_START_FAILURES:  # it will not start here: fail its tasks, no respawn loop
                    w.exited.add_done_callback(functools.partial(self._kind_cannot_start, w.kind.key, w.pid))
                    return
        if head is not None:
            started = time.time() - (time.monotonic() - w.head_started)
            # Reported once the exit code is known: it names the cause (exit code or signal).
            w.exited.add_done_callback(functools.partial(self._report_death, w.pid, head, started, w.violation))
        self._replace(w)
        self._pump()

    def _kind_cannot_start(self, key: str, pid: int, exited: asyncio.Future[int | None]) -> None:
        """Workers of an environment died starting, again and again: fail its queued tasks and
        remember the spec as failed (not retried until it changes), as for a failed build."""
        if self._stopping:
            return
        code = None if exited.cancelled() else exited.result()
        message = (f"workers for environment {key} cannot start on this endpoint: {_MAX_START_FAILURES} in a row "
                   f"exited during start-up (last: {_describe_exit(pid, code)}; the agent's log has their output)")
        log.error("%s", message)
        self._kinds.pop(key, None)
        self._start_failures.pop(key, None)
        if self._envs is not None:
            self._envs.fail(key, message)
        queue = self._queues.pop(key, deque())
        if queue:
            self._deliver([self._env_failure(t, message) for t in queue])

    def _report_death(self, pid: int, task: EngineTask, started: float, violation: str | None,
                      exited: asyncio.Future[int | None]) -> None:
        if self._stopping:
            return
        code = None if exited.cancelled() else exited.result()
        message = f"{_describe_exit(pid, code)} while running task {task.task_id}"
        if violation is not None:
            message = (f"worker {pid} was ended while running task {task.task_id}: it wrote a malformed frame to the "
                       f"agent's channel ({violation})")
        exception = _pickled(WorkerDied(message))
        self._deliver([error_result(task.task_id, WORKER_DIED, message, exception=exception,
                                    started=started, worker_pid=pid)])

    # ------------------------------------------------------------------ I/O

    def _on_readable(self, w: _Worker) -> None:
        """Read what a worker sent, handle every complete message, deliver results in one batch."""
        with costs.stage("agent.collect"):  # the results reach the agent (on_results) inside
            try:
                data = os.read(w.fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._on_worker_lost(w)
                return
            buf = w.inbuf
            buf += data
            results: list[EngineResult] = []
            pos, end = 0, len(buf)
            while end - pos >= 4:
                (size,) = _HEADER.unpack_from(buf, pos)
                start = pos + 4
                if size == -1:
                    if end - pos < 12:
                        break
                    (size,) = _BIG.unpack_from(buf, start)
                    start += 8
                stop = start + size
                if size < 0 or size > MAX_FRAME:  # never buffer what a worker merely claims it will send
                    self._protocol_violation(w, f"frame of {size} bytes (limit {MAX_FRAME})", results)
                    return
                if stop > end:
                    break
                try:
                    msg = decode_worker_frame(memoryview(buf)[start:stop])
                except ChannelError as exc:
                    self._protocol_violation(w, str(exc), results)
                    return
                self._handle(w, msg, results)
                pos = stop
            if pos:
                del buf[:pos]
            if results:
                w.head_started = time.monotonic()  # the next task had started by now
                if w.extra and not w.inflight:
                    self._detach(w)  # its one task is done: EOF ends it (no idle process kept for it)
                with costs.stage("agent.submit"):
                    self._pump()  # refill the workers before the callback, which may take a while
                self._deliver(results)
                if not w.inflight:
                    self._note_idle()

    def _protocol_violation(self, w: _Worker, why: str, results: list[EngineResult]) -> None:
        """A worker broke the channel's format (a bug, or a function writing to the channel fd):
        the results it sent before still count, then it is ended like a crashed worker and its
        current task fails with the reason. Nothing of the frame was decoded beyond its fields."""
        self.stats["protocol_violations"] += 1
        log.warning("engine worker %d sent a malformed frame (%s); ending it", w.pid, why)
        w.violation = why
        if results:
            self._deliver(list(results))
            results.clear()
        self._on_worker_lost(w)

    def _handle(self, w: _Worker, msg: tuple, results: list[EngineResult]) -> None:
        kind = msg[0]
        if kind == "r":
            _, task_id, ok, data, started, finished = msg
            if not w.inflight or w.inflight[0].task_id != task_id:
                self._protocol_violation(w, f"result for task {task_id[:80]!r}, which is not the one it runs", results)
                return
            w.inflight.popleft()
            self._cancelling.discard(task_id)  # it finished before its turn to be ended came
            # The worker's stamps are its word, and a function may write its own frame: keep them
            # within the worker's life as the agent saw it, so no forged span reaches the hub's
            # scheduler (issue 25).
            now = time.time()
            started = min(max(started, w.spawned_at), now)
            finished = min(max(finished, started), now)
            results.append(EngineResult(task_id, ok, data, started, finished, w.pid))
        elif kind == "ready":
            w.is_ready = True
            if w.kind.key:
                self._start_failures.pop(w.kind.key, None)
            if not w.ready.done():
                w.ready.set_result(None)
            self._pump()
            self._note_idle()
        else:
            log.error("unknown message %r from engine worker %d", kind, w.pid)

    def _send(self, w: _Worker, payload: bytes) -> None:
        """Frame a message as multiprocessing.Connection does and write it without blocking."""
        n = len(payload)
        w.outbuf += _HEADER.pack(n) if n <= 0x7FFFFFFF else _HEADER.pack(-1) + _BIG.pack(n)
        w.outbuf += payload
        if not w.writing:
            self._flush(w)

    def _flush(self, w: _Worker) -> None:
        assert self._loop is not None
        try:
            sent = os.write(w.fd, w.outbuf)
        except BlockingIOError:
            sent = 0
        except OSError:  # the worker is gone; EOF on the read side reports it
            sent = len(w.outbuf)
        del w.outbuf[:sent]
        if w.outbuf and not w.writing:
            self._loop.add_writer(w.fd, self._flush, w)
            w.writing = True
        elif not w.outbuf and w.writing:
            self._loop.remove_writer(w.fd)
            w.writing = False

    def _deliver(self, results: list[EngineResult]) -> None:
        self.stats["results"] += len(results)
        try:
            self._on_results(results)
        except Exception:
            log.exception("engine on_results callback failed")

    # ------------------------------------------------------------------ scheduling

    def _pump(self) -> None:
        """Dispatch queued tasks: chunks to the least-loaded ready worker of their kind while they fit."""
        if self._stopping:
            return
        if self._queue and len(self._queues) == 1:  # the common case: one kind, no per-kind lists
            self._grow()
            self._pump_kind(self._queue, [w for w in self._workers if w.is_ready and not w.extra], self._booting(""))
        elif any(self._queues.values()):
            self._grow()
            for key, queue in self._queues.items():
                if queue:
                    self._pump_kind(queue, [w for w in self._workers if w.is_ready and w.kind.key == key and not w.extra],
                                    self._booting(key))
        self._arm_timer()

    def _booting(self, key: str) -> int:
        """Pool workers of this kind started and not ready yet (a pool growing, replacements)."""
        return sum(1 for w in self._workers if w.alive and not w.is_ready and not w.extra and w.kind.key == key)

    def _pump_kind(self, queue: deque[EngineTask], ready: list[_Worker], booting: int = 0) -> None:
        """Chunks to the least-loaded ready worker while they fit. While other workers of the
        kind boot, a ready one takes only its share of the work (queued + in flight), so the
        booting ones find work when they are ready instead of a slot left idle behind a long
        queue in one worker (seen after a cancel replaced both workers of a pool)."""
        if not ready:
            return
        max_batch = self._max_batch
        limit = 2 * max_batch
        if booting:
            share = math.ceil((len(queue) + sum(len(w.inflight) for w in ready)) / (len(ready) + booting))
            limit = min(limit, max(1, share))
        while queue:
            w = min(ready, key=lambda x: len(x.inflight))
            n = min(max_batch, math.ceil(len(queue) / (len(ready) + booting)))
            if len(w.inflight) + n > limit:
                n = limit - len(w.inflight) if booting else 0
                if n <= 0:
                    break
            self._dispatch(w, n)

    def _dispatch(self, w: _Worker, n: int) -> None:
        self._idle_since.pop(w, None)
        queue, cached, inflight = self._queues[w.kind.key], w.cached, w.inflight
        if not inflight:
            w.head_started = time.monotonic()
        chunk = []
        for _ in range(n):
            task = queue.popleft()
            fid = task.function_id
            if fid in cached:
                body = None
            else:
                body = task.function_body
                cached.add(fid)
                self.stats["bodies_sent"] += 1
            chunk.append((task.task_id, fid, body, task.args))
            inflight.append(task)
        self.stats["chunks_sent"] += 1
        if w.kind.venv is not None and self._envs is not None:
            self._envs.touch(w.kind.venv)  # LRU by use, not by when the kind was built
        self._send(w, encode_chunk(chunk))

    def _arm_timer(self) -> None:
        if self._timer is None and self._loop is not None and not self._stopping:
            if any(w.inflight for w in self._workers):
                self._timer = self._loop.call_later(_TICK, self._check_timeouts)

    def _check_timeouts(self) -> None:
        """Kill any worker whose current task has run past its timeout."""
        self._timer = None
        cancelled: list[EngineResult] = []
        for w in list(self._workers):
            if not w.alive or not w.inflight:
                continue
            task = w.inflight[0]
            if task.task_id in self._cancelling:  # a cancelled task came to run: end it as cancel() would have
                self._on_readable(w)
                if w.alive and w.inflight and w.inflight[0] is task:
                    cancelled.extend(self._kill_for_cancel(w, task))
                continue
            limit = task.timeout if task.timeout is not None else self._task_timeout
            if limit is None or time.monotonic() - w.head_started <= limit:
                continue
            self._on_readable(w)  # its result may already be waiting in the pipe
            if w.alive and w.inflight and w.inflight[0] is task:
                self._kill_for_timeout(w, task, limit)
        if cancelled:
            self.stats["cancelled"] += len(cancelled)
            self._pump()
            self._deliver(cancelled)
        self._arm_timer()

    def _kill_for_timeout(self, w: _Worker, task: EngineTask, limit: float) -> None:
        started = time.time() - (time.monotonic() - w.head_started)
        self._retire(w)
        self.stats["timeouts"] += 1
        message = f"task exceeded its {limit:g} s timeout; worker {w.pid} was killed"
        log.warning("task %s: %s", task.task_id, message, extra={"task_id": task.task_id, "function_id": task.function_id})
        self._replace(w)
        self._pump()
        self._deliver([error_result(task.task_id, TASK_TIMEOUT, message, exception=_pickled(TaskTimeout(message)),
                                    started=started, worker_pid=w.pid)])
