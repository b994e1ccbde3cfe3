"""What a Parsl worker runs for one mesh task (``engine: parsl``).

Parsl ships :func:`run_remote` to its HighThroughputExecutor workers by reference, so this module
must be importable on the compute nodes (the same installation as the agent). The task itself
runs through ``_worker.run_task``: the same deserialization, error dicts and remote tracebacks as
the local engine, so a client cannot tell which engine ran its function.

Timeouts are enforced here, in the worker, because only the worker knows when a task started (it
may wait hours for a batch job to start) and Parsl cannot stop one running task from outside.
``SIGALRM`` fires after the timeout and its handler raises :class:`TaskTimeout` on the worker's
main thread (where Parsl workers run tasks); it fires again every second in case user code
swallows the exception. A task that ran past its timeout fails with ``TaskTimeout`` even if it
finished afterwards, so the outcome does not depend on how the code reacted to the alarm. Code
stuck in one long C call keeps its worker until the call returns.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from mesh_agent.engine import _worker
from mesh_agent.engine.local import TASK_TIMEOUT, TaskTimeout  # the same class, so clients re-raise it alike
from mesh_agent.protocol.serialize import serialize

__all__ = ["run_remote"]

#: Deserialized functions by id, kept for the life of the worker process (warm functions).
_CACHE: dict[str, Any] = {}
_LIMITED = False
_REPEAT_S = 1.0


def _limit_memory_once(memory_limit_mb: int | None) -> None:
    global _LIMITED
    if memory_limit_mb and not _LIMITED:
        _worker._limit_memory(memory_limit_mb)
        _LIMITED = True


def run_remote(
    task_id: str, function_id: str, body: bytes, args: bytes, timeout: float | None, memory_limit_mb: int | None
) -> tuple[str, bool, bytes, float, float, int]:
    """Run one task in this Parsl worker: ``(task_id, ok, data, started, finished, pid)``."""
    _limit_memory_once(memory_limit_mb)
    pid = os.getpid()
    if not timeout or threading.current_thread() is not threading.main_thread():
        return (*_worker.run_task(_CACHE, (task_id, function_id, body, args)), pid)
    message = f"task exceeded its {timeout:g} s timeout and was interrupted in worker {pid}"
    state = {"running": True, "fired": False}

    def on_alarm(signum: int, frame: Any) -> None:
        if state["running"]:
            state["fired"] = True
            raise TaskTimeout(message)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(timeout), _REPEAT_S)
    started = time.time()
    result: tuple[str, bool, bytes, float, float] | None = None
    try:
        try:
            result = _worker.run_task(_CACHE, (task_id, function_id, body, args))
        except TaskTimeout:  # the alarm hit outside user code (loading args, serializing the result)
            pass
    finally:
        state["running"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if result is None or state["fired"] or result[4] - result[3] > timeout:
        error = _worker.make_error(TaskTimeout(message), TASK_TIMEOUT)
        return task_id, False, serialize(error), started, time.time(), pid
    return (*result, pid)
