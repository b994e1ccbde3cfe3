"""The mesh multiprocessing proxies against a real redis-server (started here on a free port),
from threads and from real child processes: Queue, Pipe, Lock, RLock, Semaphore, Condition,
Event, Barrier, Value, Array, Manager; reference counts, expiry, and Redis going away. Every
test that takes ``rs`` runs twice: against redis-server and against the hub's embedded store."""

from __future__ import annotations

import gc
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

redis = pytest.importorskip("redis")

from cloud_hub.client import multiprocessing as mp  # noqa: E402
from cloud_hub.broker import free_port  # noqa: E402


class RedisServer:
    """A throwaway redis-server on loopback (never the system one on 6379)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        """``port``: that one (a restart of a server stopped before), else a free one."""
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is required: run ./taskw setup (apt-get install redis-server)")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                r.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class HubStore:
    """The hub's embedded store (cloud_hub.kv, a Redis subset) in place of a redis-server: the
    same proxies must behave the same against it (issue 12: deployments without Redis)."""

    def __init__(self) -> None:
        from tests.kv_thread import KVThread

        self.kv = KVThread()
        self.url = self.kv.url("alice")

    def stop(self) -> None:
        self.kv.stop()


@pytest.fixture(scope="module", params=["redis", "hub-store"])
def rs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | HubStore]:
    server = RedisServer(tmp_path_factory.mktemp("redis")) if request.param == "redis" else HubStore()
    mp.config(redis_url=server.url)
    try:
        yield server
    finally:
        server.stop()


def _child(code: str, url: str, *objs: object) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``objs`` unpickled as o0, o1...: a real other process."""
    import cloudpickle

    blob = cloudpickle.dumps(objs).hex()
    prog = (f"import pickle; from cloud_hub.client import multiprocessing as mp; mp.config(redis_url={url!r})\n"
            f"objs = pickle.loads(bytes.fromhex({blob!r}))\n" + "\n".join(f"o{i} = objs[{i}]" for i in range(len(objs))) + "\n" + code)
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)


def test_queue_between_processes(rs: RedisServer) -> None:
    q = mp.Queue()
    out = _child("for i in range(5): o0.put({'i': i})", rs.url, q)
    assert out.returncode == 0, out.stderr
    assert [q.get(timeout=5)["i"] for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_bounded_queue_is_full(rs: RedisServer) -> None:
    q = mp.Queue(maxsize=1)
    q.put(1)
    assert q.full()
    with pytest.raises(queue.Full):
        q.put(2, timeout=0.05)


def test_pipe_duplex_and_one_way(rs: RedisServer) -> None:
    a, b = mp.Pipe()
    a.send(21)
    out = _child("x = o0.recv(); o0.send(x * 2); o0.send_bytes(b'raw')", rs.url, b)
    assert out.returncode == 0, out.stderr
    assert a.recv() == 42
    assert a.poll(1) and a.recv_bytes() == b"raw"
    r, w = mp.Pipe(duplex=False)
    w.send("hi")
    assert r.recv() == "hi"
    with pytest.raises(OSError):
        r.send("no")


def test_lock_excludes_and_counter_is_exact(rs: RedisServer) -> None:
    v = mp.Value("i", 0)
    code = "for _ in range(50):\n    with o0.get_lock():\n        o0.value += 1"
    procs = [threading.Thread(target=_child, args=(code, rs.url, v)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert v.value == 150


def test_lock_released_too_many_times(rs: RedisServer) -> None:
    lock = mp.Lock()
    assert lock.acquire()
    assert not lock.acquire(timeout=0.05)
    lock.release()
    with pytest.raises(ValueError, match="released too many times"):
        lock.release()


def test_rlock_reentrant_and_owned(rs: RedisServer) -> None:
    rl = mp.RLock()
    with rl:
        with rl:
            pass
    out = _child("o0.release()", rs.url, rl)
    assert "AssertionError" in out.stderr


def test_semaphore_and_condition_and_event(rs: RedisServer) -> None:
    s = mp.Semaphore(2)
    assert s.acquire() and s.acquire() and not s.acquire(False)
    s.release()
    assert s.get_value() == 1
    cond, ev = mp.Condition(), mp.Event()
    got: list[str] = []

    def waiter() -> None:
        with cond:
            got.append("in")
            cond.wait(10)
            got.append("woken")

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(500):
        if got:
            break
        time.sleep(0.01)
    time.sleep(0.05)
    with cond:
        cond.notify()
    t.join(10)
    assert got == ["in", "woken"]
    assert not ev.wait(0.05)
    out = _child("o0.set()", rs.url, ev)
    assert out.returncode == 0 and ev.wait(5) and ev.is_set()


def test_barrier_lets_all_through(rs: RedisServer) -> None:
    b = mp.Barrier(3)
    idx: list[int] = []
    ts = [threading.Thread(target=lambda: idx.append(b.wait(10))) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert sorted(idx) == [0, 1, 2]
    b2 = mp.Barrier(2)
    with pytest.raises(mp.BrokenBarrierError):
        b2.wait(0.05)


def test_array_slices_and_manager(rs: RedisServer) -> None:
    a = mp.Array("d", [1.0, 2.0, 3.0])
    a[1] = 5.0
    a[:2] = [7.0, 8.0]
    assert a[:] == [7.0, 8.0, 3.0] and len(a) == 3 and a[-1] == 3.0
    with pytest.raises(IndexError):
        a[3]
    with pytest.raises(TypeError, match="typecode"):
        mp.Array("zz", 3)
    with mp.Manager() as m:
        d, lst, ns = m.dict(), m.list([1]), m.Namespace()
        out = _child("o0['k'] = [1, 2]; o1.append(2); o2.x = 'y'", rs.url, d, lst, ns)
        assert out.returncode == 0, out.stderr
        assert d["k"] == [1, 2] and list(lst) == [1, 2] and ns.x == "y"
        assert d.get("missing") is None and "k" in d and len(d) == 1


def test_reference_count_deletes_keys_and_expiry_is_set(rs: RedisServer) -> None:
    r = redis.Redis.from_url(rs.url)
    q = mp.Queue()
    q.put(1)
    prefix = q._prefix
    assert 0 < r.ttl(prefix + ":items") <= 3600
    out = _child("o0.get()", rs.url, q)  # a copy elsewhere takes and drops its own reference
    assert out.returncode == 0, out.stderr
    assert r.exists(prefix + ":ref")
    del q
    gc.collect()
    assert not r.keys(prefix + "*")


def _in_task(task_id: str) -> str:
    """Child code that makes the child an agent's worker running ``task_id``: the agent's worker
    module with the running task's id set, as ``run_task`` sets it (the integration test
    test_queue_when_the_consumers_agent_is_sigkilled does this on a real mesh)."""
    return f"import mesh_agent.engine._worker as w; w.CURRENT_TASK_ID = {task_id!r}\n"


def test_queue_in_a_task_is_at_least_once_across_a_sigkill(rs: RedisServer) -> None:
    r = redis.Redis.from_url(rs.url)
    q = mp.Queue()
    for i in range(5):
        q.put(i)
    pending = f"{q._prefix}:pending:t1"
    # a consumer in task t1 takes 0, then 1 (0 is consumed by asking again), and is SIGKILLed
    out = _child(_in_task("t1") + "import os, signal\nprint(o0.get(), o0.get(), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)", rs.url, q)
    assert out.returncode == -9 and out.stdout.split() == ["0", "1"], out.stderr
    assert r.lrange(pending, 0, -1) == [b"", mp.queues.dumps(1)]  # the marker, then the item in hand
    assert 0 < r.ttl(pending) <= 3600 and r.smembers(q._prefix + ":consumers") == {b"t1"}
    assert q.qsize() == 3
    # the driver's get is today's BLPOP: it does not see what t1 holds
    assert q.get(timeout=5) == 2
    # t1 run again (the same task id): the item the killed run held comes first, then the rest
    out = _child(_in_task("t1") + "import queue\ngot = [o0.get(timeout=5) for _ in range(3)]\n"
                 "try:\n    o0.get(timeout=0.2)\nexcept queue.Empty:\n    got.append('empty')\n"
                 "print(got)\nfrom cloud_hub.client.multiprocessing.queues import task_ended\ntask_ended()", rs.url, q)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 3, 4, 'empty']"
    assert not r.exists(pending) and not r.smembers(q._prefix + ":consumers")  # the task ended: consumed
    # several items left by a killed run are each handed out again, one per get
    for i in range(3):
        q.put(10 + i)
    out = _child(_in_task("t2") + "import threading\nt = threading.Thread(target=o0.get)\nt.start(); t.join()\n"
                 "print(o0.get(timeout=5), flush=True)\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", rs.url, q)
    assert out.returncode == -9 and out.stdout.split() == ["11"], out.stderr
    r.rpush(f"{q._prefix}:pending:t2", mp.queues.dumps("x"))  # as a second consumer thread of t2 would have left it
    q.put("y")
    out = _child(_in_task("t2") + "print([o0.get(timeout=5) for _ in range(3)])\n"
                 "import mesh_agent.engine._worker as w; w.CURRENT_TASK_ID = 't3'\nprint(o0.get(timeout=5))", rs.url, q)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[11,", "'x',", "12]", "y"]
    # t2's worker went on to another task (t3): t2 had ended, so its list went with t3's first get
    assert not r.exists(f"{q._prefix}:pending:t2") and r.lrange(f"{q._prefix}:pending:t3", 0, -1) == [b"", mp.queues.dumps("y")]
    # the reference count's release deletes the pending lists too (the killed runs' references
    # never came back, so drop them here as the expiry would have)
    r.set(q._prefix + ":ref", 1)
    prefix = q._prefix
    del q
    gc.collect()
    assert not r.keys(prefix + "*")


def test_redis_down_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = RedisServer(tmp_path)
    monkeypatch.setenv("MESH_REDIS_RETRY_S", "0.3")
    mp.config(redis_url=server.url)
    try:
        q = mp.Queue()
        server.stop()
        with pytest.raises(ConnectionError, match=f"cannot reach Redis at {server.url}"):
            q.put(1)
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_redis_down_then_back_within_the_retry_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis stops, and comes back on the same address while a call is retrying: the call succeeds."""
    server = RedisServer(tmp_path)
    monkeypatch.setenv("MESH_REDIS_RETRY_S", "60")
    mp.config(redis_url=server.url)
    servers = [server]

    def come_back() -> None:
        time.sleep(1.0)  # the put below starts while nothing listens, and retries
        servers.append(RedisServer(tmp_path, port=server.port))

    try:
        q = mp.Queue()
        q.put("before")
        server.stop()  # waits for the exit: from here nothing answers on that port
        t = threading.Thread(target=come_back)
        t.start()
        q.put("during")  # retried with backoff until the new server answers
        t.join(60)
        assert len(servers) == 2
        # the new server is empty (no persistence): only what was written after it came back is there
        assert q.get(timeout=10) == "during"
        assert q.empty()
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop()


def test_simple_queue_between_processes_and_closed(rs: RedisServer) -> None:
    q = mp.SimpleQueue()
    assert q.empty()
    out = _child("for i in range(3): o0.put(('x', i))", rs.url, q)
    assert out.returncode == 0, out.stderr
    assert not q.empty()
    assert [q.get() for _ in range(3)] == [("x", 0), ("x", 1), ("x", 2)]
    assert q.empty()
    q.put(1)
    out = _child("print('got', o0.get())", rs.url, q)
    assert out.returncode == 0 and "got 1" in out.stdout, out.stderr
    q.close()
    with pytest.raises(OSError, match="handle is closed"):
        q.get()
    with pytest.raises(OSError, match="handle is closed"):
        q.put(2)


def test_unpicklable_process_target_is_the_stdlib_error() -> None:
    """Raised by ``start()`` in the program, before anything is submitted (no hub is needed to see it)."""
    lock = threading.Lock()
    p = mp.Process(target=lambda: lock)
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        p.start()
    assert p.pid is None and p.exitcode is None and not p.is_alive()
    with pytest.raises(AssertionError, match="can only join a started process"):
        p.join(1)
