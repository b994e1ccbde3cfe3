"""Install what you use (issue 26, item 6): the wheel's ``[agent]`` and ``[sdk]`` extras, each in a
fresh venv with nothing else in it, from the package registry (pip's own configuration), run a task.

The project's wheel is built once from a copy of the working tree (nothing is written into the
checkout). ``[agent]`` must not bring a web framework, an ASGI server, torch or websockets; ``[sdk]``
no hub and no torch. Then a real hub (in this process, on this venv, with a real Mosquitto) enrolls
an agent through ``mesh-agent init`` of the ``[agent]`` venv, which then runs ``mesh-agent start``
(the runner and its workers on that venv's interpreter), and a script on the ``[sdk]`` venv's
interpreter submits one function through ``cloud_hub.client.Executor`` and prints its result.

The agent's idle RSS is printed (``-s`` shows it), never asserted: no timed or performance
assertions in tests (docs/testing.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
INSTALL_TIMEOUT_S = 420

# Distributions an extra must not pull in (names as importlib.metadata reports them, normalised).
HUB_ONLY = {"fastapi", "starlette", "uvicorn", "jinja2", "python-multipart", "bcrypt", "prometheus-client", "cryptography", "uvloop",
            "httptools", "watchfiles"}
HEAVY = {"torch", "numpy", "scikit-learn", "matplotlib", "flwr", "parsl", "redis", "joblib", "psycopg", "globus-sdk", "balena-sdk"}
AGENT_FORBIDDEN = HUB_ONLY | HEAVY | {"websockets"}
SDK_FORBIDDEN = HUB_ONLY | HEAVY
# What each side imports (the agent: mesh_agent/*, the SDK: cloud_hub/client/*); a missing one is a broken extra.
AGENT_NEEDS = {"pydantic", "typer", "rich", "msgpack", "dill", "cloudpickle", "aiosqlite", "aiomqtt", "paho-mqtt", "pyzmq", "httpx",
               "psutil", "pyyaml", "uv"}
SDK_NEEDS = {"pydantic", "msgpack", "dill", "cloudpickle", "httpx", "websockets", "rich", "pyyaml", "typer"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _run(cmd: list[str], *, timeout: float, what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: no answer within {timeout:.0f} s ({' '.join(map(str, cmd))[:300]}); output: {exc.stdout!r:.2000}{exc.stderr!r:.2000}")
    if res.returncode != 0:
        pytest.fail(f"{what} failed (exit {res.returncode}): {' '.join(map(str, cmd))[:300]}\n"
                    f"--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")
    return res


def _clean_env(venv: Path) -> dict[str, str]:
    """This process's environment without a trace of its own venv or checkout: the fresh venv's
    ``bin/`` first on PATH, no PYTHONPATH, no user site. pip's settings (index, find-links) stay."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTEST_CURRENT_TEST")}
    ours = os.path.realpath(Path(sys.prefix) / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != ours]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _copy_tree(dst: Path) -> None:
    """The files a clean checkout of this working tree has (tracked plus new, not ignored): no
    .venv, no build/, no egg-info, no results directories end up in the wheel."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             timeout=60, check=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:  # not a git checkout (an sdist): the whole tree, less what is never packaged
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "*.pyc", "run"))
        return
    for n in names:
        src = ROOT / n
        if src.is_file():  # listed but deleted in the working tree: skipped
            (dst / n).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / n)


def _registry_reachable(tmp: Path) -> None:
    """Fail (never skip) with a clear message when pip cannot reach the package registry."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-cache-dir", "--no-deps", "--disable-pip-version-check", "-d", str(tmp), "six"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("pip cannot reach the package registry: `pip download six` gave no answer in 180 s; this test installs "
                    "the [agent] and [sdk] extras from it (pip's configuration: index-url / find-links)")
    if res.returncode != 0:
        pytest.fail("pip cannot reach the package registry (`pip download six` failed); this test installs the [agent] and "
                    f"[sdk] extras from it (pip's configuration: index-url / find-links):\n{res.stderr[-2000:]}")


def _installed(venv: Path) -> set[str]:
    code = "import importlib.metadata as m, json; print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"
    res = _run([str(venv / "bin" / "python"), "-c", code], timeout=60, what="listing the venv's distributions", env=_clean_env(venv),
               cwd=venv)
    return {_norm(n) for n in json.loads(res.stdout)}


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel built once, then ``{"agent": venv, "sdk": venv}``, both installed at the same time."""
    tmp = tmp_path_factory.mktemp("extras")
    _registry_reachable(tmp / "probe")
    src = tmp / "src"
    _copy_tree(src)
    wheels = tmp / "wheel"
    _run([sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "--disable-pip-version-check", "-w", str(wheels), str(src)],
         timeout=INSTALL_TIMEOUT_S, what="building the project's wheel", cwd=tmp)
    (wheel,) = wheels.glob("continuum_mesh-*.whl")
    shutil.rmtree(src)
    out: dict[str, Path] = {}
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for extra in ("agent", "sdk"):
        venv = out[extra] = tmp / f"venv-{extra}"
        _run([sys.executable, "-m", "venv", str(venv)], timeout=120, what=f"python -m venv for [{extra}]", cwd=tmp)
        log = tmp / f"pip-{extra}.log"
        with open(log, "wb") as f:
            procs[extra] = (subprocess.Popen([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
                                              # no byte-compiling of every installed module up front (CPU the
                                              # suite needs): what the agent and SDK import compiles on first use
                                              "--no-compile", "-c", str(CONSTRAINTS), f"{wheel}[{extra}]"],
                                             stdout=f, stderr=subprocess.STDOUT, env=_clean_env(venv), cwd=tmp), log)
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    failed = []
    for extra, (p, log) in procs.items():
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if p.returncode != 0:
            failed.append(f"pip install '{wheel.name}[{extra}]' (exit {p.returncode}; {INSTALL_TIMEOUT_S} s at most):\n"
                          f"{log.read_text(errors='replace')[-3000:]}")
    if failed:
        pytest.fail("\n\n".join(failed))
    return out


def test_agent_extra_installs_only_what_the_agent_imports(venvs: dict[str, Path]) -> None:
    venv = venvs["agent"]
    have = _installed(venv)
    assert not have & AGENT_FORBIDDEN, f"[agent] installed {sorted(have & AGENT_FORBIDDEN)}"
    assert AGENT_NEEDS <= have, f"[agent] lacks {sorted(AGENT_NEEDS - have)}"
    env = _clean_env(venv)
    shown = subprocess.run([str(venv / "bin" / "pip"), "show", "uvicorn"], capture_output=True, text=True, timeout=60, env=env, cwd=venv)
    assert shown.returncode != 0, "pip show uvicorn found it in the [agent] venv"
    helped = _run([str(venv / "bin" / "mesh-agent"), "--help"], timeout=60, what="mesh-agent --help", env=env, cwd=venv)
    assert "init" in helped.stdout and "start" in helped.stdout
    # The agent's own modules (CLI, runner, agent, both transports, the local engine and its worker,
    # the gateway) import in this venv, from it, and pull in neither the hub, the SDK nor fl.
    code = textwrap.dedent("""
        import json, sys
        import mesh_agent.cli, mesh_agent.run, mesh_agent.agent, mesh_agent.gateway
        import mesh_agent.transport.mqtt, mesh_agent.transport.zmq, mesh_agent.engine.local, mesh_agent.engine._worker
        tops = sorted({m.split(".")[0] for m in sys.modules})
        print(json.dumps({"file": mesh_agent.__file__, "tops": tops}))
    """)
    res = _run([str(venv / "bin" / "python"), "-c", code], timeout=60, what="importing the agent's modules", env=env, cwd=venv)
    got = json.loads(res.stdout)
    assert got["file"].startswith(str(venv)), f"mesh_agent came from {got['file']}, not the fresh venv"
    assert not {"cloud_hub", "fl", "fastapi", "uvicorn", "torch", "websockets", "numpy"} & set(got["tops"]), got["tops"]


def test_sdk_extra_installs_the_sdk_and_no_hub(venvs: dict[str, Path]) -> None:
    have = _installed(venvs["sdk"])
    assert not have & SDK_FORBIDDEN, f"[sdk] installed {sorted(have & SDK_FORBIDDEN)}"
    assert SDK_NEEDS <= have, f"[sdk] lacks {sorted(SDK_NEEDS - have)}"
    # `mesh-hub login` is how an SDK user stores the hub's URL and token (docs/sdk.md): it runs without the hub's extra.
    helped = _run([str(venvs["sdk"] / "bin" / "mesh-hub"), "login", "--help"], timeout=60, what="mesh-hub login --help",
                  env=_clean_env(venvs["sdk"]), cwd=venvs["sdk"])
    assert "--url" in helped.stdout


class VenvAgent(AgentProcess):
    """``mesh-agent start`` of another venv, run outside this checkout (``python -m`` puts the working
    directory first on sys.path)."""

    def __init__(self, venv: Path, *args: Any) -> None:
        super().__init__(*args)
        self.venv = venv

    def start(self) -> "VenvAgent":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(self.venv / "bin" / "mesh-agent"), "start", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=_clean_env(self.venv), cwd=self.config_path.parent,
                                     start_new_session=True)
        log.close()
        return self


def _tree_rss(pid: int) -> tuple[float, float, int]:
    import psutil

    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    rss = [q.memory_info().rss for q in procs]
    return rss[0] / 2**20, sum(rss) / 2**20, len(procs)


SDK_SCRIPT = '''
import json, os, sys
from cloud_hub.client import Client, Executor

def square(x):
    return x * x

with Client(os.environ["EXTRAS_HUB_URL"], os.environ["EXTRAS_HUB_TOKEN"]) as client:
    with Executor(client, endpoint_id=os.environ["EXTRAS_ENDPOINT"]) as ex:
        value = ex.submit(square, 12).result(90)
        stream = ex._stream is not None
import cloud_hub
print(json.dumps({"result": value, "stream": stream, "file": cloud_hub.__file__,
                  "tops": sorted({m.split(".")[0] for m in sys.modules})}))
'''


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    with LocalMesh(tmp_path_factory.mktemp("extras-mesh"), heartbeat_s=0.5, lost_after_s=5.0, lease_s=10.0) as mesh:
        yield mesh


def test_agent_venv_runs_a_task_submitted_from_the_sdk_venv(venvs: dict[str, Path], hub: LocalMesh) -> None:
    agent_venv, sdk_venv = venvs["agent"], venvs["sdk"]
    work = hub.workdir / "venv-agent"
    work.mkdir()
    config = work / "agent.yaml"
    token = hub.client.create_enrollment_token()
    _run([str(agent_venv / "bin" / "mesh-agent"), "init", "--hub", hub.url, "--token", str(token), "--name", "extras-agent",
          "--transport", "mqtt", "--workers", "1", "--data-dir", str(work / "data"), "--config", str(config)],
         timeout=60, what="mesh-agent init from the [agent] venv", env=_clean_env(agent_venv), cwd=work)
    cfg, _ = load_config(config)
    # A field device's profile (workers on demand, keepalive and beats on change): what the RSS figure is about.
    cfg = cfg.model_validate({**cfg.model_dump(), "profile": "metered"})
    cfg.save(config)
    hub.client.set_endpoint_trusted(cfg.endpoint_id, True)  # on this machine, as the user (LocalMesh.add_agent does the same)
    agent = VenvAgent(agent_venv, cfg, config, work / "agent.log")
    hub.agents.append(agent)  # stopped with the mesh
    agent.start()
    hub.wait_online(agent, timeout=30)
    assert agent.proc is not None
    import psutil

    proc = psutil.Process(agent.proc.pid)  # the runner: `mesh-agent start` execs it in the same process
    assert proc.cmdline()[0].startswith(str(agent_venv)), proc.cmdline()
    libs = {m.path for m in proc.memory_maps() if m.path.endswith(".so") or ".so." in m.path}
    assert any(p.startswith(str(agent_venv)) for p in libs), "no extension module of the [agent] venv is loaded"
    assert not any(p.startswith(sys.prefix + os.sep) for p in libs), "the agent loaded extension modules of this venv"

    time.sleep(5)  # online and idle
    main_mb, tree_mb, n = _tree_rss(agent.proc.pid)
    print(f"\n[agent] venv agent idle (metered profile, 1 worker on demand): RSS {main_mb:.1f} MB, tree {tree_mb:.1f} MB ({n} process(es))")

    script = hub.workdir / "sdk_round_trip.py"
    script.write_text(SDK_SCRIPT)
    env = _clean_env(sdk_venv)
    env.update(EXTRAS_HUB_URL=hub.url, EXTRAS_HUB_TOKEN=hub.token, EXTRAS_ENDPOINT=cfg.endpoint_id)
    res = _run([str(sdk_venv / "bin" / "python"), str(script)], timeout=150, what="the [sdk] venv's round trip", env=env, cwd=script.parent)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["result"] == 144, (got, agent.log_path.read_text()[-3000:])
    assert got["file"].startswith(str(sdk_venv)), f"cloud_hub came from {got['file']}, not the fresh venv"
    assert got["stream"], "the SDK did not use its WebSocket stream (websockets missing from [sdk]?)"
    assert not {"fastapi", "uvicorn", "torch", "fl"} & set(got["tops"]), got["tops"]
    assert agent.alive(), agent.log_path.read_text()[-3000:]
