"""LocalEngine.cancel (issue 28 item 2): a queued task is dropped, a running one's worker is killed
and replaced (the timeout path), a task sent to a worker behind another is ended when its turn
comes; each cancelled task gets exactly one ``mesh_agent.TaskCancelled`` result, and the other
tasks go on. Real worker processes."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import AsyncIterator

import psutil
import pytest

from mesh_agent.engine import LocalEngine
from mesh_agent.engine.local import TASK_CANCELLED
from mesh_agent.protocol import TASK_CANCELLED as WIRE_CANCELLED
from tests.unit.test_engine_local import Collector, error, task, value, wait_until


def wait_for_file(path: str) -> int:
    import time

    for _ in range(60_000):  # bounded: 10 minutes
        if os.path.exists(path):
            break
        time.sleep(0.01)
    return os.getpid()


def mark_and_wait(mark: str, gate: str) -> int:
    Path(mark).touch()
    return wait_for_file(gate)


def pid() -> int:
    return os.getpid()


@pytest.fixture
def sink() -> Collector:
    return Collector()


@pytest.fixture
async def engine(sink: Collector) -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(sink, workers=1, max_batch=1, now_max=2)  # a worker holds its task and one more; the rest wait here
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop(grace=1.0)


def test_the_engine_and_the_wire_name_the_same_error_type() -> None:
    assert TASK_CANCELLED == WIRE_CANCELLED == "mesh_agent.TaskCancelled"


async def test_cancel_a_queued_task_drops_it_and_the_running_one_goes_on(engine: LocalEngine, sink: Collector, tmp_path: Path) -> None:
    gate, mark = str(tmp_path / "gate"), str(tmp_path / "mark")
    engine.submit([task("running", mark_and_wait, mark, gate)])
    await wait_until(lambda: os.path.exists(mark))
    engine.submit([task("behind", pid), task("queued", pid)])  # "behind" goes to the worker, "queued" waits in the engine
    assert engine.queued == 1
    assert engine.cancel(["queued", "never-seen"]) == ["queued"]
    first = (await sink.wait_for(1))[0]
    assert first.task_id == "queued" and error(first)["type"] == TASK_CANCELLED
    assert engine.queued == 0
    Path(gate).touch()
    results = await sink.wait_for(3)
    assert {r.task_id for r in results[1:]} == {"running", "behind"} and all(r.ok for r in results[1:])
    assert Counter(r.task_id for r in results) == {"queued": 1, "running": 1, "behind": 1}
    assert engine.stats["cancelled"] == 1 and engine.stats["cancelled_running"] == 0


async def test_cancel_a_running_task_kills_its_worker_and_a_fresh_one_runs_the_rest(engine: LocalEngine, sink: Collector,
                                                                                   tmp_path: Path) -> None:
    gate, mark = str(tmp_path / "gate"), str(tmp_path / "mark")
    old = engine.worker_pids[0]
    # One chunk: "stuck" runs, "behind" was sent to the same worker and waits its turn there.
    engine.submit([task("stuck", mark_and_wait, mark, gate), task("behind", pid)])
    await wait_until(lambda: os.path.exists(mark))
    assert engine.cancel(["stuck"]) == ["stuck"]
    results = await sink.wait_for(2)
    got = {r.task_id: r for r in results}
    err = error(got["stuck"])
    assert err["type"] == TASK_CANCELLED and f"worker {old} was killed" in err["message"]
    assert value(got["behind"]) != old  # went back to the queue, ran on the fresh worker
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    assert len(engine.worker_pids) == 1 and engine.worker_pids[0] != old
    assert Counter(r.task_id for r in results) == {"stuck": 1, "behind": 1}
    assert engine.stats["cancelled_running"] == 1


async def test_cancel_a_task_sent_behind_another_ends_it_when_its_turn_comes(engine: LocalEngine, sink: Collector,
                                                                            tmp_path: Path) -> None:
    gate, mark = str(tmp_path / "gate"), str(tmp_path / "mark")
    gate2, mark2 = str(tmp_path / "gate2"), str(tmp_path / "mark2")
    engine.submit([task("head", mark_and_wait, mark, gate), task("second", mark_and_wait, mark2, gate2), task("third", pid)])
    await wait_until(lambda: os.path.exists(mark))
    assert engine.cancel(["second"]) == ["second"]  # on the worker, behind "head": not killed yet
    assert engine.stats["cancelled_running"] == 0
    Path(gate).touch()
    results = await sink.wait_for(3, timeout=30)
    got = {r.task_id: r for r in results}
    assert isinstance(value(got["head"]), int) and isinstance(value(got["third"]), int)
    assert error(got["second"])["type"] == TASK_CANCELLED
    assert Counter(r.task_id for r in results) == {"head": 1, "second": 1, "third": 1}
    assert not os.path.exists(gate2)  # nothing ever let "second" finish: it was ended


async def test_cancel_a_task_on_an_extra_worker(engine: LocalEngine, sink: Collector, tmp_path: Path) -> None:
    gate, mark = str(tmp_path / "gate"), str(tmp_path / "mark")
    gate2, mark2 = str(tmp_path / "gate2"), str(tmp_path / "mark2")
    engine.submit([task("pool", mark_and_wait, mark, gate)])
    await wait_until(lambda: os.path.exists(mark))
    t = task("process", mark_and_wait, mark2, gate2)
    t.now = True
    engine.submit([t])  # the pool is busy: one more worker, outside the pool
    await wait_until(lambda: os.path.exists(mark2), timeout=60)
    assert engine.running_extra == 1
    assert engine.cancel(["process"]) == ["process"]
    first = (await sink.wait_for(1))[0]
    assert first.task_id == "process" and error(first)["type"] == TASK_CANCELLED
    assert engine.running_extra == 0  # ended, not replaced
    Path(gate).touch()
    results = await sink.wait_for(2)
    assert results[1].task_id == "pool" and isinstance(value(results[1]), int)
