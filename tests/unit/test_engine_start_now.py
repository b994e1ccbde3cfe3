"""LocalEngine: a task that must start now (a multiprocessing Process, issue 28 item 1) takes a
free pool slot or one more worker outside the pool, up to ``now_max``, and is refused at once
beyond it; it never waits in the queue behind busy workers."""

from __future__ import annotations

import errno
import os
import pickle
import time
from pathlib import Path
from typing import AsyncIterator

import pytest

from mesh_agent.engine import LocalEngine
from tests.unit.test_engine_local import Collector, error, task, value


def wait_for_file(path: str) -> int:
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


def pid() -> int:
    return os.getpid()


@pytest.fixture
def sink() -> Collector:
    return Collector()


@pytest.fixture
async def engine(sink: Collector) -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(sink, workers=1, now_max=1)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop(grace=1.0)


def now(t):  # type: ignore[no-untyped-def]
    t.now = True
    return t


async def test_a_now_task_takes_a_free_slot_else_one_more_worker_up_to_the_cap(engine: LocalEngine, sink: Collector,
                                                                               tmp_path: Path) -> None:
    pool_pid = engine.worker_pids[0]
    engine.submit([now(task("idle-slot", pid))])  # the pool's worker is idle: it runs there, no extra worker
    assert value((await sink.wait_for(1))[0]) == pool_pid
    assert engine.stats["started_now_extra"] == 0

    gate = str(tmp_path / "gate")
    engine.submit([task("busy", wait_for_file, gate), task("queued", pid)])  # the pool's one worker is busy, one task waits
    engine.submit([now(task("extra", wait_for_file, gate))])  # starts at once on one more worker, ahead of "queued"
    engine.submit([now(task("over-cap", pid))])  # the cap (1) is reached: refused now, with the reason
    results = await sink.wait_for(2)
    refused = results[1]
    assert refused.task_id == "over-cap"
    err = error(refused)
    exc = pickle.loads(err["exception"]) if isinstance(err.get("exception"), bytes) else None
    assert isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN
    assert "all 1 worker slots of this endpoint are in use" in str(exc) and "cap 1" in str(exc) and "start_now_max" in str(exc)
    assert engine.running_extra == 1 and engine.running + engine.queued == 2  # the extra one takes no pool slot
    Path(gate).touch()
    got = {r.task_id: r for r in await sink.wait_for(5)}
    assert value(got["busy"]) == pool_pid and value(got["queued"]) == pool_pid
    assert value(got["extra"]) != pool_pid
    assert engine.stats["started_now_extra"] == 1 and engine.stats["refused_now"] == 1
    assert engine.running_extra == 0 and engine.worker_pids == [pool_pid]  # the extra worker ended with its task
