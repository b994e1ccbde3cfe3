"""The health probes as systemd and load balancers use them: ``python -m cloud_hub.healthcheck``
against a real hub (``/healthz`` answers; ``/readyz`` refuses with the hub's reason while the
broker is unreachable), bad input refused, and the shipped hub unit waits on ``/healthz``."""

from __future__ import annotations

import configparser
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread

pytestmark = pytest.mark.integration

UNIT = Path(__file__).resolve().parents[2] / "device_images" / "systemd" / "continuum-mesh-hub.service"


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloud_hub.healthcheck", *args], capture_output=True, text=True, timeout=60)


def test_probes_against_a_hub_whose_broker_is_unreachable(tmp_path: Path) -> None:
    # A broker port nobody listens on: REST is up, the hub is not ready, and says why. The port
    # stays bound (not listening) for the whole test, so nothing else, the hub's own HTTP port
    # included, can be handed it: connections to it are refused.
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host="127.0.0.1", mqtt_port=hold.getsockname()[1], zmq_bind=None)
    hub = HubThread(cfg).start()
    try:
        live = probe("--wait", "30", "--timeout", "10", f"{hub.url}/healthz")  # bounds for a loaded machine
        assert live.returncode == 0, live.stderr
        ready = probe("--wait", "2", f"{hub.url}/readyz")
        assert ready.returncode == 1
        assert "HTTP 503" in ready.stderr and '"ready": false' in ready.stderr and "broker" in ready.stderr
    finally:
        hub.stop()
        hold.close()
    gone = probe("--wait", "1", f"{hub.url}/healthz")  # stopped: nobody answers
    assert gone.returncode == 1 and "no answer" in gone.stderr


def test_rest_does_not_wait_for_a_broker_that_never_answers(tmp_path: Path) -> None:
    """A blackholed broker: the TCP connection is accepted (by the kernel's backlog) and nothing
    is ever read or answered, so the hub's MQTT CONNECT gets no CONNACK and its first attempt
    lasts aiomqtt's whole 10 s connect timeout. REST must be up long before that, with /readyz
    refusing and naming the broker."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # never read from: no CONNACK, no RST
    port = hole.getsockname()[1]
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host="127.0.0.1", mqtt_port=port, zmq_bind=None)
    t0 = time.monotonic()
    hub = HubThread(cfg).start(wait_broker=False)
    try:
        live = httpx.get(f"{hub.url}/healthz", timeout=5)
        took = time.monotonic() - t0
        assert live.status_code == 200 and live.json()["ok"] is True
        assert took < 5.0, f"REST took {took:.1f}s to answer: it waited on the broker"  # a loose liveness bound (was >= 10 s)
        ready = httpx.get(f"{hub.url}/readyz", timeout=5)
        assert ready.status_code == 503, ready.text
        body = ready.json()
        assert body["ready"] is False and body["database"] == "ok" and body["migrations"] == "done"
        # the first attempt is still under way: REST did not wait for it to end
        assert body["broker"] == f"broker mqtt://127.0.0.1:{port}: not connected yet (first connect attempt under way)", body
        hole.settimeout(10)
        conn, _ = hole.accept()  # the hub's link really dialled the blackhole (we take it, and still never answer)
        probe_ready = probe(f"{hub.url}/readyz")
        assert probe_ready.returncode == 1 and "HTTP 503" in probe_ready.stderr and f"mqtt://127.0.0.1:{port}" in probe_ready.stderr
        assert probe(f"{hub.url}/healthz").returncode == 0
    finally:
        hub.stop()
        hole.close()
    conn.close()


def test_probe_refuses_what_is_not_a_url() -> None:
    r = probe("127.0.0.1:8700/healthz")
    assert r.returncode == 2 and "must start with http://" in r.stderr
    r = probe("--timeout", "0", "http://127.0.0.1:8700/healthz")
    assert r.returncode == 2 and "--timeout must be a positive number of seconds" in r.stderr


def test_hub_unit_waits_for_healthz_and_passes_systemd_analyze(tmp_path: Path) -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment]
    cp.read_string(UNIT.read_text())
    svc = cp["Service"]
    assert svc["ExecStart"].startswith("/opt/continuum-mesh/venv/bin/mesh-hub serve")
    assert "-m cloud_hub.healthcheck --wait" in svc["ExecStartPost"] and "${MESH_HUB_HEALTH_URL}" in svc["ExecStartPost"]
    assert "MESH_HUB_HEALTH_URL=http://127.0.0.1:8700/healthz" in UNIT.read_text()
    assert svc["UMask"] == "0077" and svc["StateDirectoryMode"] == "0700"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for exe in ("mesh-hub", "python"):
        (bindir / exe).write_text("#!/bin/sh\n")
        (bindir / exe).chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/continuum-mesh/venv/bin", str(bindir)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
