"""Idempotent submission (issue 13, item 4): a retried submit with the same key never makes a
second task, even when the hub is SIGKILLed in the middle of a large POST."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_hub.broker import free_port
from cloud_hub.client import Client, HubError
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from cloud_hub.store import make_store
from mesh_agent.cli import enroll

pytestmark = pytest.mark.integration


def triple(x: int) -> int:
    return 3 * x


def _count(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return int(c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


@pytest.fixture
def hub(tmp_path: Path) -> Any:
    with HubThread(HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="alice")) as h:
        client = Client(h.url, h.token)
        ep = enroll(h.url, client.create_enrollment_token(), "pi", tmp_path / "agent.yaml", transport="zmq").endpoint_id
        yield h, client, ep
        client.close()


def test_same_key_returns_the_first_tasks_and_inserts_nothing(hub: Any, tmp_path: Path) -> None:
    h, client, ep = hub
    fid = client.register_function(triple)
    specs = [Client.task_spec(ep, fid, (i,)) for i in range(50)]
    key = uuid.uuid4().hex
    first = client.submit_batch_placed(specs, idempotency_key=key)
    again = client.submit_batch_placed(specs, idempotency_key=key)
    assert again == first and len(set(first[0])) == 50
    assert _count(tmp_path / "hub.sqlite3") == 50
    # single submits take a key too
    one = client.request("POST", "/v1/tasks", json={**Client.task_spec(ep, fid, (7,)), "idempotency_key": "single-" + key})
    assert client.request("POST", "/v1/tasks", json={**Client.task_spec(ep, fid, (7,)), "idempotency_key": "single-" + key}) == one
    assert _count(tmp_path / "hub.sqlite3") == 51
    # without a key, the same batch is new work
    client.submit_batch_placed(specs)
    assert _count(tmp_path / "hub.sqlite3") == 101


@pytest.mark.parametrize("body, status, says", [
    ("other-request", 409, "was used for a different request"),
    ("bad-key", 422, "idempotency_key"),
    ("key-on-task", 422, "belongs on the batch"),
])
def test_bad_keys_are_refused_and_store_nothing(hub: Any, tmp_path: Path, body: str, status: int, says: str) -> None:
    h, client, ep = hub
    fid = client.register_function(triple)
    key = uuid.uuid4().hex
    client.submit_batch_placed([Client.task_spec(ep, fid, (1,))], idempotency_key=key)
    before = _count(tmp_path / "hub.sqlite3")
    if body == "other-request":
        payload: dict[str, Any] = {"tasks": [Client.task_spec(ep, fid, (2,))], "idempotency_key": key}
    elif body == "bad-key":
        payload = {"tasks": [Client.task_spec(ep, fid, (2,))], "idempotency_key": "no spaces allowed"}
    else:
        payload = {"tasks": [{**Client.task_spec(ep, fid, (2,)), "idempotency_key": uuid.uuid4().hex}]}
    with pytest.raises(HubError) as err:
        client.request("POST", "/v1/tasks/batch", json=payload)
    assert err.value.status == status and says in err.value.detail
    assert _count(tmp_path / "hub.sqlite3") == before


# ---------------------------------------------------------------- SIGKILL during a large POST
def _start_hub(db: Path, port: int, log: Path, zmq_port: int) -> subprocess.Popen[bytes]:
    code = ("from cloud_hub.config import HubConfig; from cloud_hub.server import serve; "
            f"serve(HubConfig(db_path={str(db)!r}, port={port}, mqtt_host=None, zmq_bind='tcp://127.0.0.1:{zmq_port}'))")
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)


def _wait_up(url: str, token: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "hub exited during start-up"
        try:
            if httpx.get(f"{url}/v1/endpoints", headers={"Authorization": f"Bearer {token}"}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"hub not up within {timeout}s")


def test_hub_sigkilled_during_a_large_post_makes_one_task_per_key(tmp_path: Path) -> None:
    db, port, zmq_port = tmp_path / "hub.sqlite3", free_port(), free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "hub.log"

    async def bootstrap() -> str:
        store = await make_store(HubConfig(db_path=db)).open()
        try:
            return await store.create_api_token(await store.create_user("alice"), "test")
        finally:
            await store.close()

    token = asyncio.run(bootstrap())
    proc = _start_hub(db, port, log, zmq_port)
    try:
        _wait_up(url, token, proc)
        client = Client(url, token, timeout=120)
        ep = enroll(url, client.create_enrollment_token(), "pi", tmp_path / "agent.yaml", transport="zmq").endpoint_id
        fid = client.register_function(triple)
        n = 20_000
        specs = [Client.task_spec(ep, fid, (i, "x" * 64)) for i in range(n)]
        t0 = time.monotonic()
        client.submit_batch_placed(specs[:2000], idempotency_key=uuid.uuid4().hex)  # warm up; a tenth of a round
        whole = (time.monotonic() - t0) * 10
        base = _count(db)
        made: dict[str, list[str]] = {}
        interrupted = 0
        for frac in (0.15, 0.35, 0.55, 0.75, 0.95):  # kill points spread across the request
            key = uuid.uuid4().hex
            outcome: dict[str, Any] = {}

            def post() -> None:
                try:
                    outcome["ids"] = Client(url, token, timeout=120).submit_batch_placed(specs, idempotency_key=key)[0]
                except Exception as exc:  # noqa: BLE001 - the point: the hub died under it
                    outcome["error"] = exc

            th = threading.Thread(target=post)
            th.start()
            time.sleep(whole * frac)
            proc.kill()
            proc.wait()
            th.join(60)
            interrupted += "error" in outcome
            proc = _start_hub(db, port, log, zmq_port)
            _wait_up(url, token, proc)
            # the retry a client makes: same batch, same key, until the hub answers
            retry = Client(url, token, timeout=120).submit_batch_placed(specs, idempotency_key=key)[0]
            if "ids" in outcome:
                assert retry == outcome["ids"]
            assert len(set(retry)) == n
            made[key] = retry
        assert interrupted >= 1, "no kill landed inside a request: the test exercised nothing"
        assert _count(db) == base + n * len(made), "exactly one task per submitted task, per key"
        with sqlite3.connect(db) as c:
            stored = {r[0] for r in c.execute("SELECT id FROM tasks")}
        assert all(set(ids) <= stored for ids in made.values())
        print(f"{interrupted} of {len(made)} POSTs interrupted by SIGKILL; one task per key each time")
    finally:
        proc.kill()
        proc.wait()
