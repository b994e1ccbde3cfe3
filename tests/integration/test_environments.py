"""Execution environments on a real LocalEngine: uv-built venvs from a local wheel (never PyPI),
shared and LRU-evicted venvs, failures that stick, warm pools per environment, and the bubblewrap
sandbox (docs/environments.md). Real processes, real uv, real bwrap; nothing faked."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from mesh_agent.engine import ENVIRONMENT_ERROR, LocalEngine
from mesh_agent.engine.environments import Environments
from mesh_agent.protocol.environment import env_id, normalize
from tests.fixtures.rootfs import MARKER, make_python_rootfs
from tests.fixtures.wheels import build_wheel
from tests.unit.test_engine_local import Collector, error, task, value, wait_until

pytestmark = pytest.mark.timeout(300)

# ---------------------------------------------------------------- task functions (module level)


def toy_version() -> tuple[str, str]:
    import meshtoy  # only in the environment's venv

    return meshtoy.VERSION, sys.prefix


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_then_read(path: str, text: str, pause_s: float) -> str:
    import time

    with open(path, "w") as f:
        f.write(text)
    time.sleep(pause_s)
    with open(path) as f:
        return f.read()


def write_file(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"x")
    return "connected"


def connect_unix(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
    return "connected"


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def whoami() -> int:
    return os.getpid()


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    d = tmp_path / "wheels"
    build_wheel(d, "meshtoy", "1.0")
    return d


def make_envs(tmp_path: Path, wheels: Path, **kw: Any) -> Environments:
    data = tmp_path / "agent-data"
    data.mkdir(exist_ok=True)
    return Environments(data / "envs", hidden=[data], no_index=True, find_links=[str(wheels)], **kw)


@pytest.fixture
async def started() -> AsyncIterator[list[LocalEngine]]:
    engines: list[LocalEngine] = []
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop(grace=1.0)


async def start(started: list[LocalEngine], sink: Collector, envs: Environments | None, **kw: Any) -> LocalEngine:
    eng = LocalEngine(sink, workers=kw.pop("workers", 2), memory_limit_mb=1024, environments=envs, **kw)
    await eng.start()
    started.append(eng)
    return eng


def with_env(t: Any, spec: dict[str, Any] | None) -> Any:
    t.env = normalize(spec)
    return t


# ---------------------------------------------------------------- venvs


async def test_pip_environment_runs_in_its_venv_and_equal_specs_share_it(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    eng.submit([with_env(task("a", toy_version), {"pip": ["meshtoy"], "env_vars": {"TOY_MODE": "x"}}),
                with_env(task("b", toy_version), {"pip": ["meshtoy>=1.0"]}),
                with_env(task("v", getenv, "TOY_MODE"), {"pip": ["meshtoy"], "env_vars": {"TOY_MODE": "x"}}),
                task("plain", toy_version)])
    res = {r.task_id: r for r in await sink.wait_for(4, timeout=180)}
    version_a, prefix_a = value(res["a"])
    version_b, prefix_b = value(res["b"])
    assert version_a == version_b == "1.0"
    # Two spellings that resolve alike share one venv, built once.
    assert prefix_a == prefix_b and prefix_a.startswith(str(envs.root / "venvs"))
    assert envs.stats.builds == 1 and len(envs.held()) == 1
    assert value(res["v"]) == "x"
    # The agent's own Python does not have the package: the venv is not leaking into default workers.
    assert error(res["plain"])["type"] == "builtins.ModuleNotFoundError"
    # Environment workers stay warm after their tasks. Which of the two specs still holds a slot
    # depends on completion order under load (a slot may have gone back and forth); eviction itself
    # is tested in test_environment_workers_evict_idle_ones_and_are_reaped_back.
    both = {env_id(normalize({"pip": ["meshtoy"], "env_vars": {"TOY_MODE": "x"}})), env_id(normalize({"pip": ["meshtoy>=1.0"]}))}
    assert set(eng.warm_environments()) and set(eng.warm_environments()) <= both
    # A new agent (restart) finds the venv on disk: no resolve, no build.
    again = make_envs(tmp_path, wheels)
    kind = await again.kind(normalize({"pip": ["meshtoy"]}))
    assert kind.venv == envs.held()[0] and again.stats.builds == 0 and again.stats.resolves == 0


async def test_unresolvable_requirement_fails_naming_it_and_is_not_rebuilt(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    bad = {"pip": ["meshtoy", "nosuchpkg-xyz>=2"]}
    eng.submit([with_env(task(f"bad{i}", toy_version), bad) for i in range(3)])
    first = await sink.wait_for(3, timeout=120)
    for r in first:
        err = error(r)
        assert err["type"] == ENVIRONMENT_ERROR
        assert "nosuchpkg-xyz" in err["message"] and "cannot be installed" in err["message"]
    resolves = envs.stats.resolves
    # Later tasks with the same spec fail at once, without another resolve or build...
    eng.submit([with_env(task("bad-again", toy_version), bad)])
    await sink.wait_for(4, timeout=30)
    assert error(sink.by_id()["bad-again"])["type"] == ENVIRONMENT_ERROR
    assert envs.stats.resolves == resolves and envs.stats.builds == 0 and envs.stats.refused >= 1
    # ...even after a restart (the failure is remembered on disk)...
    assert env_id(normalize(bad)) in make_envs(tmp_path, wheels).failed
    # ...while a changed spec is tried, and the engine serves everything else meanwhile.
    eng.submit([with_env(task("fixed", toy_version), {"pip": ["meshtoy"]}), task("plain", whoami)])
    await sink.wait_for(6, timeout=120)
    assert value(sink.by_id()["fixed"])[0] == "1.0"
    assert sink.by_id()["plain"].ok
    assert not list((envs.root / "venvs").glob("*")) or len(envs.held()) == 1  # no half-built venv left behind


async def test_lru_eviction_within_the_disk_budget(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    for version in ("1.0", "2.0"):  # 600 KB each: one venv fits the 1 MB budget, two do not
        build_wheel(wheels, "meshtoy", version, padding=600_000)
    sink = Collector()
    envs = make_envs(tmp_path, wheels, disk_budget_mb=1)
    eng = await start(started, sink, envs, env_idle_s=0.0)  # environment workers are reaped as soon as idle
    eng.submit([with_env(task("v1", toy_version), {"pip": ["meshtoy==1.0"]})])
    await sink.wait_for(1, timeout=120)
    first = envs.held()
    assert len(first) == 1
    await wait_until(lambda: "" in eng.warm_environments() and len(eng.warm_environments()) == 1, timeout=30)
    eng.submit([with_env(task("v2", toy_version), {"pip": ["meshtoy==2.0"]})])
    await sink.wait_for(2, timeout=120)
    assert value(sink.by_id()["v2"])[0] == "2.0"
    held = envs.held()
    assert len(held) == 1 and held != first and envs.stats.evicted == 1
    assert not (envs.root / "venvs" / first[0]).exists()
    # The evicted environment is built again when it is next used.
    await wait_until(lambda: len(eng.warm_environments()) == 1, timeout=30)
    eng.submit([with_env(task("v1-again", toy_version), {"pip": ["meshtoy==1.0"]})])
    await sink.wait_for(3, timeout=120)
    assert value(sink.by_id()["v1-again"])[0] == "1.0" and envs.stats.builds == 3


async def test_environment_workers_evict_idle_ones_and_are_reaped_back(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """One slot, a warm default pool: an environment's task takes the idle default worker's
    slot, stays warm for env_idle_s, then the default worker is prewarmed back."""
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels), workers=1, env_idle_s=1.0)
    assert eng.warm_environments() == {"": 1}
    eng.submit([with_env(task("e1", whoami), {"env_vars": {"A": "1"}})])
    await sink.wait_for(1, timeout=60)
    assert eng.stats["workers_evicted"] == 1
    eng.submit([with_env(task("e2", whoami), {"env_vars": {"A": "1"}})])
    await sink.wait_for(2, timeout=60)
    assert value(sink.by_id()["e1"]) == value(sink.by_id()["e2"])  # kept warm: same worker
    await wait_until(lambda: eng.warm_environments() == {"": 1} and eng.worker_pids, timeout=30)
    assert eng.stats["workers_reaped"] >= 1
    eng.submit([task("d", whoami)])
    await sink.wait_for(3, timeout=60)
    assert sink.by_id()["d"].ok


async def test_engine_without_environments_refuses_clearly(started: list[LocalEngine]) -> None:
    sink = Collector()
    eng = await start(started, sink, None)
    eng.submit([with_env(task("x", whoami), {"pip": ["meshtoy"]}), task("y", whoami)])
    await sink.wait_for(2, timeout=60)
    err = error(sink.by_id()["x"])
    assert err["type"] == ENVIRONMENT_ERROR and "no environments configured" in err["message"]
    assert sink.by_id()["y"].ok


# ---------------------------------------------------------------- sandbox


@pytest.fixture
def listener() -> Any:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def var_tmp() -> Any:
    """A directory outside /tmp (the sandbox's /tmp is its own tmpfs, which would hide a path there anyway)."""
    d = Path(tempfile.mkdtemp(prefix="mesh-envtest-", dir="/var/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_sandboxed_function_cannot_read_keys_write_outside_scratch_or_open_sockets(
        var_tmp: Path, wheels: Path, started: list[LocalEngine], listener: socket.socket) -> None:
    sink = Collector()
    envs = make_envs(var_tmp, wheels)
    data = var_tmp / "agent-data"
    key = data / "credentials.json"
    key.write_text('{"key": "secret"}')
    outside = var_tmp / "outside.txt"
    port = listener.getsockname()[1]
    unix_path = str(var_tmp / "service.sock")  # a Unix socket on the (read-only) filesystem: a database's, say
    unix_srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_srv.bind(unix_path)
    unix_srv.listen(4)
    eng = await start(started, sink, envs)
    sandbox = {"sandbox": True}
    eng.submit([
        task("control-read", read_file, str(key)),  # unsandboxed: the agent's own kind can (the test's baseline)
        with_env(task("key", read_file, str(key)), sandbox),
        with_env(task("write", write_file, str(outside), "x"), sandbox),
        with_env(task("scratch", write_file, "/tmp/ok.txt", "x"), sandbox),
        with_env(task("socket", connect, port), sandbox),
        with_env(task("socket-granted", connect, port), {"sandbox": True, "network": True}),
        with_env(task("venv-in-sandbox", toy_version), {"sandbox": True, "pip": ["meshtoy"]}),
        with_env(task("unix", connect_unix, unix_path), sandbox),
        with_env(task("unix-granted", connect_unix, unix_path), {"sandbox": True, "network": True}),
    ])
    res = {r.task_id: r for r in await sink.wait_for(9, timeout=180)}
    unix_srv.close()
    e = error(res["unix"])  # the network namespace does not cover socket files: the seccomp filter does
    assert e["type"] == "builtins.PermissionError" and "Operation not permitted" in e["message"]
    # Granting the network grants TCP/UDP, not the host's filesystem: the socket file is not in the sandbox at all.
    e = error(res["unix-granted"])
    assert e["type"] == "builtins.FileNotFoundError", e
    assert value(res["control-read"]) == '{"key": "secret"}'
    e = error(res["key"])
    assert e["type"] == "builtins.FileNotFoundError" and str(key) in e["message"]
    e = error(res["write"])  # default-deny: the host's /var/tmp is not there to write to
    assert e["type"] == "builtins.FileNotFoundError" and "No such file or directory" in e["message"], e
    assert not outside.exists()
    assert value(res["scratch"]) == "/tmp/ok.txt"  # its scratch space is writable
    e = error(res["socket"])
    # Its own network namespace: only its own loopback, where nothing listens; the host's port is out of reach.
    assert e["type"] == "builtins.ConnectionRefusedError" and "Connection refused" in e["message"]
    assert value(res["socket-granted"]) == "connected"
    conn, _ = listener.accept()  # exactly one connection reached the host: the granted one
    conn.close()
    with pytest.raises(socket.timeout):
        listener.accept()
    assert value(res["venv-in-sandbox"])[0] == "1.0"
    # The agent is untouched: its key is intact and it keeps serving, sandboxed or not.
    assert key.read_text() == '{"key": "secret"}'
    eng.submit([task("after", whoami), with_env(task("after-sbx", whoami), sandbox)])
    await sink.wait_for(11, timeout=60)
    assert sink.by_id()["after"].ok and sink.by_id()["after-sbx"].ok


async def test_scratch_is_private_per_sandbox(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels))
    marker = f"/tmp/mesh-scratch-{os.getpid()}.txt"
    eng.submit([with_env(task("w", write_file, marker, "inside"), {"sandbox": True})])
    await sink.wait_for(1, timeout=60)
    assert value(sink.by_id()["w"]) == marker
    assert not Path(marker).exists()  # the sandbox's /tmp is its own tmpfs


# ---------------------------------------------------------------- containers


async def test_missing_container_image_fails_naming_it(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    image = str(tmp_path / "no-such-image.sif")
    eng.submit([with_env(task("c", whoami), {"container": image}), with_env(task("c2", whoami), {"container": image})])
    await sink.wait_for(2, timeout=60)
    for r in sink.results:
        e = error(r)
        assert e["type"] == ENVIRONMENT_ERROR and image in e["message"] and "not found" in e["message"]
    assert envs.stats.failures == 1  # the second task did not try again


def _agent_packages() -> list[Path]:
    from mesh_agent.engine.environments import _container_binds

    return [Path(p) for p in _container_binds()[1]]


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """The test image: a rootfs directory with this machine's Python (tests/fixtures/rootfs.py).
    Not the host's root: the agent refuses that (it holds the agent's keys)."""
    return make_python_rootfs(tmp_path / "image-rootfs", _agent_packages())


def test_the_test_rootfs_starts_python_and_loads_the_worker_under_bwrap(rootfs: Path) -> None:
    """The image the container test uses is sound where no container runtime runs (here): under
    bubblewrap, as its root, its python3 reports its import path and, with the binds a container
    worker gets, imports the worker bootstrap, the serializers and this module. So a probe failure
    of a real runtime on that image is the runtime's, which is what the container test skips on."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    import subprocess

    from mesh_agent.engine.environments import _PATH_PROBE, _bootstrap_dirs, _container_binds, _probed_path

    binds, pkgs = _container_binds()
    argv = ["bwrap", "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--unshare-net"]
    for b in binds:
        argv += ["--ro-bind", b, b]
    out = subprocess.run([*argv, "python3", "-c", _PATH_PROBE], capture_output=True, text=True, timeout=120)
    image_path = _probed_path(out.stdout + out.stderr)
    assert image_path and not any("site-packages" in p for p in image_path)  # the image's own stdlib only
    path = [*_bootstrap_dirs(), *image_path, *pkgs]
    code = (f"import sys;sys.path[:]={path!r};import mesh_agent.engine._worker, cloudpickle, dill, "
            f"tests.integration.test_environments;print(open({MARKER!r}).read())")
    done = subprocess.run([*argv, "python3", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "inside the test rootfs" in done.stdout, done.stderr[-2000:]


async def test_container_runs_where_a_runtime_works(tmp_path: Path, wheels: Path, started: list[LocalEngine], rootfs: Path) -> None:
    """Runs a worker in a staged rootfs image with Apptainer, Singularity or podman where one is
    installed. It skips only where no runtime is installed, or where the runtime itself cannot
    start (the agent's start-up probe fails the spec, quoting the runtime); any other wrong result
    fails."""
    runtime = next((r for r in ("apptainer", "singularity", "podman") if shutil.which(r)), None)
    if runtime is None:
        pytest.skip("no container runtime installed (apptainer, singularity, podman): container path not exercised here")
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    image = str(rootfs)  # staged here: nothing is pulled (tests stay on this machine)
    eng.submit([with_env(task("c", read_file, MARKER), {"container": image, "env_vars": {"STAGE": "c"}}),
                with_env(task("v", getenv, "STAGE"), {"container": image, "env_vars": {"STAGE": "c"}})])
    await sink.wait_for(2, timeout=240)
    res = sink.by_id()
    if not res["c"].ok:
        e = error(res["c"])
        probe = f"container image {image!r} cannot start on this endpoint: "
        if e["type"] == ENVIRONMENT_ERROR and e["message"].startswith(probe):
            pytest.skip(f"{runtime} cannot start a container here: {e['message'][len(probe):]}")
        pytest.fail(f"container task failed after the runtime started: {e['type']}: {e['message']}")
    assert value(res["c"]) == "inside the test rootfs\n"  # it ran in the image, not on the host
    assert value(res["v"]) == "c"  # the spec's variables reach the worker through the runtime's clean environment
    assert env_id(normalize({"container": image, "env_vars": {"STAGE": "c"}})) in envs.held_specs()  # staged: no pull


async def test_the_hosts_root_or_the_agents_keys_as_image_are_refused(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """A rootfs image that is / or holds the agent's data directory would give the function the
    agent's keys: refused before any runtime is looked for, for every task, naming why."""
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    key_dir = tmp_path / "agent-data"
    link = tmp_path / "root-link"
    link.symlink_to("/")
    eng.submit([with_env(task("root", whoami), {"container": "/"}),
                with_env(task("link", whoami), {"container": str(link)}),
                with_env(task("above", whoami), {"container": str(tmp_path), "sandbox": True})])
    res = {r.task_id: error(r) for r in await sink.wait_for(3, timeout=60)}
    for tid in ("root", "link"):
        assert res[tid]["type"] == ENVIRONMENT_ERROR and "is the host's root directory" in res[tid]["message"]
    assert "contains the agent's data or credentials directory" in res["above"]["message"]
    assert str(key_dir) in res["above"]["message"]
    assert envs.held_specs() == []  # refused images are not reported as held


async def test_staged_container_images_are_reported_held_until_they_fail_or_go(tmp_path: Path, wheels: Path) -> None:
    """Heartbeat ``envs``: a container spec whose image is staged here is held (no pull), unless
    the spec failed here; it survives a restart and stops being reported when the image is gone."""
    image = tmp_path / "staged-rootfs"
    image.mkdir()
    missing_runtime = str(tmp_path / "bin" / "podman")  # not installed: the probe fails in the OS's words
    envs = make_envs(tmp_path, wheels, container_runtime=missing_runtime)
    spec = normalize({"container": str(image)})
    sid = env_id(spec)
    with pytest.raises(Exception, match="cannot start on this endpoint"):
        await envs.kind(spec)
    assert sid not in envs.held_specs()  # it failed here: attracting its tasks would be wrong
    envs.forget_failure(sid)  # the operator installed the runtime
    assert envs.held_specs() == [sid]
    # what the agent's heartbeat reports (Agent._held_envs reads the engine's held_environments)
    assert LocalEngine(Collector(), workers=1, environments=envs).held_environments() == [sid]
    again = make_envs(tmp_path, wheels)  # a restart reads index.json
    assert again.held_specs() == [sid]
    image.rmdir()
    assert again.held_specs() == []  # the image was removed: a task would need it staged again


async def test_builds_report_their_seconds_and_fetched_bytes(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    build_wheel(wheels, "meshtoy", "3.0", padding=300_000)
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    eng.submit([with_env(task("b", toy_version), {"pip": ["meshtoy==3.0"]})])
    await sink.wait_for(1, timeout=120)
    sid = env_id(normalize({"pip": ["meshtoy==3.0"]}))
    seconds, fetched = eng.environment_builds()[sid]
    assert 0 < seconds < 120 and fetched >= 300_000  # the padded wheel landed in uv's cache
    assert eng.held_environments() == [sid]
    # a cached venv is no build: nothing new to report
    again = make_envs(tmp_path, wheels)
    await again.kind(normalize({"pip": ["meshtoy==3.0"]}))
    assert again.builds == {}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_sandboxed_workers_are_never_shared_between_tenants(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels), workers=2)
    # Each task writes its tenant's name to the same path, waits while the other tenant's tasks
    # write theirs, and reads it back: a /tmp shared across tenants would show the other name.
    # (Write and read in one task: a tenant may get a second worker, with a /tmp of its own.)
    eng.submit([with_env(task(f"{t}{i}", write_then_read, "/tmp/mine.txt", t, 0.5), {"sandbox": True, "tenant": t})
                for i in range(2) for t in ("alice", "bob")])
    await sink.wait_for(4, timeout=120)
    res = sink.by_id()
    pids = {t: {res[f"{t}{i}"].worker_pid for i in range(2)} for t in ("alice", "bob")}
    assert not pids["alice"] & pids["bob"]  # different processes (each tenant its own kind)
    assert all(value(res[f"{t}{i}"]) == t for i in range(2) for t in ("alice", "bob"))  # and its own /tmp


async def test_prewarmed_environment_is_built_at_start_and_kept_warm(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """OpenWhisk's prewarm: a configured environment is built at start and one worker of it
    waits; the first task runs on it with no build, and it outlives the keep-warm time."""
    spec = normalize({"pip": ["meshtoy"]})
    sid = env_id(spec)
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs, workers=2, env_idle_s=0.5, prewarm=[spec])
    await wait_until(lambda: sid in eng.warm_environments() and len(eng.worker_pids) == 2, timeout=120)
    prewarmed = {w.pid for w in eng._workers if w.kind.key == sid}
    builds = envs.stats.builds
    eng.submit([with_env(task("p", toy_version), {"pip": ["meshtoy"]})])
    await sink.wait_for(1, timeout=60)
    assert value(sink.by_id()["p"])[0] == "1.0" and sink.by_id()["p"].worker_pid in prewarmed
    assert envs.stats.builds == builds  # no build on the task's path
    await asyncio.sleep(2.0)  # past keep_warm_s: an ordinary environment worker would be reaped by now
    assert {w.pid for w in eng._workers if w.kind.key == sid} == prewarmed


def test_prewarm_config_is_checked() -> None:
    from mesh_agent.config import EnvironmentsSettings

    assert EnvironmentsSettings(prewarm=[{"uv": ["numpy"]}, {}]).prewarm == [{"pip": ["numpy"]}]
    with pytest.raises(ValueError, match=r"prewarm\[0\]: environment.pip\[0\]"):
        EnvironmentsSettings(prewarm=[{"pip": ["--index-url=x"]}])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
async def test_sandboxed_workers_do_not_inherit_the_agents_environment(tmp_path: Path, wheels: Path, started: list[LocalEngine],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent may hold secrets in its environment (an enrollment token on first boot): a
    sandboxed worker starts from a short allow-list plus the spec's own variables."""
    monkeypatch.setenv("MESH_ENROLL_TOKEN", "et_secret")
    monkeypatch.setenv("MESH_ENDPOINT_ID", "ep-test")
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels))
    eng.submit([task("plain", getenv, "MESH_ENROLL_TOKEN"),
                with_env(task("sbx", getenv, "MESH_ENROLL_TOKEN"), {"sandbox": True}),
                with_env(task("sbx-id", getenv, "MESH_ENDPOINT_ID"), {"sandbox": True}),
                with_env(task("sbx-var", getenv, "MODE"), {"sandbox": True, "env_vars": {"MODE": "x"}}),
                with_env(task("sbx-home", getenv, "HOME"), {"sandbox": True})])
    await sink.wait_for(5, timeout=120)
    res = sink.by_id()
    assert value(res["plain"]) == "et_secret"  # the owner's own workers: as before
    assert value(res["sbx"]) is None
    assert value(res["sbx-id"]) == "ep-test" and value(res["sbx-var"]) == "x" and value(res["sbx-home"]) == "/tmp"


async def test_lru_follows_use_not_build_order(tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """Two venvs fit the budget, a third does not: the one evicted is the one whose tasks ran
    longest ago, even though it was built last."""
    for version in ("1.0", "2.0", "3.0"):
        build_wheel(wheels, "meshtoy", version, padding=400_000)
    sink = Collector()
    envs = make_envs(tmp_path, wheels, disk_budget_mb=1)  # each venv ~0.5 MB: two fit, three do not
    eng = await start(started, sink, envs, env_idle_s=0.0)
    n = 0
    for version in ("1.0", "2.0", "1.0"):  # 1.0 built first, but used last
        eng.submit([with_env(task(f"t{n}", toy_version), {"pip": [f"meshtoy=={version}"]})])
        n += 1
        await sink.wait_for(n, timeout=120)
        await wait_until(lambda: len(eng.warm_environments()) == 1, timeout=30)  # env workers reaped: not in use
    eng.submit([with_env(task(f"t{n}", toy_version), {"pip": ["meshtoy==3.0"]})])
    await sink.wait_for(n + 1, timeout=120)
    pins = sorted(p for k in envs.held() for p in envs._venvs[k].pins)
    assert pins == ["meshtoy==1.0", "meshtoy==3.0"], pins  # 2.0 went: least recently used


async def test_environment_whose_workers_cannot_start_fails_its_tasks_without_a_respawn_loop(
        tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """A venv whose interpreter dies at start-up (here a package's .pth file exits): after a few
    tries its tasks fail with a clear error, the spec is remembered as failed, the rest runs on."""
    build_wheel(wheels, "brokenstart", "1.0", files={"brokenstart/__init__.py": "", "brokenstart.pth": "import os; os._exit(3)\n"})
    sink = Collector()
    envs = make_envs(tmp_path, wheels)
    eng = await start(started, sink, envs)
    bad = {"pip": ["brokenstart"]}
    eng.submit([with_env(task(f"b{i}", whoami), bad) for i in range(3)] + [task("plain", whoami)])
    await sink.wait_for(4, timeout=120)
    for i in range(3):
        e = error(sink.by_id()[f"b{i}"])
        assert e["type"] == ENVIRONMENT_ERROR and "cannot start on this endpoint" in e["message"] and "exit" in e["message"]
    assert sink.by_id()["plain"].ok
    spawned = eng.stats["workers_spawned"]
    eng.submit([with_env(task("b-again", whoami), bad)])  # remembered: fails at once, no new worker
    await sink.wait_for(5, timeout=30)
    assert error(sink.by_id()["b-again"])["type"] == ENVIRONMENT_ERROR and eng.stats["workers_spawned"] == spawned
    assert env_id(normalize(bad)) in envs.failed


# ---------------------------------------------------------------- builds of another user's packages


def _write_sdist(out: Path, name: str, marker: Path) -> Path:
    """An sdist whose in-tree build backend (no build requirements, so it runs offline) writes
    ``marker`` the moment a build frontend asks it anything: proof of code run at build time."""
    import io
    import tarfile

    backend = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('built by the backend')\n"
               "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
               "def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):\n    raise RuntimeError('no')\n")
    files = {
        "pyproject.toml": f'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
                          f'[project]\nname = "{name}"\nversion = "1.0"\n',
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        "backend.py": backend,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-1.0/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


async def test_another_users_sdist_is_never_built_outside_the_sandbox(tmp_path: Path, wheels: Path,
                                                                      started: list[LocalEngine]) -> None:
    marker = tmp_path / "backend-ran"
    _write_sdist(wheels, "sdistonly", marker)
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels))
    eng.submit([with_env(task("tenant", whoami), {"pip": ["sdistonly"], "sandbox": True, "tenant": "bob"}),
                with_env(task("tenant-wheel", toy_version), {"pip": ["meshtoy"], "sandbox": True, "tenant": "bob"})])
    res = {r.task_id: r for r in await sink.wait_for(2, timeout=180)}
    e = error(res["tenant"])
    assert e["type"] == ENVIRONMENT_ERROR and "sdistonly" in e["message"] and "wheels only" in e["message"], e
    assert not marker.exists()  # the backend never ran: nothing of the tenant's executed as the agent
    assert value(res["tenant-wheel"])[0] == "1.0"  # a package with a wheel installs as before
    # The attack is real: the owner's own spec (no wheels-only rule) does run the backend, as the agent.
    eng.submit([with_env(task("owner", whoami), {"pip": ["sdistonly"]})])
    await sink.wait_for(3, timeout=180)
    assert marker.exists()


async def test_a_sandbox_that_cannot_start_fails_its_tasks_and_is_tried_again_after_a_restart(
        tmp_path: Path, wheels: Path, started: list[LocalEngine]) -> None:
    """A deployment that forbids the sandbox (here: a bwrap that always fails) fails the tenant's
    tasks with bubblewrap's words and never runs them unsandboxed; once fixed, a restarted agent
    tries again without `mesh-agent envs forget`."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    sink = Collector()
    envs = make_envs(tmp_path, wheels, bwrap=str(fake))
    eng = await start(started, sink, envs)
    spec = {"sandbox": True, "tenant": "bob"}
    eng.submit([with_env(task("t", whoami), spec)])
    e = error((await sink.wait_for(1, timeout=60))[0])
    assert e["type"] == ENVIRONMENT_ERROR and "No permissions to create new namespace" in e["message"]
    if shutil.which("bwrap") is None:
        return
    again = make_envs(tmp_path, wheels)  # the same data dir, a working bubblewrap: an agent restarted after the fix
    assert env_id(normalize(spec)) not in again.failed
    eng2 = await start(started, sink, again)
    eng2.submit([with_env(task("t2", whoami), spec)])
    await sink.wait_for(2, timeout=60)
    assert sink.by_id()["t2"].ok


async def test_another_users_task_gets_no_network_unless_the_owner_allows_it(tmp_path: Path, wheels: Path,
                                                                            started: list[LocalEngine]) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sink = Collector()
    eng = await start(started, sink, make_envs(tmp_path, wheels))
    eng.submit([with_env(task("t", whoami), {"sandbox": True, "network": True, "tenant": "bob"}),
                with_env(task("own", whoami), {"sandbox": True, "network": True})])
    res = {r.task_id: r for r in await sink.wait_for(2, timeout=60)}
    e = error(res["t"])
    assert e["type"] == ENVIRONMENT_ERROR and "tenant_network" in e["message"] and "loopback" in e["message"]
    assert res["own"].ok  # the owner's own sandboxed task may have the network
    (tmp_path / "b").mkdir()
    allowed = await start(started, sink, make_envs(tmp_path / "b", wheels, tenant_network=True))
    allowed.submit([with_env(task("t2", whoami), {"sandbox": True, "network": True, "tenant": "bob"})])
    await sink.wait_for(3, timeout=60)
    assert sink.by_id()["t2"].ok
