"""``AsyncExecutor``: the mesh for asyncio programs (FL drivers, web backends).

It wraps an :class:`Executor`: the same two background threads submit and read results for every
task, whatever their number; each ``concurrent.futures.Future`` is bridged to the event loop with
``asyncio.wrap_future``, which completes the asyncio future through ``call_soon_threadsafe``
when the result arrives. No thread per future, and ``await`` never blocks the loop.

    async with AsyncExecutor(endpoint_id="ep-...") as ex:
        print(await ex.submit(pow, 2, 10))
        print(await asyncio.gather(*(ex.submit(abs, -i) for i in range(100))))
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from cloud_hub.client._executor import Executor

__all__ = ["AsyncExecutor"]


class AsyncExecutor:
    """``submit`` returns an awaitable ``asyncio.Future``; ``async with`` shuts down without
    blocking the loop. Takes the same arguments as :class:`Executor` (or ``executor=`` one)."""

    def __init__(self, *args: Any, executor: Executor | None = None, **kwargs: Any) -> None:
        self.executor = executor if executor is not None else Executor(*args, **kwargs)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> "asyncio.Future[Any]":
        """Queue the call (no network wait) and return an asyncio future for its result.
        Call it from a running event loop."""
        return asyncio.wrap_future(self.executor.submit(fn, *args, **kwargs))

    def submit_to_registered_function(self, function_id: str, args: Sequence[Any] | None = None,
                                      kwargs: dict[str, Any] | None = None) -> "asyncio.Future[Any]":
        return asyncio.wrap_future(self.executor.submit_to_registered_function(function_id, args, kwargs))

    async def map(self, fn: Callable[..., Any], *iterables: Any) -> list[Any]:
        """All results, in order (raises the first task error, like ``asyncio.gather``)."""
        return list(await asyncio.gather(*(self.submit(fn, *a) for a in zip(*iterables))))

    @property
    def task_group_id(self) -> str:
        return self.executor.task_group_id

    async def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # Executor.shutdown(wait=True) joins the submitter and waits on results: off the loop.
        await asyncio.to_thread(self.executor.shutdown, wait, cancel_futures=cancel_futures)

    async def __aenter__(self) -> "AsyncExecutor":
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
