"""/v1/fl/runs against a real hub (uvicorn, SQLite file): the JSON the console reads, refusals
that change nothing, per-user isolation, and persistence across a hub restart."""

from __future__ import annotations

import asyncio
import base64
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from cloud_hub.client import Client, HubError
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from cloud_hub.store import SqliteStore
from fl.wire import decode_weights, encode_weights

pytestmark = pytest.mark.integration

W1 = encode_weights([np.arange(6, dtype=np.float32).reshape(2, 3)])


def _cfg(tmp_path: Path, port: int = 0) -> HubConfig:
    return HubConfig(db_path=tmp_path / "hub.sqlite3", port=port, mqtt_host=None, zmq_bind=None, bootstrap_user="alice")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[HubThread, Client, Client]]:
    async def mint() -> str:
        store = await SqliteStore(tmp_path / "hub.sqlite3").open()
        try:
            return await store.create_api_token(await store.create_user("bob"), "t")
        finally:
            await store.close()

    bob_token = asyncio.run(mint())
    h = HubThread(_cfg(tmp_path)).start()
    alice, bob = Client(h.url, h.token), Client(h.url, bob_token)
    try:
        yield h, alice, bob
    finally:
        alice.close()
        bob.close()
        h.stop()


def _rec(n: int, **kw: Any) -> dict[str, Any]:
    return {"round": n, "loss": 1.0 / n, "accuracy": 0.5 + n / 100, "participants": ["ep-a", "ep-b"], "stragglers": ["ep-c"],
            "dropped": {}, "round_time_s": 0.4, "extra": {"asked": ["ep-a", "ep-b", "ep-c"]}, **kw}


def _counts(db: Path) -> tuple[int, ...]:
    with sqlite3.connect(db) as c:
        return tuple(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("fl_runs", "fl_rounds", "fl_checkpoints"))


def test_run_lifecycle_json_shapes(hub) -> None:
    _, alice, _ = hub
    run = alice.fl_create_run("digits", strategy="fedavg", rounds_planned=2, clients=["ep-a", "ep-b", "ep-c"],
                              client_names={"ep-a": "pi-1"}, config={"dataset": "digits", "local_epochs": 2})
    assert run["id"].startswith("flr-") and run["status"] == "running" and run["rounds"] == [] and run["checkpoint"] is None
    assert run["num_clients"] == 3 and run["client_names"] == {"ep-a": "pi-1"} and run["mode"] == "sync"
    alice.fl_put_round(run["id"], 1, _rec(1), W1)
    alice.fl_put_round(run["id"], 1, _rec(1, accuracy=0.55), W1)  # retry of the last round: replaces it
    out = alice.fl_put_round(run["id"], 2, _rec(2), W1, state={"version": 2}, status="finished")
    assert out == {"run_id": run["id"], "round": 2, "status": "finished", "checkpoint_bytes": len(W1)}
    got = alice.fl_run(run["id"])
    assert got["status"] == "finished" and got["rounds_done"] == 2 and got["last_accuracy"] == 0.52
    assert [r["round"] for r in got["rounds"]] == [1, 2] and got["rounds"][0]["accuracy"] == 0.55
    assert set(got["rounds"][0]) == {"round", "loss", "accuracy", "participants", "stragglers", "dropped", "round_time_s", "extra"}
    assert got["checkpoint"]["round"] == 2 and got["checkpoint"]["bytes"] == len(W1)
    ck = alice.fl_checkpoint(run["id"])
    assert ck["state"] == {"version": 2} and np.array_equal(decode_weights(ck["weights"])[0], decode_weights(W1)[0])
    (summary,) = alice.fl_runs()
    assert summary["id"] == run["id"] and summary["rounds_done"] == 2 and "rounds" not in summary and "config" not in summary
    assert alice.fl_runs(status="running") == []


def test_bad_requests_are_refused_and_change_nothing(hub, tmp_path: Path) -> None:
    h, alice, bob = hub
    run = alice.fl_create_run("r", strategy="fedavg", rounds_planned=3)
    alice.fl_put_round(run["id"], 1, _rec(1), W1)
    db = tmp_path / "hub.sqlite3"
    before = _counts(db), alice.fl_run(run["id"])
    rid = run["id"]
    b64 = base64.b64encode(W1).decode()
    cases: list[tuple[str, str, str, Any, int, str]] = [
        ("skips a round", "PUT", f"/v1/fl/runs/{rid}/rounds/3", {"record": _rec(3), "weights": b64}, 409, "next round is 2"),
        ("round zero", "PUT", f"/v1/fl/runs/{rid}/rounds/0", {"record": _rec(1), "weights": b64}, 422, "path says round 0"),
        ("path and record disagree", "PUT", f"/v1/fl/runs/{rid}/rounds/2", {"record": _rec(3), "weights": b64}, 422, "path says round 2"),
        ("weights not a blob", "PUT", f"/v1/fl/runs/{rid}/rounds/2", {"record": _rec(2), "weights": base64.b64encode(b"x" * 20).decode()}, 422, "bad magic"),
        ("weights not base64", "PUT", f"/v1/fl/runs/{rid}/rounds/2", {"record": _rec(2), "weights": "abc"}, 422, "base64"),
        ("unknown field", "PUT", f"/v1/fl/runs/{rid}/rounds/2", {"record": _rec(2, surprise=1), "weights": b64}, 422, "surprise"),
        ("unknown run", "PUT", "/v1/fl/runs/flr-nope/rounds/2", {"record": _rec(2), "weights": b64}, 404, "unknown FL run"),
        ("bad status", "PATCH", f"/v1/fl/runs/{rid}", {"status": "exploded"}, 422, "status"),
        ("empty name", "POST", "/v1/fl/runs", {"name": "", "strategy": "x", "rounds_planned": 1}, 422, "name"),
        ("zero rounds", "POST", "/v1/fl/runs", {"name": "n", "strategy": "x", "rounds_planned": 0}, 422, "rounds_planned"),
        ("huge config", "POST", "/v1/fl/runs", {"name": "n", "strategy": "x", "rounds_planned": 1, "config": {"x": "y" * 70000}}, 413, "over the"),
        ("no checkpoint yet", "GET", "/v1/fl/runs/flr-nope/checkpoint", None, 404, "unknown FL run"),
    ]
    for name, method, path, body, status, text in cases:
        with pytest.raises(HubError) as info:
            alice.request(method, path, json=body)
        assert info.value.status == status, (name, info.value.detail)
        assert text in info.value.detail, (name, info.value.detail)
    big = HubConfig().max_payload_bytes
    with pytest.raises(HubError) as info:
        alice.request("PUT", f"/v1/fl/runs/{rid}/rounds/2", json={"record": _rec(2), "weights": base64.b64encode(b"\0" * (big + 1)).decode()})
    assert info.value.status == 413
    # another user's run does not exist for them, and they cannot write to it
    for call in (lambda: bob.fl_run(rid), lambda: bob.fl_checkpoint(rid), lambda: bob.fl_put_round(rid, 2, _rec(2), W1),
                 lambda: bob.fl_set_status(rid, "aborted")):
        with pytest.raises(HubError) as info:
            call()
        assert info.value.status == 404
    assert bob.fl_runs() == []
    # no token
    assert httpx.get(f"{h.url}/v1/fl/runs").status_code == 401
    assert (_counts(db), alice.fl_run(rid)) == before
    # a finished run takes no more rounds and cannot be reopened
    alice.fl_put_round(rid, 2, _rec(2), W1, status="finished")
    with pytest.raises(HubError, match="409.*finished"):
        alice.fl_put_round(rid, 3, _rec(3), W1)
    with pytest.raises(HubError, match="409.*finished"):
        alice.fl_set_status(rid, "running")


def test_runs_survive_a_hub_restart(tmp_path: Path) -> None:
    h = HubThread(_cfg(tmp_path)).start()
    token, port = h.token, h.cfg.port
    with Client(h.url, token) as c:
        rid = c.fl_create_run("r", strategy="fedbuff", mode="async", rounds_planned=5)["id"]
        c.fl_put_round(rid, 1, _rec(1), W1, state={"version": 1})
        c.fl_set_status(rid, "aborted", "driver stopped")
    h.stop()
    h2 = HubThread(_cfg(tmp_path, port)).start()
    try:
        with Client(h2.url, token) as c:
            run = c.fl_run(rid)
            assert run["status"] == "aborted" and run["error"] == "driver stopped" and run["rounds_done"] == 1
            assert c.fl_checkpoint(rid)["state"] == {"version": 1}
            assert c.fl_set_status(rid, "running")["error"] is None
            c.fl_put_round(rid, 2, _rec(2), W1)
            assert c.fl_run(rid)["rounds_done"] == 2
    finally:
        h2.stop()
