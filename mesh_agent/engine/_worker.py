"""The loop that runs inside each warm worker process.

Why a separate, tiny module: each worker is a fresh interpreter (``python -c`` started by the
engine, see :func:`boot`) that imports this module before it can run anything, and every import
here is paid again on each restart after a crash, a timeout or an idle reap. Only the standard
library and the serializer facade are imported; the serializer pulls in dill lazily, only when a
body needs it (``mesh_agent.protocol`` loads its envelope code lazily for the same reason).

Wire format: plain frames (``_channel.py``, never pickle: the agent must not unpickle what a
worker running another user's code sends), framed as :class:`multiprocessing.connection.Connection`
frames them, over a socketpair whose end this process inherits.

* parent -> worker: a chunk, ``[(task_id, function_id, body or None, args_blob), ...]``;
  ``body`` is sent only the first time this worker sees ``function_id``.
* worker -> parent: ready (with the pid) once after start-up, then one result
  ``(task_id, ok, data, started, finished)`` per task, in task order.

Why every result is written as soon as it exists, not held back for a batch: a task may end the
process (``os._exit``, a segfault, the OOM killer) and anything still in this process's memory dies
with it. Written results sit in the kernel's socket buffer and reach the parent even after this
process is gone, so on EOF the parent knows exactly which task was running (the first unreported
one), no finished task is lost or run twice, and the right task is blamed. Batching still happens:
the parent reads whatever has accumulated in one go and delivers it as one callback. Measured on
2 cores: 60-90k no-op tasks/s this way, ~135k/s holding results for 2 ms batches, which lost
finished results and blamed innocent tasks when a worker died.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import time
import traceback
from typing import Any, Callable

from mesh_agent.engine._channel import MAX_RESULT_BYTES, decode_chunk, encode_ready, encode_result
from mesh_agent.protocol.serialize import SerializationError, deserialize, deserialize_function, serialize

__all__ = ["SERIALIZATION_ERROR", "make_error", "type_name", "run_task", "main", "boot"]

#: Public name of the serializer's error (the class lives in ``mesh_agent.protocol.serialize``).
SERIALIZATION_ERROR = "mesh_agent.protocol.SerializationError"

Task = tuple[str, str, "bytes | None", bytes]
#: the task running now in this worker (a re-run after a crash has the same id): cloud_hub.client.refs
#: names producers by it, and a mesh Queue consumer keys its pending list by it (at-least-once delivery)
CURRENT_TASK_ID: str | None = None
Result = tuple[str, bool, bytes, float, float]


def type_name(exc: BaseException) -> str:
    """``module.QualName`` of an exception, as shown to users and matched by clients."""
    if isinstance(exc, SerializationError):
        return SERIALIZATION_ERROR
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def make_error(exc: BaseException, exc_type: str | None = None) -> dict[str, Any]:
    """The error dict of a failed task: what a client needs to show or re-raise the remote error.

    ``exception`` is the pickled exception only if it also unpickles: exceptions whose
    ``__init__`` takes extra required arguments pickle fine but fail to load, and a client
    should get ``None`` rather than a blob that blows up later.
    """
    try:
        message = str(exc)
    except Exception:
        message = f"<unprintable {type(exc).__name__}>"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    blob: bytes | None
    try:
        blob = pickle.dumps(exc, protocol=5)
        pickle.loads(blob)
    except Exception:
        blob = None
    return {"type": exc_type or type_name(exc), "message": message, "traceback": tb, "exception": blob}


def _failure(task_id: str, exc: BaseException, started: float) -> Result:
    return task_id, False, serialize(make_error(exc)), started, time.time()


def _load_function(cache: dict[str, Any], function_id: str, body: bytes | None) -> Any:
    """The callable for ``function_id``, or a :class:`SerializationError` saying why it won't load.

    The parent sends each body only once per worker, so a body that failed to load is kept and
    retried by the function's next task: the failure may be transient (MemoryError, a module
    installed since), and later tasks must get the real error rather than "not cached".
    """
    cached = cache.get(function_id)
    if cached is not None and not isinstance(cached, bytes):
        return cached
    body = body if body is not None else cached
    if body is None:  # only an engine bug can get here
        return SerializationError(f"function {function_id!r} is not cached in worker {os.getpid()}")
    try:
        fn = deserialize_function(body)
    except Exception as exc:
        cache[function_id] = body
        err = SerializationError(f"bad function body for {function_id!r}: {exc}")
        err.__cause__ = exc
        return err
    cache[function_id] = fn
    return fn


def _split_call(blob: bytes) -> tuple[list[Any] | tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from an args blob; any malformation is a :class:`SerializationError`."""
    try:
        call = deserialize(blob)
    except Exception as exc:
        raise SerializationError(f"bad arguments blob: {exc}") from exc
    if (
        isinstance(call, (list, tuple))
        and len(call) == 2
        and isinstance(call[0], (list, tuple))
        and isinstance(call[1], dict)
    ):
        return call[0], call[1]
    raise SerializationError(f"bad arguments blob: expected (args, kwargs), got {type(call).__name__}")


def run_task(cache: dict[str, Any], task: Task) -> Result:
    """Run one task; every failure, including ``SystemExit`` from user code, becomes a result."""
    task_id, function_id, body, args_blob = task
    global CURRENT_TASK_ID
    CURRENT_TASK_ID = task_id
    started = time.time()
    fn: Callable[..., Any] | BaseException = _load_function(cache, function_id, body)
    if isinstance(fn, BaseException):
        return _failure(task_id, fn, started)
    try:
        args, kwargs = _split_call(args_blob)
    except SerializationError as exc:
        return _failure(task_id, exc, started)
    refs = sys.modules.get("cloud_hub.client.refs")  # loaded only when an argument was a MeshRef (issue 12)
    if refs is not None:
        try:
            args, kwargs = refs.resolve(args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - a missing ref fails this task, not the worker
            return _failure(task_id, exc, started)
        started = time.time()  # the run starts now: fetching inputs is transfer, which the scheduler predicts apart (locality)
    staging = sys.modules.get("mesh_agent.staging")  # loaded only if an argument or a function uses it
    if staging is not None:
        return _run_staged(staging, task_id, fn, args, kwargs, started)
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - user code must never take the worker down
        return _failure(task_id, exc, started)
    return _success(task_id, value, started)


def _run_staged(staging: Any, task_id: str, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any], started: float) -> Result:
    """Globus file references in, the function, outputs pushed out (see mesh_agent.staging)."""
    try:
        args, kwargs = staging.stage_in(task_id, args, kwargs)
        value = fn(*args, **kwargs)
        value = staging.stage_out(task_id, value)
    except BaseException as exc:  # noqa: BLE001
        return _failure(task_id, exc, started)
    finally:
        staging.cleanup(task_id)
    return _success(task_id, value, started)


def _success(task_id: str, value: Any, started: float) -> Result:
    try:
        data = serialize(value)
    except Exception as exc:
        err = SerializationError(f"cannot serialize the result ({type(value).__name__}): {exc}")
        err.__cause__ = exc
        return _failure(task_id, err, started)
    if len(data) > MAX_RESULT_BYTES:
        return _failure(task_id, SerializationError(
            f"the result ({type(value).__name__}, {len(data)} bytes serialized) is over this endpoint's "
            f"{MAX_RESULT_BYTES // 2**20} MiB limit for one result: return a ref to it instead (docs/data.md)"), started)
    return task_id, True, data, started, time.time()


def _exit_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when the agent dies, even mid-task.

    Pipe EOF already ends an idle worker; this covers one busy in a long task. Best effort:
    other systems rely on EOF alone.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    except Exception:
        return
    if parent_pid > 0 and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)  # (0: wrapped by bwrap or a container runtime, which dies with the agent instead)


def _limit_memory(memory_limit_mb: int) -> None:
    """Cap the address space so a runaway task gets MemoryError instead of the OOM killer.

    Applied after start-up imports so the limit is spent on user code. Linux only: elsewhere
    RLIMIT_AS is missing or not enforced.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import resource
    except ImportError:
        return
    limit = memory_limit_mb * 1024 * 1024
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    # Soft and hard alike: with only the soft limit set, a task could raise it again (issue 25).
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class FdConnection:
    """``send_bytes``/``recv_bytes`` on an inherited socket, framed as
    :class:`multiprocessing.connection.Connection` frames them (4-byte big-endian length, or -1
    and an 8-byte length). Written out because importing ``multiprocessing.connection`` costs a
    worker about 3 MB resident, a third of its start-up footprint."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def _read(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = os.read(self.fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv_bytes(self) -> bytes:
        (size,) = struct.unpack("!i", self._read(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._read(8))
        return self._read(size)

    def send_bytes(self, data: bytes) -> None:
        n = len(data)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        view = memoryview(header + data) if n < 1 << 16 else None
        if view is None:
            self._write(memoryview(header))
            view = memoryview(data)
        self._write(view)

    def _write(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view):]


def boot(args: dict[str, Any]) -> None:
    """Entry point of a worker started by ``LocalEngine``: ``args`` carries the inherited socket's
    fd, the memory limit and the agent's pid. A plain interpreter, not a multiprocessing child,
    so user code may start its own processes (no daemon flag) and no resource tracker runs.
    A sandboxed worker was locked down before this interpreter started (``_lockdown.py``)."""
    main(FdConnection(int(args["fd"])), args.get("mem"), int(args["ppid"]))


def _resume_ref_stagers() -> None:
    """After a restart, serve this endpoint's local refs (issue 12, docs/data.md) to consumers on
    other endpoints again, before any task here touches refs. Only where refs.sqlite3 exists, and
    in a thread: the worker reports ready at once, and an endpoint without local refs pays nothing."""
    d = os.environ.get("MESH_ENDPOINT_DATA_DIR")
    if not d or not os.path.exists(os.path.join(d, "refs.sqlite3")):
        return

    def go() -> None:
        try:
            from mesh_agent.refstore import resume_stagers

            resume_stagers()
        except Exception:  # noqa: BLE001 - staging is best effort; consumers get a clear timeout
            pass

    import threading

    threading.Thread(target=go, daemon=True, name="mesh-ref-resume").start()


def main(conn: Any, memory_limit_mb: int | None, parent_pid: int) -> None:
    """Worker loop: report ready, then run chunks until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's to handle
    _exit_with_parent(parent_pid)
    if memory_limit_mb:
        _limit_memory(memory_limit_mb)
    send = conn.send_bytes
    recv = conn.recv_bytes
    cache: dict[str, Any] = {}
    _resume_ref_stagers()
    try:
        send(encode_ready(os.getpid()))
        while True:
            chunk = decode_chunk(recv())
            if chunk is None:
                return
            for task in chunk:
                send(encode_result(*run_task(cache, task)))
    except (EOFError, OSError):
        return  # the agent closed the pipe or died: exit, never linger as an orphan
