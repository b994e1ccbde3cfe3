"""The backup drill (issue 19 item 6), with a real ``mesh-hub serve`` process, a real Mosquitto and
real agent processes: back up in the middle of a run, keep working, stop the hub, restore the
backup, start it again.

What must hold: every task accepted before the backup ends with exactly one result (agents say
what they hold, the hub re-queues what they no longer have, results are stored once), the SDK's
futures for them all complete across the restore, and the work accepted after the backup is
reported as lost by the restore, by count and by id, so that nothing is silently gone."""

from __future__ import annotations

import json
import sqlite3
import stat
import subprocess
import sys
from concurrent.futures import wait
from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def slow_square(x: int) -> int:
    import time

    time.sleep(0.05)
    return x * x


def _hub_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloud_hub.cli", *args], capture_output=True, text=True, timeout=120)


def _rows(db: Path, sql: str, params: tuple = ()) -> list[tuple]:  # type: ignore[type-arg]
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_backup_mid_run_then_restore_loses_nothing_silently(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    backup = tmp_path / "backups" / "hub-mid-run.sqlite3"
    backup.parent.mkdir()
    report = tmp_path / "restore-report.json"
    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0, hub_process=True) as mesh:
        db = mesh.hub_cfg.db_path
        agents = [mesh.add_agent("field-1", "mqtt", workers=2, prefetch=16), mesh.add_agent("lan-1", "zmq", workers=2, prefetch=16)]
        mesh.wait_online(timeout=90)
        client = mesh.client
        fid = client.register_function(slow_square)
        with Executor(client, agents[0].endpoint_id) as ex_a, Executor(client, agents[1].endpoint_id) as ex_b:
            before = [ex.submit(slow_square, i) for i in range(200) for ex in (ex_a, ex_b)]
            wait_for(lambda: all(getattr(f, "task_id", None) for f in before) and sum(f.done() for f in before) >= 40, "every task accepted and the first 40 results",
                      120)
            out = _hub_cli("backup", str(backup), "--db", str(db))  # while the hub serves and the agents work
            assert out.returncode == 0, out.stderr
            done_at_backup = sum(f.done() for f in before)
            assert done_at_backup < len(before), "the backup must land in the middle of the run"
            assert stat.S_IMODE(backup.stat().st_mode) == 0o600
            # Keep working: new work is accepted, and earlier work finishes, after the backup.
            after = client.submit_batch([client.task_spec(a.endpoint_id, fid, (i,)) for i in range(30) for a in agents])
            wait_for(lambda: sum(f.done() for f in before) >= done_at_backup + 40, "40 more results after the backup", 120)
            mesh.stop_hub()
            out = _hub_cli("restore", str(backup), "--db", str(db))
            assert out.returncode == 2 and "--force" in out.stderr, "an existing database is not overwritten without --force"
            out = _hub_cli("restore", str(backup), "--db", str(db), "--force", "--report", str(report))
            assert out.returncode == 0, out.stderr
            assert f"lost: {len(after)} tasks accepted after the backup" in out.stdout, out.stdout
            mesh.start_hub()
            finished, not_done = wait(before, timeout=240)
            assert not not_done, f"{len(not_done)} tasks accepted before the backup have no result after the restore"
            assert sorted(f.result() for f in before) == sorted([i * i for i in range(200)] * 2)
        ids = [f.task_id for f in before]  # type: ignore[attr-defined]
        q = ",".join("?" * len(ids))

        def all_done() -> bool:  # the restored hub re-runs what finished only after the backup
            return _rows(db, f"SELECT COUNT(*) FROM tasks WHERE state='done' AND id IN ({q})", tuple(ids))[0][0] == len(ids)

        wait_for(all_done, "every task from before the backup done in the restored hub", 240)
        per_task = dict(_rows(db, f"SELECT task_id, COUNT(*) FROM results WHERE task_id IN ({q}) GROUP BY task_id", tuple(ids)))
        assert set(per_task) == set(ids) and set(per_task.values()) == {1}, "exactly one result per task accepted before the backup"
        q_after = ",".join("?" * len(after))
        assert _rows(db, f"SELECT COUNT(*) FROM tasks WHERE id IN ({q_after})", tuple(after))[0][0] == 0
    rep = json.loads(report.read_text())
    assert rep["compared"] is True
    assert rep["lost_tasks"] == len(after) and set(rep["lost_task_ids"]) == set(after), "lost work is counted and named, not silent"
    assert rep["rerun_tasks"] > 0, "tasks that finished after the backup ran again on the restored hub"
    assert rep["replaced"] and Path(rep["replaced"]).exists(), "the replaced database is kept"
