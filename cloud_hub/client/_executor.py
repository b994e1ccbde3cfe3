"""``Executor``: the standard ``concurrent.futures`` interface over the mesh.

``submit()`` never waits on the network: it serializes the call (the function body is cached by
content hash) and queues it. Two background threads do the rest. The submitter gathers calls for
a couple of milliseconds and posts them as one batch; a function body the hub has not seen rides
with the first batch that uses it (no registration round trip). Each batch carries a fresh
idempotency key, so when the hub restarts or a link drops the submitter retries the same batch
with backoff and jitter for up to ``submit_timeout_s`` and the hub never makes a task twice. The
reader follows the hub's result stream and completes futures; each result completes its future
once, however often it is delivered. Batches and results share one WebSocket to the hub when it
offers one (cloud_hub/client/_stream.py: no request per batch, no long poll); otherwise, or while
it is down, they go over REST (one long poll for all outstanding tasks).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from concurrent.futures import Executor as _Executor
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from cloud_hub.client import _dataflow
from cloud_hub.client._client import Client, EndpointSelector, HubError, HubUnreachable, constraints_spec, selector
from cloud_hub.client._env import env_options, merge_env, pop_env_options
from cloud_hub.client._memo import ENV_FIELDS, Inflight, MemoOptions, key_for, pop_options
from cloud_hub.client._results import decode_row
from cloud_hub.client._stream import FrameTooBig, HubStream
from mesh_agent.backoff import Backoff, retry
from mesh_agent.protocol.bodies import TASK_CANCELLED

__all__ = ["Executor", "SubmitTimeout"]

log = logging.getLogger("cloud_hub.client")

_ORPHAN_TTL_S = 300.0
#: Answers worth retrying with the same idempotency key: the hub is (re)starting, overloaded or out of disk.
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504, 507})


#: Submits, cancels and the store-URL lookup retried through a hub restart (mesh_agent/backoff.py):
#: full jitter, up to 0.2 s doubling to 5 s, within a budget set per call (``submit_timeout_s``).
#: A Retry-After the hub sent is waited at least; one that does not fit in the budget ends it.
_HUB_RETRY = Backoff(base=0.2, cap=5.0, jitter=(0.0, 1.0))
#: The REST result reader reconnecting: 0.2 s doubling to 5 s, times 0.5-1.5, back to 0.2 s after
#: a good poll. No bound: results are durable at the hub and the reader runs until shut down.
_READ_RETRY = Backoff(base=0.2, cap=5.0, jitter=(0.5, 1.5))


def _retry_after(exc: BaseException) -> float | None:
    """What a HubError asked for (Retry-After), else None."""
    value = getattr(exc, "retry_after", None)
    return float(value) if isinstance(value, (int, float)) else None


def _retryable(exc: BaseException) -> bool:
    """The hub is unreachable, or answered with a status worth sending the same request again."""
    return isinstance(exc, HubUnreachable) or (isinstance(exc, HubError) and exc.status in _RETRY_STATUS)


def mark_cancelled(f: "Future[Any]") -> bool:
    """Put a future that is running (here: submitted to the mesh) in the cancelled state, as
    ``Future.cancel()`` does for a pending one: ``cancelled()`` is True, ``result()`` raises
    ``CancelledError``, waiters (``wait``, ``as_completed``) and done-callbacks hear of it. False
    when it had finished already. The stdlib's ``cancel()`` refuses a running future, and a mesh
    task is "running" from its submit on."""
    from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING

    with f._condition:  # type: ignore[attr-defined]
        state = f._state  # type: ignore[attr-defined]
        if state == FINISHED:
            return False
        if state in (CANCELLED, CANCELLED_AND_NOTIFIED):
            return True
        if state == PENDING:
            f._state = CANCELLED  # type: ignore[attr-defined]  # the submitter sees it and sends nothing
        else:
            f._state = CANCELLED_AND_NOTIFIED  # type: ignore[attr-defined]
            for waiter in f._waiters:  # type: ignore[attr-defined]
                waiter.add_cancelled(f)
        f._condition.notify_all()  # type: ignore[attr-defined]
    f._invoke_callbacks()  # type: ignore[attr-defined]
    return True


class MeshFuture(Future):  # type: ignore[type-arg]
    """A future of a task on the mesh. ``cancel()`` cancels the task wherever it is (docs/sdk.md,
    "Cancel"): not sent yet, nothing is sent; queued at the hub or an agent, it never runs;
    running, its worker is ended. True when the task ends cancelled (``cancelled()`` is then
    True and ``result()`` raises ``CancelledError``), False when it had finished (or the hub
    could not be reached: the reason is logged)."""

    def __init__(self, executor: "Executor | None" = None) -> None:
        super().__init__()
        self._mesh_executor = executor

    def cancel(self) -> bool:
        ex = self._mesh_executor
        if ex is None:
            return super().cancel()
        try:
            return ex.cancel(self)
        except Exception as exc:  # the hub unreachable, ...: as the stdlib's cancel(), never raises
            log.warning("could not cancel task %s: %s", getattr(self, "task_id", "?"), exc)
            return False


class SubmitTimeout(TimeoutError):
    """The hub could not be reached (or kept refusing with a retryable answer) for the whole
    ``submit_timeout_s``; the task was not accepted."""


@dataclass
class _Item:
    future: "Future[Any]"
    spec: dict[str, Any]
    fid: str
    name: str
    body: bytes | None  # None: a function registered earlier (submit_to_registered_function)


@dataclass
class _Deferred:
    """A call whose Future arguments are all done (cloud_hub/client/_dataflow.py). The submitter,
    not the thread that finished the last input nor ``submit()``, swaps each Future for a
    ``TaskOutput`` (that needs the hub's store URL: a request) and sends the call."""

    future: "Future[Any]"  # the caller's Future
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


#: How long the hub's store URL (``GET /v1/kv``) is reused for dependent submits; a hub restarted
#: with an ephemeral ``kv_port`` hands out a new one, so it is not kept for the Executor's life.
_STORE_URL_TTL_S = 10.0


class Executor(_Executor):
    """Runs calls on the mesh.

    ``Executor(endpoint_id="ep-...")`` is enough once ``mesh-hub login`` has saved a hub and token
    (or ``MESH_HUB_URL`` / ``MESH_TOKEN`` are set); pass ``client=`` to use another.
    ``endpoint`` says where: an endpoint id, ``"auto"`` (the default: the hub's scheduler places
    each batch on your endpoints by predicted completion time), a list of ids, or
    ``{"tags": [...]}``. ``endpoint_id=`` is the same thing under Globus Compute's name.
    ``constraints`` (``{"tags": [...], "gpu": True, "min_memory_mb": 2048}``) are what every
    function submitted here needs. ``submit_timeout_s``: how long a batch is retried through hub
    restarts and dropped links before its futures fail with :class:`SubmitTimeout`.
    ``task_group_id``: every task submitted here is filed under it (a new uuid4 by default), so a
    later process can :meth:`reload_tasks`. Each future gets ``task_id`` and ``endpoint_id``
    (where it was placed) once it is submitted. ``stream=False``: REST only, never the WebSocket.
    ``early_results=True`` (stream only): a result comes as soon as the agent sends it, before the
    hub's own commit (the agent keeps it until then), which saves that commit on the round trip;
    the hub's task status may say ``leased`` for a moment after the future is done.
    """

    def __init__(
        self,
        client: Client | None = None,
        endpoint_id: EndpointSelector | None = None,
        *,
        endpoint: EndpointSelector | None = None,
        constraints: dict[str, Any] | None = None,
        batch_size: int = 5000,
        batch_interval_s: float = 0.002,
        task_timeout_s: float | None = None,
        task_ttl_s: float | None = None,
        submit_timeout_s: float = 300.0,
        task_group_id: str | None = None,
        stream: bool = True,
        early_results: bool = False,
        environment: dict[str, Any] | None = None,
        container: str | None = None,
        sandbox: bool | None = None,
    ) -> None:
        if endpoint is not None and endpoint_id is not None and endpoint != endpoint_id:
            raise ValueError("pass either endpoint= or endpoint_id=, not both")
        where = endpoint if endpoint is not None else endpoint_id
        self.client = client if client is not None else Client()
        self.endpoint = selector("auto" if where is None else where)
        self.constraints = constraints_spec(constraints)
        # Where every task runs on its endpoint (docs/environments.md); checked now, not at the first submit.
        self.environment = env_options(environment, container, sandbox)
        self._fn_envs: dict[str, dict[str, Any]] = {}  # function id -> its register_function(environment=...)
        self.batch_size = batch_size
        self.batch_interval_s = batch_interval_s
        self.task_timeout_s = task_timeout_s
        self.task_ttl_s = task_ttl_s
        self.submit_timeout_s = float(submit_timeout_s)
        self.task_group_id = task_group_id or str(uuid.uuid4())
        self.task_count_submitted = 0  # tasks the hub has accepted
        self._queue: "queue.Queue[_Item | _Deferred | None]" = queue.Queue()
        self._store_url: tuple[str, float] | None = None  # (hub's store URL, when asked): dependent submits
        self._pending: dict[str, Future[Any]] = {}
        self._orphans: dict[str, tuple[float, dict[str, Any]]] = {}  # results seen before their submit returned
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._shutdown = False
        self._memo_fns: dict[str, tuple[Callable[..., Any], MemoOptions]] = {}  # registered with cache=True
        self._inflight = Inflight()  # repeats of a cached call still running join it (cloud_hub/client/_memo.py)
        self._cursor = self.client.result_cursor()  # also: a wrong URL or token fails here, in one line
        # One WebSocket for submits and results when the hub offers it (cloud_hub/client/_stream.py); else REST.
        self._stream: HubStream | None = HubStream.first(self.client, self._cursor, early_results) if stream else None
        self._submitter = threading.Thread(target=self._submit_loop, name="mesh-submit", daemon=True)
        self._reader = threading.Thread(target=self._result_loop, name="mesh-results", daemon=True)
        self._submitter.start()
        self._reader.start()

    @property
    def endpoint_id(self) -> EndpointSelector:  # Globus Compute's name for ``endpoint``
        return self.endpoint

    @endpoint_id.setter
    def endpoint_id(self, value: EndpointSelector) -> None:
        self.endpoint = selector(value)

    # ---------------------------------------------------------------- public API
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        """Queue ``fn(*args, **kwargs)``; returns at once (no request is made here).

        ``cache=True`` (and ``ignore_for_cache=[names]``) memoize this call (docs/sdk.md,
        "Memoization"); they are options, not arguments of ``fn``, unless ``fn`` has a parameter
        of that name."""
        if self._shutdown:
            raise RuntimeError("cannot submit after shutdown")
        if _dataflow.has_futures(args, kwargs):  # a Future as an argument: sent once it is done (cloud_hub/client/_dataflow.py)
            return _dataflow.submit_after(self, fn, args, kwargs)
        opts = pop_options(fn, kwargs)
        env = pop_env_options(fn, kwargs)
        fid, body = self.client.function_body(fn)
        return self._enqueue(fid, getattr(fn, "__name__", None) or type(fn).__name__, body, args, kwargs, fn=fn, opts=opts, env=env)

    def submit_now(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        """Like :meth:`submit`, for a call that must start at once (``start: "now"``): the hub sends
        it outside the agent's fetch credit, and the agent runs it on a free worker or on one more
        up to its cap (``start_now_max``), never behind its queue; beyond the cap the future fails
        with ``BlockingIOError`` saying so. What a multiprocessing ``Process`` is submitted with
        (docs/multiprocessing.md, "Start")."""
        if self._shutdown:
            raise RuntimeError("cannot submit after shutdown")
        fid, body = self.client.function_body(fn)
        return self._enqueue(fid, getattr(fn, "__name__", None) or type(fn).__name__, body, args, kwargs, fn=fn, start_now=True)

    def register_function(self, fn: Callable[..., Any], name: str | None = None, *, cache: bool = False,
                          ignore_for_cache: Sequence[str] = (), environment: dict[str, Any] | None = None,
                          container: str | None = None, sandbox: bool | None = None) -> str:
        """Register ``fn`` now (one request per distinct body) and return its id, for
        :meth:`submit_to_registered_function` here or in another process. ``cache=True``: every
        call of it through this Executor is memoized (``ignore_for_cache``: argument names left
        out of the key). ``environment``/``container``/``sandbox``: where every call of it runs
        (docs/environments.md), unless a submit says otherwise."""
        env = env_options(environment, container, sandbox)
        fid = self.client.register_function(fn, name)
        if env:
            self._fn_envs[fid] = env
        if cache or ignore_for_cache:
            self._memo_fns[fid] = (fn, MemoOptions(cache, ignore_for_cache))
        return fid

    def submit_to_registered_function(self, function_id: str, args: Sequence[Any] | None = None,
                                      kwargs: dict[str, Any] | None = None) -> "Future[Any]":
        """Run a function registered earlier (by any process of yours) by its id."""
        if self._shutdown:
            raise RuntimeError("cannot submit after shutdown")
        return self._enqueue(function_id, "function", None, tuple(args or ()), dict(kwargs or {}))

    def _enqueue(self, fid: str, name: str, body: bytes | None, args: Sequence[Any], kwargs: dict[str, Any], *,
                 fn: Callable[..., Any] | None = None, opts: MemoOptions | None = None,
                 env: dict[str, Any] | None = None, start_now: bool = False) -> "Future[Any]":
        made = self._item(fid, name, body, args, kwargs, fn=fn, opts=opts, env=env)
        if isinstance(made, Future):
            return made
        if start_now:
            made.spec["start"] = "now"
        self._queue.put(made)
        return made.future

    def _item(self, fid: str, name: str, body: bytes | None, args: Sequence[Any], kwargs: dict[str, Any], *,
              fn: Callable[..., Any] | None = None, opts: MemoOptions | None = None,
              env: dict[str, Any] | None = None) -> "_Item | Future[Any]":
        """The queue item for one call, or the Future of the same cached call already running (memoization)."""
        registered = self._memo_fns.get(fid)
        if opts is None and registered is not None:
            opts = registered[1]
        key = None
        if opts is not None and opts.cache:
            # The key is computed first, before anything is serialized or queued: an argument that
            # cannot be hashed fails this call with MemoKeyError and nothing is sent or stored.
            key = key_for(fn if fn is not None else (registered[0] if registered else None), fid, args, kwargs, opts, {})
        spec = Client.task_spec(self.endpoint, fid, args, kwargs, self.task_timeout_s, self.task_ttl_s, self.constraints)
        environment = merge_env(self.environment, self._fn_envs.get(fid), env)
        if environment is not None:
            spec["environment"] = environment
        if key is not None:
            if any(k in spec for k in ENV_FIELDS):  # the environment is part of the call
                key = key_for(fn if fn is not None else (registered[0] if registered else None), fid, args, kwargs, opts, spec)  # type: ignore[arg-type]
            joined = self._inflight.join(key)
            if joined is not None:
                return joined
            spec["cache_key"] = key
        fut: Future[Any] = MeshFuture(self)
        if "cache_key" in spec:
            self._inflight.lead(spec["cache_key"], fut)
        return _Item(fut, spec, fid, name, body)

    def _submit_deferred(self, out: "Future[Any]", fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Hand a call whose Future arguments are done to the submitter (no request here: this runs
        in ``submit()`` or in whichever thread finished the last input)."""
        if self._shutdown:
            out.set_exception(RuntimeError("cannot submit after shutdown"))
            return
        self._queue.put(_Deferred(out, fn, args, kwargs))

    def _resolve(self, d: _Deferred) -> "_Item | None":
        """In the submitter: swap the Futures among ``d``'s arguments for ``TaskOutput`` refs and
        make its queue item (None when it failed, was cancelled, or joined a running cached call)."""
        if d.future.cancelled():
            return None
        try:
            url = self._hub_store_url()
            args, kwargs = _dataflow.swap_all(d.args, d.kwargs, url)
            opts = pop_options(d.fn, kwargs)
            env = pop_env_options(d.fn, kwargs)
            fid, body = self.client.function_body(d.fn)
            made = self._item(fid, getattr(d.fn, "__name__", None) or type(d.fn).__name__, body, args, kwargs, fn=d.fn, opts=opts, env=env)
        except BaseException as exc:  # noqa: BLE001 - the caller sees it on the Future
            if not d.future.done():
                d.future.set_exception(exc)
            return None
        real = made if isinstance(made, Future) else made.future
        _dataflow.chain(real, d.future)
        return None if isinstance(made, Future) else made

    def _hub_store_url(self) -> str:
        """The hub's store URL (where a consumer's worker reads its inputs), asked at most every
        ``_STORE_URL_TTL_S`` and retried like a batch (the hub restarting) within ``submit_timeout_s``."""
        now = time.monotonic()
        if self._store_url is not None and now - self._store_url[1] < _STORE_URL_TTL_S:
            return self._store_url[0]
        tries = _HUB_RETRY.replace(deadline=max(0.0, self.submit_timeout_s)).start()
        while True:  # bounded: ``tries`` ends it at submit_timeout_s
            try:
                url = str(self.client.request("GET", "/v1/kv")["url"])
                break
            except (HubUnreachable, HubError) as exc:
                if not _retryable(exc):
                    raise
                delay = tries.next_delay(_retry_after(exc) or 0.0)
                if delay is None:
                    raise SubmitTimeout(f"the hub's store URL, needed to pass a Future as an argument, could not be had within "
                                        f"submit_timeout_s={self.submit_timeout_s:g} ({tries.failures} attempts); last error: {exc}") from None
            time.sleep(delay)
        self._store_url = (url, time.monotonic())
        return url

    def map(  # type: ignore[override]
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        progress: bool = False,
    ) -> Iterator[Any]:
        """Like ``Executor.map``; ``progress=True`` shows a rich progress bar as results arrive."""
        futures = [self.submit(fn, *args) for args in zip(*iterables)]
        if progress:
            self._progress(futures, getattr(fn, "__name__", "tasks"))
        deadline = None if timeout is None else time.monotonic() + timeout

        def results() -> Iterator[Any]:
            try:
                for f in futures:
                    yield f.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            finally:
                for f in futures:
                    Future.cancel(f)  # as the stdlib: only what was not submitted yet; remote tasks run on

        return results()

    def reload_tasks(self, task_group_id: str | None = None) -> list["Future[Any]"]:
        """Futures for every task filed under ``task_group_id`` (default: this executor's), by
        any process: finished ones complete at once, the others when their results arrive. For a
        laptop that slept, or a script that died, while its tasks ran."""
        group = task_group_id or self.task_group_id
        rows = self.client.task_group(group)
        futures: list[Future[Any]] = []
        ids = [r["task_id"] for r in rows]
        with self._lock:
            for r in rows:
                f: Future[Any] | None = self._pending.get(r["task_id"])
                if f is None:
                    f = MeshFuture(self)
                    f.set_running_or_notify_cancel()
                f.task_id, f.endpoint_id = r["task_id"], r["endpoint_id"]  # type: ignore[attr-defined]
                orphan = self._orphans.pop(r["task_id"], None)
                if orphan is not None:
                    self._complete(f, orphan[1])
                elif not f.done():
                    self._pending[r["task_id"]] = f
                futures.append(f)
        for i in range(0, len(ids), 5000):  # results stored before this executor's stream began
            for row in self.client.wait_results(ids[i : i + 5000], timeout_s=0):
                with self._lock:
                    f2 = self._pending.pop(row["task_id"], None)
                    if f2 is not None:
                        self._complete(f2, row)
        self._work.set()
        return futures

    def cancel(self, future: "Future[Any]") -> bool:
        """Cancel one task of this executor wherever it is (:meth:`cancel_futures`)."""
        return self.cancel_futures([future])[0]

    def cancel_futures(self, futures: Iterable["Future[Any]"]) -> list[bool]:
        """Cancel tasks of this executor, in one request to the hub (docs/sdk.md, "Cancel"): one not
        sent yet is never sent; one queued at the hub or on an agent never runs; a running one's
        worker is ended (and replaced). Each such task ends with one ``cancelled`` result, and its
        future is cancelled (``cancelled()`` True, ``result()`` raises ``CancelledError``). Per
        future: True when it ends cancelled, False when it had finished. A task whose batch is on
        its way to the hub right now is cancelled as soon as the hub has accepted it. Raises
        ``HubError``/``HubUnreachable`` when the hub refuses or cannot be reached for
        ``min(submit_timeout_s, 30)`` s (its futures stay as they were)."""
        futures = list(futures)
        out = [False] * len(futures)
        ask: dict[str, list[int]] = {}
        for i, f in enumerate(futures):
            if f.done():
                out[i] = f.cancelled()
                continue
            if Future.cancel(f):  # not taken by the submitter yet: never sent
                out[i] = True
                continue
            tid = getattr(f, "task_id", None)
            if tid is None:  # in a batch on its way: cancelled at the hub once accepted (_post)
                f._mesh_cancel = True  # type: ignore[attr-defined]
                out[i] = mark_cancelled(f)
                continue
            ask.setdefault(tid, []).append(i)
        if ask:
            answer = self._cancel_at_hub(list(ask))
            for tid in answer["cancelled"]:
                for i in ask.get(tid, ()):
                    out[i] = mark_cancelled(futures[i])
                with self._lock:
                    self._pending.pop(tid, None)
        return out

    def cancel_group(self, task_group_id: str | None = None) -> list[str]:
        """Cancel every unfinished task filed under ``task_group_id`` (default: this executor's),
        by whichever process submitted it; this executor's futures among them are cancelled.
        Returns the ids of the tasks cancelled."""
        group = task_group_id or self.task_group_id
        ids = self._retry_hub(lambda: self.client.cancel_task_group(group))
        with self._lock:
            hit = [self._pending.pop(t, None) for t in ids]
        for f in hit:
            if f is not None:
                mark_cancelled(f)
        return ids

    def _cancel_at_hub(self, ids: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"cancelled": [], "done": []}
        for i in range(0, len(ids), 50_000):
            part = self._retry_hub(lambda: self.client.cancel_tasks(ids[i : i + 50_000]))
            out["cancelled"] += part["cancelled"]
            out["done"] += part["done"]
        return out

    def _retry_hub(self, call: Callable[[], Any]) -> Any:
        """A cancel request, retried with backoff through a hub restart (it is idempotent), for at
        most ``submit_timeout_s`` or 30 s; then the last error."""
        policy = _HUB_RETRY.replace(deadline=max(0.0, min(self.submit_timeout_s, 30.0)))
        return retry(call, retry_on=_retryable, policy=policy, wait_hint=_retry_after)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        # Leaving on an error must not block forever on remote tasks that may never finish.
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
        return False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.future.cancel()
        self._queue.put(None)
        if wait:
            self._submitter.join()
            with self._lock:
                pending = list(self._pending.values())
            for f in pending:
                try:
                    f.exception()
                except BaseException:
                    pass
        self._work.set()

    # ---------------------------------------------------------------- internals
    @staticmethod
    def _progress(futures: list["Future[Any]"], label: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False) as bar:
            tid = bar.add_task(label, total=len(futures))
            done = 0
            for f in futures:
                try:
                    f.exception()
                except BaseException:
                    pass
                done += 1
                if done % 50 == 0 or done == len(futures):
                    bar.update(tid, completed=done)

    def _submit_loop(self) -> None:
        closing = False
        while not closing:
            item = self._queue.get()
            if item is None:
                break
            batch: list[_Item] = []
            self._take(item, batch)
            # A lone submit goes out at once; a burst is gathered while it keeps coming.
            deadline = time.monotonic() + (self.batch_interval_s if not self._queue.empty() else 0.0)
            while len(batch) < self.batch_size:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    closing = True
                    break
                self._take(nxt, batch)
            live = [it for it in batch if it.future.set_running_or_notify_cancel()]
            if live:
                self._post(live)

    def _take(self, item: "_Item | _Deferred", batch: list[_Item]) -> None:
        if isinstance(item, _Deferred):
            made = self._resolve(item)
            if made is not None:
                batch.append(made)
        else:
            batch.append(item)

    def _post(self, batch: list[_Item]) -> None:
        """One batch, retried with the same idempotency key until accepted, refused for good, or
        out of ``submit_timeout_s``. Full-jitter exponential backoff (``_HUB_RETRY``)."""
        key = uuid.uuid4().hex
        tries = _HUB_RETRY.replace(deadline=max(0.0, self.submit_timeout_s)).start()
        resent_bodies = False
        refusals = 0
        # Bounded by ``tries`` (submit_timeout_s), except for 429s: the hub is up and sets the pace
        # of those itself, as often as it asks (docs/sdk.md, "Over a queue bound").
        while True:
            functions = {it.fid: (it.name, it.body) for it in batch if it.body is not None and not self.client.knows(it.fid)}
            try:
                ids, eps = self._submit_batch([it.spec for it in batch], key, functions or None)  # type: ignore[arg-type]
                break
            except (HubUnreachable, HubError) as exc:
                status = getattr(exc, "status", None)
                if status == 404 and "unknown function" in str(exc) and not resent_bodies:
                    # the hub lost what we registered (a new database): send the bodies once more
                    self.client.forget(it.fid for it in batch)
                    resent_bodies = True
                    continue
                if isinstance(exc, HubError) and status not in _RETRY_STATUS:
                    self._fail(batch, exc)
                    return
                if status == 429:
                    # Over a queue bound (docs/operations.md, "Limits, shares and 429"): the hub
                    # stored nothing and said when to come back. Wait that long (plus jitter, so
                    # many clients do not return at once) and resend with the same key. The hub is
                    # alive and answering, so this does not count against submit_timeout_s.
                    refusals += 1
                    delay = (getattr(exc, "retry_after", None) or 1.0) * random.uniform(1.0, 1.25)
                    if refusals == 1 or refusals % 20 == 0:
                        log.info("hub is at a queue bound (%s); resubmitting %d task(s) in %.1f s", exc, len(batch), delay)
                    tries.pause(delay)  # not counted against submit_timeout_s
                    time.sleep(delay)
                    continue
                spent = tries.elapsed
                got = tries.next_delay()
                if got is None:
                    self._fail(batch, SubmitTimeout(f"the hub did not accept {len(batch)} task(s) within submit_timeout_s="
                                                    f"{self.submit_timeout_s:g} ({tries.failures} attempts); last error: {exc}"))
                    return
                if tries.failures == 1 or tries.failures % 10 == 0:
                    log.warning("submit of %d task(s) not accepted yet (%s); retrying for up to %.0f s more",
                                len(batch), exc, self.submit_timeout_s - spent)
                time.sleep(got)
            except Exception as exc:  # anything else (a bug, a TLS error) fails the batch with its reason
                self._fail(batch, exc)
                return
        with self._lock:
            self.task_count_submitted += len(batch)
            for it, tid, ep in zip(batch, ids, eps):
                f = it.future
                f.task_id = tid  # type: ignore[attr-defined]
                f.endpoint_id = ep  # type: ignore[attr-defined]
                orphan = self._orphans.pop(tid, None)
                if orphan is not None:
                    self._complete(f, orphan[1])
                else:
                    self._pending[tid] = f
        self._work.set()
        late = [tid for it, tid in zip(batch, ids) if getattr(it.future, "_mesh_cancel", False)]
        if late:  # cancelled while their batch was on its way
            try:
                self._cancel_at_hub(late)
            except Exception as exc:
                log.warning("could not cancel %d task(s) at the hub: %s", len(late), exc)

    def _submit_batch(self, specs: list[dict[str, Any]], key: str, functions: dict[str, tuple[str, bytes]] | None) -> tuple[list[str], list[str]]:
        """Over the stream when it is up, else REST; the same body and key either way."""
        stream = self._stream
        if stream is not None and stream.connected:
            body = self.client.batch_body(specs, key, functions, self.task_group_id)
            try:
                return self.client.batch_accepted(stream.submit(body, self.client.timeout), functions)
            except FrameTooBig:
                pass
        return self.client.submit_batch_placed(specs, key, functions=functions, task_group_id=self.task_group_id)

    @staticmethod
    def _fail(batch: list[_Item], exc: BaseException) -> None:
        for it in batch:
            if not it.future.done():
                it.future.set_exception(exc)

    def _complete(self, f: "Future[Any]", row: dict[str, Any]) -> None:
        if f.done():
            return
        f.started, f.finished = row.get("started"), row.get("finished")  # type: ignore[attr-defined]
        if row.get("endpoint_id"):  # where it ran: the hub may have moved it since the submit answered (late binding)
            f.endpoint_id = row["endpoint_id"]  # type: ignore[attr-defined]
        try:
            ok, value = decode_row(row, self.client.trusted_endpoints)
        except Exception as exc:  # a result that does not deserialize here (missing module, ...)
            f.set_exception(exc)
            return
        if ok:
            f.set_result(value)
        elif getattr(value, "remote_type", None) == TASK_CANCELLED:  # its one result says: cancelled
            mark_cancelled(f)
        else:
            f.set_exception(value)

    def _reading_done(self) -> bool:
        with self._lock:
            idle = not self._pending
        return idle and self._shutdown and self._queue.empty() and not self._submitter.is_alive()

    def _deliver(self, rows: list[dict[str, Any]], cursor: int) -> None:
        """Complete each row's future once; a repeat (at-least-once delivery) finds none and is kept as an orphan."""
        now = time.monotonic()
        with self._lock:
            self._cursor = max(self._cursor, cursor)
            for row in rows:
                f = self._pending.pop(row["task_id"], None)
                if f is not None:
                    self._complete(f, row)
                else:
                    self._orphans[row["task_id"]] = (now, row)
            if len(self._orphans) > 10_000:
                self._orphans = {k: v for k, v in self._orphans.items() if now - v[0] < _ORPHAN_TTL_S}

    def _rest_results_once(self, wait_s: float) -> None:
        """One REST poll of at most ``wait_s`` while the stream is down (or a plain wait when nothing is pending)."""
        with self._lock:
            idle = not self._pending
        try:
            if idle:
                raise HubUnreachable("nothing pending")
            rows, cursor = self.client.result_stream(self._cursor, timeout_s=wait_s)
            self._deliver(rows, cursor)
        except Exception:
            time.sleep(wait_s)

    def _result_loop(self) -> None:
        if self._stream is not None:
            if self._stream.run(self):  # served until shutdown
                return
            self._stream = None  # the hub offers no stream: REST from here on
        failed = 0  # polls failed since the last good one; no bound: the reader runs until shut down
        while True:
            with self._lock:
                idle = not self._pending
            if idle:
                if self._shutdown and self._queue.empty() and not self._submitter.is_alive():
                    return
                self._work.wait(0.5)
                self._work.clear()
                continue
            try:
                rows, cursor = self.client.result_stream(self._cursor, timeout_s=10.0)
                failed = 0
            except Exception as exc:  # hub restarting or link down: keep waiting, results are durable
                log.warning("result stream interrupted (%s); retrying", exc)
                time.sleep(_READ_RETRY.delay(failed))
                failed += 1
                continue
            self._deliver(rows, cursor)
