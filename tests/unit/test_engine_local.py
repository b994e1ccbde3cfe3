"""LocalEngine: warm spawned workers, batching, timeouts, crash isolation, clean stop."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from collections import Counter
from typing import Any, AsyncIterator, Callable

import psutil
import pytest

from mesh_agent.engine import EngineResult, EngineTask, LocalEngine, TaskTimeout, make_error
from mesh_agent.protocol.serialize import deserialize, function_id, serialize, serialize_function

# ---------------------------------------------------------------- task functions (module level)


def noop() -> None:
    return None


def add(a: int, b: int = 0, *, scale: int = 1) -> tuple[int, str]:
    return (a + b) * scale, "sum"


def explode(msg: str) -> None:
    raise ValueError(f"boom: {msg}")


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def exit_hard(code: int) -> None:
    os._exit(code)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def pid() -> int:
    return os.getpid()


def make_generator() -> Any:
    return (i for i in range(3))


def allocate(nbytes: int) -> int:
    return len(bytearray(nbytes))


def record(path: str, tag: str) -> str:
    with open(path, "a") as f:
        f.write(tag + "\n")
    return tag


# ---------------------------------------------------------------- helpers


class Collector:
    """on_results sink that lets a test wait for a number of results."""

    def __init__(self) -> None:
        self.results: list[EngineResult] = []
        self.calls = 0
        self._changed = asyncio.Event()

    def __call__(self, batch: list[EngineResult]) -> None:
        self.calls += 1
        self.results.extend(batch)
        self._changed.set()

    async def wait_for(self, n: int, timeout: float = 10.0) -> list[EngineResult]:
        async def _wait() -> None:
            while len(self.results) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(_wait(), timeout)
        return self.results

    def by_id(self) -> dict[str, EngineResult]:
        return {r.task_id: r for r in self.results}


_BODIES: dict[Callable[..., Any], bytes] = {}


def task(task_id: str, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> EngineTask:
    body = _BODIES.get(fn) or _BODIES.setdefault(fn, serialize_function(fn))
    return EngineTask(task_id, function_id(body), body, serialize((args, kwargs)), timeout)


def value(result: EngineResult) -> Any:
    assert result.ok, deserialize(result.data)
    return deserialize(result.data)


def error(result: EngineResult) -> dict[str, Any]:
    assert not result.ok
    return deserialize(result.data)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def sink() -> Collector:
    return Collector()


@pytest.fixture
async def engine(sink: Collector) -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(sink, workers=2, memory_limit_mb=1024)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop(grace=1.0)


# ---------------------------------------------------------------- tests


async def test_many_noops_each_reported_exactly_once(engine: LocalEngine, sink: Collector) -> None:
    n = 2000
    engine.submit([task(f"t{i}", noop) for i in range(n)])
    results = await sink.wait_for(n)
    await asyncio.sleep(0.05)  # nothing extra may trickle in
    assert Counter(r.task_id for r in sink.results) == Counter(f"t{i}" for i in range(n))
    assert all(r.ok and deserialize(r.data) is None for r in results)
    assert {r.worker_pid for r in results} <= set(engine.worker_pids)
    assert engine.running == 0 and engine.queued == 0


async def test_return_values_round_trip(engine: LocalEngine, sink: Collector) -> None:
    engine.submit([task("a", add, 2, 3), task("b", add, 2, b=5, scale=10), task("c", pid)])
    await sink.wait_for(3)
    got = sink.by_id()
    assert value(got["a"]) == (5, "sum")  # a tuple: travels by pickle, not JSON
    assert value(got["b"]) == (70, "sum")
    assert value(got["c"]) == got["c"].worker_pid
    for r in got.values():
        assert r.started <= r.finished <= time.time()


def running_task_id() -> Any:
    import sys

    return sys.modules["mesh_agent.engine._worker"].CURRENT_TASK_ID


async def test_a_task_sees_its_own_task_id(engine: LocalEngine, sink: Collector) -> None:
    """What a mesh Queue keys its consumer's pending list by (at-least-once delivery, issue 12)."""
    engine.submit([task(f"id-{i}", running_task_id) for i in range(6)])
    await sink.wait_for(6)
    assert {k: value(r) for k, r in sink.by_id().items()} == {f"id-{i}": f"id-{i}" for i in range(6)}


async def test_lambda_body(engine: LocalEngine, sink: Collector) -> None:
    body = serialize_function(lambda x: x * 2)
    engine.submit([EngineTask("l", function_id(body), body, serialize(([21], {})))])
    (r,) = await sink.wait_for(1)
    assert value(r) == 42


async def test_exception_gives_error_dict_with_remote_traceback(engine: LocalEngine, sink: Collector) -> None:
    engine.submit([task("x", explode, "kaput")])
    (r,) = await sink.wait_for(1)
    err = error(r)
    assert err["type"] == "builtins.ValueError"
    assert err["message"] == "boom: kaput"
    assert "explode" in err["traceback"] and "ValueError: boom: kaput" in err["traceback"]
    exc = pickle.loads(err["exception"])
    assert isinstance(exc, ValueError) and str(exc) == "boom: kaput"
    assert r.worker_pid in engine.worker_pids  # the worker survived


async def test_timeout_kills_and_replaces_worker_and_requeues_its_tasks(engine: LocalEngine, sink: Collector) -> None:
    before = set(engine.worker_pids)
    # 6 tasks over 2 workers: chunks of 3, so two quick tasks wait behind the slow one.
    engine.submit([task("slow", sleep_for, 30, timeout=0.5)] + [task(f"q{i}", sleep_for, 0.01) for i in range(5)])
    await sink.wait_for(6)
    got = sink.by_id()
    assert len(sink.results) == 6
    err = error(got["slow"])
    assert err["type"] == "mesh_agent.engine.TaskTimeout"
    assert "0.5 s timeout" in err["message"] and str(got["slow"].worker_pid) in err["message"]
    assert isinstance(pickle.loads(err["exception"]), TaskTimeout)
    assert all(value(got[f"q{i}"]) == 0.01 for i in range(5))
    assert not psutil.pid_exists(got["slow"].worker_pid) or psutil.Process(got["slow"].worker_pid).status() == "zombie"
    await wait_until(lambda: len(engine.worker_pids) == 2)
    assert got["slow"].worker_pid not in engine.worker_pids
    assert len(set(engine.worker_pids) - before) == 1
    assert engine.stats["timeouts"] == 1


async def test_engine_default_timeout(sink: Collector) -> None:
    eng = LocalEngine(sink, workers=1, task_timeout=0.3)
    await eng.start()
    try:
        eng.submit([task("slow", sleep_for, 30), task("ok", sleep_for, 0.7, timeout=5)])
        await sink.wait_for(2)
        got = sink.by_id()
        assert error(got["slow"])["type"] == "mesh_agent.engine.TaskTimeout"
        assert value(got["ok"]) == 0.7  # its own timeout beats the engine default
    finally:
        await eng.stop()


@pytest.mark.parametrize(
    ("fn", "args", "cause"),
    [(exit_hard, (3,), "exited with code 3"), (kill_self, (), "killed by signal 9 (SIGKILL)")],
)
async def test_worker_death_is_isolated(
    engine: LocalEngine, sink: Collector, fn: Callable[..., Any], args: tuple[Any, ...], cause: str
) -> None:
    engine.submit([task("die", fn, *args)] + [task(f"n{i}", add, i) for i in range(9)])
    await sink.wait_for(10)
    got = sink.by_id()
    assert len(sink.results) == 10
    err = error(got["die"])
    assert err["type"] == "mesh_agent.engine.WorkerDied"
    assert cause in err["message"] and str(got["die"].worker_pid) in err["message"]
    assert all(value(got[f"n{i}"]) == (i, "sum") for i in range(9))
    await wait_until(lambda: len(engine.worker_pids) == 2)
    assert engine.workers == 2 and got["die"].worker_pid not in engine.worker_pids
    # The pool still works, on both workers.
    engine.submit([task(f"after{i}", pid) for i in range(40)])
    await sink.wait_for(50)
    assert {value(r) for r in sink.results if r.task_id.startswith("after")} <= set(engine.worker_pids)
    assert engine.stats["worker_deaths"] == 1


async def test_crash_mid_chunk_loses_nothing_and_runs_nothing_twice(sink: Collector, tmp_path: Any) -> None:
    """Tasks finished before the crash keep their results; only the killer is blamed."""
    log = str(tmp_path / "ran.log")
    eng = LocalEngine(sink, workers=1, max_batch=32)
    await eng.start()
    try:
        tags = [f"r{i}" for i in range(20)]
        eng.submit([task(t, record, log, t) for t in tags[:10]] + [task("die", exit_hard, 5)]
                   + [task(t, record, log, t) for t in tags[10:]])
        await sink.wait_for(21)
        got = sink.by_id()
        assert len(sink.results) == 21
        assert "exited with code 5" in error(got["die"])["message"]
        assert all(value(got[t]) == t for t in tags)
        with open(log) as f:
            assert Counter(f.read().split()) == Counter(tags)  # each ran exactly once
    finally:
        await eng.stop()


async def test_submit_before_start_is_queued(sink: Collector) -> None:
    eng = LocalEngine(sink, workers=1)
    eng.submit([task("early", add, 1)])
    assert eng.queued == 1
    await eng.start()
    try:
        (r,) = await sink.wait_for(1)
        assert value(r) == (1, "sum")
    finally:
        await eng.stop()


async def test_function_body_sent_once_per_worker(engine: LocalEngine, sink: Collector) -> None:
    engine.submit([task(f"a{i}", noop) for i in range(300)] + [task(f"b{i}", add, i) for i in range(300)])
    await sink.wait_for(600)
    assert engine.stats["bodies_sent"] <= 4  # 2 functions x 2 workers
    engine.submit([task(f"c{i}", noop) for i in range(300)])
    await sink.wait_for(900)
    assert engine.stats["bodies_sent"] <= 4
    assert set(engine.warm_functions()) == {task("", noop).function_id, task("", add).function_id}


async def test_bad_args_and_bad_body_are_clear_errors(engine: LocalEngine, sink: Collector) -> None:
    good = task("good", pid)
    bad_args = EngineTask("bad-args", good.function_id, good.function_body, b"garbage")
    wrong_shape = EngineTask("wrong-shape", good.function_id, good.function_body, serialize([1, 2, 3]))
    bad_body = EngineTask("bad-body", "f-bad", b"pickle\nnot a pickle", serialize(([], {})))
    bad_body_again = EngineTask("bad-body-2", "f-bad", b"pickle\nnot a pickle", serialize(([], {})))
    engine.submit([bad_args, wrong_shape, bad_body, bad_body_again, good])
    await sink.wait_for(5)
    got = sink.by_id()
    for tid in ("bad-args", "wrong-shape"):
        err = error(got[tid])
        assert err["type"] == "mesh_agent.protocol.SerializationError"
        assert err["message"].startswith("bad arguments blob")
    for tid in ("bad-body", "bad-body-2"):
        err = error(got[tid])
        assert err["type"] == "mesh_agent.protocol.SerializationError"
        assert "bad function body for 'f-bad'" in err["message"]
    assert value(got["good"]) in engine.worker_pids
    assert engine.stats["worker_deaths"] == 0


async def test_unserializable_result(engine: LocalEngine, sink: Collector) -> None:
    engine.submit([task("gen", make_generator)])
    (r,) = await sink.wait_for(1)
    err = error(r)
    assert err["type"] == "mesh_agent.protocol.SerializationError"
    assert "generator" in err["message"]


async def test_memory_error_is_an_ordinary_failure(engine: LocalEngine, sink: Collector) -> None:
    engine.submit([task("big", allocate, 4 << 30), task("small", allocate, 1 << 20)])
    await sink.wait_for(2)
    got = sink.by_id()
    assert error(got["big"])["type"] == "builtins.MemoryError"
    assert value(got["small"]) == 1 << 20
    assert engine.stats["worker_deaths"] == 0


async def test_workers_ignore_sigint(engine: LocalEngine, sink: Collector) -> None:
    pids = set(engine.worker_pids)
    for p in pids:
        os.kill(p, signal.SIGINT)
    await asyncio.sleep(0.2)
    engine.submit([task(f"p{i}", pid) for i in range(20)])
    await sink.wait_for(20)
    assert set(engine.worker_pids) == pids and engine.stats["worker_deaths"] == 0


async def test_callback_errors_do_not_break_the_engine() -> None:
    seen: list[EngineResult] = []

    def flaky(batch: list[EngineResult]) -> None:
        seen.extend(batch)
        raise RuntimeError("callback bug")

    eng = LocalEngine(flaky, workers=1)
    await eng.start()
    try:
        eng.submit([task("a", noop)])
        await wait_until(lambda: len(seen) == 1)
        eng.submit([task("b", noop)])
        await wait_until(lambda: len(seen) == 2)
    finally:
        await eng.stop()


async def test_stop_leaves_no_child_processes(sink: Collector) -> None:
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # other tests' meshes may still run (session fixtures)
    eng = LocalEngine(sink, workers=2)
    await eng.start()
    pids = set(eng.worker_pids)
    eng.submit([task("busy", sleep_for, 30)] + [task(f"n{i}", noop) for i in range(10)])
    await wait_until(lambda: eng.running > 0)
    await eng.stop(grace=0.5)
    assert eng.workers == 0
    for p in pids:
        assert not psutil.pid_exists(p)
    # The only child multiprocessing may leave is its shared resource tracker.
    children = [c for c in psutil.Process().children(recursive=True)
                if c.pid not in before and c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert all("resource_tracker" in " ".join(c.cmdline()) for c in children), children
    with pytest.raises(RuntimeError):
        eng.submit([task("late", noop)])


def test_make_error_handles_unpicklable_exceptions() -> None:
    class Local(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a)

    try:
        raise Local(1, 2)
    except Local as exc:
        err = make_error(exc)
    assert err["type"].endswith("Local") and err["exception"] is None
    assert "test_make_error_handles_unpicklable_exceptions" in err["traceback"]
