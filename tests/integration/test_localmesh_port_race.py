"""LocalMesh draws the hub's port with ``free_port`` and binds it later: another process may take it
in between (seen once in a full parallel run: the hub's bind failed, "address already in use").
A fresh hub then draws another port instead of failing the test that started it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

import cloud_hub.broker
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration


def test_a_fresh_hub_whose_drawn_port_was_taken_draws_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    real = cloud_hub.broker.free_port
    draws: list[int] = []

    def draw(host: str = "127.0.0.1") -> Any:
        p = port if not draws else real(host)
        draws.append(p)
        return p

    mesh = LocalMesh(tmp_path / "mesh")
    try:
        mesh.broker.start()
        monkeypatch.setattr(cloud_hub.broker, "free_port", draw)  # the hub's draw only
        mesh.start_hub()
        assert mesh.hub is not None and mesh.hub.cfg.port != port and draws[0] == port and len(draws) >= 2
        assert mesh.client.request("GET", "/v1/health") is not None
    finally:
        mesh.stop()
        taken.close()


def test_a_mesh_whose_hub_cannot_start_leaves_no_broker_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draw is a taken port: start() fails, and stops the broker it started (the fixture that
    called it never reaches its teardown; a leaked Mosquitto was found after such a run)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    mesh = LocalMesh(tmp_path / "mesh")
    real_start = mesh.broker.start
    procs: list[Any] = []

    def broker_then_taken() -> Any:
        out = real_start()
        procs.append(mesh.broker.proc)
        monkeypatch.setattr(cloud_hub.broker, "free_port", lambda host="127.0.0.1": taken.getsockname()[1])
        return out

    monkeypatch.setattr(mesh.broker, "start", broker_then_taken)
    try:
        with pytest.raises(RuntimeError, match="hub failed to start"):
            mesh.start()
        assert procs and procs[0] is not None and procs[0].poll() is not None, "the broker still runs"
    finally:
        taken.close()
        for p in procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
