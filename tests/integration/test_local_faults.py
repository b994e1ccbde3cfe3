"""Local faults on a device, with real agent processes: a full disk (a real, tiny tmpfs), and a queue
database truncated by a power cut. Each gets a clear error naming the problem, and no task or result
that was safely stored is lost: every submitted task ends with exactly one delivered result."""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
import subprocess
import sys
from concurrent.futures import wait
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def slow_square(x: int) -> int:
    import time

    time.sleep(0.05)
    return x * x


def fill_then_answer(disk: str, flag: str, queue: str) -> str:
    """The first run fills the disk (from inside the task, as a runaway job would), then returns a
    result that can no longer be stored; later runs just answer."""
    import errno
    import os
    import sqlite3
    import time

    if not os.path.exists(flag):
        open(flag, "w").close()
        # The agent starts a task while its row is being committed: fill the disk only once this
        # task's row is on disk, so that it is the result, not the task, that finds no room.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            db = sqlite3.connect(f"file:{queue}?mode=ro", uri=True)
            try:
                if db.execute("SELECT 1 FROM tasks WHERE instr(args, ?) > 0", (flag.encode(),)).fetchone():
                    break
            finally:
                db.close()
            time.sleep(0.05)
        fd = os.open(os.path.join(disk, "filler-from-task"), os.O_WRONLY | os.O_CREAT)
        try:
            for chunk in (1 << 16, 1 << 12, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)
    return "r" * 100_000


def fill(path: Path) -> None:
    """Write until the filesystem says ENOSPC, down to the last byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


def log_of(agent: AgentProcess) -> str:
    return agent.log_path.read_text() if agent.log_path.exists() else ""


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB filesystem (tmpfs) that fills up like an SD card does."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the queue-quota path is covered by tests/unit/test_agent_store_faults.py)")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(disk)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _results_per_task(mesh: LocalMesh) -> dict[str, int]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return dict(db.execute("SELECT task_id, COUNT(*) FROM results GROUP BY task_id").fetchall())


def test_full_disk_nothing_unstored_is_acknowledged_and_results_survive(mesh: LocalMesh, tiny_disk: Path, tmp_path: Path) -> None:
    agent = mesh.add_agent("sd-card", "mqtt", workers=1, prefetch=8, data_dir=tiny_disk / "queue")
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert ex.submit(slow_square, 3).result(30) == 9
        # 1. the disk fills up: new tasks cannot be stored, so they are not acknowledged (the hub keeps
        # them leased and sends them again). The agent may already have started some while their
        # batch was being written; those finish and their results reach the hub, which keeps one.
        fill(tiny_disk / "filler")
        futures = [ex.submit(slow_square, i) for i in range(20)]
        wait_for(lambda: "could not store" in log_of(agent), "the agent reporting it cannot store tasks")
        line = next(ln for ln in log_of(agent).splitlines() if "could not store" in ln)
        assert "disk full" in line and str(agent.cfg.queue_path) in line and "not acknowledged" in line
        status = [mesh.client.task_status(f.task_id) for f in futures]  # type: ignore[attr-defined]
        assert all(s["acked"] is None for s in status), "nothing the agent could not store was acknowledged"
        assert {s["state"] for s in status} <= {"queued", "leased", "done"}
        assert agent.alive(), "a full disk is not a crash"
        # space comes back: everything runs, each result once
        (tiny_disk / "filler").unlink()
        done, not_done = wait(futures, timeout=90)
        assert not not_done and [f.result() for f in futures] == [i * i for i in range(20)]

        # 2. the disk fills while a result is waiting to be written, and then the power goes
        fut = ex.submit(fill_then_answer, str(tiny_disk), str(tmp_path / "filled-once"), str(agent.cfg.queue_path))
        wait_for(lambda: "could not store 1 results" in log_of(agent), "the agent holding a result it cannot store")
        assert not fut.done()
        agent.kill()
        (tiny_disk / "filler-from-task").unlink()
        agent.start()
        assert fut.result(90) == "r" * 100_000  # the stored task ran again after the restart
    counts = _results_per_task(mesh)
    assert all(n == 1 for n in counts.values()) and len(counts) == 22


def test_truncated_queue_after_a_power_cut(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("cut", "mqtt", workers=1, prefetch=64)
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        futures = [ex.submit(slow_square, i) for i in range(60)]
        wait_for(lambda: sum(f.done() for f in futures) >= 10, "first results")
        agent.kill()
        q = agent.cfg.queue_path
        with sqlite3.connect(q) as db:  # what any next opener does: fold the WAL into the file
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        data = q.read_bytes()
        q.write_bytes(data[: len(data) * 6 // 10])  # the tail of the file is gone
        damaged = hashlib.sha256(q.read_bytes()).hexdigest()

        cli = [sys.executable, "-m", "mesh_agent.cli"]
        out = subprocess.run([*cli, "start", "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
        text = " ".join((out.stdout + out.stderr).split())
        assert out.returncode == 3 and "not a usable queue database" in text and str(q) in text and "mesh-agent queue recover" in text
        assert hashlib.sha256(q.read_bytes()).hexdigest() == damaged, "a refused start leaves the file as it was"
        out = subprocess.run([*cli, "queue", "recover", "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "damaged queue moved to" in out.stdout
        aside = next(q.parent.glob(f"{q.name}.damaged-*"))
        assert hashlib.sha256(aside.read_bytes()).hexdigest() == damaged

        agent.start()
        done, not_done = wait(futures, timeout=120)
        assert not not_done, f"{len(not_done)} tasks never came back"
        assert [f.result() for f in futures] == [i * i for i in range(60)]
    counts = _results_per_task(mesh)
    assert len(counts) == 60 and set(counts.values()) == {1}
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        resent = db.execute("SELECT COUNT(*) FROM tasks WHERE attempts >= 2").fetchone()[0]
    assert resent > 0, "tasks lost with the file were re-sent by the hub (reconciliation on hello)"
