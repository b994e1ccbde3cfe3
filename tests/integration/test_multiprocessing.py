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
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from tests.unit.test_mp_proxies import RedisServer

pytestmark = pytest.mark.integration

PROGRAMS = Path(__file__).resolve().parents[1] / "fixtures" / "mp_programs"
ROOT = Path(__file__).resolve().parents[2]


class Env:
    """One mesh, and where shared state lives: ``redis`` (a real redis-server, MESH_REDIS_URL) or
    ``hub-store`` (no Redis configured: the hub's embedded store, found through GET /v1/kv)."""

    def __init__(self, mesh: LocalMesh, redis: RedisServer, mode: str) -> None:
        self.mesh, self.redis, self.mode = mesh, redis, mode

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
            assert changed != text
            path = tmp / name
            path.write_text(changed)
        out = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=240, env=self.env(), cwd=tmp or ROOT)
        assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def worker_pids(self) -> set[int]:
        pids: set[int] = set()
        for a in self.mesh.agents:
            if a.proc is not None:
                pids |= {c.pid for c in psutil.Process(a.proc.pid).children(recursive=True)}
        return pids


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, RedisServer]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    m = LocalMesh(tmp_path_factory.mktemp("mpmesh"), heartbeat_s=0.5, lost_after_s=3.0)
    m.start()
    try:
        m.add_agent("mp-mqtt", "mqtt", workers=2)
        m.add_agent("mp-zmq", "zmq", workers=2)
        m.add_agent("mp-zmq2", "zmq", workers=2)
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
    assert pids <= env.worker_pids(), "the samples were not computed by the agents' workers"
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


def test_gridsearch_through_joblib_backend(env: Env) -> None:
    mesh = _field(env.run("gridsearch.py", "mesh"), "best")
    local = _field(env.run("gridsearch.py", "sequential"), "best")
    assert mesh == local


def test_evolution_strategies_with_array_and_manager(env: Env, tmp_path: Path) -> None:
    out = env.run("evolution.py", "6")
    start, end = float(_field(out, "start")[0]), float(_field(out, "end")[0])
    assert end < start * 0.6
    std = env.run("evolution.py", "6", stdlib=True, tmp=tmp_path)
    assert abs(end - float(_field(std, "end")[0])) < 1e-9  # the same trajectory as local processes


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
def test_queue_is_at_most_once_when_a_consumer_is_killed(env: Env, tmp_path: Path) -> None:
    """A consumer SIGKILLed right after ``get`` loses that item; nobody receives it twice."""
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
""")
    assert out.returncode == 0, out.stderr
    assert "killed-exitcode 1" in out.stdout
    assert "got [('killed', 0), ('ok', 1), ('ok', 2), ('ok', 3)]" in out.stdout
