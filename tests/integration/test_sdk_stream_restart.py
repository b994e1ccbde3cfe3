"""The SDK's stream through a hub SIGKILL and restart (issue 13 item 3): a steady stream of
``Executor.submit`` calls over the WebSocket while the hub process is killed and started again on
the same port and database. The stream reconnects with backoff, submits it lost are sent again
with their idempotency keys, and results come again from the SDK's cursor: no submit is refused,
each task exists once, each future completes once with its own value."""

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


def echo(i: int) -> int:
    return i


def test_stream_reconnects_through_a_hub_sigkill_and_loses_or_duplicates_nothing(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    with LocalMesh(tmp_path, heartbeat_s=0.5, lost_after_s=3.0, lease_s=5.0, hub_process=True) as m:
        agent = m.add_agent("a", "mqtt", workers=2)
        m.wait_online(timeout=90)
        client = Client(m.url, m.token, timeout=10)
        # early_results: the strictest case, results may reach the SDK before the hub that dies commits them
        ex = Executor(client, endpoint_id=agent.endpoint_id, submit_timeout_s=120, task_group_id="stream-restart", early_results=True)
        deadline = time.monotonic() + 30
        while not (ex._stream is not None and ex._stream.connected) and time.monotonic() < deadline:
            time.sleep(0.02)
        stream = ex._stream
        assert stream is not None and stream.connected
        futs = []
        restarted = threading.Event()

        def bounce() -> None:
            while len(futs) < N // 3:
                time.sleep(0.01)
            m.kill_hub()  # SIGKILL: no close frame, no graceful shutdown
            time.sleep(2.0)  # submits keep coming while it is down
            m.start_hub()
            restarted.set()

        t = threading.Thread(target=bounce)
        t.start()
        refused = 0
        for i in range(N):
            try:
                futs.append(ex.submit(echo, i))
            except Exception:  # submit() must never raise here
                refused += 1
            time.sleep(0.02)
        t.join(60)
        assert restarted.is_set()
        results = [f.result(180) for f in futs]
        deadline = time.monotonic() + 60
        while not (stream.connected and stream.connects >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        connects = stream.connects
        before = stream.submits
        assert ex.submit(echo, -1).result(60) == -1
        after = stream.submits  # that submit went over the new stream, not REST
        ex.shutdown()
        client.close()
        deadline = time.monotonic() + 60  # the hub's own commits may follow the SDK's results
        while True:
            with sqlite3.connect(m.hub_cfg.db_path, timeout=30) as db:
                stored = db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM tasks WHERE task_group_id='stream-restart'").fetchone()
                done = db.execute("SELECT COUNT(*) FROM results r JOIN tasks t ON t.id = r.task_id WHERE t.task_group_id='stream-restart'").fetchone()[0]
            if done >= N + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert refused == 0
    assert results == list(range(N))
    assert stored == (N + 1, N + 1)  # each submit made exactly one task
    assert done == N + 1
    assert len({f.task_id for f in futs}) == N  # type: ignore[attr-defined]
    assert connects >= 2  # it reconnected to the restarted hub
    assert after == before + 1
