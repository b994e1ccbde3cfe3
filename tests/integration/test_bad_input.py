"""Invariant 4: bad input gets a clear error and changes no stored state."""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cloud_hub.client import Client, Executor, HubError
from cloud_hub.localmesh import LocalMesh
from cloud_hub.store import SqliteStore, StoreError
from mesh_agent.config import ConfigError, load_config
from mesh_agent.protocol import Envelope, Kind, encode, new_key, serialize, serialize_function
from mesh_agent.transport.mqtt import down_topic, up_topic
from tests.integration.peers import connect_intruder

pytestmark = pytest.mark.integration


def touch(path: str) -> str:
    open(path, "w").close()
    return path


def _counts(mesh: LocalMesh) -> tuple[int, int, int, int]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return tuple(db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("tasks", "results", "functions", "endpoints"))  # type: ignore[return-value]


def _spec(ep: str, fid: str, args: bytes) -> dict:
    return {"endpoint_id": ep, "function_id": fid, "args": base64.b64encode(args).decode()}


def test_api_rejects_bad_requests_without_state_change(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("target", "mqtt", start=False)
    c = mesh.client
    fid = c.register_function(touch)
    before = _counts(mesh)
    ok_args = serialize(((), {}))

    cases: list[tuple[str, dict, int, str]] = [
        ("unknown function", _spec(agent.endpoint_id, "0" * 64, ok_args), 404, "unknown function"),
        ("unknown endpoint", _spec("ep-nope", fid, ok_args), 404, "unknown endpoint"),
        ("oversize payload", _spec(agent.endpoint_id, fid, b"pickle\n" + b"x" * (10 * 2**20 + 1)), 413, "over the 10485760-byte limit"),
        ("args without header", _spec(agent.endpoint_id, fid, b"\x00garbage"), 422, "unknown serialization header"),
        ("short function id", _spec(agent.endpoint_id, "abc", ok_args), 422, "function_id"),
    ]
    for name, spec, status, text in cases:
        with pytest.raises(HubError) as info:
            c.request("POST", "/v1/tasks", json=spec)
        assert info.value.status == status, name
        assert text in info.value.detail, (name, info.value.detail)
        # the same bad task inside an otherwise good batch: the whole batch is refused
        with pytest.raises(HubError) as info:
            c.submit_batch([_spec(agent.endpoint_id, fid, ok_args), spec])
        assert info.value.status == status, name
    r = httpx.post(f"{mesh.url}/v1/tasks", content=b"{not json", headers={"Authorization": f"Bearer {mesh.token}", "content-type": "application/json"})
    assert r.status_code == 422
    assert _counts(mesh) == before


def test_tokens_are_checked_and_stored_hashed(mesh: LocalMesh) -> None:
    before = _counts(mesh)
    spec = {"name": "f", "body": base64.b64encode(serialize_function(touch)).decode()}
    assert httpx.post(f"{mesh.url}/v1/functions", json=spec).status_code == 401
    bad = Client(mesh.url, "cm_wrong")
    with pytest.raises(HubError) as info:
        bad.register_function(touch)
    assert info.value.status == 401 and "invalid API token" in info.value.detail
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": "ce_not-a-real-token", "name": "x"})
    assert r.status_code == 401 and "enrollment token" in r.json()["detail"]
    assert _counts(mesh) == before
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        stored = [r[0] for r in db.execute("SELECT hash FROM api_tokens")]
    assert mesh.token not in stored and all(len(h) == 64 for h in stored)
    # an enrollment token is single-use by default
    tok = mesh.client.create_enrollment_token()
    assert httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": tok, "name": "one"}).status_code == 201
    assert httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": tok, "name": "two"}).status_code == 401


def test_forged_and_malformed_frames_are_refused(mesh: LocalMesh, tmp_path: Path) -> None:
    agent = mesh.add_agent("guarded", "mqtt")
    mesh.wait_online(agent)
    marker = tmp_path / "pwned"
    body = serialize_function(touch)
    from mesh_agent.protocol import function_id

    task = {"id": "forged-1", "fn": function_id(body), "args": serialize(((str(marker),), {})), "timeout": None, "exp": None}
    forged = encode(Envelope(Kind.TASKS, agent.endpoint_id, {"tasks": [task], "functions": {function_id(body): body}}), new_key())
    before = _counts(mesh)
    # An attacker past the broker's ACLs (see test_attacks.py for what the ACLs themselves stop).
    pub = connect_intruder(mesh)
    assert pub.connected.is_set()
    try:
        # to the agent: a task signed with the wrong key, and garbage
        pub.publish(down_topic("mesh", agent.endpoint_id), forged)
        pub.publish(down_topic("mesh", agent.endpoint_id), b"\x00\x01garbage")
        # to the hub: garbage, and a result frame signed with the wrong key
        pub.publish(up_topic("mesh", agent.endpoint_id), b"CM\x02")
        fake = encode(Envelope(Kind.RESULTS, agent.endpoint_id, {"results": [{"id": "x", "ok": True, "data": b"json\n1"}]}), new_key())
        pub.publish(up_topic("mesh", agent.endpoint_id), fake)
    finally:
        pub.close()
    deadline = time.monotonic() + 10
    while mesh.hub.hub.dispatcher.stats["rejected_frames"] < 2 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)
    assert mesh.hub.hub.dispatcher.stats["rejected_frames"] >= 2  # type: ignore[union-attr]
    # the agent still works, never ran the forged task, and logged why
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert ex.submit(pow, 2, 5).result(30) == 32
    assert not marker.exists()
    assert "rejected frame from hub: bad signature" in agent.log_path.read_text()
    assert "rejected frame from hub: malformed" in agent.log_path.read_text()
    with sqlite3.connect(agent.cfg.queue_path) as db:
        assert db.execute("SELECT COUNT(*) FROM tasks WHERE id='forged-1'").fetchone()[0] == 0
    assert _counts(mesh)[1] == before[1] + 1  # only the legitimate result


def test_corrupt_agent_queue_is_a_clear_error(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("corrupt", "mqtt", start=False)
    agent.cfg.queue_path.parent.mkdir(parents=True, exist_ok=True)
    agent.cfg.queue_path.write_bytes(b"this is not a database" * 100)
    out = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert "not a usable queue database" in out.stdout + out.stderr
    assert agent.cfg.queue_path.read_bytes() == b"this is not a database" * 100  # left as it was, for recovery


def test_corrupt_hub_db_and_bad_agent_config(tmp_path: Path) -> None:
    db = tmp_path / "hub.sqlite3"
    db.write_bytes(b"garbage" * 1000)
    with pytest.raises(StoreError, match="not a usable hub database"):
        asyncio.run(SqliteStore(db).open())
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("endpoint_id: e\nname: n\nhub_url: http://x\ndata_dir: /tmp/x\ncredentials_file: /tmp/c\nworkerz: 3\n")
    with pytest.raises(ConfigError, match="workerz: Extra inputs are not permitted"):
        load_config(cfg)
    cfg.write_text("endpoint_id: e\nname: n\nhub_url: http://x\ndata_dir: /tmp/x\ncredentials_file: /tmp/c\nworkers: -1\n")
    with pytest.raises(ConfigError, match="workers"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
