"""Structured logs from real processes: ``mesh-hub serve --log-format json`` and an agent whose
config says ``log_format: json`` write one JSON object per line, with the ids as fields; a wrong
format is one clear error and exit 2 (issue 19 item 5)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import wait
from pathlib import Path

import httpx
import pytest

from cloud_hub.broker import find_mosquitto, free_port
from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration


def sleepy(s: float) -> float:
    import time

    time.sleep(s)
    return s


def _json_lines(text: str) -> list[dict]:  # type: ignore[type-arg]
    rows = []
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise AssertionError(f"not a JSON line: {line!r}") from None
    return rows


def test_hub_process_logs_json(tmp_path: Path) -> None:
    port = free_port()
    err = tmp_path / "hub.err"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "cloud_hub.cli", "serve", "--db", str(tmp_path / "hub.sqlite3"), "--port", str(port),
                                 "--mqtt-host", "", "--zmq-bind", "", "--log-format", "json", "--log-level", "INFO"],
                                stdout=subprocess.DEVNULL, stderr=f, env={k: v for k, v in os.environ.items() if k != "MESH_LOG_FORMAT"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise AssertionError("hub did not answer within 60 s")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    rows = _json_lines(err.read_text())
    assert any(f"REST http://127.0.0.1:{port}" in r["msg"] for r in rows), rows
    assert any("shut" in r["msg"].lower() or "stop" in r["msg"].lower() for r in rows), rows
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in rows)


def test_wrong_log_format_is_one_clear_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "serve", "--db", str(tmp_path / "hub.sqlite3"), "--log-format", "xml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "log format must be one of text, json, not 'xml'" in out.stdout + out.stderr
    assert not (tmp_path / "hub.sqlite3").exists(), "nothing was created"
    env = dict(os.environ, MESH_LOG_FORMAT="xml")
    out = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(tmp_path / "agent.yaml")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "MESH_LOG_FORMAT must be one of text, json, not 'xml'" in out.stdout + out.stderr


def test_agent_logs_json_with_endpoint_task_and_function_ids(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cloud_hub.dispatcher")
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0) as mesh:
        agent = mesh.add_agent("json-1", "mqtt", workers=1, prefetch=4, task_timeout=1.0, log_format="json")
        mesh.wait_online(agent, timeout=60)
        fid = mesh.client.register_function(sleepy)
        with Executor(mesh.client, agent.endpoint_id) as ex:
            fut = ex.submit(sleepy, 5.0)  # killed at its 1 s timeout: a WARNING naming the task
            wait([fut], timeout=60)
            assert fut.done() and fut.exception() is not None
        task_id = fut.task_id  # type: ignore[attr-defined]
        agent.stop()
    online = [r for r in caplog.records if r.name == "cloud_hub.dispatcher" and "online via" in r.getMessage()]
    assert online and all(getattr(r, "endpoint_id", None) == agent.endpoint_id for r in online), "the hub's lines carry the endpoint id"
    rows = _json_lines(agent.log_path.read_text())
    assert rows and all(r["endpoint_id"] == agent.endpoint_id for r in rows), "every line of the agent names its endpoint"
    assert any(r["msg"].startswith("online: ") for r in rows)
    timeout = [r for r in rows if "timeout" in r["msg"]]
    assert timeout and timeout[0]["task_id"] == task_id and timeout[0]["function_id"] == fid and timeout[0]["level"] == "WARNING"
