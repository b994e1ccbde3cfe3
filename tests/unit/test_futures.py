"""cancel_and_notify (cloud_hub/client/_futures.py): a waiter on a never-run future wakes when it
is cancelled; with Future.cancel() alone it would wait forever (the Pool.join() hang)."""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait

from cloud_hub.client._futures import cancel_and_notify


def test_a_waiter_wakes_when_a_never_run_future_is_cancelled() -> None:
    f: Future[int] = Future()
    got: list[set] = []
    t = threading.Thread(target=lambda: got.append(wait([f], timeout=30, return_when=FIRST_COMPLETED)[0]))
    t.start()
    # the waiter is registered before the cancel: that is the case Future.cancel() leaves asleep
    for _ in range(200):
        if f._waiters:  # type: ignore[attr-defined]
            break
        threading.Event().wait(0.01)
    assert cancel_and_notify(f)
    t.join(10)
    assert not t.is_alive() and got == [{f}] and f.cancelled()


def test_a_finished_future_is_left_as_it_is() -> None:
    f: Future[int] = Future()
    f.set_result(1)
    assert not cancel_and_notify(f) and f.result() == 1
    g: Future[int] = Future()
    assert cancel_and_notify(g) and cancel_and_notify(g) and g.cancelled()
