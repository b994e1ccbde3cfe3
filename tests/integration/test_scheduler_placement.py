"""endpoint="auto" with two real agents: the hub's scheduler learns which one is faster.

Both agents have two workers; the function genuinely runs 4x longer on the one named "slow"
(it reads the endpoint name the agent gives its workers), the way a Pi is slower than a laptop for the same
call. The scheduler is told nothing about that: it has to measure it.
"""

from __future__ import annotations

import collections
import sqlite3
import statistics
import time

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration


def work(x: int) -> int:
    import os
    import time

    slow = os.environ.get("MESH_ENDPOINT_NAME") == "slow"  # the agent tells its workers who they are
    time.sleep(0.2 if slow else 0.05)
    return x


def _wait_submitted(futs: list, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(hasattr(f, "endpoint_id") for f in futs):
        assert time.monotonic() < deadline, "batch not submitted"
        time.sleep(0.02)


def test_auto_learns_the_faster_endpoint_explains_itself_and_survives_restart_and_outage(mesh: LocalMesh) -> None:
    slow = mesh.add_agent("slow", workers=2, prefetch=0)
    fast = mesh.add_agent("fast", workers=2, prefetch=0)
    mesh.wait_online()
    name = {slow.endpoint_id: "slow", fast.endpoint_id: "fast"}
    rounds = []
    with Executor(mesh.client, endpoint="auto") as ex:
        for n in (6, 40, 40):
            futs = [ex.submit(work, i) for i in range(n)]
            assert [f.result(60) for f in futs] == list(range(n))
            rounds.append(collections.Counter(name[f.endpoint_id] for f in futs))
    # Exploration first (each endpoint probed), then most of the work goes to the fast one:
    # by earliest finish about 4:1, with the slow one taking the overflow.
    assert rounds[0]["slow"] >= 1 and rounds[0]["fast"] >= 1
    learned = rounds[2]
    assert learned["fast"] >= 0.65 * 40, rounds
    assert learned["slow"] >= 1, rounds

    # The decisions explain each placement, predicted against actual.
    page = mesh.client.scheduler_decisions(limit=40)
    assert len(page["decisions"]) == 40 and page["next_before"] is not None
    # a task placed again while it waited in the hub (late binding) has a "moved" row too
    moved_early = page["summary"]["moved"]
    assert page["summary"]["decisions"] == 86 + moved_early and page["summary"]["completed"] == 86
    for d in page["decisions"]:
        if d["state"] == "moved":
            continue
        assert d["state"] == "done" and d["ok"] is True
        assert d["policy"] == "delta-outage-aware" and d["selector"]["kind"] == "auto"
        assert d["predicted"]["endpoint_id"] == d["endpoint_id"] == d["compared"][0]["endpoint_id"]
        assert {c["endpoint_id"] for c in d["compared"]} <= set(name)
        assert d["actual_s"] > 0 and d["error_s"] == pytest.approx(d["actual_s"] - d["predicted_s"], abs=1e-5)
        assert d["predicted"]["source"] in ("group", "endpoint")  # measured, not a guess
    # The run-time estimates are what each endpoint measured (sleep 0.05 vs 0.2; the bounds are
    # generous because other work shares the machine).
    for who, (lo, hi) in {"fast": (0.03, 0.2), "slow": (0.15, 0.8)}.items():
        mine = [d for d in page["decisions"] if name[d["endpoint_id"]] == who and d["state"] == "done"]
        assert mine, who
        assert lo < statistics.median(d["runtime_s"] for d in mine) < hi, (who, mine)
        assert lo < mine[0]["predicted"]["run"] < hi, (who, mine[0])
    older = mesh.client.scheduler_decisions(limit=200, before=page["next_before"])
    assert len(older["decisions"]) == 46 + moved_early and older["next_before"] is None
    assert not {d["seq"] for d in older["decisions"]} & {d["seq"] for d in page["decisions"]}
    one = mesh.client.scheduler_decisions(task_id=page["decisions"][5]["task_id"])["decisions"]
    assert page["decisions"][5]["seq"] in [d["seq"] for d in one]
    # one decision per placement of that task: the first, plus one "moved" row per late re-placement
    assert [d["state"] for d in one].count("moved") == len(one) - 1, one

    # Profiles and decisions survive a hub restart: the next batch is placed by what was learned.
    mesh.stop_hub()
    mesh.start_hub()
    mesh.wait_online()
    assert mesh.client.scheduler_decisions(limit=1)["summary"]["decisions"] == 86 + moved_early
    with Executor(mesh.client, endpoint="auto") as ex:
        futs = [ex.submit(work, i) for i in range(40)]
        assert [f.result(60) for f in futs] == list(range(40))
        after = collections.Counter(name[f.endpoint_id] for f in futs)
    assert after["fast"] >= 0.65 * 40, after

    # An endpoint lost with work still queued for it at the hub: that work is placed again on
    # the live one (outage-aware); what the agent had already stored waits for it to return.
    with Executor(mesh.client, endpoint="auto") as ex:
        futs = [ex.submit(work, i) for i in range(40)]
        _wait_submitted(futs)
        slow.kill()
        placed = [f.endpoint_id for f in futs]  # where each was placed (a result says where it ran)
        on_slow = sum(e == slow.endpoint_id for e in placed)
        assert on_slow >= 3  # 2 go to its workers (prefetch 0), the rest wait at the hub
        done_fast = [f.result(60) for f, e in zip(futs, placed) if e == fast.endpoint_id]
        deadline = time.monotonic() + 30
        while mesh.hub.hub.placement.stats["moved"] == 0:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "nothing re-placed after the endpoint was lost"
            time.sleep(0.1)
        slow.start()
        assert sorted(done_fast + [f.result(60) for f, e in zip(futs, placed) if e == slow.endpoint_id]) == list(range(40))
    moved = mesh.hub.hub.placement.stats["moved"]  # type: ignore[union-attr]
    # late binding: an endpoint that ran out of work also took tasks still waiting in the hub
    reb = mesh.hub.hub.placement.stats["rebalanced"]  # type: ignore[union-attr]
    assert 1 <= moved <= on_slow - 1 + reb
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        states = dict(db.execute("SELECT state, COUNT(*) FROM scheduler_decisions GROUP BY state").fetchall())
        assert states == {"done": 166, "moved": moved_early + moved + reb}  # the stats count since the hub's restart
        # each moved task ran exactly once, and the tasks moved off the lost endpoint ran on the live one
        rows = db.execute(
            "SELECT d.task_id, d.endpoint_id FROM scheduler_decisions d WHERE d.state='done' AND d.task_id IN "
            "(SELECT task_id FROM scheduler_decisions WHERE state='moved')").fetchall()
        assert len(rows) == len({t for t, _ in rows}) and moved <= len(rows) <= moved_early + moved + reb
        assert sum(e == fast.endpoint_id for _, e in rows) >= moved
        assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 166
