"""The swarm harness on a small swarm: 50 endpoints with real connections, real enrollment in bulk,
a real hub process and a real Mosquitto. Checks invariants, never times: every task gets exactly
one result, and (MQTT) every endpoint comes back online after the broker is SIGKILLed and restarted,
and the mesh still delivers every task exactly once afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from sim.swarm.harness import SwarmConfig, run_swarm

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed (./taskw setup installs it)")


@pytest.mark.parametrize("transport", ["mqtt", "zmq"])
def test_small_swarm_delivers_every_task_once(tmp_path: Path, transport: str) -> None:
    cfg = SwarmConfig(50, transport, heartbeat_s=1.0, lost_after_s=20.0, idle_s=1.0, load_s=120.0, max_tasks=300, batch=60,
                      per_endpoint=2, window=300, after_restart_tasks=100)
    report = run_swarm(cfg, tmp_path / "swarm")
    assert "error" not in report, report.get("error")
    assert report["connect"]["all_online"] and report["connect"]["online"] == 50
    assert report["idle"]["online"] == 50 and report["idle"]["heartbeats_per_s"] > 0  # beats flowed
    load = report["load"]
    assert load["drained"], load
    assert load["delivery"] == {"submitted": 300, "delivered": 300, "lost": 0, "duplicated": 0, "unknown": 0}
    assert load["error_count"] == 0, load["errors"]
    assert report["hub_alive"]
    if transport == "mqtt":
        rc = report["reconnect"]
        assert rc["swarm_noticed_drop"] and rc["all_back"] and rc["back"] == 50 and rc["hub_alive"], rc
        after = report["after_restart"]
        assert after["drained"]
        # over the whole run, before and after the restart: 400 tasks, each exactly one result
        assert after["delivery"] == {"submitted": 400, "delivered": 400, "lost": 0, "duplicated": 0, "unknown": 0}
    # the hub's own view, not just the swarm's: every endpoint is online there
    assert report["endpoints_online_at_hub"] == 50


def test_bulk_enrollment_is_all_or_nothing_and_writes_broker_logins(mesh) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from cloud_hub.broker_auth import ACL_FILE, PASSWORD_FILE
    from mesh_agent.transport.zmq import curve_keypair

    url = f"{mesh.url}/v1/endpoints/enroll-batch"
    before = len(mesh.client.list_endpoints())
    tok = mesh.client.create_enrollment_token(uses=3)
    # bad input: clear one-line errors, nothing stored, no token use spent
    r = httpx.post(url, json={"token": "ce_not-a-real-token", "endpoints": [{"name": "a"}]})
    assert r.status_code == 401 and "enrollment token" in r.json()["detail"]
    r = httpx.post(url, json={"token": tok, "endpoints": [{"name": f"e{i}"} for i in range(4)]})  # 4 > 3 uses
    assert r.status_code == 401 and "fewer than 4 uses" in r.json()["detail"]
    r = httpx.post(url, json={"token": tok, "endpoints": [{"name": "bad name!"}]})
    assert r.status_code == 422
    r = httpx.post(url, json={"token": tok, "endpoints": []})
    assert r.status_code == 422
    pub = curve_keypair()[0]
    r = httpx.post(url, json={"token": tok, "transport": "zmq", "endpoints": [{"name": "z1", "curve_public": pub}, {"name": "z2", "curve_public": pub}]})
    assert r.status_code == 422 and "twice" in r.json()["detail"]
    r = httpx.post(url, json={"token": tok, "transport": "zmq", "endpoints": [{"name": "z1"}]})
    assert r.status_code == 422 and "endpoints[0]" in r.json()["detail"]
    assert len(mesh.client.list_endpoints()) == before
    # all three uses in one request: three endpoints, their broker logins and ACLs in the files
    r = httpx.post(url, json={"token": tok, "endpoints": [{"name": f"e{i}"} for i in range(3)]})
    assert r.status_code == 201, r.text
    eps = r.json()["endpoints"]
    assert len(eps) == 3 and len({e["endpoint_id"] for e in eps}) == 3 and all(e["mqtt"]["password"] for e in eps)
    pw = (mesh.broker.workdir / PASSWORD_FILE).read_text()
    acl = (mesh.broker.workdir / ACL_FILE).read_text()
    for e in eps:
        assert f"{e['endpoint_id']}:" in pw and f"topic write mesh/ep/{e['endpoint_id']}/up" in acl
    assert len(mesh.client.list_endpoints()) == before + 3
    # the token is used up now
    r = httpx.post(url, json={"token": tok, "endpoints": [{"name": "late"}]})
    assert r.status_code == 401
    # a CURVE key already enrolled: 409, and nothing of that batch is stored
    tok2 = mesh.client.create_enrollment_token(uses=4)
    k1, k2 = curve_keypair()[0], curve_keypair()[0]
    assert httpx.post(url, json={"token": tok2, "transport": "zmq", "endpoints": [{"name": "z1", "curve_public": k1}]}).status_code == 201
    r = httpx.post(url, json={"token": tok2, "transport": "zmq", "endpoints": [{"name": "z2", "curve_public": k2}, {"name": "z3", "curve_public": k1}]})
    assert r.status_code == 409 and "already enrolled" in r.json()["detail"]
    assert len(mesh.client.list_endpoints()) == before + 4
