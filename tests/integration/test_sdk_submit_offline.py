"""``submit()`` while the hub is down (issue 18, item 5), with an in-process hub stopped and started
again on the same port and database, a real broker and one ZeroMQ agent:

* a hub that does not come back within ``submit_timeout_s``: the Future fails with
  :class:`SubmitTimeout` (a plain submit and one whose argument is a Future), and the batch is
  never sent later, so the hub holds no task for it once it is back;
* a submit whose argument is a Future (``submit_after``) makes no request in ``submit()``: it
  returns while the hub is down and completes once the hub is back.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.client._executor import SubmitTimeout
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration


def inc(x: int) -> int:
    return x + 1


def double(x: int) -> int:
    return 2 * x


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    with LocalMesh(tmp_path, heartbeat_s=0.5, lost_after_s=3.0, lease_s=5.0) as m:
        m.add_agent("a", "zmq", workers=2)
        m.wait_online(timeout=90)
        yield m


def _tasks_in_group(m: LocalMesh, group: str) -> int:
    with sqlite3.connect(m.hub_cfg.db_path) as db:
        return int(db.execute("SELECT COUNT(*) FROM tasks WHERE task_group_id=?", (group,)).fetchone()[0])


@contextlib.contextmanager
def _warm_executor(mesh: LocalMesh, group: str, submit_timeout_s: float) -> Iterator[tuple[Executor, Future[int]]]:
    """An Executor on the agent with one task done through it (the hub is up), shut down after."""
    client = Client(mesh.url, mesh.token, timeout=10)
    ex = Executor(client, endpoint_id=mesh.agents[0].endpoint_id, submit_timeout_s=submit_timeout_s, task_group_id=group)
    try:
        a = ex.submit(inc, 1)
        assert a.result(60) == 2
        yield ex, a
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
        client.close()


def test_submit_timeout_fails_the_future_and_sends_nothing_later(mesh: LocalMesh) -> None:
    with _warm_executor(mesh, "timeout-group", 3) as (ex, a):
        mesh.stop_hub()  # down, and not back within submit_timeout_s
        t0 = time.monotonic()
        lost = ex.submit(inc, 10)
        dependent = ex.submit(double, a)  # its input is done: it needs the hub's store URL first
        for f in (lost, dependent):
            exc = f.exception(timeout=120)  # a loose liveness bound: 3 s of retries plus backoff
            assert isinstance(exc, SubmitTimeout), exc
            assert "submit_timeout_s=3" in str(exc) and "\n" not in str(exc)
        assert time.monotonic() - t0 < 120
        assert _tasks_in_group(mesh, "timeout-group") == 1, "only the task made before the hub went down"
        mesh.start_hub()
        b = ex.submit(inc, 20)  # the Executor works again ...
        assert b.result(120) == 21
        assert _tasks_in_group(mesh, "timeout-group") == 2, "... and the timed-out submits were never sent"


def test_a_future_argument_submit_makes_no_request_and_completes_after_the_hub_returns(mesh: LocalMesh) -> None:
    with _warm_executor(mesh, "dataflow-group", 120) as (ex, a):
        pending = ex.submit(inc, 100)  # not awaited: may still be running when the hub stops
        mesh.stop_hub()
        b = ex.submit(double, a)  # a done input: before issue 18 this asked GET /v1/kv here and raised
        c = ex.submit(double, pending)
        assert not b.done() and not c.done()
        mesh.start_hub()
        assert b.result(120) == 4
        assert c.result(120) == 202
        assert _tasks_in_group(mesh, "dataflow-group") == 4, "each submit made one task"
