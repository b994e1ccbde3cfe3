"""Each endpoint's frame bytes per day (``info.bytes_per_day`` in ``GET /v1/endpoints``, shown by the
console): counted by the hub, kept in the endpoint's info so a restarted hub goes on from them; and
a replica that does not hold a metered endpoint's session judges it by the bound its hello chose.

Real hub(s), real Mosquitto, real agent processes; PostgreSQL for the replica test (tests/pg.py)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import psycopg
import pytest

from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import LocalMesh
from cloud_hub.server import HubThread
from tests.pg import pg_url  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


def double(x: int) -> int:
    return 2 * x


def _info(client: Client, endpoint_id: str) -> dict:
    return next(e for e in client.list_endpoints() if e["id"] == endpoint_id)


def _stored_traffic(db: Path, endpoint_id: str) -> dict:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (info,), = c.execute("SELECT info FROM endpoints WHERE id=?", (endpoint_id,)).fetchall()
    return json.loads(info).get("traffic") or {}


def test_bytes_per_day_are_reported_and_survive_a_hub_restart(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("counted", "mqtt", workers=1)
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert [f.result(60) for f in [ex.submit(double, i) for i in range(20)]] == [2 * i for i in range(20)]
    e = _info(mesh.client, agent.endpoint_id)
    b = e["info"]["bytes_per_day"]
    assert b["up"] > 0 and b["down"] > 0 and b["since"] <= time.time()
    assert mesh.hub is not None
    live = mesh.hub.hub.dispatcher.traffic[agent.endpoint_id]  # counted frame bytes, scaled to a day over >= 1 h
    assert b["up"] <= live[0] * 24 and b["down"] <= live[1] * 24 and b["since"] == live[4]

    # The counters kept in the endpoint's info (written at each heartbeat) outlive the hub.
    deadline = time.monotonic() + 30
    while _stored_traffic(mesh.hub_cfg.db_path, agent.endpoint_id).get("bytes_in", 0) < 1000 and time.monotonic() < deadline:
        time.sleep(0.2)
    kept = _stored_traffic(mesh.hub_cfg.db_path, agent.endpoint_id)
    assert kept.get("bytes_in", 0) >= 1000, kept
    mesh.stop_hub()
    restarted = time.time()
    mesh.start_hub()
    mesh.wait_online(agent, timeout=60)
    after = _info(mesh.client, agent.endpoint_id)["info"]["bytes_per_day"]
    assert after["since"] == pytest.approx(kept["since"]) and after["since"] < restarted
    assert mesh.hub.hub.dispatcher.traffic[agent.endpoint_id][0] >= kept["bytes_in"]


def _db(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(url) as c:
        return c.execute(sql).fetchall()


def test_a_replica_without_the_session_keeps_a_quiet_metered_endpoint_online(tmp_path: Path, pg_url: str) -> None:  # noqa: F811
    """A metered MQTT agent beats only on change or every beat_max_s. The replica holding its
    session bounds its silence by beat_max_s + mqtt_lost_after_s (its will ends it sooner); another
    replica, reading the shared row, must use the same bound, not lost_after_s."""
    lost_after_s = 2.0
    mesh = LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=lost_after_s, lease_s=10.0,
                     hub_overrides={"database_url": pg_url, "mqtt_client_id": "hub-a", "replica_id": "a",
                                    "mqtt_lost_after_s": 60.0, "beat_max_s": 600.0})
    mesh.start()
    hub_b: HubThread | None = None
    try:
        cfg_b = mesh.hub_cfg.model_copy(update={"port": 0, "zmq_bind": "tcp://127.0.0.1:*", "mqtt_client_id": "hub-b", "replica_id": "b",
                                                "mqtt_username": "mesh-hub-b", "mqtt_password": "b-" + "x" * 30})
        hub_b = HubThread(cfg_b).start()
        clients = {"a": mesh.client, "b": Client(hub_b.url, mesh.token)}
        agent = mesh.add_agent("quiet-pi", "mqtt", workers=1, profile="metered")
        mesh.wait_online(agent, timeout=60)
        deadline = time.monotonic() + 30
        owner: str | None = None
        while owner is None and time.monotonic() < deadline:
            rows = _db(pg_url, f"SELECT replica FROM endpoint_owners WHERE endpoint_id='{agent.endpoint_id}'")
            owner = rows[0][0] if rows else None
            time.sleep(0.1)
        assert owner in clients, "some replica holds the session"
        other = clients["b" if owner == "a" else "a"]
        # Quiet well past lost_after_s: no task, no state change, beat_max_s far away.
        time.sleep(lost_after_s * 2.5)
        seen = _info(other, agent.endpoint_id)
        assert time.time() - seen["last_seen"] > lost_after_s, "the shared row really is older than lost_after_s"
        assert seen["info"].get("beats") == "adaptive"
        assert seen["online"] is True, "the other replica judges a metered endpoint by its own bound"
        assert seen["info"]["bytes_per_day"]["up"] > 0, "bytes per day from the counters the holder keeps in the row"
        assert _info(clients[owner], agent.endpoint_id)["online"] is True
        # A clean stop says goodbye: the holder ends the session, and the other replica follows the row.
        assert agent.stop() == 0
        deadline = time.monotonic() + 30
        while _info(other, agent.endpoint_id)["online"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _info(other, agent.endpoint_id)["online"] is False
        clients["b"].close()
    finally:
        if hub_b is not None:
            hub_b.stop()
        mesh.stop()
