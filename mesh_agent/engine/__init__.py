"""The agent's local execution engine: a pool of warm worker processes.

``LocalEngine`` and the task/result types live in :mod:`mesh_agent.engine.local`, which imports
asyncio; they are loaded lazily here because every worker process imports this package (to reach
``mesh_agent.engine._worker``) and should pay only for what it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mesh_agent.engine._worker import make_error

if TYPE_CHECKING:
    from mesh_agent.engine.environments import EnvError, Environments
    from mesh_agent.engine.local import (
        ENVIRONMENT_ERROR,
        TASK_TIMEOUT,
        WORKER_DIED,
        EngineResult,
        EngineTask,
        LocalEngine,
        TaskTimeout,
        WorkerDied,
        error_result,
    )

__all__ = [
    "ENVIRONMENT_ERROR",
    "EnvError",
    "Environments",
    "TASK_TIMEOUT",
    "WORKER_DIED",
    "EngineResult",
    "EngineTask",
    "LocalEngine",
    "TaskTimeout",
    "WorkerDied",
    "error_result",
    "make_error",
]

_LAZY = frozenset(__all__) - {"make_error"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from mesh_agent.engine import local

        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
