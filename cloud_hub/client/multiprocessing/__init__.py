"""The standard library's ``multiprocessing`` API, run on the mesh (Lithops-style).

Change only the import line of a ``multiprocessing`` program:

    from cloud_hub.client import multiprocessing          # was: import multiprocessing
    from cloud_hub.client.multiprocessing import Pool     # was: from multiprocessing import Pool

``Pool`` and ``Process`` become tasks on your endpoints (through the SDK's Executor: batched,
retried, your code shipped by value); ``Queue``, ``Pipe``, ``Lock``, ``Event``, ``Value``,
``Array``, ``Manager()``... become proxies to state in Redis, which both this program and the
endpoints reach. Where work runs and which Redis: ``config(endpoint=, redis_url=)`` or
``MESH_MP_ENDPOINT`` / ``MESH_REDIS_URL``; the hub and token come from ``mesh-hub login`` or
``MESH_HUB_URL`` / ``MESH_TOKEN``. See docs/multiprocessing.md.
"""

from __future__ import annotations

from multiprocessing import AuthenticationError, BufferTooShort, ProcessError, TimeoutError
from typing import Any

from cloud_hub.client.multiprocessing._state import config, settings
from cloud_hub.client.multiprocessing.managers import Manager, SyncManager
from cloud_hub.client.multiprocessing.pool import Pool, Process, active_children, cpu_count, current_process, parent_process
from cloud_hub.client.multiprocessing.queues import JoinableQueue, Pipe, Queue, SimpleQueue
from cloud_hub.client.multiprocessing.sharedctypes import Array, RawArray, RawValue, Value
from cloud_hub.client.multiprocessing.synchronize import (Barrier, BoundedSemaphore, BrokenBarrierError, Condition, Event, Lock, RLock,
                                                          Semaphore)

__all__ = ["Array", "AuthenticationError", "Barrier", "BoundedSemaphore", "BrokenBarrierError", "BufferTooShort", "Condition",
           "Event", "JoinableQueue", "Lock", "Manager", "Pipe", "Pool", "Process", "ProcessError", "Queue", "RLock", "RawArray",
           "RawValue", "Semaphore", "SimpleQueue", "SyncManager", "TimeoutError", "Value", "active_children", "config",
           "cpu_count", "current_process", "freeze_support", "get_context", "get_start_method", "parent_process",
           "set_start_method", "settings"]


if "joblib" in __import__("sys").modules:  # a scikit-learn program: make the "mesh" backend known
    try:
        import cloud_hub.client._joblib  # noqa: F401
    except ImportError:
        pass


def freeze_support() -> None:
    """Nothing to do: no child interpreter is started here."""


def get_start_method(allow_none: bool = False) -> str:
    return "mesh"


def set_start_method(method: str | None, force: bool = False) -> None:
    """Accepted and ignored: every start method means a task on the mesh."""


def get_all_start_methods() -> list[str]:
    return ["mesh"]


def get_context(method: str | None = None) -> Any:
    """This module: ``ctx.Pool``, ``ctx.Queue``... are the mesh ones whatever the method."""
    import sys

    return sys.modules[__name__]
