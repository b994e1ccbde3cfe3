"""A driver's lifetime bounds its work (issue 28 item 3), on a real mesh (hub, a ZeroMQ agent with
2 workers, a real redis-server) with real driver processes:

- a driver SIGKILLed while its Processes wait in a Barrier: within its lease (``MESH_MP_LEASE_S``,
  8 s here) the hub cancels its Process and Pool tasks, the agent ends those workers, and its
  shared state leaves Redis; another program's task on the same agent goes on (to its own end),
  and a second program on the same mesh then runs to its end;
- a driver that exits normally: its daemon Process and unfinished Pool work are cancelled at
  once (no lease wait), a non-daemon Process is joined first, as the standard library does.
See docs/multiprocessing.md, "Lease"."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import LocalMesh
from tests.integration.test_mp_proxies import RedisServer

pytestmark = pytest.mark.integration

LEASE_S = 8

DIES = textwrap.dedent('''
    import json, time
    from cloud_hub.client import multiprocessing as mp
    from cloud_hub.client.multiprocessing import _runner, _state

    def meet(b):
        b.wait()

    def block(url, key):
        import redis
        redis.Redis.from_url(url, socket_timeout=None).blpop([key], timeout=600)

    if __name__ == "__main__":
        b = mp.Barrier(4)  # two Processes and this driver: never all four
        q = mp.Queue()
        q.put("state")
        ps = [mp.Process(target=meet, args=(b,)) for _ in range(2)]
        for p in ps:
            p.start()
        pool = mp.Pool(2)
        r = pool.apply_async(block, (_state.redis_url(), "never"))
        f = r._futures[0]
        for _ in range(6000):
            if getattr(f, "task_id", None):
                break
            time.sleep(0.01)
        ex = _runner.executor()
        print(json.dumps({"group": ex.task_group_id, "tasks": [p.pid for p in ps] + [f.task_id]}), flush=True)
        b.wait()
''')

SECOND = textwrap.dedent('''
    from cloud_hub.client import multiprocessing as mp

    def square(x):
        return x * x

    def meet(b, q, i):
        b.wait()
        q.put(i)

    if __name__ == "__main__":
        with mp.Pool(2) as pool:
            print(sum(pool.map(square, range(16))))
        b, q = mp.Barrier(2), mp.Queue()
        ps = [mp.Process(target=meet, args=(b, q, i)) for i in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        print(sorted(q.get(timeout=60) for _ in ps), [p.exitcode for p in ps])
''')

EXITS = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    from cloud_hub.client import multiprocessing as mp
    from cloud_hub.client.multiprocessing import _runner, _state

    def block(url, key):
        import redis
        redis.Redis.from_url(url, socket_timeout=None).blpop([key], timeout=600)

    def late(path):
        time.sleep(1.0)
        Path(path).write_text("joined")

    if __name__ == "__main__":
        d = mp.Process(target=block, args=(_state.redis_url(), "never"), daemon=True)
        d.start()
        n = mp.Process(target=late, args=(sys.argv[1],))
        n.start()
        pool = mp.Pool(2)
        r = pool.apply_async(block, (_state.redis_url(), "never"))
        f = r._futures[0]
        for _ in range(6000):
            if getattr(f, "task_id", None):
                break
            time.sleep(0.01)
        print(json.dumps({"group": _runner.executor().task_group_id, "daemon": d.pid, "joined": n.pid, "pool": f.task_id}), flush=True)
        # no join, no close: the program just ends
''')


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, RedisServer, Any]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    m = LocalMesh(tmp_path_factory.mktemp("mplease"), heartbeat_s=0.5, lost_after_s=3.0)
    m.start()
    try:
        agent = m.add_agent("shared", "zmq", workers=2)
        m.wait_online(timeout=90)
        yield m, redis, agent
    finally:
        m.stop()
        redis.stop()


def _env(m: LocalMesh, redis: RedisServer, agent: Any) -> dict[str, str]:
    return {**os.environ, "MESH_HUB_URL": m.url, "MESH_TOKEN": m.token, "MESH_REDIS_URL": redis.url,
            "MESH_MP_ENDPOINT": agent.endpoint_id, "MESH_MP_LEASE_S": str(LEASE_S), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}


def _rows(m: LocalMesh, ids: list[str]) -> dict[str, tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{m.hub_cfg.db_path}?mode=ro", uri=True)
    try:
        q = f"SELECT id, state, cancelled, cancel_pending FROM tasks WHERE id IN ({','.join('?' * len(ids))})"
        return {r[0]: r[1:] for r in db.execute(q, ids)}
    finally:
        db.close()


def _leases(m: LocalMesh, group: str) -> int:
    db = sqlite3.connect(f"file:{m.hub_cfg.db_path}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM task_group_leases WHERE task_group_id=?", (group,)).fetchone()[0])
    finally:
        db.close()


def _wait(pred: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.1)


def hold(url: str, running: str, gate: str) -> str:
    import redis

    r = redis.Redis.from_url(url, socket_timeout=None)
    r.rpush(running, b"1")
    r.blpop([gate], timeout=600)
    return "other work done"


def _first_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise AssertionError(f"the driver printed nothing (exit {proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
    return dict(json.loads(line))


def test_a_driver_sigkilled_in_a_barrier_frees_its_workers_and_a_second_program_finishes(
        mesh: tuple[LocalMesh, RedisServer, Any], tmp_path: Path) -> None:
    import redis as redis_lib

    m, redis, agent = mesh
    r = redis_lib.Redis.from_url(redis.url, socket_timeout=None)
    tag = uuid.uuid4().hex
    other = Executor(client=Client(m.url, m.token), endpoint=agent.endpoint_id)  # another program's work on the same agent
    running = other.submit(hold, redis.url, f"running:{tag}", f"gate:{tag}")
    assert r.blpop([f"running:{tag}"], timeout=120) is not None
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    driver = subprocess.Popen([sys.executable, str(script)], env=_env(m, redis, agent), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        info = _first_line(driver)
        ids = info["tasks"]
        assert all(ids) and _leases(m, info["group"]) == 1
        assert any(k.startswith(b"mesh:mp:") for k in r.scan_iter("mesh:mp:*"))  # the Barrier, the Queue
        driver.send_signal(signal.SIGKILL)  # mid-program, in the Barrier's wait
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
    # Within its lease: every task of it is cancelled, and the agent confirmed (its workers ended).
    _wait(lambda: all(row[1] is not None and row[2] is None for row in _rows(m, ids).values()), "the dead driver's tasks cancelled")
    assert _leases(m, info["group"]) == 0
    _wait(lambda: not any(True for _ in r.scan_iter("mesh:mp:*")), "the dead driver's shared state expired")
    assert not running.done()  # the other program's task goes on: its worker was not touched
    r.rpush(f"gate:{tag}", b"1")
    assert running.result(120) == "other work done"
    # A second program on the same mesh runs to its end.
    second = tmp_path / "second.py"
    second.write_text(SECOND)
    out = subprocess.run([sys.executable, str(second)], env=_env(m, redis, agent), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [str(sum(x * x for x in range(16))), "[0, 1] [0, 0]"]
    other.shutdown()


def test_a_driver_that_exits_cancels_its_daemon_and_pool_work_and_joins_the_rest(
        mesh: tuple[LocalMesh, RedisServer, Any], tmp_path: Path) -> None:
    m, redis, agent = mesh
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    flag = tmp_path / "joined"
    out = subprocess.run([sys.executable, str(script), str(flag)], env=_env(m, redis, agent), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.splitlines()[0])
    assert flag.read_text() == "joined"  # the non-daemon Process was joined at exit, as the stdlib does
    rows = _rows(m, [info["daemon"], info["pool"], info["joined"]])
    # Cancelled by the exit itself, not by the lease running out.
    assert rows[info["daemon"]][1] is not None and rows[info["pool"]][1] is not None, rows
    assert rows[info["joined"]][0] == "done" and rows[info["joined"]][1] is None
    assert _leases(m, info["group"]) == 0
    _wait(lambda: all(row[2] is None for row in _rows(m, [info["daemon"], info["pool"]]).values()), "the agent confirmed")
