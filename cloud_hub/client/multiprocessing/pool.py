"""``Pool`` and ``Process`` as tasks on the mesh, through the SDK's ``Executor``.

Why on the Executor and not on long-lived workers pulling from Redis (Lithops' design): the
agents already keep warm worker processes, and the Executor already batches submits (one request
for a whole ``map``), retries through hub restarts, ships the program's own code by value and
brings remote tracebacks back. A Pool chunk is one task; the mesh runs a task at least once, so a
chunk whose agent was killed is run again from its start when that agent comes back (the agent
keeps it in its durable queue) rather than lost; chunks the hub had not sent yet go elsewhere.

``initializer(*initargs)`` runs once per worker process per Pool (the agent's workers are warm
and reused), as the standard library runs it once per pool process.
"""

from __future__ import annotations

import errno
import itertools
import os
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future, as_completed, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from multiprocessing import TimeoutError
from typing import Any, Callable, Iterable, Iterator

from cloud_hub.client._futures import cancel_and_notify
from cloud_hub.client.multiprocessing import _runner, _state
from cloud_hub.client.multiprocessing.queues import task_ended

__all__ = ["Pool", "Process", "AsyncResult", "MapResult", "cpu_count", "current_process", "active_children"]

RUN, CLOSE, TERMINATE = 0, 1, 2
#: on a worker: pool id -> the globals its initializer set in this process
_initialized: dict[str, dict[str, Any]] = {}


def _init_once(pool_id: str, initializer: Callable[..., Any] | None, initargs: tuple[Any, ...], fn: Callable[..., Any]) -> None:
    """Run the Pool's initializer once per worker process, and give every later task of the pool
    the globals it set. Why the copy: a function of ``__main__`` arrives by value with a fresh
    globals dict per task, where a stdlib pool process keeps one ``__main__`` for its life; the
    initializer's ``global x`` assignments are the standard way to hand a pool shared state."""
    if initializer is None:
        return
    g = getattr(fn, "__globals__", None)
    if pool_id not in _initialized:
        ig = getattr(initializer, "__globals__", {})
        before = dict(ig)
        initializer(*initargs)
        _initialized[pool_id] = {k: v for k, v in ig.items() if k not in before or before[k] is not v}
        if len(_initialized) > 256:  # old pools of a long-lived worker
            _initialized.pop(next(iter(_initialized)))
        if g is not None and g is not ig:
            g.update(_initialized[pool_id])
    elif g is not None:
        g.update(_initialized[pool_id])


def _run_chunk(pool_id: str, initializer: Callable[..., Any] | None, initargs: tuple[Any, ...],
               fn: Callable[..., Any], chunk: list[Any], star: bool) -> list[Any]:
    """Runs on the agent's worker: one chunk of a map (or one apply). When it ends, what its
    Queue consumers got counts as consumed (queues.task_ended: at-least-once delivery)."""
    try:
        _init_once(pool_id, initializer, initargs, fn)
        if star:
            return [fn(*a) for a in chunk]
        return [fn(a) for a in chunk]
    finally:
        task_ended()


def _run_apply(pool_id: str, initializer: Callable[..., Any] | None, initargs: tuple[Any, ...],
               fn: Callable[..., Any], args: tuple[Any, ...], kwds: dict[str, Any]) -> Any:
    try:
        _init_once(pool_id, initializer, initargs, fn)
        return fn(*args, **kwds)
    finally:
        task_ended()


def _picklable(obj: Any) -> None:
    """Raise what pickling raises (``TypeError: cannot pickle '_thread.lock' object``), in the
    caller, before anything is queued: the standard library's error for an unpicklable target."""
    import cloudpickle

    cloudpickle.dumps(obj)


def _tags(e: dict[str, Any]) -> set[str]:
    return set((e.get("info") or {}).get("tags") or e.get("tags") or [])


def cpu_count() -> int:
    """The fleet's capacity: worker slots of the online endpoints the configured selector would
    use (``"auto"``: every endpoint this program may use; an id or a list of ids: those; ``{"tags":
    [...]}``: those carrying every tag). None of them online raises ``NotImplementedError``, as the
    standard library's ``cpu_count()`` does when it cannot tell (never the whole fleet instead)."""
    sel = _state.settings()["endpoint"]
    eps = _runner.executor().client.list_endpoints()
    if isinstance(sel, str) and sel != "auto":
        eps = [e for e in eps if e["id"] == sel]
    elif isinstance(sel, (list, tuple)):
        eps = [e for e in eps if e["id"] in sel]
    elif isinstance(sel, dict):
        want = set(sel.get("tags") or ())
        eps = [e for e in eps if want <= _tags(e)]
    total = 0
    for e in eps:
        if e.get("online"):
            info = e.get("info") or {}
            total += int(info.get("capacity") or info.get("workers") or 1)
    if total < 1:
        raise NotImplementedError(f"cannot determine the number of CPUs: no online endpoint matches this program's selector {sel!r}")
    return total


# ---------------------------------------------------------------- results
class AsyncResult:
    """``multiprocessing.pool.AsyncResult`` over one or more task futures."""

    def __init__(self, futures: list["Future[Any]"], flatten: bool, callback: Callable[[Any], Any] | None = None,
                 error_callback: Callable[[BaseException], Any] | None = None) -> None:
        self._futures, self._flatten = futures, flatten
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._left = len(futures)
        self._lock = threading.Lock()
        self._callback, self._error_callback = callback, error_callback
        if not futures:
            self._finish()
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, f: "Future[Any]") -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._left -= 1
            failed = f.cancelled() or f.exception() is not None
            if not failed and self._left > 0:
                return
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            for f in self._futures:
                if f.done() and (f.cancelled() or f.exception() is not None):
                    self._error = f.exception() if not f.cancelled() else RuntimeError("pool terminated")
                    break
            else:
                vals = [f.result() for f in self._futures]
                self._value = list(itertools.chain.from_iterable(vals)) if self._flatten else vals[0]
            self._event.set()
        if self._error is None and self._callback is not None:
            self._callback(self._value)
        elif self._error is not None and self._error_callback is not None:
            self._error_callback(self._error)

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._error is None

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._value


MapResult = AsyncResult
ApplyResult = AsyncResult


class IMapIterator:
    """What ``imap``/``imap_unordered`` return: an iterator with ``next(timeout)``."""

    def __init__(self, futures: list["Future[Any]"], ordered: bool) -> None:
        self._futures = futures
        self._chunks: Iterator[Future[Any]] = iter(futures) if ordered else as_completed(futures)
        self._buf: list[Any] = []
        self._head: Future[Any] | None = None  # the chunk being waited for (kept across a timeout)

    def __iter__(self) -> "IMapIterator":
        return self

    def next(self, timeout: float | None = None) -> Any:
        """The next result; ``multiprocessing.TimeoutError`` after ``timeout`` seconds, and the
        same result is still the next one (as the standard library's iterator keeps it)."""
        while not self._buf:
            if self._head is None:
                self._head = next(self._chunks)  # StopIteration ends the iteration
            try:
                self._buf = list(self._head.result(timeout))
            except FuturesTimeout:
                raise TimeoutError from None
            self._head = None
        return self._buf.pop(0)

    __next__ = next


# ---------------------------------------------------------------- Pool
class Pool:
    """``multiprocessing.Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None)``.

    ``processes`` (default: :func:`cpu_count`, the fleet's capacity) sets the default chunk size,
    as in the standard library; the mesh decides where chunks run."""

    _ids = itertools.count(1)

    def __init__(self, processes: int | None = None, initializer: Callable[..., Any] | None = None,
                 initargs: Iterable[Any] = (), maxtasksperchild: int | None = None, context: Any = None) -> None:
        if processes is not None and processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if maxtasksperchild is not None and (not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0):
            raise ValueError("maxtasksperchild must be a positive int or None")
        self._ex = _runner.executor()
        if processes is None:
            try:
                processes = cpu_count()
            except NotImplementedError:  # no matching endpoint online yet: the stdlib's ``os.cpu_count() or 1``
                processes = 1
        self._processes = processes
        self._initializer, self._initargs = initializer, tuple(initargs)
        if initializer is not None:
            _picklable((initializer, self._initargs))
        self._id = uuid.uuid4().hex
        self._window = _Window(self._ex, processes, float(_state.settings()["start_timeout_s"]))
        self._state = RUN
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        f = self._window.submit(fn, args)
        with self._lock:
            self._futures.append(f)
            if len(self._futures) > 4096:
                self._futures = [x for x in self._futures if not x.done()]
        return f

    def _chunks(self, func: Callable[..., Any], iterable: Iterable[Any], chunksize: int | None, star: bool) -> list["Future[Any]"]:
        self._check_running()
        if not callable(func):
            raise TypeError(f"{type(func).__name__!r} object is not callable")
        _picklable(func)
        items = list(iterable)
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            if extra:
                chunksize += 1
        if chunksize < 1:
            chunksize = 1
        return [self._submit(_run_chunk, self._id, self._initializer, self._initargs, func, items[i:i + chunksize], star)
                for i in range(0, len(items), chunksize)]

    def map(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int | None = None) -> list[Any]:
        return self.map_async(func, iterable, chunksize).get()

    def map_async(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int | None = None,
                  callback: Callable[[Any], Any] | None = None, error_callback: Callable[[BaseException], Any] | None = None) -> AsyncResult:
        return AsyncResult(self._chunks(func, iterable, chunksize, False), True, callback, error_callback)

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]], chunksize: int | None = None) -> list[Any]:
        return self.starmap_async(func, iterable, chunksize).get()

    def starmap_async(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]], chunksize: int | None = None,
                      callback: Callable[[Any], Any] | None = None, error_callback: Callable[[BaseException], Any] | None = None) -> AsyncResult:
        return AsyncResult(self._chunks(func, [tuple(a) for a in iterable], chunksize, True), True, callback, error_callback)

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        return IMapIterator(self._chunks(func, iterable, chunksize, False), ordered=True)

    def imap_unordered(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        return IMapIterator(self._chunks(func, iterable, chunksize, False), ordered=False)

    def apply(self, func: Callable[..., Any], args: tuple[Any, ...] = (), kwds: dict[str, Any] | None = None) -> Any:
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func: Callable[..., Any], args: tuple[Any, ...] = (), kwds: dict[str, Any] | None = None,
                    callback: Callable[[Any], Any] | None = None, error_callback: Callable[[BaseException], Any] | None = None) -> AsyncResult:
        self._check_running()
        _picklable(func)
        f = self._submit(_run_apply, self._id, self._initializer, self._initargs, func, tuple(args), dict(kwds or {}))
        return AsyncResult([f], False, callback, error_callback)

    def close(self) -> None:
        if self._state == RUN:
            self._state = CLOSE

    def terminate(self) -> None:
        """Cancels every unfinished chunk wherever it is (one request): queued ones never run,
        running ones are ended (their workers killed and replaced), as the stdlib kills its pool."""
        self._state = TERMINATE
        _cancel_all(self._window.terminate())

    def join(self) -> None:
        if self._state == RUN:
            raise ValueError("Pool is still running")
        with self._lock:
            futures = list(self._futures)
        wait([f for f in futures if not f.cancelled()])

    def __enter__(self) -> "Pool":
        self._check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __repr__(self) -> str:
        return f"<mesh Pool state={('RUN', 'CLOSE', 'TERMINATE')[self._state]} processes={self._processes}>"


class _PoolFuture(Future):  # type: ignore[type-arg]
    """The program's future of one Pool task; ``task_id`` is its mesh task's once it is sent."""

    _inner: "Future[Any] | None" = None

    @property
    def task_id(self) -> str | None:
        return getattr(self._inner, "task_id", None)


class _Window:
    """At most ``processes`` of a Pool's tasks on the mesh at once, each started now.

    Why: a stdlib Pool has ``processes`` live processes, and a mapped function may wait for its
    siblings (a Barrier across chunks, a Queue another chunk fills). An ordinary task can sit in
    an agent's queue behind busy workers, so such a map could deadlock. Each chunk therefore goes
    with ``start: "now"`` (``Executor.submit_now``: a free worker slot, or an extra worker up to
    the agent's cap), and the rest wait here, in the program, as a stdlib Pool's tasks wait in its
    task queue. A chunk the fleet refuses (EAGAIN: every slot and extra worker in use) goes back
    to the head of the line and the window shrinks to what is running; it grows back by one per
    finished chunk.

    Bounds, as ``Process.start()`` has (``start_timeout_s``): a refused chunk with nothing of the
    Pool running is retried with backoff, then fails with ``BlockingIOError``; a refused chunk
    waiting for the Pool's running ones fails the same way when none of them ends within the
    bound (they may be waiting for it: a Barrier with more parties than the fleet can start); a
    chunk the hub still holds after the bound (every selected endpoint offline) is cancelled and
    fails the same way."""

    def __init__(self, ex: Any, processes: int, start_timeout_s: float) -> None:
        self._ex, self._max, self._size = ex, processes, processes
        self._timeout = start_timeout_s
        self._pending: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._inflight: dict[Future[Any], Future[Any]] = {}  # mesh future -> the caller's
        self._sent_at: dict[Future[Any], float] = {}  # mesh future -> when sent (monotonic), until it is seen leaving the hub
        self._timed_out: set[Future[Any]] = set()  # cancelled here: never left the hub within the bound
        self._refused_since: float | None = None  # refused with nothing of ours running
        self._blocked_since: float | None = None  # refused while ours run: waiting for one to end
        self._retry: threading.Timer | None = None
        self._watch: threading.Timer | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> "Future[Any]":
        outer: Future[Any] = _PoolFuture()
        with self._lock:
            self._pending.append((outer, fn, args))
        self._pump()
        return outer

    def _pump(self) -> None:
        """Send what fits in the window (outside the lock: a done callback may run at once)."""
        while True:
            with self._lock:
                if self._closed or not self._pending or len(self._inflight) >= self._size or self._retry is not None:
                    return
                outer, fn, args = self._pending.popleft()
                if outer.cancelled():
                    continue
                try:
                    inner = self._ex.submit_now(fn, *args)
                except Exception as exc:  # the Executor shut down: this task fails, as apply_async after close would
                    failed: BaseException | None = exc
                else:
                    failed = None
                    self._inflight[inner] = outer
                    self._sent_at[inner] = time.monotonic()
                    self._blocked_since = None
                    outer._inner = inner  # type: ignore[attr-defined]
                    self._arm_watch()
            if failed is not None:
                if not outer.done():
                    outer.set_exception(failed)
                continue
            inner.add_done_callback(lambda f, o=outer, a=(fn, args): self._done(f, o, a))

    def _done(self, inner: "Future[Any]", outer: "Future[Any]", job: tuple[Callable[..., Any], tuple[Any, ...]]) -> None:
        exc = None if inner.cancelled() else inner.exception()
        refused = isinstance(exc, OSError) and exc.errno == errno.EAGAIN
        with self._lock:
            self._inflight.pop(inner, None)
            self._sent_at.pop(inner, None)
            timed_out = inner in self._timed_out
            self._timed_out.discard(inner)
            if self._watch is not None and not self._sent_at and self._blocked_since is None:
                self._watch.cancel()  # nothing left to watch: no timer thread outlives the work
                self._watch = None
            if refused and (self._closed or outer.done()):
                refused, exc = False, None  # terminated meanwhile: the caller's future ends cancelled
                inner = _CANCELLED
            elif refused:
                self._pending.appendleft((outer, job[0], job[1]))
                now = time.monotonic()
                if self._inflight:  # the fleet runs this many of ours now: wait for one of them
                    self._size = max(1, len(self._inflight))
                    self._refused_since = None
                    if self._blocked_since is None:
                        self._blocked_since = now
                    self._arm_watch()
                elif self._refused_since is not None and now - self._refused_since > self._timeout:
                    self._pending.popleft()
                    refused = False
                    exc = BlockingIOError(errno.EAGAIN, f"a Pool task could not start within start_timeout_s={self._timeout:g} s: "
                                          f"{exc.strerror or exc}")
                else:
                    if self._refused_since is None:
                        self._refused_since = now
                    delay = min(5.0, 0.25 * 2 ** min(5, int(now - self._refused_since)))
                    self._retry = threading.Timer(delay, self._retry_now)
                    self._retry.daemon = True
                    self._retry.start()
            else:
                self._refused_since = None
                self._size = min(self._max, self._size + 1)
        if not refused and not outer.done():
            if timed_out:
                outer.set_exception(BlockingIOError(errno.EAGAIN, f"a Pool task did not start within start_timeout_s={self._timeout:g} s: "
                                                    "the hub still held it (every selected endpoint offline?); it was cancelled"))
            elif inner is _CANCELLED or inner.cancelled():
                cancel_and_notify(outer)
            elif exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(inner.result())
        self._pump()

    def _retry_now(self) -> None:
        with self._lock:
            self._retry = None
        self._pump()

    def _arm_watch(self) -> None:
        """(Under the lock.) One timer while anything is out or waiting: see ``_check``."""
        if self._watch is None and not self._closed:
            self._watch = threading.Timer(min(5.0, max(0.25, self._timeout / 4)), self._check)
            self._watch.daemon = True
            self._watch.start()

    def _check(self) -> None:
        """The bounds of the class docstring: a refused chunk blocked for ``start_timeout_s``
        fails; a chunk out for that long is asked about once, and cancelled if the hub still
        holds it (queued: never sent to an agent, which would have started or refused it)."""
        now = time.monotonic()
        blocked: Future[Any] | None = None
        with self._lock:
            self._watch = None
            if self._closed:
                return
            stale = [f for f, at in self._sent_at.items() if now - at > self._timeout]
            if self._blocked_since is not None and self._pending and now - self._blocked_since > self._timeout:
                blocked = self._pending.popleft()[0]
                self._blocked_since = now if self._pending else None
        if blocked is not None and not blocked.done():
            blocked.set_exception(BlockingIOError(
                errno.EAGAIN, f"a Pool task could not start within start_timeout_s={self._timeout:g} s: the fleet refused it while it "
                f"ran {self._size} of this Pool's tasks and none of them ended (they may be waiting for it). Use a smaller Pool, add "
                "endpoints, raise start_now_max in the agents' config, or multiprocessing.config(start_timeout_s=)"))
        for f in stale:
            tid = getattr(f, "task_id", None)
            try:
                state = self._ex.client.task_status(tid)["state"] if tid else None
            except Exception:  # the hub unreachable: ask again at the next look
                continue
            with self._lock:
                if state == "queued" and f in self._sent_at:
                    self._timed_out.add(f)
                self._sent_at.pop(f, None)  # seen: asked once
            if f in self._timed_out:
                _cancel_all([f])
        with self._lock:
            if self._sent_at or (self._blocked_since is not None and self._pending):
                self._arm_watch()

    def terminate(self) -> list["Future[Any]"]:
        """Stop sending; the caller's futures not sent are cancelled here, and the mesh futures
        of the rest are returned for one cancel request."""
        with self._lock:
            self._closed = True
            for t in (self._retry, self._watch):
                if t is not None:
                    t.cancel()
            self._retry = self._watch = None
            pending, self._pending = list(self._pending), deque()
            inflight = [f for f in self._inflight if not f.done()]
        for outer, _fn, _args in pending:
            cancel_and_notify(outer)
        return inflight


_CANCELLED: Any = object()  # _Window._done: the caller's future ends cancelled


def _cancel_all(futures: list["Future[Any]"]) -> None:
    """Cancel these tasks, one request per Executor; the hub unreachable: logged, the lease (or the
    program's exit) cancels them later."""
    by_ex: dict[int, tuple[Any, list[Future[Any]]]] = {}
    for f in futures:
        ex = getattr(f, "_mesh_executor", None)
        if ex is None:
            f.cancel()
            continue
        by_ex.setdefault(id(ex), (ex, []))[1].append(f)
    for ex, fs in by_ex.values():
        try:
            ex.cancel_futures(fs)
        except Exception as exc:
            _state.log.warning("could not cancel %d task(s): %s", len(fs), exc)


# ---------------------------------------------------------------- Process
def _run_process(proc: "Process") -> tuple[int, str | None]:
    """Runs on the agent's worker: ``proc.run()``; the exit code as a child process would have it.
    When it ends, what its Queue consumers got counts as consumed (queues.task_ended)."""
    _signal_started(proc)
    try:
        proc.run()
        return 0, None
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0, None
        if isinstance(code, int):
            return code, None
        return 1, f"{code}\n"
    except BaseException:
        return 1, f"Process {proc.name}:\n{traceback.format_exc()}"
    finally:
        task_ended()


def _signal_started(proc: "Process") -> None:
    """Tell the waiting ``start()`` that the target is about to run (one list push in the
    program's store; a re-run after an agent restart pushes again, which nobody waits for)."""
    key, url = getattr(proc, "_started_key", None), getattr(proc, "_started_url", None)
    if not key or not url:
        return
    from cloud_hub.client.multiprocessing._resource import connection, retrying

    r = connection(url)

    def push() -> None:
        pipe = r.pipeline()
        pipe.rpush(key, b"1")
        pipe.expire(key, 600)
        pipe.execute()

    retrying(url, push)


class _Current:
    name = "MainProcess"
    daemon = False
    pid = os.getpid()
    ident = pid
    authkey = b""


_children: "set[Process]" = set()


def current_process() -> Any:
    return _Current


def active_children() -> list["Process"]:
    return [p for p in list(_children) if p.is_alive()]


def parent_process() -> None:
    return None


class Process:
    """``multiprocessing.Process``: ``start()`` submits ``run()`` as one task; ``exitcode`` is 0,
    the ``sys.exit`` code, or 1 with the traceback printed here (where the stdlib child prints its
    own). Subclasses that override ``run`` travel by value with their instance."""

    _ids = itertools.count(1)

    def __init__(self, group: None = None, target: Callable[..., Any] | None = None, name: str | None = None,
                 args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None, *, daemon: bool | None = None) -> None:
        assert group is None, "group argument must be None for now"
        self._target, self._args, self._kwargs = target, tuple(args), dict(kwargs or {})
        self._name = name or f"Process-{next(self._ids)}"
        self.daemon = bool(daemon)
        self._future: Future[Any] | None = None
        self._exitcode: int | None = None
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_future"] = None
        return state

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, v: str) -> None:
        self._name = v

    def run(self) -> None:
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")
        if self._future is not None:
            raise AssertionError("cannot start a process twice")
        _picklable(self)
        self._started_key, self._started_url = f"mesh:mp:started:{uuid.uuid4().hex}", _state.redis_url()
        self._future = _runner.executor().submit_now(_run_process, self)
        _children.add(self)
        _runner.run_first_at_exit()  # at exit: join it (terminate a daemon one) before shared objects are dropped
        try:
            self._wait_started(float(_state.settings()["start_timeout_s"]))
        except BaseException:
            f, self._future = self._future, None  # not started, as a failed fork: start() may be called again
            _children.discard(self)
            if f is not None:
                _state.cancel(f)
            raise

    def _wait_started(self, budget: float) -> None:
        """Return once the target runs (its task's first act is a push to ``_started_key``), or
        its task already ended; raise ``BlockingIOError`` (EAGAIN, as a failed ``fork``) when it
        was refused (the endpoint's slots and extra workers all in use) or did not start within
        ``budget`` seconds (``multiprocessing.config(start_timeout_s=)``)."""
        from cloud_hub.client.multiprocessing._resource import connection, retrying

        f, key, url = self._future, self._started_key, self._started_url
        assert f is not None
        r = connection(url)
        deadline = time.monotonic() + budget
        while True:
            if f.done():
                exc = f.exception() if not f.cancelled() else None
                if isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
                    raise BlockingIOError(errno.EAGAIN, f"{self.name} could not start: {exc.strerror or exc}") from None
                return  # ended already (its exit code and output come with join())
            left = deadline - time.monotonic()
            if left <= 0:
                sel = _state.settings()["endpoint"]
                raise BlockingIOError(errno.EAGAIN, f"{self.name} did not start within start_timeout_s={budget:g} s: no endpoint "
                                      f"matching {sel!r} ran it (offline, or every worker slot and extra worker in use; each "
                                      "agent starts at most start_now_max extra workers). Add endpoints, raise start_now_max in "
                                      "the agent's config, or multiprocessing.config(start_timeout_s=)")
            if retrying(url, lambda: r.blpop([key], timeout=max(1, min(5, int(left))))) is not None:
                retrying(url, lambda: r.delete(key))
                return

    def _settle(self) -> None:
        f = self._future
        if f is None or not f.done() or self._exitcode is not None:
            return
        if f.cancelled():
            self._exitcode = self._exitcode if self._exitcode is not None else -15  # terminated (SIGTERM), as the stdlib reports it
            _children.discard(self)
            return
        exc = f.exception()
        if exc is not None:
            print(f"Process {self.name}: the mesh could not run it: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._exitcode = 1
            return
        code, text = f.result()
        if text:
            sys.stderr.write(text)
        self._exitcode = code
        _children.discard(self)

    def join(self, timeout: float | None = None) -> None:
        if self._future is None:
            raise AssertionError("can only join a started process")
        wait([self._future], timeout)
        self._settle()

    def is_alive(self) -> bool:
        if self._future is None:
            return False
        self._settle()
        return not self._future.done()

    @property
    def exitcode(self) -> int | None:
        self._settle()
        return self._exitcode

    @property
    def pid(self) -> str | None:
        """The mesh task id (there is no local pid)."""
        return getattr(self._future, "task_id", None) if self._future is not None else None

    ident = pid

    def terminate(self) -> None:
        """Cancels its task wherever it is: not started, it never runs; running, its worker is
        killed (and replaced). ``exitcode`` is then -15, as for a child ended by SIGTERM. A task
        that had ended keeps its exit code."""
        self._end(-15)

    def kill(self) -> None:
        """As :meth:`terminate`; ``exitcode`` -9 (SIGKILL)."""
        self._end(-9)

    def _end(self, code: int) -> None:
        if self._future is not None and not self._future.done() and _state.cancel(self._future):
            self._exitcode = code
            _children.discard(self)

    def close(self) -> None:
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running. You should first call join() or terminate().")
        self._closed = True

    def __repr__(self) -> str:
        state = "initial" if self._future is None else ("started" if self.exitcode is None else f"stopped exitcode={self.exitcode}")
        return f"<mesh Process name={self.name!r} {state}>"
