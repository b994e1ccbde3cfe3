"""Late binding (docs/scheduler.md, "Late binding"): the scheduler's tasks wait in the hub
beyond each endpoint's lookahead, and an endpoint that runs out of work takes over the newest
of them when they would finish sooner there.

Two agents with one worker each run a function that takes 50 ms on both, so the scheduler
learns they are equal. Then, unknown to the scheduler, "a" slows down to 300 ms (a throttled
Pi, a busy laptop) and a wave of 40 tasks is placed about evenly on the learned speeds. Without
late binding "a" would have been sent its whole half at once (its prefetch is 256) and the wave
would wait for it; with it, "b" takes over most of what "a" has not started."""

from __future__ import annotations

import collections
import sqlite3
from pathlib import Path

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from cloud_hub.store.lookahead import keep_placed

pytestmark = pytest.mark.integration


def nap(x: int, flag: str) -> int:
    import os
    import time

    slow = os.environ.get("MESH_ENDPOINT_NAME") == "a" and os.path.exists(flag)
    time.sleep(0.3 if slow else 0.05)
    return x


def test_an_endpoint_that_runs_out_of_work_takes_over_what_waits_for_a_slower_one(mesh: LocalMesh, tmp_path: Path) -> None:
    a = mesh.add_agent("a", workers=1)
    b = mesh.add_agent("b", workers=1)
    mesh.wait_online()
    flag = str(tmp_path / "slow")
    name = {a.endpoint_id: "a", b.endpoint_id: "b"}
    with Executor(mesh.client, endpoint="auto") as ex:
        for _ in range(2):  # learn: both equal
            futs = [ex.submit(nap, i, flag) for i in range(10)]
            assert [f.result(60) for f in futs] == list(range(10))
        Path(flag).touch()
        futs = [ex.submit(nap, i, flag) for i in range(40)]
        assert [f.result(120) for f in futs] == list(range(40))
    ran = collections.Counter(name[f.endpoint_id] for f in futs)
    stats = mesh.hub.hub.placement.stats  # type: ignore[union-attr]
    assert stats["rebalanced"] >= 1, (stats, ran)
    # at 300 ms against 50 ms, "b" can do 6 tasks while "a" does one: an even split would leave
    # "b" about 20; taking over what waits in the hub gives it most of the wave
    assert ran["b"] >= 26, ran
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 60  # each task once
        assert db.execute("SELECT COUNT(*) FROM tasks WHERE placed = 1").fetchone()[0] == 60


def test_keep_placed_caps_only_the_schedulers_tasks_and_keeps_order() -> None:
    rows = [("t1", 1), ("t2", None), ("t3", 1), ("t4", 1), ("t5", None), ("t6", None)]
    assert keep_placed(rows, 4, None) == rows[:4]
    assert keep_placed(rows, 4, 1) == [("t1", 1), ("t2", None), ("t5", None), ("t6", None)]
    assert keep_placed(rows, 3, 0) == [("t2", None), ("t5", None), ("t6", None)]
    assert keep_placed(rows, 10, 2) == [("t1", 1), ("t2", None), ("t3", 1), ("t5", None), ("t6", None)]
    assert keep_placed([], 5, 3) == []
