"""joblib's ``"mesh"`` backend: ``with joblib.parallel_backend("mesh"):`` runs ``Parallel`` (and so
scikit-learn's ``n_jobs``) as tasks on the mesh.

Each joblib batch (a ``BatchedCalls``: a few calls of e.g. ``_fit_and_score`` with their data)
is one task through the same Executor as ``cloud_hub.client.multiprocessing``, so endpoints come
from ``multiprocessing.config(endpoint=...)`` / ``MESH_MP_ENDPOINT``. ``n_jobs=-1`` means the
fleet's capacity (``cpu_count()``). Code inside a task runs sequentially (no nested fan-out from
an agent's worker). Registered when this module is imported, and by
``cloud_hub.client.multiprocessing`` when joblib is already loaded.
"""

from __future__ import annotations

from typing import Any, Callable

from joblib import register_parallel_backend
from joblib._parallel_backends import AutoBatchingMixin, ParallelBackendBase, SequentialBackend

__all__ = ["MeshBackend", "register"]


def _call(func: Callable[[], Any]) -> Any:
    """On the agent's worker: one joblib batch."""
    return func()


class MeshBackend(AutoBatchingMixin, ParallelBackendBase):
    """Batches as mesh tasks; futures are the Executor's."""

    supports_retrieve_callback = True
    supports_return_generator = True
    supports_timeout = True
    default_n_jobs = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._futures: list[Any] = []

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            n_jobs = self.default_n_jobs
        if n_jobs < 0:
            from cloud_hub.client.multiprocessing.pool import cpu_count

            try:
                total = cpu_count()
            except NotImplementedError:  # no selected endpoint online: as joblib with an unknown count
                total = 1
            return max(total + 1 + n_jobs, 1)
        return int(n_jobs)

    def configure(self, n_jobs: int = 1, parallel: Any = None, prefer: Any = None, require: Any = None, **kw: Any) -> int:
        if require == "sharedmem":
            raise ValueError("the mesh backend has no shared memory between tasks (require='sharedmem')")
        self.parallel = parallel
        return self.effective_n_jobs(n_jobs)

    def submit(self, func: Callable[[], Any], callback: Callable[[Any], Any] | None = None) -> Any:
        from cloud_hub.client.multiprocessing import _runner

        fut = _runner.executor().submit(_call, func)
        self._futures = [f for f in self._futures if not f.done()] + [fut]
        if callback is not None:
            fut.add_done_callback(callback)
        return fut

    def retrieve_result_callback(self, future: Any) -> Any:
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        for f in self._futures:
            f.cancel()
        self._futures = []

    def get_nested_backend(self) -> tuple[Any, int | None]:
        return SequentialBackend(nesting_level=(self.nesting_level or 0) + 1), None

    def __reduce__(self) -> tuple[Any, ...]:  # travels inside BatchedCalls: no futures, no executor
        return (MeshBackend, ())


def register() -> None:
    register_parallel_backend("mesh", MeshBackend)


register()
