"""``Executor``: the standard ``concurrent.futures`` interface over the mesh.

Two background threads do the batching users should not have to think about: one gathers
``submit`` calls for a couple of milliseconds and posts them as one batch; the other reads the
hub's result stream (one long poll for all outstanding tasks, never one poll per task) and
completes futures. Each result completes its future once, however often it is delivered.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from concurrent.futures import Executor as _Executor
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator

from cloud_hub.client._client import Client, EndpointSelector, HubError, constraints_spec, selector
from cloud_hub.client._results import decode_result

__all__ = ["Executor"]

log = logging.getLogger("cloud_hub.client")

_ORPHAN_TTL_S = 300.0


class Executor(_Executor):
    """Runs calls on the mesh.

    ``endpoint`` says where: an endpoint id, ``"auto"`` (the default: the hub's scheduler places
    each batch on your endpoints by predicted completion time), a list of ids, or
    ``{"tags": [...]}``. ``endpoint_id=`` is the older spelling and still works.
    ``constraints`` (``{"tags": [...], "gpu": True, "min_memory_mb": 2048}``) are what every
    function submitted here needs; the scheduler never places it elsewhere. Each future gets
    ``task_id`` and ``endpoint_id`` (where it was placed) once it is submitted.
    """

    def __init__(
        self,
        client: Client,
        endpoint_id: EndpointSelector | None = None,
        *,
        endpoint: EndpointSelector | None = None,
        constraints: dict[str, Any] | None = None,
        batch_size: int = 5000,
        batch_interval_s: float = 0.002,
        task_timeout_s: float | None = None,
        task_ttl_s: float | None = None,
    ) -> None:
        if endpoint is not None and endpoint_id is not None and endpoint != endpoint_id:
            raise ValueError("pass either endpoint= or endpoint_id=, not both")
        where = endpoint if endpoint is not None else endpoint_id
        self.client = client
        self.endpoint = selector("auto" if where is None else where)
        self.endpoint_id = self.endpoint  # older name
        self.constraints = constraints_spec(constraints)
        self.batch_size = batch_size
        self.batch_interval_s = batch_interval_s
        self.task_timeout_s = task_timeout_s
        self.task_ttl_s = task_ttl_s
        self._queue: "queue.Queue[tuple[Future[Any], dict[str, Any]] | None]" = queue.Queue()
        self._pending: dict[str, Future[Any]] = {}
        self._orphans: dict[str, tuple[float, dict[str, Any]]] = {}  # results seen before their submit returned
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._shutdown = False
        self._cursor = client.result_cursor()
        self._submitter = threading.Thread(target=self._submit_loop, name="mesh-submit", daemon=True)
        self._reader = threading.Thread(target=self._result_loop, name="mesh-results", daemon=True)
        self._submitter.start()
        self._reader.start()

    # ---------------------------------------------------------------- public API
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "Future[Any]":
        if self._shutdown:
            raise RuntimeError("cannot submit after shutdown")
        fid = self.client.register_function(fn)
        spec = Client.task_spec(self.endpoint, fid, args, kwargs, self.task_timeout_s, self.task_ttl_s, self.constraints)
        fut: Future[Any] = Future()
        self._queue.put((fut, spec))
        return fut

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
                    f.cancel()

        return results()

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
                    item[0].cancel()
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
            batch = [item]
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
                batch.append(nxt)
            live = [(f, s) for f, s in batch if f.set_running_or_notify_cancel()]
            if live:
                self._post(live)

    def _post(self, batch: list[tuple["Future[Any]", dict[str, Any]]]) -> None:
        try:
            ids, eps = self.client.submit_batch_placed(s for _, s in batch)
        except (HubError, OSError, Exception) as exc:  # the hub refused or is unreachable
            for f, _ in batch:
                f.set_exception(exc)
            return
        with self._lock:
            for (f, _), tid, ep in zip(batch, ids, eps):
                f.task_id = tid  # type: ignore[attr-defined]
                f.endpoint_id = ep  # type: ignore[attr-defined]
                orphan = self._orphans.pop(tid, None)
                if orphan is not None:
                    self._complete(f, orphan[1])
                else:
                    self._pending[tid] = f
        self._work.set()

    @staticmethod
    def _complete(f: "Future[Any]", row: dict[str, Any]) -> None:
        if f.done():
            return
        f.started, f.finished = row.get("started"), row.get("finished")  # type: ignore[attr-defined]
        try:
            ok, value = decode_result(row["ok"], base64.b64decode(row["data"]))
        except Exception as exc:  # a result that does not deserialize here (missing module, ...)
            f.set_exception(exc)
            return
        if ok:
            f.set_result(value)
        else:
            f.set_exception(value)

    def _result_loop(self) -> None:
        backoff = 0.2
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
                rows, self._cursor = self.client.result_stream(self._cursor, timeout_s=10.0)
                backoff = 0.2
            except Exception as exc:  # hub restarting or link down: keep waiting, results are durable
                log.warning("result stream interrupted (%s); retrying", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            now = time.monotonic()
            with self._lock:
                for row in rows:
                    f = self._pending.pop(row["task_id"], None)
                    if f is not None:
                        self._complete(f, row)
                    else:
                        self._orphans[row["task_id"]] = (now, row)
                if len(self._orphans) > 10_000:
                    self._orphans = {k: v for k, v in self._orphans.items() if now - v[0] < _ORPHAN_TTL_S}
