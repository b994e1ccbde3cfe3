"""The one Executor every Pool and Process of this program submits through, and the program's exit.

Why not in ``_state`` with the settings: the shared objects (``_resource``) and data refs
(``cloud_hub.client.refs``) read the settings and the lease there, and the Executor is built on
those refs (a Future passed to a task becomes one, ``_dataflow``). Making the Executor here, above
both, keeps the imports pointing one way: ``_runner`` -> ``_executor`` -> ``refs`` -> ``_state``.
A ``config()`` that changes where work runs bumps ``_state.generation()``, and the next
:func:`executor` replaces the one it holds.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from typing import Any

from cloud_hub.client.multiprocessing import _state

__all__ = ["executor", "shutdown_executor", "run_first_at_exit"]

log = logging.getLogger("cloud_hub.client.multiprocessing")

_lock = threading.Lock()
_executor: Any = None
_made_at = -1  # the _state.generation() it was made with


def executor() -> Any:
    """The one Executor every Pool and Process of this program submits through (batching,
    retries, code by value come from it)."""
    global _executor, _made_at
    with _lock:
        if _executor is not None and _made_at != _state.generation():  # config() changed where work runs
            old, _executor = _executor, None
            old.shutdown(wait=False)
        if _executor is None:
            from cloud_hub.client._executor import Executor

            _made_at = _state.generation()
            s = _state.settings()
            _executor = Executor(client=s["client"], endpoint=s["endpoint"], task_timeout_s=s["task_timeout_s"])
            _state.lease().hold(_executor)  # its tasks live while this program renews the lease
        return _executor


def shutdown_executor() -> None:
    """This program is done with the mesh: what it submitted and is unfinished is cancelled
    (Pool chunks, daemon or unjoined Processes), the hub leases are dropped, the renewing stops."""
    global _executor
    with _lock:
        ex, _executor = _executor, None
    held = _state.take_lease()
    if ex is not None:
        ex.shutdown(wait=False, cancel_futures=True)
        ex._submitter.join(10)  # a batch on its way is accepted first, then cancelled with its group
    if held is not None:
        held.end()


def _at_exit() -> None:
    """At exit, as the standard library's ``multiprocessing.util._exit_function``: daemon
    Processes are terminated (their tasks cancelled), the others are joined; then everything
    left of this program (Pool chunks) is cancelled and its leases dropped."""
    pool = sys.modules.get("cloud_hub.client.multiprocessing.pool")
    if pool is not None:
        try:
            for p in list(pool._children):
                if p.daemon and p.is_alive():
                    p.terminate()
            for p in list(pool._children):
                if not p.daemon and p.is_alive():
                    p.join()
        except BaseException as exc:  # an interrupted join (Ctrl-C at exit): cancel the rest below
            log.warning("at exit: %s", exc)
    shutdown_executor()


def run_first_at_exit() -> None:
    """Make :func:`_at_exit` the next exit handler to run: before the weakref finalizers (also an
    exit handler) drop the shared objects that non-daemon Processes still use while joined."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


atexit.register(_at_exit)
