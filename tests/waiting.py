"""The one way tests wait for something that happens in another process: poll, bounded in time.

Why one helper: a dozen private copies had drifted (different poll steps, some returning None,
some printing no context on failure). Here a timeout always raises ``AssertionError`` naming
what was awaited, with the tail of the logs that explain it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

__all__ = ["wait_for"]


def wait_for(pred: Callable[[], T], what: str, timeout: float = 30.0, *, step: float = 0.05, logs: Iterable[Any] = ()) -> T:
    """Call ``pred`` every ``step`` seconds until it returns something truthy, and return that.

    After ``timeout`` seconds (checked once more at the deadline) raise ``AssertionError``
    naming ``what``, followed by the last 2,500 characters of each of ``logs``: paths, or
    objects with a ``log_path`` (an ``AgentProcess``), that say why it did not happen.
    """
    deadline = time.monotonic() + timeout
    for _ in range(max(1, int(timeout / max(step, 1e-3)) + 2)):  # bounded in count as well as time
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(step)
    got = pred()
    if got:
        return got
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{_tails(logs)}")


def _tails(logs: Iterable[Any]) -> str:
    out = []
    for item in logs:
        path = Path(getattr(item, "log_path", item))
        name = getattr(getattr(item, "cfg", None), "name", path.name)
        if path.exists():
            out.append(f"\n--- {name}\n{path.read_text(errors='replace')[-2500:]}")
    return "".join(out)
