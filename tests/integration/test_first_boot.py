"""A device enrolls itself on first boot from MESH_* variables, as a balena or systemd device does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import load_config
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def cube(x: int) -> int:
    return x ** 3


def _start(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)


def test_first_boot_enrolls_from_env_once_then_runs_tasks(mesh: LocalMesh, tmp_path: Path) -> None:
    config = tmp_path / "data" / "agent.yaml"
    env = {
        "MESH_HUB_URL": mesh.url,
        "MESH_ENROLL_TOKEN": mesh.client.create_enrollment_token(uses=1),
        "MESH_AGENT_NAME": "balena-pi-1",
        "MESH_TRANSPORT": "zmq",
        "MESH_DATA_DIR": str(tmp_path / "data" / "queue"),
        "MESH_WORKERS": "1",
    }
    proc = _start(config, env, tmp_path / "agent.log")
    wait_for(lambda: config.exists() or proc.poll() is not None, "the config written (or the agent exiting)", 30)
    assert config.exists(), (tmp_path / "agent.log").read_text()
    cfg, _ = load_config(config)
    assert cfg.name == "balena-pi-1" and cfg.queue_path.parent == tmp_path / "data" / "queue"
    agent = AgentProcess(cfg, config, tmp_path / "agent.log")
    agent.proc = proc
    try:
        mesh.wait_online(agent)
        with Executor(mesh.client, cfg.endpoint_id) as ex:
            assert ex.submit(cube, 4).result(30) == 64
        assert agent.stop() == 0
        # Second boot: same variables, token already used up. It must not enroll again.
        agent.proc = _start(config, env, tmp_path / "agent.log")
        mesh.wait_online(agent)
        assert load_config(config)[0].endpoint_id == cfg.endpoint_id
        assert [e["id"] for e in mesh.client.list_endpoints() if e["name"] == "balena-pi-1"] == [cfg.endpoint_id]
    finally:
        agent.stop()


def test_refused_token_and_unreachable_hub_exit_clearly_and_write_nothing(mesh: LocalMesh, tmp_path: Path) -> None:
    device = tmp_path / "device"
    device.mkdir()
    config = device / "agent.yaml"
    bad = {"MESH_HUB_URL": mesh.url, "MESH_ENROLL_TOKEN": "ce_not-a-token", "MESH_TRANSPORT": "zmq"}
    r = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(config)],
                       env={**os.environ, **bad}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "invalid, expired or used up" in " ".join(r.stdout.split())
    down = {"MESH_HUB_URL": "http://127.0.0.1:9", "MESH_ENROLL_TOKEN": "ce_x", "MESH_ENROLL_WAIT_S": "0"}
    r = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(config)],
                       env={**os.environ, **down}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "unreachable" in " ".join(r.stdout.split())
    assert list(device.iterdir()) == []
