"""The SDK's side of memoization (docs/sdk.md, "Memoization"): cache keys, and repeats of a call
still running joined to it.

Why both here: the hub answers a repeat whose result it already has (``cache_key`` on the task,
cloud_hub/store/memo.py), but a repeat submitted while the first call still runs would run again.
Like Parsl's memoizer, the Executor hands such a repeat a future that completes with the first
call's outcome, so a burst with repeats sends each distinct call once.
"""

from __future__ import annotations

import inspect
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, Sequence

from mesh_agent.protocol.memo import MemoKeyError, bound_arguments, memo_key

__all__ = ["ENV_FIELDS", "MemoKeyError", "MemoOptions", "pop_options", "Inflight", "key_for"]

#: Environment-like fields of a task spec that change what a call computes (item 1 of issue 16).
ENV_FIELDS = ("environment", "container", "sandbox")


class MemoOptions:
    """``cache`` and ``ignore_for_cache`` for one function or one submit."""

    __slots__ = ("cache", "ignore")

    def __init__(self, cache: bool, ignore: Iterable[str] = ()) -> None:
        if not isinstance(cache, bool):
            raise TypeError(f"cache must be True or False, not {type(cache).__name__}")
        if isinstance(ignore, str):
            raise TypeError("ignore_for_cache is a list of argument names, not one string")
        self.cache = cache
        self.ignore = tuple(ignore)
        for name in self.ignore:
            if not isinstance(name, str):
                raise TypeError(f"ignore_for_cache names arguments by name (str), got {name!r}")


def pop_options(fn: Callable[..., Any] | None, kwargs: dict[str, Any]) -> MemoOptions | None:
    """Take ``cache=`` and ``ignore_for_cache=`` out of a submit's keyword arguments, unless the
    function itself has a parameter of that name (then it is the function's argument, and
    caching is asked for with ``register_function(fn, cache=True)`` instead)."""
    params: Mapping[str, Any] = {}
    if fn is not None:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
    cache = kwargs.pop("cache") if "cache" in kwargs and "cache" not in params else None
    ignore = kwargs.pop("ignore_for_cache") if "ignore_for_cache" in kwargs and "ignore_for_cache" not in params else None
    if cache is None and ignore is None:
        return None
    return MemoOptions(bool(cache) if isinstance(cache, bool) or cache is None else cache, ignore or ())


def key_for(fn: Callable[..., Any] | None, fid: str, args: Sequence[Any], kwargs: Mapping[str, Any], opts: MemoOptions,
            spec: Mapping[str, Any]) -> str:
    """The call's cache key, or :class:`MemoKeyError` naming the argument that cannot be hashed."""
    env = {k: spec[k] for k in ENV_FIELDS if k in spec} or None
    return memo_key(fid, bound_arguments(fn, args, kwargs), opts.ignore, env)


class Inflight:
    """Cache key -> the future of the first call with it, while that call runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lead: dict[str, Future[Any]] = {}

    def join(self, key: str) -> "Future[Any] | None":
        """A future that completes as the running call with this key does, or None (no such call:
        the caller becomes the leader and must :meth:`lead`)."""
        with self._lock:
            lead = self._lead.get(key)
        if lead is None:
            return None
        follower: Future[Any] = Future()
        follower.set_running_or_notify_cancel()

        def copy(f: "Future[Any]") -> None:
            if f.cancelled():
                follower.cancel()
                return
            exc = f.exception()
            if exc is not None:
                follower.set_exception(exc)
            else:
                follower.set_result(f.result())
            for attr in ("task_id", "endpoint_id"):
                if hasattr(f, attr):
                    setattr(follower, attr, getattr(f, attr))

        lead.add_done_callback(copy)
        return follower

    def lead(self, key: str, fut: "Future[Any]") -> None:
        with self._lock:
            self._lead[key] = fut

        def done(f: "Future[Any]") -> None:
            with self._lock:
                if self._lead.get(key) is f:
                    del self._lead[key]

        fut.add_done_callback(done)

    def __len__(self) -> int:
        with self._lock:
            return len(self._lead)
