"""An attacker's view of a shared endpoint (issue 25, DESIGN.md invariant 5, docs/environments.md
"The sandbox", docs/security.md).

One real LocalMesh per parameter (real Mosquitto, real hub, a real ``mesh-agent start`` process):
user A (the hub's bootstrap user ``demo``) enrolls the agent and shares it with users B and C, whose
tasks the hub forces into the sandbox. The agent runs

* ``root``: as this machine's tests do (uid 0, every capability), with the project's venv Python;
* ``nobody``: as uid/gid 65534 through ``setpriv --reuid=65534 --regid=65534 --clear-groups``, with
  ``/usr/bin/python3.11`` and the venv's packages on ``PYTHONPATH`` (the venv's own interpreter lives
  under /root, which uid 65534 cannot reach), data directory and key owned by 65534.

Every attack is a function B (or C) submits; it returns a dict of what it observed inside and the
test asserts on that. After every test (fixture ``shared``'s teardown) the agent must be alive, its
key and config unchanged, and a task of the owner must still run: a teardown error means the attack
harmed the endpoint itself (the agent is restarted so later tests still run).

Work directories live under /var/tmp, not /tmp: the sandbox's /tmp is its own, which would hide
them for the wrong reason. ``MESH_SEC_KEEP=1`` keeps them (agent logs, markers) after the run.

Run (needs mosquitto, bwrap, gcc for the native attacks; the ``nobody`` half needs a root test
process, setpriv and /usr/bin/python3.11, else it skips):

    .venv/bin/python -m pytest tests/security -p no:cacheprovider -q -rA --timeout 600
    .venv/bin/python -m pytest tests/security -k agent-as-root        # one half

About 3 minutes for both halves on 2 cores. A failing test names what the attack reached; an
ERROR at teardown means the attack harmed the endpoint itself (agent died, key changed, owner's
task no longer runs).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from cloud_hub.store import SqliteStore
from tests.fixtures.wheels import build_wheel
from tests.security.packages import (
    build_binary_wheel,
    build_hostile_sdist,
    compile_audit_library,
)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3.11"
#: the engine's memory_limit_mb on the shared endpoint (test_limits tries to exceed it)
MEMORY_LIMIT_MB = 512
#: the agent's own per-task timeout; attacks that may hang pass a shorter one
TASK_TIMEOUT_S = 90.0
WORKERS = 4
#: a user other than the owner whose value B may never see: put in the agent's environment
AGENT_ENV_SECRETS = {"MESH_ENROLL_TOKEN": "ce_agent-env-secret-1", "CM_SECRET_TOKEN": "cm_agent-env-secret-2"}


def _new_user_token(m: LocalMesh, name: str) -> str:
    """An API token of a new user ``name`` of the mesh's hub (written in its database)."""

    async def mint() -> str:
        store = await SqliteStore(m.hub_cfg.db_path).open()
        try:
            return await store.create_api_token(await store.create_user(name), "test")
        finally:
            await store.close()

    return asyncio.run(mint())


class AgentAs(AgentProcess):
    """``mesh-agent start`` with a command prefix (setpriv), its own interpreter and environment.
    LocalMesh's AgentProcess always runs ``sys.executable`` with the test's environment."""

    def __init__(self, base: AgentProcess, prefix: list[str], python: str, env: dict[str, str]) -> None:
        super().__init__(base.cfg, base.config_path, base.log_path)
        self.prefix, self.python, self.env = prefix, python, env

    def start(self) -> AgentAs:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed here after the fork
        self.proc = subprocess.Popen(
            [*self.prefix, self.python, "-m", "mesh_agent.cli", "start", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=str(REPO),
        )
        log.close()
        return self


@dataclass
class Outcome:
    """What became of one submitted attack: its value, or the error it ended with, or no answer."""

    ok: bool
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False

    def describe(self) -> str:
        if self.ok:
            return f"returned {self.value!r}"[:3000]
        if self.timed_out:
            return "no result within the test's wait"
        return f"failed: {type(self.error).__name__}: {self.error}"[:3000]

    def expect(self) -> Any:
        """The attack's observations; the test fails (naming why) if it did not return any."""
        if not self.ok:
            pytest.fail(f"the attack did not report back, so nothing was checked: {self.describe()}")
        return self.value


def _file_state(p: Path) -> tuple[str, int, int, int]:
    st = p.stat()
    return hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode, st.st_uid, st.st_gid


def owner_probe(key_file: str) -> dict[str, Any]:
    """The owner's own task (unsandboxed): reads the agent's key and starts a process."""
    import os
    import subprocess

    with open(key_file) as f:
        key = f.read()
    subprocess.run(["true"], check=True, timeout=30)
    return {"key": key, "uid": os.getuid()}


@dataclass
class SharedEndpoint:
    """The mesh, the agent owned by A and shared with B and C, and what the attacks need to know."""

    user: str  # "root" or "nobody": whom the agent runs as
    mesh: LocalMesh
    agent: AgentAs
    clients: dict[str, Client]
    workdir: Path
    markers: Path
    helper: bytes | None
    runtime_paths: list[str]  # what a sandboxed worker legitimately needs to see (interpreter, venv, code)
    build_marker: Path
    audit_marker: Path
    audit_library: bytes | None
    key_text: str
    file_states: dict[Path, tuple[str, int, int, int]] = field(default_factory=dict)
    deaths: list[str] = field(default_factory=list)

    # ------------------------------------------------------------ facts about the endpoint
    @property
    def ep(self) -> str:
        return self.agent.endpoint_id

    @property
    def agent_pid(self) -> int:
        assert self.agent.proc is not None
        return self.agent.proc.pid

    @property
    def key_file(self) -> Path:
        return Path(self.agent.cfg.credentials_file)

    @property
    def data_dir(self) -> Path:
        return Path(self.agent.cfg.data_dir)

    @property
    def config_file(self) -> Path:
        return self.agent.config_path

    @property
    def key_hex(self) -> str:
        import json

        return json.loads(self.key_text)["key"]

    def marker(self, name: str) -> Path:
        """A host path the agent's user could write: it exists afterwards only if code ran on the host."""
        p = self.markers / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
        p.unlink(missing_ok=True)
        return p

    def log_text(self) -> str:
        return self.agent.log_path.read_text(errors="replace")

    def agent_status(self, field_name: str) -> int:
        """A ``VmRSS``/``VmHWM``-style field of the agent process's /proc status, in kB."""
        for line in Path(f"/proc/{self.agent_pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
        raise KeyError(field_name)

    # ------------------------------------------------------------ running tasks
    def submit(self, who: str, fn: Callable[..., Any], *args: Any, task_timeout_s: float | None = None,
               ttl_s: float | None = None, environment: dict[str, Any] | None = None) -> tuple[Executor, Any]:
        ex = Executor(self.clients[who], endpoint=self.ep, task_timeout_s=task_timeout_s, task_ttl_s=ttl_s)
        kw = {"environment": environment} if environment else {}
        return ex, ex.submit(fn, *args, **kw)

    @staticmethod
    def wait(ex: Executor, fut: Any, timeout: float) -> Outcome:
        try:
            return Outcome(True, fut.result(timeout=timeout))
        except TimeoutError:
            return Outcome(False, timed_out=True)
        except BaseException as exc:  # noqa: BLE001 - the remote error is the observation
            if type(exc).__name__ == "TimeoutError" and "concurrent" in type(exc).__module__:
                return Outcome(False, timed_out=True)
            return Outcome(False, error=exc)
        finally:
            ex.shutdown(wait=False, cancel_futures=True)

    def run(self, who: str, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, task_timeout_s: float | None = 60.0,
            ttl_s: float | None = None, environment: dict[str, Any] | None = None) -> Outcome:
        """Submit ``fn(*args)`` as user ``who`` ("a" the owner, "b", "c") and wait for its outcome."""
        ex, fut = self.submit(who, fn, *args, task_timeout_s=task_timeout_s, ttl_s=ttl_s, environment=environment)
        return self.wait(ex, fut, timeout)

    # ------------------------------------------------------------ health
    def ensure_running(self) -> None:
        if not self.agent.alive():
            self.restart()

    def restart(self) -> None:
        if self.agent.proc is not None and self.agent.proc.poll() is None:
            self.agent.kill()
        self.agent.start()
        self.mesh.wait_online(self.agent, timeout=90)

    def check_intact(self, test: str) -> None:
        """Invariant 5 after an attack: the agent lives, its key and config are untouched, and the
        owner's own task still runs (and reads the key it expects)."""
        problems: list[str] = []
        if not self.agent.alive():
            code = self.agent.proc.returncode if self.agent.proc is not None else None
            problems.append(f"the agent process died during the attack (exit status {code}); log tail:\n{self.log_text()[-1500:]}")
            self.deaths.append(test)
            self.restart()
        for p, before in self.file_states.items():
            try:
                now = _file_state(p)
            except OSError as exc:
                now = (f"gone: {exc}", 0, 0, 0)
            if now != before:
                problems.append(f"{p} changed (sha256, mode, uid, gid): {before} -> {now}")
        if self.key_file.read_text() != self.key_text:  # put it back, so that later tests still run
            self.key_file.write_text(self.key_text)
        out = self.run("a", owner_probe, str(self.key_file), timeout=120, task_timeout_s=60)
        if not out.ok:
            problems.append(f"the owner's task no longer runs after the attack: {out.describe()}")
        elif out.value.get("key") != self.key_text:
            problems.append("the owner's task read a different key than the one the agent was enrolled with")
        if problems:
            pytest.fail(f"after {test}: " + "\n".join(problems), pytrace=False)


def _compile_helper(out: Path) -> bytes | None:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    exe = out / "mesh-sec-helper"
    r = subprocess.run([gcc, "-O1", "-o", str(exe), str(Path(__file__).with_name("helper.c"))], check=False,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cannot compile tests/security/helper.c: {r.stderr}")
    return exe.read_bytes()


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.chown(os.path.join(root, n), uid, gid, follow_symlinks=False)


def _runtime_paths(python: str, user: str) -> list[str]:
    """The interpreter, venv and code a sandboxed worker runs: the only host paths beyond the
    system directories it may see."""
    paths = {str(REPO), str(Path(sysconfig.get_paths()["purelib"]))}
    if user == "root":
        paths.add(os.path.realpath(sys.prefix))
        paths.add(os.path.realpath(sys.base_prefix))
        paths.add(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    return sorted(paths)


@pytest.fixture(scope="session", params=["root", "nobody"], ids=["agent-as-root", "agent-as-nobody"])
def shared_endpoint(request: pytest.FixtureRequest) -> Iterator[SharedEndpoint]:
    user = request.param
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for these tests: run ./taskw setup (apt-get install mosquitto)")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed: there is no sandbox to attack")
    if user == "nobody":
        if os.geteuid() != 0:
            pytest.skip("running the agent as uid 65534 needs a root test process (setpriv)")
        if shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON):
            pytest.skip(f"needs setpriv and {SYSTEM_PYTHON} to run the agent as uid {NOBODY}")
        repo = Path(__file__).resolve().parents[2]
        closed = [str(d) for d in [repo, *repo.parents] if not (d.stat().st_mode & 0o001)]
        if closed:
            pytest.skip(f"uid {NOBODY} cannot reach this checkout ({closed[0]} is not world-traversable): "
                        "clone it under /work or /var/tmp to run the agent-as-nobody half")
    work = Path(tempfile.mkdtemp(prefix=f"mesh-sec-{user}-", dir="/var/tmp"))
    work.chmod(0o755)
    m = LocalMesh(work, heartbeat_s=0.5, lost_after_s=5.0)
    m.start()
    shared: SharedEndpoint | None = None
    try:
        markers = work / "markers"
        markers.mkdir()
        markers.chmod(0o1777)  # whatever uid the agent runs as could leave a marker here
        bindir = work / "bin"
        bindir.mkdir()
        helper = _compile_helper(bindir)
        name = f"shared-{user}"
        agents_dir = work / "agents"
        key_file = (agents_dir / f"{name}.credentials.json").resolve()  # where enroll() puts it
        wheels = work / "wheels"
        build_wheel(wheels, "meshtoy", "1.0")
        build_marker = markers / "build-backend-ran-outside-the-sandbox"
        build_hostile_sdist(wheels, "hostilepkg", "1.0", marker=build_marker, key_file=key_file)
        audit_marker = markers / "shared-library-loaded-outside-the-sandbox"
        audit_library = compile_audit_library(bindir, marker=audit_marker, key_file=key_file)
        if audit_library is not None:
            build_binary_wheel(wheels, "auditlib", "1.0", {"auditlib/__init__.py": b"", "auditlib/mesh_sec_audit.so": audit_library})
        base = m.add_agent(name, "mqtt", workers=WORKERS, start=False, task_timeout=TASK_TIMEOUT_S,
                           memory_limit_mb=MEMORY_LIMIT_MB,
                           environments={"no_index": True, "find_links": [str(wheels)], "keep_warm_s": 600})
        assert base.cfg.credentials_file == key_file
        if user == "root":
            python = sys.executable
            prefix: list[str] = []
            env = dict(os.environ, PYTHONUNBUFFERED="1", **AGENT_ENV_SECRETS)
        else:
            python = SYSTEM_PYTHON
            prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            home = work / "home-nobody"
            home.mkdir()
            Path(base.cfg.data_dir).mkdir(parents=True, exist_ok=True)
            _chown_tree(agents_dir, NOBODY, NOBODY)
            _chown_tree(home, NOBODY, NOBODY)
            env = {
                "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",  # uv from the venv's bin
                "HOME": str(home), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}",
                **AGENT_ENV_SECRETS,
            }
        agent = AgentAs(base, prefix, python, env)
        m.agents[m.agents.index(base)] = agent
        agent.start()
        m.wait_online(agent, timeout=90)
        clients = {"a": m.client}
        for who, uname in (("b", "bob"), ("c", "carol")):
            clients[who] = Client(m.url, _new_user_token(m, uname), trusted_endpoints=[agent.endpoint_id])
            m.client.share_endpoint(agent.endpoint_id, uname)
        shared = SharedEndpoint(user, m, agent, clients, work, markers, helper, _runtime_paths(python, user), build_marker,
                                audit_marker, audit_library, key_file.read_text())
        shared.file_states = {p: _file_state(p) for p in (key_file, agent.config_path)}
        # The sandbox starts at all, with the user's uid in place (not an attack: a precondition).
        out = shared.run("b", _whoami, timeout=180)
        if not out.ok:
            pytest.fail(f"a sandboxed task of a shared user does not run at all on this endpoint: {out.describe()}\n"
                        f"{shared.log_text()[-3000:]}")
        yield shared
    finally:
        if shared is not None:
            for who in ("b", "c"):
                shared.clients[who].close()
        m.stop()
        if os.environ.get("MESH_SEC_KEEP") != "1":
            shutil.rmtree(work, ignore_errors=True)


def _whoami() -> dict[str, Any]:
    import os

    return {"uid": os.getuid(), "pid": os.getpid()}


@pytest.fixture
def shared(shared_endpoint: SharedEndpoint, request: pytest.FixtureRequest) -> Iterator[SharedEndpoint]:
    """The shared endpoint for one attack; afterwards (teardown) invariant 5 is checked."""
    shared_endpoint.ensure_running()
    yield shared_endpoint
    shared_endpoint.check_intact(request.node.name)
