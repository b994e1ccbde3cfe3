"""Admission control (issue 16, item 3) on a real mesh: Mosquitto, the hub, ZeroMQ agents.

- past a user's queue bound the hub answers 429 with Retry-After and stores nothing; a batch
  larger than the bound itself gets 413 (it could never fit);
- the SDK's Executor resubmits over a bound transparently: every task runs once, none is lost
  or doubled (idempotency keys);
- a function's concurrency limit holds on an endpoint with more workers than the limit;
- a config with bad limits or shares keeps the hub from starting, with the entry named.
"""

from __future__ import annotations

import asyncio
import base64
import sqlite3
from typing import Any, Iterator

import httpx
import pytest
from pydantic import ValidationError

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor, HubError
from cloud_hub.config import HubConfig
from cloud_hub.localmesh import AgentProcess, LocalMesh
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import function_id, serialize, serialize_function

pytestmark = pytest.mark.integration


def tiny(i: int) -> int:
    return i


def slow(i: int) -> int:
    import time

    time.sleep(0.4)
    return i


FID_TINY = function_id(serialize_function(tiny))
FID_SLOW = function_id(serialize_function(slow))


class _M:
    def __init__(self, mesh: LocalMesh, online: AgentProcess, offline: AgentProcess, carol: Client) -> None:
        self.mesh, self.online, self.offline, self.carol = mesh, online, offline, carol


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_M]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    limits = {"users": {"carol": {"max_queued": 20}}, "functions": {FID_TINY: {"max_queued": 10}, FID_SLOW: {"max_running": 2}}}
    mesh = LocalMesh(tmp_path_factory.mktemp("admission"), heartbeat_s=0.5, lost_after_s=3.0, hub_overrides={"limits": limits})
    mesh.start()
    try:
        online = mesh.add_agent("busy", "zmq", workers=4)
        offline = mesh.add_agent("away", "zmq", workers=1, start=False)  # enrolled, never started: work waits at the hub
        mesh.wait_online(online, timeout=90)

        async def mint() -> str:
            store = await SqliteStore(mesh.hub_cfg.db_path).open()
            try:
                return await store.create_api_token(await store.create_user("carol"), "test")
            finally:
                await store.close()

        carol = Client(mesh.url, asyncio.run(mint()))
        mesh.client.share_endpoint(offline.endpoint_id, "carol")
        yield _M(mesh, online, offline, carol)
        carol.close()
    finally:
        mesh.stop()


def _count(m: _M, sql: str = "SELECT COUNT(*) FROM tasks", args: tuple[Any, ...] = ()) -> int:
    with sqlite3.connect(m.mesh.hub_cfg.db_path) as c:
        return int(c.execute(sql, args).fetchone()[0])


def _specs(ep: str, fid: str, n: int) -> list[dict[str, Any]]:
    return [{"endpoint_id": ep, "function_id": fid, "args": base64.b64encode(serialize(((i,), {}))).decode()} for i in range(n)]


def test_past_the_queue_bound_the_hub_answers_429_with_retry_after_and_stores_nothing(m: _M) -> None:
    fid = m.carol.register_function(slow)
    m.carol.submit_batch_placed(_specs(m.offline.endpoint_id, fid, 15))
    before = _count(m)
    r = httpx.post(f"{m.mesh.url}/v1/tasks/batch", json={"tasks": _specs(m.offline.endpoint_id, fid, 10)},
                   headers={"Authorization": f"Bearer {m.carol._http.headers['Authorization'].split()[1]}"})
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert "15 queued and submitted 10, over your bound of 20" in r.json()["detail"]
    assert _count(m) == before
    with pytest.raises(HubError) as info:  # the SDK's error carries the hub's Retry-After
        m.carol.submit_batch_placed(_specs(m.offline.endpoint_id, fid, 6))
    assert info.value.status == 429 and info.value.retry_after is not None and info.value.retry_after >= 1
    with pytest.raises(HubError) as big:  # could never fit: not a 429 to retry forever
        m.carol.submit_batch_placed(_specs(m.offline.endpoint_id, fid, 21))
    assert big.value.status == 413 and "exceeds your queue bound of 20" in big.value.detail
    assert _count(m) == before
    m.carol.submit_batch_placed(_specs(m.offline.endpoint_id, fid, 5))  # exactly up to the bound is fine
    assert _count(m) == before + 5


def test_the_executor_resubmits_over_a_bound_and_every_task_runs_once(m: _M) -> None:
    before = _count(m, "SELECT COUNT(*) FROM tasks WHERE function_id=?", (FID_TINY,))
    # batches of 5 (the hub bounds this function at 10 queued): the submitter meets 429s and waits them out
    with Executor(m.mesh.client, endpoint=m.online.endpoint_id, batch_size=5) as ex:
        futs = [ex.submit(tiny, i) for i in range(60)]
        assert sorted(f.result(timeout=240) for f in futs) == list(range(60))
    assert _count(m, "SELECT COUNT(*) FROM tasks WHERE function_id=?", (FID_TINY,)) == before + 60
    assert m.mesh.hub is not None and m.mesh.hub.hub.admission.stats["refused"] > 0, "the bound was never reached: the test proved nothing"


def test_a_functions_concurrency_limit_holds_on_a_bigger_endpoint(m: _M) -> None:
    with Executor(m.mesh.client, endpoint=m.online.endpoint_id) as ex:
        futs = [ex.submit(slow, i) for i in range(8)]
        assert sorted(f.result(timeout=120) for f in futs) == list(range(8))
        spans = [(f.started, f.finished) for f in futs]  # type: ignore[attr-defined]
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    running = most = 0
    for _, d in edges:
        running += d
        most = max(most, running)
    assert most <= 2, f"{most} ran at once on a 4-worker endpoint under max_running=2"


@pytest.mark.parametrize("settings, words", [
    ({"limits": {"user": {"max_queued": -5}}}, "limits.user.max_queued"),
    ({"limits": {"users": {"bob": {"max_parallel": 3}}}}, "unknown key(s) ['max_parallel']"),
    ({"limits": "{not json"}, "limits is not valid JSON"),
    ({"shares": "alice=lots"}, "the weight of 'alice' is not a number"),
    ({"shares": {"alice": 0}}, "shares.alice: a share is a number > 0"),
])
def test_bad_limits_or_shares_keep_the_hub_from_starting(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError) as info:
        HubConfig(**settings)
    assert words in str(info.value)


def test_mesh_hub_serve_with_bad_limits_exits_with_one_line_and_creates_nothing(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    db = tmp_path / "hub.sqlite3"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    env["MESH_HUB_LIMITS"] = '{"user": {"max_queued": 0}}'
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "serve", "--db", str(db), "--port", "0", "--mqtt-host", ""],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "limits.user.max_queued: must be a whole number >= 1" in lines[0]
    assert not db.exists()
