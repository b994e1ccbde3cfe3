"""A ``Future`` as an argument of a later task (issue 12): ``ex.submit(g, ex.submit(f, x))``.

Why the task waits here, in the SDK, until its inputs are done, and not on an agent: a
consumer dispatched early would hold a worker slot while it waits, and with every slot so held
the producers queued behind them would never run. So the consumer is submitted the moment its
last input finishes (a callback, no polling), with each Future replaced by a small
:class:`~cloud_hub.client.refs.TaskOutput` (task id + the hub's store). The consumer's worker
reads the producer's result from the hub itself (``MESH.RESULT``): the bytes go hub -> agent,
never back up from this program. (The producer's own Future still receives its result, as
every Future does; return a ref from the producer to keep even that away from the program.)
Neither ``submit()`` nor the callback makes a request: the Executor's background submitter asks
the hub for its store's URL and sends the call (through hub restarts, within ``submit_timeout_s``).

A failed input fails the consumer without running it, with an error naming the input's task.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

from cloud_hub.client._futures import cancel_and_notify

__all__ = ["has_futures", "submit_after", "swap_all", "chain", "DependencyError"]


class DependencyError(RuntimeError):
    """A task was not run because a Future passed as its argument failed."""


def _walk(v: Any, depth: int, out: list[Future[Any]]) -> None:
    if isinstance(v, Future):
        out.append(v)
    elif depth < 2 and type(v) in (list, tuple):
        for x in v:
            _walk(x, depth + 1, out)
    elif depth < 2 and type(v) is dict:
        for x in v.values():
            _walk(x, depth + 1, out)


def futures_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Future[Any]]:
    """Futures among the arguments, also inside a list, tuple or dict argument (two levels, as
    the agent resolves refs)."""
    out: list[Future[Any]] = []
    for a in args:
        _walk(a, 0, out)
    for a in kwargs.values():
        _walk(a, 0, out)
    return out


def has_futures(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(futures_in(args, kwargs))


def _swap(v: Any, depth: int, url: str) -> Any:
    from cloud_hub.client.refs import TaskOutput

    if isinstance(v, Future):
        from cloud_hub.client.refs import MeshRef

        value = v.result()
        if isinstance(value, MeshRef):  # already small: pass the ref itself (and the scheduler sees where it lies)
            return value
        return TaskOutput(str(getattr(v, "task_id")), url)
    if depth < 2 and type(v) in (list, tuple):
        return type(v)(_swap(x, depth + 1, url) for x in v)
    if depth < 2 and type(v) is dict:
        return {k: _swap(x, depth + 1, url) for k, x in v.items()}
    return v


def swap_all(args: tuple[Any, ...], kwargs: dict[str, Any], url: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with each (done) Future replaced by its ``TaskOutput`` on the hub's store ``url``."""
    return tuple(_swap(a, 0, url) for a in args), {k: _swap(v, 0, url) for k, v in kwargs.items()}


def chain(real: Future[Any], out: Future[Any]) -> None:
    """Complete ``out`` (the caller's Future) as ``real`` (the submitted task's) completes."""
    def done(f: Future[Any]) -> None:
        out.task_id = getattr(f, "task_id", None)  # type: ignore[attr-defined]
        out.endpoint_id = getattr(f, "endpoint_id", None)  # type: ignore[attr-defined]
        if out.done():  # cancelled by the caller meanwhile
            return
        exc = f.exception() if not f.cancelled() else None
        if f.cancelled():
            cancel_and_notify(out)  # waiters on ``out`` wake (Future.cancel alone would not tell them)
        elif exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result())

    real.add_done_callback(done)


def submit_after(ex: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> "Future[Any]":
    """Return a Future at once; hand ``fn`` to ``ex``'s submitter when every input Future is done.
    Nothing here touches the network (the hub may be restarting): the submitter asks the hub for
    its store's URL and sends the call, retrying within ``submit_timeout_s`` like any batch."""
    deps = futures_in(args, kwargs)
    out: Future[Any] = Future()
    out.task_id = None  # type: ignore[attr-defined]  # set once submitted
    left = [len(deps)]
    lock = threading.Lock()

    def go() -> None:
        for d in deps:
            exc = d.exception()
            if exc is not None:
                err = DependencyError(f"not run: its argument, task {getattr(d, 'task_id', None) or '(never submitted)'}, "
                                      f"failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                out.set_exception(err)
                return
            if getattr(d, "task_id", None) is None:
                out.set_exception(TypeError("only Futures of a mesh Executor can be task arguments (this one has no task_id)"))
                return
        ex._submit_deferred(out, fn, args, kwargs)

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            go()

    for d in deps:
        d.add_done_callback(one_done)
    return out
