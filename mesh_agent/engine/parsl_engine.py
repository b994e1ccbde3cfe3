"""ParslEngine (``engine: parsl``): tasks run on a Parsl HighThroughputExecutor, e.g. Slurm jobs.

An agent on an HPC login node must not run the work itself: it holds the durable queue and the
link to the hub, and hands tasks to Parsl, which gets compute nodes from the batch system in
*blocks* and scales them between ``min_blocks`` and ``max_blocks`` (``htex_auto_scale``).

It has the same interface and the same result semantics as :class:`LocalEngine`, so the agent
does not care which one it drives:

* results are :class:`EngineResult` with the same serialized error dicts (the task runs through
  ``_worker.run_task`` on the worker, see :mod:`mesh_agent.engine._remote`);
* a task over its timeout fails with ``mesh_agent.engine.TaskTimeout``, enforced in the worker
  (only it knows when the task started, which may be hours after submission while a batch job
  waits in the queue; see :mod:`mesh_agent.engine._remote`);
* a task whose worker dies (``os._exit``, a segfault, the OOM killer, a node lost) fails with
  ``mesh_agent.engine.WorkerDied``; others are not affected;
* ``stop()`` does not report unfinished tasks: the agent's durable queue runs them again.

Parsl calls back from its own threads; results are handed to the agent's event loop in batches.
Parsl launches ``interchange.py`` and ``process_worker_pool.py`` from ``PATH``: the directory of
the running interpreter (the venv's ``bin/``) is put on ``PATH`` if they are not found.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mesh_agent.engine.local import WORKER_DIED, EngineResult, EngineTask, WorkerDied, _pickled, error_result
from mesh_agent.settings import ConfigError

if TYPE_CHECKING:  # the runner hands a light view of it (mesh_agent.settings), not the pydantic model
    from mesh_agent.config import ParslSettings

__all__ = ["ParslEngine", "PARSL_ERROR", "build_parsl_config"]

log = logging.getLogger(__name__)

PARSL_ERROR = "mesh_agent.engine.ParslError"
_LABEL = "mesh"
_WARM_KEEP = 256


def _ensure_parsl_on_path() -> None:
    """Parsl runs its helper scripts by name; make sure the venv's bin/ is searched."""
    if shutil.which("process_worker_pool.py") and shutil.which("interchange.py"):
        return
    bindir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    if not shutil.which("process_worker_pool.py"):
        raise ConfigError(f"engine: parsl: process_worker_pool.py not found on PATH nor in {bindir}; install continuum-mesh[hpc]")


def build_parsl_config(settings: ParslSettings, run_dir: Path, workers: int | None = None) -> Any:
    """The parsl ``Config`` for these settings: one HighThroughputExecutor and its provider."""
    try:
        from parsl.config import Config
        from parsl.executors import HighThroughputExecutor
        from parsl.launchers import MpiExecLauncher, SingleNodeLauncher, SrunLauncher
        from parsl.providers import LocalProvider, PBSProProvider, SlurmProvider
    except ImportError as exc:
        raise ConfigError(f"engine: parsl needs Parsl installed (pip install 'continuum-mesh[hpc]'): {exc}") from None

    launcher = {"single": SingleNodeLauncher, "srun": SrunLauncher, "mpiexec": MpiExecLauncher}[settings.launcher]()
    blocks = dict(
        nodes_per_block=settings.nodes_per_block, init_blocks=settings.init_blocks, min_blocks=settings.min_blocks,
        max_blocks=settings.max_blocks, parallelism=settings.parallelism, worker_init=settings.worker_init, launcher=launcher,
    )
    provider: Any
    if settings.provider == "local":
        provider = LocalProvider(**blocks)
    elif settings.provider == "slurm":
        provider = SlurmProvider(
            partition=settings.partition, account=settings.account, qos=settings.qos, walltime=settings.walltime,
            scheduler_options=settings.scheduler_options, **blocks,
        )
    else:
        provider = PBSProProvider(
            account=settings.account, queue=settings.queue, walltime=settings.walltime,
            scheduler_options=settings.scheduler_options, **blocks,
        )
    address = settings.address or ("127.0.0.1" if settings.provider == "local" else None)
    executor = HighThroughputExecutor(
        label=_LABEL,
        provider=provider,
        address=address,
        cores_per_worker=settings.cores_per_worker,
        max_workers_per_node=workers or settings.max_workers_per_node,
        worker_logdir_root=str(run_dir / "workers"),
        heartbeat_period=settings.heartbeat_period,
        heartbeat_threshold=settings.heartbeat_threshold,
    )
    return Config(
        executors=[executor],
        run_dir=str(run_dir),
        strategy="htex_auto_scale",
        strategy_period=settings.strategy_period,
        max_idletime=settings.max_idletime,
        retries=0,  # the agent's queue decides about re-execution, not Parsl
        usage_tracking=0,
        garbage_collect=True,
    )


class ParslEngine:
    """Runs tasks through a Parsl DataFlowKernel; results go to ``on_results`` in batches."""

    def __init__(
        self,
        on_results: Callable[[list[EngineResult]], None],
        settings: ParslSettings,
        run_dir: Path,
        workers: int | None = None,
        task_timeout: float | None = None,
        memory_limit_mb: int | None = None,
        max_batch: int = 32,
    ) -> None:
        self._on_results = on_results
        self._settings = settings
        self._run_dir = Path(run_dir)
        self._workers_per_node = workers
        self._task_timeout = task_timeout
        self._memory_limit_mb = memory_limit_mb
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dfk: Any = None
        self._app: Any = None
        self._futures: dict[str, Future[Any]] = {}  # task id -> Parsl's future, until reported
        self._warm: OrderedDict[str, None] = OrderedDict()
        self._done: list[EngineResult] = []
        self._done_lock = threading.Lock()
        self._flush_scheduled = False
        self._started = False
        self._stopping = False
        self.stats: dict[str, int] = {"tasks_submitted": 0, "results": 0, "worker_deaths": 0, "late_results": 0}

    # ------------------------------------------------------------------ interface shared with LocalEngine

    @property
    def workers(self) -> int:
        """Task slots at full scale: what the agent asks the hub for (plus prefetch)."""
        per_node = self._workers_per_node or self._settings.max_workers_per_node
        if per_node is None:
            per_node = max(1, int((os.cpu_count() or 1) / self._settings.cores_per_worker))
        return self._settings.max_blocks * self._settings.nodes_per_block * per_node

    @property
    def worker_pids(self) -> list[int]:
        return []  # workers live on other nodes; their pids come back with each result

    @property
    def running(self) -> int:
        """Tasks handed to Parsl and not yet reported (running or waiting for a block)."""
        return len(self._futures)

    @property
    def queued(self) -> int:
        return 0  # nothing waits inside the engine: every task goes to Parsl at once

    def warm_functions(self) -> list[str]:
        return sorted(self._warm)

    async def start(self) -> None:
        """Start Parsl (interchange, provider, initial blocks); returns once it accepts tasks."""
        if self._started:
            raise RuntimeError("engine already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        _ensure_parsl_on_path()
        self._run_dir.mkdir(parents=True, exist_ok=True)
        # Parsl logs at DEBUG into <run_dir>/parsl.log; keep that out of the agent's own log.
        logging.getLogger("parsl").propagate = False
        config = build_parsl_config(self._settings, self._run_dir, self._workers_per_node)
        from parsl.app.python import PythonApp
        from parsl.dataflow.dflow import DataFlowKernel

        from mesh_agent.engine._remote import run_remote

        self._dfk = await asyncio.to_thread(DataFlowKernel, config)
        self._app = PythonApp(run_remote, data_flow_kernel=self._dfk, executors=[_LABEL], cache=False)
        log.info("parsl engine started: provider %s, blocks %d..%d, run dir %s", self._settings.provider,
                 self._settings.min_blocks, self._settings.max_blocks, self._run_dir)

    async def stop(self, grace: float = 5.0) -> None:
        """Shut Parsl down (cancels its blocks); unfinished tasks are not reported."""
        if self._stopping:
            return
        self._stopping = True
        self._futures.clear()
        if self._dfk is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._dfk.cleanup), timeout=max(grace, 0) + 30)
            except Exception as exc:  # a stuck provider must not keep the agent from exiting
                log.error("parsl cleanup failed: %r", exc)

    def submit(self, tasks: list[EngineTask]) -> None:
        """Hand tasks to Parsl; never blocks for long. Call from the loop thread."""
        if self._stopping or self._app is None:
            raise RuntimeError("engine is stopped" if self._stopping else "engine not started")
        for task in tasks:
            timeout = task.timeout if task.timeout is not None else self._task_timeout
            fut = self._app(task.task_id, task.function_id, task.function_body, task.args, timeout, self._memory_limit_mb)
            self._futures[task.task_id] = fut
            fut.add_done_callback(lambda f, t=task: self._on_done(t, f))
            self._warm[task.function_id] = None
            self._warm.move_to_end(task.function_id)
            while len(self._warm) > _WARM_KEEP:
                self._warm.popitem(last=False)
        self.stats["tasks_submitted"] += len(tasks)

    # ------------------------------------------------------------------ results

    def _on_done(self, task: EngineTask, fut: Future[Any]) -> None:
        """Parsl's thread: turn the outcome into an EngineResult and wake the loop."""
        if self._stopping or fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            task_id, ok, data, started, finished, pid = fut.result()
            result = EngineResult(task_id, ok, data, started, finished, pid)
        else:
            result = self._failure(task, exc)
        with self._done_lock:
            self._done.append(result)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the agent is gone, the queue re-runs the task
            pass

    def _failure(self, task: EngineTask, exc: BaseException) -> EngineResult:
        name = type(exc).__name__
        if name in ("WorkerLost", "ManagerLost"):
            self.stats["worker_deaths"] += 1
            message = f"the Parsl worker running task {task.task_id} died ({name}: {exc})"
            return error_result(task.task_id, WORKER_DIED, message, exception=_pickled(WorkerDied(message)))
        message = f"Parsl could not run task {task.task_id}: {name}: {exc}"
        return error_result(task.task_id, PARSL_ERROR, message)

    def _flush(self) -> None:
        with self._done_lock:
            batch, self._done = self._done, []
            self._flush_scheduled = False
        fresh = []
        for r in batch:
            if self._futures.pop(r.task_id, None) is not None:
                fresh.append(r)
            else:
                self.stats["late_results"] += 1  # a duplicate callback, or the engine stopped
        self._deliver(fresh)

    def _deliver(self, results: list[EngineResult]) -> None:
        if not results or self._stopping:
            return
        self.stats["results"] += len(results)
        try:
            self._on_results(results)
        except Exception:
            log.exception("engine on_results callback failed")
