"""Memoization, queue bounds and fair share with the hub on PostgreSQL (the replica-ready store):
the same submit path, memo rows and fair leases as on SQLite, through a real hub and agent."""

from __future__ import annotations

import base64
from typing import Any, Iterator

import psycopg
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor, HubError
from cloud_hub.localmesh import LocalMesh
from mesh_agent.protocol import serialize
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def slow_cube(x: int) -> int:
    import time

    time.sleep(0.2)
    return x ** 3


@pytest.fixture
def mesh(tmp_path: Any, pg_url: str) -> Iterator[tuple[LocalMesh, Any, str]]:  # noqa: F811
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    m = LocalMesh(tmp_path / "pgmesh", heartbeat_s=0.5, lost_after_s=3.0,
                  hub_overrides={"database_url": pg_url, "limits": {"user": {"max_queued": 30}}})
    m.start()
    try:
        agent = m.add_agent("pg", "zmq", workers=2)
        away = m.add_agent("pg-away", "zmq", workers=1, start=False)
        m.wait_online(agent, timeout=90)
        yield m, agent, away.endpoint_id
    finally:
        m.stop()


def test_memo_and_queue_bound_on_postgresql(mesh: Any, pg_url: str) -> None:  # noqa: F811
    m, agent, away = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        first = ex.submit(slow_cube, 3, cache=True)
        assert first.result(timeout=60) == 27
        again = ex.submit(slow_cube, 3, cache=True)
        assert again.result(timeout=60) == 27
    with psycopg.connect(pg_url) as c:
        row = c.execute("SELECT dispatched, state FROM tasks WHERE id=%s", (again.task_id,)).fetchone()  # type: ignore[attr-defined]
    assert row == (None, "done")
    fid = m.client.register_function(slow_cube)
    spec = {"endpoint_id": away, "function_id": fid, "args": base64.b64encode(serialize(((1,), {}))).decode()}
    m.client.submit_batch_placed([spec] * 25)
    with psycopg.connect(pg_url) as c:
        before = c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    with pytest.raises(HubError) as info:
        m.client.submit_batch_placed([spec] * 10)
    assert info.value.status == 429 and info.value.retry_after is not None
    with psycopg.connect(pg_url) as c:
        assert c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == before
