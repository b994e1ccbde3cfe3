"""Small operations on ``concurrent.futures.Future`` that the standard library does not offer."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["cancel_and_notify"]


def cancel_and_notify(f: "Future[Any]") -> bool:
    """Cancel a future that no executor runs (the caller's side of a chained future) and wake
    whoever waits on it. False when it had finished.

    Why not ``Future.cancel()`` alone: on a PENDING future it only sets CANCELLED; the waiters of
    ``concurrent.futures.wait``/``as_completed`` hear of it only from
    ``set_running_or_notify_cancel()``, which an executor calls and nothing calls on these. A
    Pool chunk whose EAGAIN refusal arrived after ``terminate()`` was cancelled that way while
    ``Pool.join()`` waited, and join() never returned though every future was done."""
    from concurrent.futures._base import CANCELLED

    if not f.cancel():
        return False
    with f._condition:  # type: ignore[attr-defined]  # an RLock: notify once, under it
        if f._state == CANCELLED:  # type: ignore[attr-defined]
            f.set_running_or_notify_cancel()
    return True
