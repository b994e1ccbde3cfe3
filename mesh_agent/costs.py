"""An opt-in CPU ledger: how much of a process's CPU each stage of the task path takes.

Why: the hub's and the agent's cost per task is spread over a dozen stages (decode, auth,
validation, placement, insert, lease, sign, send, verify, result store, push), none of which
dominates; a profiler's call tree does not add up to "what does a task cost per stage", and its
own overhead is larger than the stages. ``bench/hotpath.py`` reads this ledger (issue 30).

How:

* ``with stage("sign"): ...`` charges the CPU time of the calling *thread* (``thread_time_ns``)
  spent inside the block to ``sign``. Stages nest exclusively: time in an inner stage is not
  also charged to the outer one, so the rows add up.
* A stage should not span an ``await`` that suspends (the event loop would run other work inside
  it). Wrap synchronous code, or an ``await`` of a coroutine that usually finishes without
  suspending (a cache hit). When another asyncio task enters a stage while one is open, the open
  one was suspended: its whole time goes to ``ledger.suspended:<name>`` instead, so a reader sees
  it rather than a wrong figure. A block that ends with another stage on top counts
  ``ledger.misnested``.
* Off unless ``MESH_COST_LEDGER`` names a folder when the process starts: then ``stage`` costs
  about 1 us (two clock reads), else one attribute check and a shared no-op object (~0.1 us).
* A process that called :func:`start` writes ``<folder>/<role>-<pid>.json`` every half second:
  per stage [blocks, CPU ns], per thread its CPU seconds (psutil), and the process's CPU seconds,
  so a reader can say what share of each thread's CPU the stages account for.

The agent and the hub both use it, so it lives in the lowest layer (``mesh_agent``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV", "enabled", "stage", "start", "snapshot"]

ENV = "MESH_COST_LEDGER"
_DIR = os.environ.get(ENV) or None
#: Whether this process keeps the ledger (decided once, at import).
enabled = _DIR is not None

_clock = time.thread_time_ns
_totals: dict[str, list[int]] = {}  # stage -> [blocks, ns]
_by_thread: dict[str, int] = {}  # thread name -> ns charged to stages on it
_lock = threading.Lock()
_local = threading.local()
_started = False


class _Null:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _Null()


def _charge(name: str, ns: int, blocks: int) -> None:
    thread = _local.thread
    _local.in_ledger = True  # a collection tripped in here is not a stage (see _gc_stage)
    try:
        with _lock:
            _by_thread[thread] = _by_thread.get(thread, 0) + ns
            row = _totals.get(name)
            if row is None:
                _totals[name] = [blocks, ns]
            else:
                row[0] += blocks
                row[1] += ns
    finally:
        _local.in_ledger = False


def _task() -> Any:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop on this thread (the database thread)
        return None


class _Stage:
    __slots__ = ("name", "t0", "task", "suspended", "spent")

    def __init__(self, name: str) -> None:
        self.name = name
        self.spent = 0
        self.suspended = False

    def __enter__(self) -> None:
        now = _clock()
        self.task = _task()
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
            _local.thread = threading.current_thread().name
        if stack:  # pause the enclosing stage: its time so far is its own
            top = stack[-1]
            top.spent += now - top.t0
            if top.task is not self.task:  # another asyncio task runs: the open stage is suspended
                top.suspended = True
        self.t0 = now
        stack.append(self)

    def __exit__(self, *exc: object) -> None:
        now = _clock()
        stack = _local.stack
        if not stack or stack[-1] is not self:
            _charge("ledger.misnested", 0, 1)
            if self in stack:
                stack.remove(self)
            return
        stack.pop()
        spent = self.spent + now - self.t0
        _charge(f"ledger.suspended:{self.name}" if self.suspended else self.name, spent, 1)
        if stack:
            stack[-1].t0 = now  # the enclosing stage resumes


def stage(name: str) -> Any:
    """A context manager charging the block's thread CPU to ``name`` (a no-op unless enabled)."""
    return _Stage(name) if enabled else _NULL


def snapshot() -> dict[str, Any]:
    """The ledger so far: stages ([blocks, ns]), per-thread CPU and the part of it charged to
    stages (seconds, by thread name), the process's CPU and its live children's (seconds)."""
    import psutil

    _local.in_ledger = True
    try:
        with _lock:
            stages = {k: list(v) for k, v in _totals.items()}
            charged = {k: v / 1e9 for k, v in _by_thread.items()}
    finally:
        _local.in_ledger = False
    proc = psutil.Process()
    names = {t.native_id: t.name for t in threading.enumerate()}
    threads: dict[str, float] = {}
    for t in proc.threads():
        name = names.get(t.id, "other")
        threads[name] = threads.get(name, 0.0) + t.user_time + t.system_time
    cpu = proc.cpu_times()
    return {"pid": os.getpid(), "stages": stages, "threads": threads, "charged_s": charged, "process_cpu_s": cpu.user + cpu.system,
            "children_cpu_s": _children_cpu(proc)}


def _children_cpu(proc: Any) -> float:
    """CPU of the live child processes (an agent's workers), which ``cpu_times`` counts only once reaped."""
    total = 0.0
    for child in proc.children(recursive=True):
        try:
            c = child.cpu_times()
        except Exception:  # gone meanwhile
            continue
        total += c.user + c.system
    return total


def start(role: str) -> None:
    """Write this process's ledger to ``$MESH_COST_LEDGER/<role>-<pid>.json`` every 0.5 s (if enabled)."""
    global _started
    if not enabled or _started:
        return
    _started = True
    assert _DIR is not None
    path = Path(_DIR) / f"{role}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        while True:
            try:
                snap = snapshot()
                snap["role"] = role
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(snap))
                os.replace(tmp, path)
            except Exception:  # a ledger must never take the process down
                pass
            time.sleep(0.5)

    threading.Thread(target=loop, name="cost-ledger", daemon=True).start()
    global _gc_role
    _gc_role = role
    if _gc_stage not in gc.callbacks:
        gc.callbacks.append(_gc_stage)


_gc_open: dict[int, _Stage] = {}  # thread id -> its collection in progress
_gc_role = "process"


def _gc_stage(phase: str, info: dict[str, Any]) -> None:
    """The garbage collector's passes as stages of their own (``<role>.gc.gen0``..``gen2``): a
    collection runs inside whatever stage allocated the object that tripped it, and a full one in
    a process holding millions of objects costs milliseconds, which would otherwise be charged to
    that unlucky stage."""
    tid = threading.get_ident()
    if phase == "start":
        if not enabled or getattr(_local, "in_ledger", False):  # tripped inside the ledger, holding its lock: charging it would deadlock
            return
        st = _gc_open[tid] = _Stage(f"{_gc_role}.gc.gen{info.get('generation', 0)}")
        st.__enter__()
    else:
        done = _gc_open.pop(tid, None)
        if done is not None:
            done.__exit__()
