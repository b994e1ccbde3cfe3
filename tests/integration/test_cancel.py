"""Cancellation on a real mesh (issue 28 item 2): hub, broker, real agent processes. A cancelled
task never runs if it had not started, is ended (its worker killed and replaced) if it had, ends
with exactly one ``cancelled`` result, and its SDK future says so; the cancel of a task held by an
offline agent waits in the hub and applies when the agent comes back; only the submitter may
cancel, and bad input changes nothing. See docs/protocol.md, "Cancellation"."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections import Counter
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.client._results import decode_row
from cloud_hub.localmesh import LocalMesh
from cloud_hub.store import SqliteStore

pytestmark = pytest.mark.integration


def mark_and_wait(mark: str, gate: str) -> int:
    """Write our pid to ``mark``, then wait (bounded) for ``gate``."""
    Path(mark).write_text(str(os.getpid()))
    for _ in range(60_000):
        if os.path.exists(gate):
            break
        time.sleep(0.01)
    return os.getpid()


def touch(mark: str) -> int:
    Path(mark).write_text(str(os.getpid()))
    return os.getpid()


class _M:
    def __init__(self, mesh: LocalMesh, solo: Any, away: Any, eve: Client) -> None:
        self.mesh, self.solo, self.away, self.eve = mesh, solo, away, eve
        self.eve_token = eve._token


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_M]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    mesh = LocalMesh(tmp_path_factory.mktemp("cancel"), heartbeat_s=0.5, lost_after_s=3.0)
    mesh.start()
    try:
        solo = mesh.add_agent("solo", "zmq", workers=1, prefetch=4)
        away = mesh.add_agent("away", "zmq", workers=1, start=False)  # enrolled, not started: its work waits at the hub
        mesh.wait_online(solo, timeout=90)

        async def mint() -> str:
            store = await SqliteStore(mesh.hub_cfg.db_path).open()
            try:
                return await store.create_api_token(await store.create_user("eve"), "test")
            finally:
                await store.close()

        eve = Client(mesh.url, asyncio.run(mint()))
        yield _M(mesh, solo, away, eve)
        eve.close()
    finally:
        mesh.stop()


def _hub_rows(mesh: LocalMesh, ids: list[str]) -> dict[str, tuple[Any, ...]]:
    """task id -> (state, cancelled, cancel_pending), read from the hub's database."""
    db = sqlite3.connect(f"file:{mesh.hub_cfg.db_path}?mode=ro", uri=True)
    try:
        q = f"SELECT id, state, cancelled, cancel_pending FROM tasks WHERE id IN ({','.join('?' * len(ids))})"
        return {r[0]: r[1:] for r in db.execute(q, ids)}
    finally:
        db.close()


def _state(mesh: LocalMesh, f: Any) -> str | None:
    tid = getattr(f, "task_id", None)
    return None if tid is None else _hub_rows(mesh, [tid]).get(tid, (None,))[0]


def _wait(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def _results_of(client: Client, cursor: int, ids: list[str]) -> list[dict[str, Any]]:
    """Every result row the hub delivers after ``cursor`` for these tasks (bounded reads)."""
    rows: list[dict[str, Any]] = []
    for _ in range(100):
        got, cursor = client.result_stream(cursor, timeout_s=0)
        rows += [r for r in got if r["task_id"] in ids]
        if not got:
            break
    return rows


def _one_cancelled_result_each(client: Client, cursor: int, ids: list[str]) -> None:
    rows = _results_of(client, cursor, ids)
    assert Counter(r["task_id"] for r in rows) == {i: 1 for i in ids}, rows
    for r in rows:
        ok, exc = decode_row(r)
        assert not ok and getattr(exc, "remote_type", None) == "mesh_agent.TaskCancelled", exc


def test_cancel_running_and_queued_tasks_on_an_agent(m: _M, tmp_path: Path) -> None:
    """A running task's worker is killed and replaced; one queued behind it on the agent never
    runs; both futures are cancelled and each task has exactly one cancelled result."""
    client = m.mesh.client
    cursor = client.result_cursor()
    ex = Executor(client=Client(m.mesh.url, m.mesh.token), endpoint=m.solo.endpoint_id)
    mark, gate, queued_mark = tmp_path / "running", tmp_path / "gate", tmp_path / "queued"
    running = ex.submit(mark_and_wait, str(mark), str(gate))
    _wait(mark.exists, "the task started")
    worker = int(mark.read_text())
    queued = ex.submit(touch, str(queued_mark))
    _wait(lambda: _state(m.mesh, queued) == "acked", "the agent stored the second task")
    assert ex.cancel_futures([running, queued]) == [True, True]
    for f in (running, queued):
        assert f.cancelled() and f.done()
        with pytest.raises(CancelledError):
            f.result(0)
    assert running.cancel() is True  # again: still cancelled, nothing more happens
    _wait(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE, "the worker was killed")
    # The agent's one worker is fresh and free: a new task runs, and the cancelled one never did.
    after = ex.submit(touch, str(tmp_path / "after"))
    assert after.result(120) != worker
    assert not queued_mark.exists()
    _wait(lambda: all(r[2] is None for r in _hub_rows(m.mesh, [running.task_id, queued.task_id]).values()),
          "the agent confirmed both cancels")
    rows = _hub_rows(m.mesh, [running.task_id, queued.task_id])
    assert all(r[0] == "done" and r[1] is not None for r in rows.values())
    _one_cancelled_result_each(client, cursor, [running.task_id, queued.task_id])
    gate.touch()
    ex.shutdown()


def test_cancel_a_task_queued_at_the_hub(m: _M, tmp_path: Path) -> None:
    """Its agent never started: the task waits at the hub, is cancelled there at once (no cancel
    to send), and does not run when the agent comes up."""
    client = m.mesh.client
    cursor = client.result_cursor()
    ex = Executor(client=Client(m.mesh.url, m.mesh.token), endpoint=m.away.endpoint_id)
    f = ex.submit(touch, str(tmp_path / "away"))
    _wait(lambda: getattr(f, "task_id", None) is not None, "the hub accepted it")
    assert f.cancel() is True and f.cancelled()
    assert _hub_rows(m.mesh, [f.task_id])[f.task_id] == ("done", pytest.approx(time.time(), abs=60), None)
    _one_cancelled_result_each(client, cursor, [f.task_id])
    m.away.start()
    try:
        m.mesh.wait_online(m.away, timeout=90)
        probe = ex.submit(touch, str(tmp_path / "probe"))
        probe.result(120)
        assert not (tmp_path / "away").exists()
    finally:
        m.away.stop()
    ex.shutdown()


def test_cancel_waits_in_the_hub_for_an_offline_agent_and_applies_on_reconnect(m: _M, tmp_path: Path) -> None:
    """Two tasks stored on the agent (one running, one queued behind it), the agent SIGKILLed:
    both are cancelled at the hub at once (futures cancelled, one result each), and the cancels
    wait there; when the agent comes back and resumes its stored tasks, the cancels reach it: the
    running one is ended, the queued one never runs, and the agent confirms."""
    client = m.mesh.client
    cursor = client.result_cursor()
    ex = Executor(client=Client(m.mesh.url, m.mesh.token), endpoint=m.solo.endpoint_id)
    mark, gate, queued_mark = tmp_path / "a", tmp_path / "gate", tmp_path / "b"
    a = ex.submit(mark_and_wait, str(mark), str(gate))
    _wait(mark.exists, "the first task started")
    b = ex.submit(touch, str(queued_mark))
    _wait(lambda: _state(m.mesh, b) == "acked", "the agent stored the second task")
    m.solo.kill()
    m.mesh.wait_online(m.solo, timeout=60, online=False)
    assert ex.cancel_futures([a, b]) == [True, True]
    rows = _hub_rows(m.mesh, [a.task_id, b.task_id])
    assert all(r[0] == "done" and r[2] == 1 for r in rows.values()), rows  # cancelled, to be sent
    mark.unlink()
    m.solo.start()
    try:
        m.mesh.wait_online(m.solo, timeout=90)
        _wait(lambda: all(r[2] is None for r in _hub_rows(m.mesh, [a.task_id, b.task_id]).values()),
              "the agent confirmed both cancels", timeout=90)
        after = ex.submit(touch, str(tmp_path / "after"))
        after.result(120)  # the one worker is free again
        assert not queued_mark.exists()
        if mark.exists():  # the agent resumed the first task before the cancel came: its worker was killed
            pid = int(mark.read_text())
            _wait(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "the resumed run ended")
        _one_cancelled_result_each(client, cursor, [a.task_id, b.task_id])
        assert "cancelled 2 tasks by their submitter" in m.solo.log_path.read_text() or \
            "cancelled 1 tasks by their submitter" in m.solo.log_path.read_text()
    finally:
        gate.touch()
    ex.shutdown()


def test_a_task_group_is_cancelled_whole(m: _M, tmp_path: Path) -> None:
    client = Client(m.mesh.url, m.mesh.token)
    ex = Executor(client=client, endpoint=m.solo.endpoint_id, task_group_id=f"g-{uuid.uuid4().hex[:8]}")
    cursor = client.result_cursor()
    gate = tmp_path / "gate"
    fs = [ex.submit(mark_and_wait, str(tmp_path / f"m{i}"), str(gate)) for i in range(3)]
    _wait(lambda: all(getattr(f, "task_id", None) for f in fs), "the hub accepted them")
    _wait((tmp_path / "m0").exists, "the first started")
    ids = ex.cancel_group()
    assert sorted(ids) == sorted(f.task_id for f in fs)
    assert all(f.cancelled() for f in fs)
    assert ex.cancel_group() == []  # nothing left to cancel
    _one_cancelled_result_each(client, cursor, [f.task_id for f in fs])
    assert ex.submit(touch, str(tmp_path / "next")).result(120) > 0
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    ex.shutdown()


def test_only_the_submitter_may_cancel_and_bad_input_changes_nothing(m: _M, tmp_path: Path) -> None:
    ex = Executor(client=Client(m.mesh.url, m.mesh.token), endpoint=m.solo.endpoint_id)
    gate = tmp_path / "gate"
    f = ex.submit(mark_and_wait, str(tmp_path / "m"), str(gate))
    _wait(lambda: getattr(f, "task_id", None) is not None, "the hub accepted it")
    http = httpx.Client(base_url=m.mesh.url, headers={"Authorization": f"Bearer {m.eve_token}"})
    own = httpx.Client(base_url=m.mesh.url, headers={"Authorization": f"Bearer {m.mesh.token}"})
    try:
        r = http.post(f"/v1/tasks/{f.task_id}/cancel")  # another user's task: unknown to eve
        assert r.status_code == 404 and r.json()["detail"] == f"unknown task {f.task_id}; nothing was cancelled"
        r = own.post("/v1/tasks/cancel", json={"task_ids": [f.task_id, "0" * 32]})  # one unknown id: nothing changes
        assert r.status_code == 404 and "unknown task " + "0" * 32 in r.json()["detail"]
        r = own.post("/v1/tasks/cancel", json={"task_ids": [f.task_id, "not-a-task"]})
        assert r.status_code == 422 and r.json()["detail"] == "task_ids[1]: 'not-a-task' is not a task id (32 hex digits)"
        r = own.post("/v1/tasks/cancel", json={"task_ids": []})
        assert r.status_code == 422 and isinstance(r.json()["detail"], str)
        r = own.post("/v1/tasks/nothex/cancel")
        assert r.status_code == 422 and "is not a task id" in r.json()["detail"]
        assert _hub_rows(m.mesh, [f.task_id])[f.task_id][1] is None  # not cancelled
        gate.touch()
        assert f.result(120) > 0  # it ran to its end
        r = own.post(f"/v1/tasks/{f.task_id}/cancel")  # finished: its result stands
        assert r.status_code == 200 and r.json() == {"task_id": f.task_id, "cancelled": False, "state": "done"}
    finally:
        http.close()
        own.close()
    ex.shutdown()
