"""``mesh-agent start`` validates, then execs the light runner: the running agent never loads the
CLI's or the validator's packages (pydantic, typer, rich, httpx), keeps its process id (SIGTERM
from systemd reaches it) and carries no secret in its command line or environment.

Checked from outside the process: /proc/<pid>/maps (pydantic_core's compiled module), /proc/<pid>/
cmdline and environ, and the runner's own list of loaded packages (a DEBUG line at exit), after it
ran a task, so lazily imported modules count too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import load_config
from mesh_agent.run import HEAVY_MODULES

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


def test_started_agent_runs_without_pydantic_typer_rich_or_httpx(mesh: LocalMesh, tmp_path: Path) -> None:
    agent = mesh.add_agent("light", "mqtt", workers=1, start=False)
    _, creds = load_config(agent.config_path)
    with open(agent.log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(agent.config_path), "--log-level", "DEBUG"],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    running = AgentProcess(agent.cfg, agent.config_path, agent.log_path)
    running.proc = proc
    try:
        mesh.wait_online(running)
        with Executor(mesh.client, agent.endpoint_id) as ex:
            assert [f.result(60) for f in [ex.submit(square, i) for i in range(5)]] == [0, 1, 4, 9, 16]
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"mesh_agent.run" in cmdline, cmdline  # the CLI process became the runner, same pid
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "pydantic_core" not in maps and "/pydantic/" not in maps
        secret = creds.key.encode()
        assert secret not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert secret not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        assert running.stop() == 0
    text = agent.log_path.read_text()
    assert "online: " in text
    found = re.search(r"runner modules: (.*)", text)
    assert found, text[-3000:]
    loaded = set(found.group(1).split())
    assert "mesh_agent" in loaded and "asyncio" in loaded  # the line lists what it claims to
    assert loaded.isdisjoint(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))


def test_start_refuses_bad_settings_before_it_execs(mesh: LocalMesh, tmp_path: Path) -> None:
    """A config that does not validate fails in the CLI, with its one-line error and exit 2."""
    agent = mesh.add_agent("bad", "mqtt", workers=1, start=False)
    text = agent.config_path.read_text().replace("prefetch: 256", "prefetch: -4")
    assert text != agent.config_path.read_text()
    agent.config_path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "prefetch" in out.stdout and "Traceback" not in out.stdout + out.stderr
    assert not agent.cfg.queue_path.exists()


def test_runner_started_by_hand_says_what_it_needs() -> None:
    out = subprocess.run([sys.executable, "-m", "mesh_agent.run"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--settings-fd" in out.stdout and "Traceback" not in out.stderr


def test_sigterm_reaches_the_runner(mesh: LocalMesh) -> None:
    """systemd sends SIGTERM to the pid it started: after exec that pid is the runner."""
    agent = mesh.add_agent("term", "zmq", workers=1)
    mesh.wait_online(agent)
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(20) == 0
    assert "disconnected from" in agent.log_path.read_text()
