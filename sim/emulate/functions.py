"""The workload's functions. They run on the agents, so they are instrumented the only way that
survives a SIGKILL: before doing anything, each appends ``"<key> <pid>\\n"`` to a run log (one
``O_APPEND`` write, atomic for a line this short). Counting lines per ``key`` gives the true number
of executions, independent of what the hub or the agent believe, and so the re-execution count.
``key`` is ``"<seq>.<attempt>"``: a submission the SDK retried (the hub restarting) is another
key, so a task the hub accepted without the SDK hearing of it is never mistaken for a rerun.

Each body is self-contained (imports inside): functions from a module the endpoint lacks travel
by value, and only their own code goes with them.

:func:`expected` says what a correct result is, so the checker can tell a right result from a
result of another task delivered under this task's id.
"""

from __future__ import annotations

import zlib
from typing import Any

__all__ = ["echo", "sleep", "cpu", "fail", "expected", "CATALOG"]


def echo(key: str, payload: bytes, param: float, runlog: str) -> dict[str, int]:
    """Checksum the payload: the data path end to end."""
    import os
    import zlib

    fd = os.open(runlog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return {"key": key, "n": len(payload), "crc": zlib.crc32(payload)}


def sleep(key: str, payload: bytes, param: float, runlog: str) -> dict[str, int]:
    """Sleep ``param`` ms: a task long enough to be cut by a power cut or an outage."""
    import os
    import time
    import zlib

    fd = os.open(runlog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    time.sleep(param / 1000.0)
    return {"key": key, "n": len(payload), "crc": zlib.crc32(payload)}


def cpu(key: str, payload: bytes, param: float, runlog: str) -> dict[str, int]:
    """Sum of squares below ``param`` by a Python loop: real CPU work on the endpoint."""
    import os
    import zlib

    fd = os.open(runlog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    total = 0
    for i in range(int(param)):
        total += i * i
    return {"key": key, "n": len(payload), "crc": zlib.crc32(payload), "v": total}


def fail(key: str, payload: bytes, param: float, runlog: str) -> None:
    """Raise: error results must be delivered exactly once too, with their remote traceback."""
    import os

    fd = os.open(runlog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    raise ValueError(f"planned failure of task {key}")


CATALOG = {"echo": echo, "sleep": sleep, "cpu": cpu, "fail": fail}


def expected(fn: str, key: str, payload: bytes, param: float) -> dict[str, int] | str:
    """The correct outcome: the return value, or for ``fail`` the error message expected."""
    if fn == "fail":
        return f"planned failure of task {key}"
    out: dict[str, Any] = {"key": key, "n": len(payload), "crc": zlib.crc32(payload)}
    if fn == "cpu":
        n = int(param)
        out["v"] = (n - 1) * n * (2 * n - 1) // 6 if n > 0 else 0  # closed form of the loop's sum
    return out
