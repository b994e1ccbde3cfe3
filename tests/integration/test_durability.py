"""Invariants 1 and 2 with real processes: nothing accepted is lost, each result delivered once."""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import wait

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def slow_square(x: int) -> int:
    import time

    time.sleep(0.01)
    return x * x


def _hub_rows(mesh: LocalMesh, sql: str) -> list[tuple]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return db.execute(sql).fetchall()


@pytest.mark.parametrize("transport", ["mqtt", "zmq"])
def test_sigkill_mid_batch_every_task_exactly_one_result(mesh: LocalMesh, transport: str) -> None:
    agent = mesh.add_agent("victim", transport, workers=2, prefetch=64)
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        futures = [ex.submit(slow_square, i) for i in range(500)]
        wait_for(lambda: sum(f.done() for f in futures) >= 100, "first 100 results", 60)
        agent.kill()  # SIGKILL the agent and its workers mid-batch
        done_at_kill = sum(f.done() for f in futures)
        assert done_at_kill < 500, "the kill must land mid-batch"
        agent.start()
        finished, not_done = wait(futures, timeout=120)
        assert not not_done
        assert [f.result() for f in futures] == [i * i for i in range(500)]
    ids = {f.task_id for f in futures}  # type: ignore[attr-defined]
    rows = _hub_rows(mesh, "SELECT task_id FROM results")
    assert len(rows) == len({r[0] for r in rows}), "one stored result per task"
    assert ids <= {r[0] for r in rows}
    states = dict(_hub_rows(mesh, "SELECT state, COUNT(*) FROM tasks GROUP BY state"))
    assert states == {"done": 500}


def test_hub_restart_with_tasks_queued_and_in_flight(mesh: LocalMesh) -> None:
    a = mesh.add_agent("m1", "mqtt", prefetch=16)
    z = mesh.add_agent("z1", "zmq", prefetch=16)
    mesh.wait_online()
    with Executor(mesh.client, a.endpoint_id) as ex_a, Executor(mesh.client, z.endpoint_id) as ex_z:
        futures = [ex.submit(slow_square, i) for i in range(300) for ex in (ex_a, ex_z)]
        wait_for(lambda: all(f.running() or f.done() for f in futures) and sum(f.done() for f in futures) >= 30, "tasks accepted and running", 60)
        mesh.stop_hub()
        time.sleep(1.0)  # agents keep working and hold their results while the hub is away
        mesh.start_hub()
        finished, not_done = wait(futures, timeout=120)
        assert not not_done, f"{len(not_done)} results missing after hub restart"
        assert sorted(f.result() for f in futures) == sorted([i * i for i in range(300)] * 2)
    assert dict(_hub_rows(mesh, "SELECT state, COUNT(*) FROM tasks GROUP BY state")) == {"done": 600}


def test_broker_restart_loses_nothing(mesh: LocalMesh) -> None:
    a = mesh.add_agent("b1", "mqtt", prefetch=16)
    mesh.wait_online(a)
    with Executor(mesh.client, a.endpoint_id) as ex:
        futures = [ex.submit(slow_square, i) for i in range(300)]
        wait_for(lambda: sum(f.done() for f in futures) >= 30, "first results", 60)
        mesh.broker.stop()
        time.sleep(1.0)
        mesh.broker.start()
        finished, not_done = wait(futures, timeout=120)
        assert not not_done
        assert [f.result() for f in futures] == [i * i for i in range(300)]


def test_offline_endpoint_tasks_wait_at_hub_and_run_on_return(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("sleepy", "mqtt")
    mesh.wait_online(agent)
    agent.stop()
    mesh.wait_online(agent, online=False, timeout=30)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        futures = [ex.submit(slow_square, i) for i in range(50)]
        wait_for(lambda: all(f.running() for f in futures), "tasks accepted", 30)
        time.sleep(2.0)
        assert not any(f.done() for f in futures)
        ep = mesh.client.get_endpoint(agent.endpoint_id)
        assert ep["online"] is False and ep["queued"] == 50
        agent.start()
        finished, not_done = wait(futures, timeout=60)
        assert not not_done
        assert [f.result() for f in futures] == [i * i for i in range(50)]
