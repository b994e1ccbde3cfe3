"""Submits survive a hub restart (issue 18 item 5): a steady stream of ``Executor.submit`` calls
while the hub process is SIGKILLed and started again on the same port and database. No submit is
refused, and every task exists once and runs exactly once on the agent (the SDK retries each batch with backoff and jitter
under one idempotency key, so a retry of a batch the hub had already stored makes nothing new)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration

N = 240


def echo(i: int, log: str) -> int:
    """Returns ``i`` and appends it to ``log`` on the agent's machine: one line per execution."""
    import os

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{i}\n".encode())  # one write, O_APPEND: whole lines even from two workers
    finally:
        os.close(fd)
    return i


def test_steady_submits_through_a_hub_sigkill_and_restart(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    with LocalMesh(tmp_path, heartbeat_s=0.5, lost_after_s=3.0, lease_s=5.0, hub_process=True) as m:
        agent = m.add_agent("a", "zmq", workers=2)
        m.wait_online(timeout=90)
        client = Client(m.url, m.token, timeout=10)
        ex = Executor(client, endpoint_id=agent.endpoint_id, submit_timeout_s=120, task_group_id="restart-stream")
        futs = []
        runs = tmp_path / "executions.log"
        restarted = threading.Event()

        def bounce() -> None:
            while len(futs) < N // 3:
                time.sleep(0.01)
            m.kill_hub()  # SIGKILL: no graceful shutdown
            time.sleep(2.0)  # submits keep coming while it is down
            m.start_hub()
            restarted.set()

        t = threading.Thread(target=bounce)
        t.start()
        refused = 0
        for i in range(N):
            try:
                futs.append(ex.submit(echo, i, str(runs)))
            except Exception:  # submit() must never raise here
                refused += 1
            time.sleep(0.02)
        t.join(60)
        assert restarted.is_set()
        results = [f.result(180) for f in futs]
        ex.shutdown()
        client.close()
        with sqlite3.connect(m.hub_cfg.db_path) as db:
            stored = db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM tasks WHERE task_group_id='restart-stream'").fetchone()
            done = db.execute("SELECT COUNT(*) FROM results r JOIN tasks t ON t.id = r.task_id WHERE t.task_group_id='restart-stream'").fetchone()[0]
    assert refused == 0
    assert results == list(range(N))
    assert stored == (N, N)  # each submit made exactly one task
    assert done == N
    assert len({f.task_id for f in futs}) == N  # type: ignore[attr-defined]
    executed = sorted(int(x) for x in runs.read_text().split())
    assert executed == list(range(N)), "every task ran exactly once on the agent"
