"""An agent reports its GPUs (nvidia-smi's answer) in its hello; the hub keeps them in the
endpoint's info."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration

ROW = "0, NVIDIA A100-SXM4-40GB, 40960, GPU-0a1b2c3d-0000-1111-2222-333344445555, 535.104.05"


def test_agent_hello_carries_its_gpus_to_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{ROW}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("MESH_NO_GPU_PROBE", raising=False)
    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=3.0, lease_s=5.0) as mesh:
        monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ["PATH"])  # the agent's environment
        gpu_agent = mesh.add_agent("hpc-login", "mqtt", workers=1)
        monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != str(bindir)))
        plain = mesh.add_agent("pi", "mqtt", workers=1)
        mesh.wait_online(timeout=60)
        deadline = time.monotonic() + 20
        while True:
            rows = {e["id"]: e for e in mesh.client.list_endpoints()}
            info = rows[gpu_agent.endpoint_id].get("info") or {}
            if info.get("gpus") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert info["gpus"] == [{"index": 0, "name": "NVIDIA A100-SXM4-40GB", "memory_mb": 40960,
                                 "uuid": "GPU-0a1b2c3d-0000-1111-2222-333344445555", "driver": "535.104.05"}]
        assert info["gpu"] is False  # placement's flag stays what the config says (mesh-agent init --gpu)
        other = rows[plain.endpoint_id].get("info") or {}
        assert other.get("gpus") in ([], None) or not any("A100" in g["name"] for g in other["gpus"])
