"""Invariant 4 at the dispatcher, with per-endpoint lanes and group commit: a results frame that is
authentic (the endpoint's own key, fresh) but malformed is refused whole, with a clear log line,
and stores nothing, while a well-formed one for the same task right after it is stored once."""

from __future__ import annotations

import logging
import sqlite3
import time

import pytest

from cloud_hub.localmesh import LocalMesh
from mesh_agent.config import load_config
from mesh_agent.protocol import Envelope, Kind, encode, serialize
from mesh_agent.transport.mqtt import up_topic
from tests.integration.peers import connect_intruder

pytestmark = pytest.mark.integration


def _task_row(mesh: LocalMesh, tid: str) -> tuple[str, int]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        state = db.execute("SELECT state FROM tasks WHERE id=?", (tid,)).fetchone()[0]
        stored = db.execute("SELECT COUNT(*) FROM results WHERE task_id=?", (tid,)).fetchone()[0]
    return str(state), int(stored)


def _wait(pred, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_an_authentic_but_malformed_results_frame_stores_nothing(mesh: LocalMesh, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cloud_hub.dispatcher")
    agent = mesh.add_agent("never-started", "mqtt", start=False)  # its tasks stay queued at the hub
    _, creds = load_config(agent.config_path)
    fid = mesh.client.register_function(pow, "pow")
    tid = mesh.client.submit(agent.endpoint_id, fid, 2, 5)
    assert _task_row(mesh, tid) == ("queued", 0)
    stats = mesh.hub.hub.dispatcher.stats  # type: ignore[union-attr]
    rejected = stats["rejected_frames"]
    good = {"id": tid, "ok": True, "data": serialize(32), "started": time.time(), "finished": time.time(), "pid": 1}
    bad = {"id": "t-other", "ok": True, "started": time.time()}  # no data
    pub = connect_intruder(mesh)  # only to publish on the endpoint's topic; the frames carry its own MAC
    assert pub.connected.is_set()
    try:
        frame = encode(Envelope(Kind.RESULTS, agent.endpoint_id, {"results": [good, bad]}), creds.key_bytes)
        pub.publish(up_topic("mesh", agent.endpoint_id), frame)
        _wait(lambda: stats["rejected_frames"] > rejected, "the hub to refuse the malformed results frame")
        assert _task_row(mesh, tid) == ("queued", 0), "a refused frame must store nothing, not even its good result"
        frame = encode(Envelope(Kind.RESULTS, agent.endpoint_id, {"results": [good]}), creds.key_bytes)
        pub.publish(up_topic("mesh", agent.endpoint_id), frame)
        _wait(lambda: _task_row(mesh, tid) == ("done", 1), "the well-formed results frame to be stored")
    finally:
        pub.close()
    assert stats["rejected_frames"] == rejected + 1
    assert f"rejected frame on mqtt channel {agent.endpoint_id}: malformed: results body: results[1] has no 'data'" in caplog.text
