"""Standard-library multiprocessing programs on a real mesh (issue 12 items 1-3): a real hub,
Mosquitto, one MQTT and two ZeroMQ agents, and a real redis-server on a free loopback port.
Also intermediate data by reference (cloud_hub.client.refs): a map -> shuffle -> reduce word
count whose shuffle data goes agent -> Redis -> agent, never through the SDK.

The programs in tests/fixtures/mp_programs/ run as scripts, changed only in their import line
(marked ``mesh-import``); the same files with that line put back run on the standard library
here too, so the comparison is with the real thing, not with our reading of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from tests.integration.test_mp_proxies import RedisServer

pytestmark = pytest.mark.integration

PROGRAMS = Path(__file__).resolve().parents[1] / "fixtures" / "mp_programs"
ROOT = Path(__file__).resolve().parents[2]


class Env:
    """One mesh, and where shared state lives: ``redis`` (a real redis-server, MESH_REDIS_URL) or
    ``hub-store`` (no Redis configured: the hub's embedded store, found through GET /v1/kv)."""

    def __init__(self, mesh: LocalMesh, redis: RedisServer, mode: str) -> None:
        self.mesh, self.redis, self.mode = mesh, redis, mode
        self.seen_workers: set[int] = set()  # agent workers seen while programs ran (run())

    @property
    def store_url(self) -> str:
        if self.mode == "redis":
            return self.redis.url
        return str(Client(self.mesh.url, self.mesh.token).request("GET", "/v1/kv")["url"])

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        env.update(MESH_HUB_URL=self.mesh.url, MESH_TOKEN=self.mesh.token, MESH_CONFIG=str(self.mesh.workdir / "no-config.yaml"),
                   PYTHONPATH=str(ROOT))
        if self.mode == "redis":
            env["MESH_REDIS_URL"] = self.redis.url
        return env

    def run(self, name: str, *args: str, stdlib: bool = False, tmp: Path | None = None) -> str:
        path = PROGRAMS / name
        if stdlib:
            assert tmp is not None
            text = path.read_text()
            changed = re.sub(r"^from cloud_hub\.client import multiprocessing  # (noqa: F401  )?mesh-import.*$", "import multiprocessing",
                             text, count=1, flags=re.M)
            changed = re.sub(r"^from cloud_hub\.client\.multiprocessing import (.*?)  # mesh-import.*$", r"from multiprocessing import \1",
                             changed, count=1, flags=re.M)
            assert changed != text
            path = tmp / name
            path.write_text(changed)
        stop = threading.Event()
        watcher = None if stdlib else threading.Thread(target=self._watch_workers, args=(stop,), daemon=True)
        if watcher is not None:
            watcher.start()
        try:
            out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=240, env=self.env(), cwd=tmp or ROOT)
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(5)
        assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def _watch_workers(self, stop: threading.Event) -> None:
        """Every agent worker seen while a program runs, the short-lived extra ones too (an extra
        worker ends with its one task, and its pid may be reused by the time the program ends)."""
        for _ in range(240 * 20):  # bounded: the program's own timeout, at 50 ms a look
            self.seen_workers |= self.worker_pids()
            if stop.wait(0.05):
                break
        self.seen_workers |= self.worker_pids()

    def worker_pids(self) -> set[int]:
        pids: set[int] = set()
        for a in self.mesh.agents:
            if a.proc is not None:
                try:
                    pids |= {c.pid for c in psutil.Process(a.proc.pid).children(recursive=True)}
                except psutil.Error:
                    pass  # an agent a test has just killed
        return pids


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, RedisServer]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    m = LocalMesh(tmp_path_factory.mktemp("mpmesh"), heartbeat_s=0.5, lost_after_s=3.0)
    m.start()
    try:
        m.add_agent("mp-mqtt", "mqtt", workers=2, tags=["mp-mqtt"])
        m.add_agent("mp-zmq", "zmq", workers=2, tags=["mp-zmq"])
        m.add_agent("mp-zmq2", "zmq", workers=2, tags=["mp-zmq"])
        m.wait_online(timeout=90)
        yield m, redis
    finally:
        m.stop()
        redis.stop()


@pytest.fixture(scope="module", params=["redis", "hub-store"])
def env(request: pytest.FixtureRequest, mesh: tuple[LocalMesh, RedisServer]) -> Env:
    return Env(mesh[0], mesh[1], request.param)


def _field(out: str, key: str) -> list[str]:
    for line in out.splitlines():
        if line.startswith(key + " "):
            return line.split(" ", 1)[1].split()
    raise AssertionError(f"no {key!r} line in:\n{out}")


def test_pi_with_pool_map(env: Env, tmp_path: Path) -> None:
    out = env.run("pi.py", "5000", "12")
    pi = float(_field(out, "pi")[0])
    pids = {int(p) for p in _field(out, "pids")}
    # Pool tasks start at once: on a pool worker of an agent, or on an extra worker the agent
    # started for one of them and that ended with it (docs/multiprocessing.md, "Start"): both were
    # seen as the agents' children while the program ran
    assert pids <= env.seen_workers, "the samples were not computed by the agents' workers"
    assert int(_field(out, "cpus")[0]) == 6  # the fleet's capacity, 3 agents x 2 workers
    std = env.run("pi.py", "5000", "12", stdlib=True, tmp=tmp_path)
    assert pi == float(_field(std, "pi")[0])  # same seeds, same estimate as local processes
    assert abs(pi - 3.14159) < 0.05


def test_producer_consumer_with_queue_lock_event(env: Env) -> None:
    out = env.run("producer_consumer.py", "40")
    got, expected = _field(out, "sum")[0], _field(out, "sum")[2]
    assert got == expected
    assert _field(out, "consumed") == ["40"]
    assert _field(out, "producer") == ["done", "True"]
    assert "".join(_field(out, "exitcodes")) == "[0,0,0]"


def _hub_tasks(mesh: LocalMesh) -> dict[str, tuple[str, str]]:
    """Every task the hub holds: id -> (endpoint id, state)."""
    import sqlite3

    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return {r[0]: (r[1], r[2]) for r in db.execute("SELECT id, endpoint_id, state FROM tasks")}


def test_gridsearch_through_joblib_backend(env: Env) -> None:
    before = _hub_tasks(env.mesh)
    mesh = _field(env.run("gridsearch.py", "mesh"), "best")
    ran = {k: v for k, v in _hub_tasks(env.mesh).items() if k not in before}
    local = _field(env.run("gridsearch.py", "sequential"), "best")
    assert mesh == local
    # the fits ran as tasks on the agents (GridSearchCV's 6 candidates x 3 folds, in joblib's batches)
    assert ran, "GridSearchCV ran no task on the mesh"
    assert {ep for ep, _ in ran.values()} <= {a.endpoint_id for a in env.mesh.agents}
    assert {state for _, state in ran.values()} == {"done"}


def test_evolution_strategies_with_array_and_manager(env: Env, tmp_path: Path) -> None:
    out = env.run("evolution.py", "6")
    start, end = float(_field(out, "start")[0]), float(_field(out, "end")[0])
    assert end < start * 0.6
    std = env.run("evolution.py", "6", stdlib=True, tmp=tmp_path)
    assert abs(end - float(_field(std, "end")[0])) < 1e-9  # the same trajectory as local processes


def test_lithops_c_types_example(env: Env, tmp_path: Path) -> None:
    """Lithops' examples/multiprocessing/c_types.py (issue 28): an ``Array('i')`` reached through a
    global by a Process and a Pool, and ``Array('c', b'...')``, ``Value('c')``, ``RawArray('c')``
    as bytes; the same lines as the standard library prints."""
    out = env.run("c_types.py")
    assert out == env.run("c_types.py", stdlib=True, tmp=tmp_path)
    assert "bumped [37, 11, 14, 11, 15, 19]" in out and "word b'mesh' b'mesh' b'm' 4 b'a' b'\\x00\\x00\\x00'" in out
    assert "shouted b'MESH' b'ES' b'Z' b'M\\x00\\x00' b'M' 0" in out


# ------------------------------------------------------------------ the standard library's errors
def _pool_program(env: Env, tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    prog = tmp_path / "prog.py"
    prog.write_text("import threading\nfrom cloud_hub.client import multiprocessing\n"
                    "def sq(x):\n    return x * x\n"
                    "def boom(x):\n    return 1 / x\n"
                    "if __name__ == '__main__':\n" + "\n".join("    " + line for line in body.splitlines()) + "\n")
    return subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=120, env=env.env(), cwd=tmp_path)


def test_stdlib_errors(env: Env, tmp_path: Path) -> None:
    out = _pool_program(env, tmp_path, """
pool = multiprocessing.Pool(2)
print('apply', pool.apply(sq, (7,)))
print('starmap', pool.starmap(pow, [(2, 3), (3, 2)]))
print('imap', list(pool.imap(sq, range(4))))
print('unordered', sorted(pool.imap_unordered(sq, range(4))))
seen = []
r = pool.map_async(sq, [1, 2], callback=seen.append)  # the callback runs on a result thread
print('async', r.get(60))
print('callback', seen[0])
try:
    pool.map(boom, [1, 0])
except ZeroDivisionError as e:
    print('remote', type(e).__name__)
lock = threading.Lock()
try:
    pool.map(lambda x: lock, [1])
except TypeError as e:
    print('unpicklable', e)
bad = multiprocessing.Process(target=lambda: lock)
try:
    bad.start()
except TypeError as e:
    print('unpicklable-process', e, bad.pid, bad.exitcode)
pool.close()
try:
    pool.map(sq, [1])
except ValueError as e:
    print('closed', e)
pool.join()
p = multiprocessing.Process(target=boom, args=(0,))
p.start(); p.join(60)
print('exitcode', p.exitcode, p.is_alive())
""")
    assert out.returncode == 0, out.stderr
    lines = out.stdout
    assert "apply 49" in lines and "starmap [8, 9]" in lines and "imap [0, 1, 4, 9]" in lines and "unordered [0, 1, 4, 9]" in lines
    assert "callback [1, 4]" in lines and "async [1, 4]" in lines
    assert "remote ZeroDivisionError" in lines
    assert "unpicklable cannot pickle '_thread.lock' object" in lines
    assert "unpicklable-process cannot pickle '_thread.lock' object None None" in lines  # refused by start(), nothing submitted
    assert "closed Pool not running" in lines
    assert "exitcode 1 False" in lines and "ZeroDivisionError" in out.stderr  # the child's traceback, as the stdlib prints it


# ------------------------------------------------------------------ intermediate data (item 2)
import random  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

from cloud_hub.client import Client, Executor, refs  # noqa: E402

WORDS_PER_MAP, MAPS, REDUCERS = 20_000, 6, 3


def _words(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"word{rng.randrange(40_000)}" for _ in range(WORDS_PER_MAP)]


def _buckets(seed: int) -> list[dict[str, int]]:
    out: list[dict[str, int]] = [{} for _ in range(REDUCERS)]
    for w, c in Counter(_words(seed)).items():
        out[zlib.crc32(w.encode()) % REDUCERS][w] = c
    return out


def map_plain(seed: int) -> list[dict[str, int]]:
    return _buckets(seed)


def map_ref(seed: int, store: refs.Store) -> list[refs.MeshRef]:
    return [store.put(b) for b in _buckets(seed)]


def map_ref_shared(seed: int, store: refs.Store) -> list[refs.MeshRef]:
    return [store.put(b, tier="shared") for b in _buckets(seed)]


def reduce_plain(parts: list[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for p in parts:
        total.update(p)
    return dict(total)


def reduce_ref(parts: list[dict[str, int]], store: refs.Store) -> refs.MeshRef:
    return store.put(reduce_plain(parts))  # parts arrive resolved: the worker fetched them


class _Metered:
    """A Client that counts the HTTP bytes between this program and the hub."""

    def __init__(self, env: Env) -> None:
        self.client = Client(env.mesh.url, env.mesh.token)
        self.bytes = 0

        def req(r: Any) -> None:
            self.bytes += len(r.content or b"")

        def resp(r: Any) -> None:
            r.read()
            self.bytes += len(r.content or b"")

        self.client._http.event_hooks["request"].append(req)
        self.client._http.event_hooks["response"].append(resp)


def wordcount_via_sdk(env: Env) -> tuple[dict[str, int], int]:
    m = _Metered(env)
    with Executor(client=m.client, endpoint=[a.endpoint_id for a in env.mesh.agents], stream=False) as ex:  # HTTP: metered
        parts = [f.result(120) for f in [ex.submit(map_plain, s) for s in range(MAPS)]]
        out = [ex.submit(reduce_plain, [p[r] for p in parts]).result(120) for r in range(REDUCERS)]
    return {k: v for d in out for k, v in d.items()}, m.bytes


def wordcount_via_refs(env: Env) -> tuple[dict[str, int], int, int]:
    m = _Metered(env)
    store = refs.Store(env.store_url)
    with Executor(client=m.client, endpoint=[a.endpoint_id for a in env.mesh.agents], stream=False) as ex:  # HTTP: metered
        parts = [f.result(120) for f in [ex.submit(map_ref, s, store) for s in range(MAPS)]]
        outs = [f.result(120) for f in [ex.submit(reduce_ref, [p[r] for p in parts], store) for r in range(REDUCERS)]]
    sdk = m.bytes
    result = {k: v for ref in outs for k, v in refs.get(ref).items()}  # the one place the data comes here
    return result, sdk, sum(r.size for r in outs)


def test_wordcount_shuffle_through_refs_not_the_sdk(env: Env) -> None:
    expected = dict(Counter(w for s in range(MAPS) for w in _words(s)))
    plain, plain_bytes = wordcount_via_sdk(env)
    viaref, ref_bytes, fetched = wordcount_via_refs(env)
    assert plain == expected and viaref == expected
    # the shuffle (6 maps x 3 buckets of ~100 KB) went agent -> Redis -> agent; only refs crossed the hub
    assert ref_bytes * 20 < plain_bytes, (ref_bytes, plain_bytes)
    assert fetched > 0


def _fail_with(env: Env, fn: Any, *args: Any) -> BaseException:
    with Executor(client=Client(env.mesh.url, env.mesh.token), endpoint=env.mesh.agents[0].endpoint_id) as ex:
        exc = ex.submit(fn, *args).exception(120)
    assert exc is not None
    return exc


def test_missing_ref_names_its_producer(env: Env) -> None:
    store = refs.Store(env.store_url)
    with Executor(client=Client(env.mesh.url, env.mesh.token), endpoint=env.mesh.agents[1].endpoint_id) as ex:
        f = ex.submit(map_ref_shared, 1, store)
        made = f.result(120)
    assert made[0].producer == f"task {f.task_id}" and made[0].tier == "shared"
    refs.delete(made[0])
    exc = _fail_with(env, reduce_plain, [made[0]])
    assert isinstance(exc, refs.RefError) and f"put by task {f.task_id}" in str(exc) and "deleted or lost" in str(exc)
    with pytest.raises(refs.RefError, match="expired"):
        short = store.put("x", ttl_s=0.05)
        import time

        time.sleep(0.2)
        refs.get(short)


def test_ref_limits_refuse_and_store_nothing(env: Env) -> None:
    import redis as redis_lib

    r = redis_lib.Redis.from_url(env.store_url)
    store = refs.Store(env.store_url)
    before = r.dbsize()
    with pytest.raises(ValueError, match="over the ref size limit of 1000 bytes"):
        store.put(b"x" * 5000, max_bytes=1000)
    for bad in (0, -1, 8 * 86400, "1h"):
        with pytest.raises(ValueError, match="ttl_s must be"):
            store.put(1, ttl_s=bad)  # type: ignore[arg-type]
    assert r.dbsize() == before
    with pytest.raises(TypeError, match="MeshRef"):
        refs.get("mesh:ref:nope")  # type: ignore[arg-type]


# ------------------------------------------------------------------ failure semantics (item 3)
def test_queue_item_of_a_consumer_whose_task_is_not_run_again(env: Env, tmp_path: Path) -> None:
    """A consumer's worker SIGKILLed under a live agent fails its task (exit code 1), which the
    mesh does not run again: the item it got stays in that task's pending list (until the
    queue's reference count or expiry deletes it), and no other consumer receives it."""
    out = _pool_program(env, tmp_path, """
import os, signal
q, seen = multiprocessing.Queue(), multiprocessing.Queue()
for i in range(4):
    q.put(i)
def die_after_get(q, seen):
    seen.put(('killed', q.get()))
    os.kill(os.getpid(), signal.SIGKILL)
def drain(q, seen):
    while True:
        try:
            seen.put(('ok', q.get(timeout=1)))
        except Exception:
            return
p = multiprocessing.Process(target=die_after_get, args=(q, seen)); p.start(); p.join(120)
print('killed-exitcode', p.exitcode)
p2 = multiprocessing.Process(target=drain, args=(q, seen)); p2.start(); p2.join(120)
got = []
while not seen.empty():
    got.append(seen.get(timeout=5))
print('got', sorted(got))
import pickle, redis
print('pending', [pickle.loads(b) for b in redis.Redis.from_url(q._url).lrange(q._prefix + ':pending:' + p.pid, 1, -1)])
""")
    assert out.returncode == 0, out.stderr
    assert "killed-exitcode 1" in out.stdout
    assert "got [('killed', 0), ('ok', 1), ('ok', 2), ('ok', 3)]" in out.stdout
    assert "pending [0]" in out.stdout


# ------------------------------------------------------------------ endpoint selectors, in this process
@pytest.fixture
def mp_here(env: Env) -> Iterator[Any]:
    """``cloud_hub.client.multiprocessing`` configured in this process for ``env``'s mesh and store;
    ``configure(endpoint=...)`` picks the selector. The module's settings are put back after."""
    from cloud_hub.client import multiprocessing as mp
    from cloud_hub.client.multiprocessing import _runner, _state

    saved = dict(_state._settings)

    def configure(endpoint: Any) -> Any:
        mp.config(client=Client(env.mesh.url, env.mesh.token), redis_url=env.store_url, endpoint=endpoint)
        return mp

    try:
        yield configure
    finally:
        _runner.shutdown_executor()
        with _state._lock:
            _state._settings.clear()
            _state._settings.update(saved)


def where_am_i(x: int) -> tuple[int, str]:
    import os
    import time

    time.sleep(0.05)  # long enough that one endpoint does not take every chunk before the others start
    return x, os.environ["MESH_ENDPOINT_ID"]  # set by the agent for its workers (mesh_agent.datasets)


def record_endpoint(q: Any) -> None:
    import os

    q.put(os.environ["MESH_ENDPOINT_ID"])


def _ids(env: Env, *names: str) -> list[str]:
    by_name = {a.cfg.name: a.endpoint_id for a in env.mesh.agents}
    return [by_name[n] for n in names]


def test_cpu_count_counts_only_the_selected_endpoints(env: Env, mp_here: Any) -> None:
    assert mp_here("auto").cpu_count() == 6
    assert mp_here(_ids(env, "mp-mqtt")).cpu_count() == 2
    assert mp_here(_ids(env, "mp-mqtt", "mp-zmq2")).cpu_count() == 4
    assert mp_here(_ids(env, "mp-zmq")[0]).cpu_count() == 2
    assert mp_here({"tags": ["mp-zmq"]}).cpu_count() == 4
    # no endpoint carries the tag: the standard library's "cannot tell", never the whole fleet
    mp = mp_here({"tags": ["no-such-tag"]})
    with pytest.raises(NotImplementedError, match="no online endpoint matches"):
        mp.cpu_count()
    assert mp.Pool()._processes == 1  # a Pool still opens, as the stdlib's does with os.cpu_count() None
    from cloud_hub.client._joblib import MeshBackend

    assert MeshBackend().effective_n_jobs(-1) == 1  # joblib's n_jobs=-1 likewise
    mp_here({"tags": ["mp-zmq"]})
    assert MeshBackend().effective_n_jobs(-1) == 4


@pytest.mark.parametrize("selector", ["ids", "tags"])
def test_pool_and_process_run_only_on_the_selected_endpoints(env: Env, mp_here: Any, selector: str) -> None:
    chosen = set(_ids(env, "mp-zmq", "mp-zmq2"))  # tagged mp-zmq; mp-mqtt is left out either way
    mp = mp_here(sorted(chosen) if selector == "ids" else {"tags": ["mp-zmq"]})
    with mp.Pool() as pool:
        out = pool.map(where_am_i, range(24), chunksize=1)
    assert [x for x, _ in out] == list(range(24))
    assert {ep for _, ep in out} <= chosen, {ep for _, ep in out} - chosen
    q = mp.Queue()
    procs = [mp.Process(target=record_endpoint, args=(q,)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    got = {q.get(timeout=10) for _ in procs}
    assert got <= chosen, got - chosen


# ------------------------------------------------------------------ a consumer's agent SIGKILLed
def consume(q: Any, log: Any, gate: Any) -> None:
    """Log each item got; on the first run, after logging its third item the consumer waits on
    ``gate`` (where the test kills the agent), holding that item as done but not yet consumed."""
    import os
    import queue as _q

    log.put(("start", os.environ["MESH_ENDPOINT_ID"]))
    n = 0
    for _ in range(1000):
        try:
            item = q.get(timeout=2)
        except _q.Empty:
            return
        n += 1
        log.put(("item", item))
        if n == 3 and not gate.is_set():
            gate.wait(300)


def test_queue_when_the_consumers_agent_is_sigkilled(env: Env, mp_here: Any) -> None:
    """The Process task is stored on its agent, which re-runs it from the start (same task id)
    when it comes back. Queue delivery to a consumer in a task is at least once: the item the
    killed run held (it had got it, and even logged it) sat in that task's pending list, and the
    re-run's first ``get`` hands it out again before the rest; nothing is lost, and only that
    one item is processed twice."""
    import time

    import redis

    victim = next(a for a in env.mesh.agents if a.cfg.name == "mp-zmq2")
    mp = mp_here(victim.endpoint_id)
    q, log, gate = mp.Queue(), mp.Queue(), mp.Event()
    for i in range(10):
        q.put(i)
    p = mp.Process(target=consume, args=(q, log, gate))
    p.start()
    for _ in range(1200):  # the first run logged 0, 1 and 2, holds 2 and waits on the gate
        if q.qsize() == 7 and log.qsize() == 4:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the consumer did not reach the gate: {q.qsize()} items left, {log.qsize()} logged")
    assert p.is_alive()
    r = redis.Redis.from_url(env.store_url)
    held = r.keys(q._prefix + ":pending:*")
    assert len(held) == 1 and r.lrange(held[0], 1, -1) == [mp.queues.dumps(2)]  # 0 and 1 are consumed, 2 is in hand
    victim.kill()  # SIGKILL the agent and its workers, the consumer with them
    gate.set()
    victim.start()
    p.join(180)
    env.mesh.wait_online(victim, timeout=90)
    assert p.exitcode == 0
    entries = []
    while not log.empty():
        entries.append(log.get(timeout=5))
    assert entries[:4] == [("start", victim.endpoint_id), ("item", 0), ("item", 1), ("item", 2)]
    assert entries[4] == ("start", victim.endpoint_id)  # the same task, run again from the start
    assert entries[5:] == [("item", i) for i in range(2, 10)]  # 2 again, first: nothing lost, nothing else twice
    assert q.empty()
    assert r.keys(q._prefix + ":pending:*") == []  # the re-run ended normally: what it got is consumed
