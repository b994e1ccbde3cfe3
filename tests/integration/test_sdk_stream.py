"""The SDK's WebSocket stream (issue 13 item 3) over a real hub, Mosquitto and agent process.

- Every task submitted through the stream gets exactly one result, and one task row.
- A hub that does not offer the stream (``stream: false``) is used over REST, with the same results.
- A wrong token is refused with close code 4401 and a reason that says so; nothing is stored.
- Malformed frames get a clear error (a ``refused`` answer, or close code 4400 with the reason);
  nothing is stored.
- An idempotency key means the same request on the stream and on REST: a retry makes nothing new.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.client._client import AuthError, HubUnreachable
from cloud_hub.client._stream import HubStream, stream_url
from cloud_hub.localmesh import LocalMesh
from mesh_agent.protocol import function_id, serialize, serialize_function

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, str]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    with LocalMesh(tmp_path_factory.mktemp("stream"), heartbeat_s=0.5, lost_after_s=3.0) as m:
        agent = m.add_agent("s", "mqtt", workers=2)
        m.wait_online(timeout=90)
        yield m, agent.endpoint_id


def _counts(m: LocalMesh) -> tuple[int, int]:
    with sqlite3.connect(m.hub_cfg.db_path, timeout=30) as db:
        return db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0], db.execute("SELECT COUNT(*) FROM results").fetchone()[0]


def _wait_connected(ex: Executor, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ex._stream is not None and ex._stream.connected:
            return
        time.sleep(0.02)
    raise AssertionError("the Executor's stream did not connect")


def _raw(m: LocalMesh, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token if token is not None else m.token}"}
    return connect(stream_url(m.url), additional_headers=headers, open_timeout=30, proxy=None)


def _batch(ep: str, fid: str, body: bytes, n: int, key: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tasks": [{"endpoint_id": ep, "function_id": fid, "args": base64.b64encode(serialize(((i,), {}))).decode()} for i in range(n)],
        "functions": {fid: {"name": "square", "body": base64.b64encode(body).decode()}},
    }
    if key is not None:
        out["idempotency_key"] = key
    return out


@pytest.mark.parametrize("early", [False, True])
def test_stream_gives_exactly_one_result_per_task(mesh: tuple[LocalMesh, str], early: bool) -> None:
    """Default: a result comes once the hub stored it. ``early_results``: as the agent sends it,
    before the hub's commit; still once per task, and the hub stores each once."""
    m, ep = mesh
    group = "stream-" + uuid.uuid4().hex[:8]
    assert m.hub is not None
    stats = m.hub.hub.dispatcher.stats
    early_before = stats.get("stream_results_early", 0)
    with Executor(m.client, endpoint_id=ep, task_group_id=group, early_results=early) as ex:
        _wait_connected(ex)
        assert ex.submit(square, 3).result(60) == 9
        futs = [ex.submit(square, i) for i in range(300)]
        got = [f.result(120) for f in futs]
        stream = ex._stream
        assert stream is not None and stream.connected and stream.connects == 1
        assert stream.submits >= 2  # the batches went over the stream, not REST
    assert got == [i * i for i in range(300)]
    assert len({f.task_id for f in futs}) == 300  # type: ignore[attr-defined]
    early_sent = stats.get("stream_results_early", 0) - early_before
    deadline = time.monotonic() + (60 if early else 0)  # early: the hub's commit may follow the SDK's result
    while True:
        with sqlite3.connect(m.hub_cfg.db_path, timeout=30) as db:
            tasks, distinct = db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM tasks WHERE task_group_id=?", (group,)).fetchone()
            results = db.execute("SELECT COUNT(*) FROM results r JOIN tasks t ON t.id = r.task_id WHERE t.task_group_id=?", (group,)).fetchone()[0]
        if results >= 301 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (tasks, distinct, results) == (301, 301, 301)
    if early:
        assert early_sent > 0  # some went out before the hub's commit
    else:
        assert early_sent == 0


def test_results_are_resent_after_the_cursor_and_completed_once(mesh: tuple[LocalMesh, str]) -> None:
    """At least once on the wire: a reconnect from an older cursor gets the same results again;
    the Executor completes each future once and keeps its value."""
    m, ep = mesh
    with Executor(m.client, endpoint_id=ep) as ex:
        _wait_connected(ex)
        start = ex._cursor
        futs = [ex.submit(square, i) for i in range(20)]
        assert [f.result(60) for f in futs] == [i * i for i in range(20)]
        # The hub resends everything after an older cursor (what a reconnect after a loss does).
        with _raw(m) as ws:
            ws.send(json.dumps({"op": "hello", "after": start}))
            assert json.loads(ws.recv(timeout=30))["op"] == "welcome"
            seen: list[dict[str, Any]] = []
            deadline = time.monotonic() + 30
            while len({r["task_id"] for r in seen} & {f.task_id for f in futs}) < 20 and time.monotonic() < deadline:  # type: ignore[attr-defined]
                msg = json.loads(ws.recv(timeout=30))
                if msg["op"] == "results":
                    seen += msg["results"]
        ex._deliver(seen, 0)  # delivered a second time: no future changes
        assert [f.result(0) for f in futs] == [i * i for i in range(20)]
    assert {f.task_id for f in futs} <= {r["task_id"] for r in seen}  # type: ignore[attr-defined]


def test_bad_token_is_refused_with_a_clear_close_reason_and_nothing_stored(mesh: tuple[LocalMesh, str]) -> None:
    m, ep = mesh
    before = _counts(m)
    body = serialize_function(square)
    with _raw(m, token="cm_not-a-real-token") as ws:
        with pytest.raises(ConnectionClosed) as info:
            ws.send(json.dumps({"op": "hello", "after": 0}))
            ws.send(json.dumps({"op": "submit", "ref": 1, "batch": _batch(ep, function_id(body), body, 3)}))
            ws.recv(timeout=30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 4401
    assert "refused the token" in info.value.rcvd.reason
    with _raw(m, token="") as ws, pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=30)
    assert info.value.rcvd is not None and info.value.rcvd.code == 4401 and "missing API token" in info.value.rcvd.reason
    # The SDK's side says it in one line, as a 401.
    bad = Client(m.url, "cm_not-a-real-token", timeout=10)
    try:
        with pytest.raises(AuthError, match="refused the token"):
            HubStream(bad)._connect(0)
    finally:
        bad.close()
    assert _counts(m) == before


@pytest.mark.parametrize("frame, reason", [
    ("not json at all", "frame is not JSON"),
    (b"\x00\x01binary", "binary frames are not part of this protocol"),
    (json.dumps([1, 2]), 'JSON object with an "op"'),
    (json.dumps({"op": "submit", "ref": 1, "batch": {}}), 'first frame must be "hello"'),
    (json.dumps({"op": "hello", "after": -5}), '"after" must be a result cursor'),
])
def test_malformed_first_frame_closes_with_the_reason(mesh: tuple[LocalMesh, str], frame: str | bytes, reason: str) -> None:
    m, _ = mesh
    before = _counts(m)
    with _raw(m) as ws:
        ws.send(frame)
        with pytest.raises(ConnectionClosed) as info:
            while True:
                msg = json.loads(ws.recv(timeout=30))
                assert msg["op"] == "error" and reason in msg["detail"]
    assert info.value.rcvd is not None and info.value.rcvd.code == 4400 and reason in info.value.rcvd.reason
    assert _counts(m) == before


def test_malformed_submits_are_refused_and_store_nothing(mesh: tuple[LocalMesh, str]) -> None:
    m, ep = mesh
    before = _counts(m)
    body = serialize_function(square)
    fid = function_id(body)
    good = _batch(ep, fid, body, 2)
    bad_args = _batch(ep, fid, body, 2)
    bad_args["tasks"][1]["args"] = "%%% not base64 %%%"
    with _raw(m) as ws:
        ws.send(json.dumps({"op": "hello", "after": None}))
        assert json.loads(ws.recv(timeout=30))["op"] == "welcome"
        cases = [
            (bad_args, 422, "batch.tasks.1.args"),
            ({**good, "tasks": []}, 422, "batch.tasks"),
            ({**good, "surprise": 1}, 422, "batch.surprise"),
            ({**good, "idempotency_key": "x"}, 422, "batch.idempotency_key"),
            (_batch(ep, "0" * 64, body, 1), 422, "not the SHA-256 of its body"),
            ({**_batch("ep-nope", fid, body, 1)}, 404, "unknown endpoint ep-nope"),
            ("just a string", 422, "batch"),
        ]
        for ref, (batch, status, detail) in enumerate(cases, 1):
            ws.send(json.dumps({"op": "submit", "ref": ref, "batch": batch}))
            msg = json.loads(ws.recv(timeout=30))
            assert (msg["op"], msg["ref"], msg["status"]) == ("refused", ref, status), msg
            assert detail in msg["detail"], msg
        # A submit frame without a ref cannot be answered: the connection closes with the reason.
        ws.send(json.dumps({"op": "submit", "batch": good}))
        with pytest.raises(ConnectionClosed) as info:
            while True:
                ws.recv(timeout=30)
        assert info.value.rcvd is not None and info.value.rcvd.code == 4400 and 'integer "ref"' in info.value.rcvd.reason
    assert _counts(m) == before


def test_idempotency_key_is_the_same_request_on_stream_and_rest(mesh: tuple[LocalMesh, str]) -> None:
    m, ep = mesh
    body = serialize_function(square)
    fid = function_id(body)
    key = uuid.uuid4().hex
    batch = _batch(ep, fid, body, 4, key)
    before = _counts(m)[0]
    with _raw(m) as ws:
        ws.send(json.dumps({"op": "hello", "after": None}))
        assert json.loads(ws.recv(timeout=30))["op"] == "welcome"
        answers = []
        for ref in (1, 2):  # a retry on the stream
            ws.send(json.dumps({"op": "submit", "ref": ref, "batch": batch}))
            while True:
                msg = json.loads(ws.recv(timeout=30))
                if msg.get("ref") == ref:
                    answers.append(msg)
                    break
        ws.send(json.dumps({"op": "submit", "ref": 3, "batch": {**batch, "tasks": batch["tasks"][:1]}}))
        while True:
            conflict = json.loads(ws.recv(timeout=30))
            if conflict.get("ref") == 3:
                break
    assert answers[0]["op"] == answers[1]["op"] == "accepted"
    assert answers[0]["task_ids"] == answers[1]["task_ids"] and len(answers[0]["task_ids"]) == 4
    assert (conflict["op"], conflict["status"]) == ("refused", 409)
    rest = m.client.request("POST", "/v1/tasks/batch", json=batch)  # the same key and body over REST
    assert rest["task_ids"] == answers[0]["task_ids"]
    assert _counts(m)[0] == before + 4


def test_a_hub_without_the_stream_is_used_over_rest(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    with LocalMesh(tmp_path, heartbeat_s=0.5, lost_after_s=3.0, hub_overrides={"stream": False}) as m:
        agent = m.add_agent("r", "zmq", workers=2)
        m.wait_online(timeout=90)
        with Executor(m.client, endpoint_id=agent.endpoint_id, task_group_id="rest-only") as ex:
            got = [f.result(120) for f in [ex.submit(square, i) for i in range(50)]]
            deadline = time.monotonic() + 30
            while ex._stream is not None and time.monotonic() < deadline:  # the reader gives up on the stream at its first try
                time.sleep(0.05)
            assert ex._stream is None
        with sqlite3.connect(m.hub_cfg.db_path, timeout=30) as db:
            stored = db.execute("SELECT COUNT(*), COUNT(DISTINCT id) FROM tasks WHERE task_group_id='rest-only'").fetchone()
    assert got == [i * i for i in range(50)]
    assert stored == (50, 50)


def test_result_rows_on_the_stream_are_the_rest_rows() -> None:
    """The stream builds result rows directly; they must stay what REST's ResultOut gives."""
    from cloud_hub.api.app import _result_out
    from cloud_hub.api.stream import _row

    for r in ({"task_id": "t1", "ok": 1, "data": b"\x01\x02", "started": 1.5, "finished": 2.5, "endpoint_id": "ep-1", "own_endpoint": True},
              {"task_id": "t2", "ok": 0, "data": None, "started": None, "finished": None}):
        assert _row(r) == _result_out(r).model_dump(mode="json")


def test_stream_over_https_uses_wss_with_the_hubs_ca(tmp_path: Path) -> None:
    """An https:// hub with a private CA: the stream is wss:// and verified with the same CA as REST."""
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=3.0, tls=True) as m:
        assert m.url.startswith("https://")
        agent = m.add_agent("t", "zmq", workers=1)
        m.wait_online(timeout=90)
        with Executor(m.client, endpoint_id=agent.endpoint_id) as ex:
            stream = ex._stream
            assert stream is not None and stream.url.startswith("wss://") and stream.connected
            assert [f.result(60) for f in [ex.submit(square, i) for i in range(20)]] == [i * i for i in range(20)]
            assert stream.submits >= 1 and stream.connects == 1
        # A client that does not trust the hub's CA gets no stream (and no REST either): one clear line.
        untrusting = Client(m.url, m.token, timeout=10, verify=True)
        try:
            with pytest.raises(HubUnreachable, match="stream"):
                HubStream(untrusting)._connect(0)
        finally:
            untrusting.close()


def _recv_ref(ws: Any, ref: int) -> dict[str, Any]:
    """The answer to submit ``ref`` on a msgpack stream (result frames in between are skipped)."""
    while True:
        got = ws.recv(timeout=30)
        assert isinstance(got, bytes), f"a msgpack stream answered with text: {got!r}"
        msg = msgpack.unpackb(got, raw=False)
        if msg.get("ref") == ref:
            return msg


def test_msgpack_stream_carries_raw_bytes_and_refuses_bad_frames(mesh: tuple[LocalMesh, str]) -> None:
    """A hello with ``"enc": "msgpack"`` switches both directions to binary frames: arguments,
    function bodies and results travel as raw bytes. A bad batch is refused with REST's words and
    stores nothing; a frame that is not msgpack closes the stream with the reason."""
    m, ep = mesh
    body = serialize_function(square)
    fid = function_id(body)
    batch = {"tasks": [{"endpoint_id": ep, "function_id": fid, "args": serialize(((i,), {}))} for i in range(5)],
             "functions": {fid: {"name": "square", "body": body}}}
    with _raw(m) as ws:
        ws.send(json.dumps({"op": "hello", "after": None, "enc": "msgpack"}))
        welcome = json.loads(ws.recv(timeout=30))  # the welcome is still JSON text
        assert (welcome["op"], welcome["enc"]) == ("welcome", "msgpack")
        before = _counts(m)
        bad_args = {**batch, "tasks": [{**batch["tasks"][0], "args": 5}]}
        cases = [
            (bad_args, 422, "batch.tasks.0.args"),
            ({**batch, "surprise": 1}, 422, "batch.surprise"),
            ({**batch, "functions": {fid: {"name": "square", "body": serialize_function(len)}}}, 422, "not the SHA-256"),
            ({**batch, "tasks": [{**batch["tasks"][0], "endpoint_id": "ep-nope"}]}, 404, "unknown endpoint ep-nope"),
        ]
        for ref, (b, status, detail) in enumerate(cases, 1):
            ws.send(msgpack.packb({"op": "submit", "ref": ref, "batch": b}, use_bin_type=True))
            msg = _recv_ref(ws, ref)
            assert (msg["op"], msg["status"]) == ("refused", status) and detail in msg["detail"], msg
        assert _counts(m) == before
        ws.send(msgpack.packb({"op": "submit", "ref": 9, "batch": batch}, use_bin_type=True))
        accepted = _recv_ref(ws, 9)
        assert accepted["op"] == "accepted" and len(accepted["task_ids"]) == 5
        got: dict[str, bytes] = {}
        deadline = time.monotonic() + 60
        while len(got) < 5 and time.monotonic() < deadline:
            msg = msgpack.unpackb(ws.recv(timeout=30), raw=False)
            for r in msg.get("results", []):
                if r["task_id"] in accepted["task_ids"]:
                    assert isinstance(r["data"], bytes)  # raw, not base64 text
                    got[r["task_id"]] = r["data"]
        assert len(got) == 5
        ws.send(b"\xc1 this is not msgpack")
        with pytest.raises(ConnectionClosed) as info:
            while True:
                ws.recv(timeout=30)
        assert info.value.rcvd is not None and info.value.rcvd.code == 4400 and "not msgpack" in info.value.rcvd.reason


def test_unknown_encoding_in_hello_gets_json(mesh: tuple[LocalMesh, str]) -> None:
    m, _ = mesh
    with _raw(m) as ws:
        ws.send(json.dumps({"op": "hello", "after": None, "enc": "xml"}))
        welcome = json.loads(ws.recv(timeout=30))
    assert (welcome["op"], welcome["enc"]) == ("welcome", "json")


def test_sdk_speaks_msgpack_and_falls_back_to_json(mesh: tuple[LocalMesh, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK asks for msgpack; a hub that answers JSON (one that does not speak msgpack) gets
    JSON text frames from the same SDK, with the same results."""
    from cloud_hub.api import _stream_wire as wire

    m, ep = mesh
    for hub_speaks, expect in ((("json", "msgpack"), "msgpack"), (("json",), "json")):
        monkeypatch.setattr(wire, "ENCODINGS", hub_speaks)
        with Executor(m.client, endpoint_id=ep) as ex:
            _wait_connected(ex)
            assert [f.result(60) for f in [ex.submit(square, i) for i in range(20)]] == [i * i for i in range(20)]
            assert ex._stream is not None and ex._stream.enc == expect
