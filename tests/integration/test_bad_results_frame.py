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


def test_a_results_frame_sent_again_verbatim_is_acked_again_and_stored_once(mesh: LocalMesh) -> None:
    """A site gateway re-sends the very results frame it holds (it cannot sign a new one) until the
    hub's result_ack reaches it. The hub refuses the copy as a replay, stores nothing twice, and
    acknowledges its ids again: without that, a lost ack left the gateway re-sending the frame
    over its uplink until the frame expired (docs/sites.md)."""
    from mesh_agent.protocol import open_frame
    from mesh_agent.transport.mqtt import down_topic

    agent = mesh.add_agent("behind-a-gateway", "mqtt", start=False)
    _, creds = load_config(agent.config_path)
    fid = mesh.client.register_function(pow, "pow")
    tid = mesh.client.submit(agent.endpoint_id, fid, 2, 5)
    stats = mesh.hub.hub.dispatcher.stats  # type: ignore[union-attr]
    good = {"id": tid, "ok": True, "data": serialize(32), "started": time.time(), "finished": time.time(), "pid": 1}
    frame = encode(Envelope(Kind.RESULTS, agent.endpoint_id, {"results": [good]}), creds.key_bytes)
    pub = connect_intruder(mesh)
    assert pub.connected.is_set()

    def acks() -> list[list[str]]:
        out = []
        for topic, f in list(pub.frames):
            env = open_frame(f, creds.key_bytes).open()
            if topic == down_topic("mesh", agent.endpoint_id) and env.kind is Kind.RESULT_ACK:
                out.append(list(env.body["ids"]))
        return out

    try:
        pub.subscribe(down_topic("mesh", agent.endpoint_id))
        pub.publish(up_topic("mesh", agent.endpoint_id), frame)
        _wait(lambda: _task_row(mesh, tid) == ("done", 1) and len(acks()) == 1, "the results stored and acked")
        rejected = stats["rejected_frames"]
        pub.publish(up_topic("mesh", agent.endpoint_id), frame)  # the gateway's re-send: the same bytes
        _wait(lambda: len(acks()) == 2, "the copy acknowledged again")
    finally:
        pub.close()
    assert acks() == [[tid], [tid]]
    assert stats["rejected_frames"] == rejected + 1 and stats["results_reacked"] == 1, "refused as a replay, answered with an ack"
    assert _task_row(mesh, tid) == ("done", 1), "stored once"
