"""``GET /metrics`` on a real hub with a real Mosquitto and a real agent process: the series the
alert rules need, task counters by function, latency histograms, device counters carried by
heartbeats, bounded per-endpoint series, and a refused scrape that changes nothing."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_hub.client import Executor
from cloud_hub.config import HubConfig
from cloud_hub.localmesh import LocalMesh
from cloud_hub.server import HubThread
from tests.pg import pg_url  # noqa: F401  (fixture)
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def double(x: int) -> int:
    return 2 * x


def boom(x: int) -> int:
    raise ValueError(f"no {x}")


def scrape(url: str, token: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict[str, Any], metric: str, /, **labels: str) -> float:
    got = [v for lab, v in m.get(metric, []) if all(lab.get(k) == want for k, want in labels.items())]
    assert len(got) == 1, (metric, labels, m.get(metric))
    return got[0]


def test_metrics_of_a_working_mesh(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("pi-metrics", "mqtt", workers=1)
    mesh.wait_online(agent)
    assert mesh.hub is not None
    url = mesh.hub.url
    before = scrape(url)
    assert value(before, "mesh_endpoints_online", transport="mqtt", site="") == 1
    assert value(before, "mesh_endpoints_enrolled", transport="mqtt") == 1
    seen = value(before, "mesh_endpoint_last_seen_timestamp_seconds", endpoint=agent.endpoint_id)
    assert time.time() - 60 < seen <= time.time() + 1
    # the session's liveness bound (lost_after_s here) and nothing learned yet about outages
    assert value(before, "mesh_endpoint_silence_allowed_seconds", endpoint=agent.endpoint_id,
                 name="pi-metrics") == pytest.approx(mesh.hub_cfg.lost_after_s)
    assert "process_resident_memory_bytes" in before and "mesh_hub_disk_free_bytes" in before

    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert [f.result(60) for f in [ex.submit(double, i) for i in range(12)]] == [2 * i for i in range(12)]
        bad = [ex.submit(boom, i) for i in range(3)]
        for f in bad:
            with pytest.raises(Exception):
                f.result(60)

    m = scrape(url)
    assert value(m, "mesh_tasks_submitted_total", function="double") == 12
    assert value(m, "mesh_tasks_submitted_total", function="boom") == 3
    assert value(m, "mesh_tasks_completed_total", function="double") == 12
    assert value(m, "mesh_tasks_failed_total", function="boom") == 3
    assert [v for lab, v in m["mesh_tasks_completed_total"] if lab["function"] == "boom"] == []  # failures are not completions
    assert value(m, "mesh_task_submit_to_result_seconds_count") == 15
    assert value(m, "mesh_task_submit_to_dispatch_seconds_count") == 15
    assert 0 < value(m, "mesh_task_submit_to_result_seconds_sum") < 15 * 60
    assert value(m, "mesh_tasks", state="queued") == 0
    assert value(m, "mesh_frame_bytes_received_total", transport="mqtt") > 0
    # a second scrape counts nothing twice
    again = scrape(url)
    assert value(again, "mesh_tasks_completed_total", function="double") == 12
    assert value(again, "mesh_task_submit_to_result_seconds_count") == 15

    # Device counters ride on heartbeats: disk free under the agent's queue, frame bytes it sent.
    def devices() -> Any:
        d = scrape(url)
        return d if value(d, "mesh_devices_sum", counter="bytes_sent") > 0 else None

    d = wait_for(devices, "a heartbeat with device counters", timeout=60, step=0.3)
    free = value(d, "mesh_devices_disk_free_min_bytes")
    assert not math.isnan(free) and free > 0
    assert value(d, "mesh_devices_sum", counter="worker_restarts") == 0
    # alerts detail: no per-endpoint bytes or device series besides a non-empty backlog
    assert "mesh_endpoint_frame_bytes_received_total" not in d
    assert "mesh_device_disk_free_bytes" not in d

    # Queued work for an offline endpoint shows per endpoint (what MeshQueueGrowing watches).
    agent.kill()
    mesh.wait_online(agent, online=False, timeout=60)
    ex = Executor(mesh.client, agent.endpoint_id)
    try:
        [ex.submit(double, i) for i in range(5)]
        q = scrape(url)
        assert value(q, "mesh_endpoint_queued_tasks", endpoint=agent.endpoint_id) == 5
        assert value(q, "mesh_tasks", state="queued") == 5
        assert "mesh_endpoints_online" not in q or all(v == 0 for _, v in q["mesh_endpoints_online"])
    finally:
        ex.shutdown(wait=False, cancel_futures=True)  # their agent is dead: nobody will run them


def test_metrics_token_and_full_detail(tmp_path: Any) -> None:
    """With ``metrics_token`` a scrape without it is refused (401) and counts nothing; ``full``
    detail adds per-endpoint series."""
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*",
                    bootstrap_user="demo", metrics_token="s3cret", metrics_endpoint_detail="full")
    hub = HubThread(cfg).start()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(f"{hub.url}/metrics", headers=headers, timeout=30)
            assert r.status_code == 401 and "metrics_token" in r.json()["detail"]
        assert hub.hub.metrics.scrapes == 0  # refused scrapes read and ingest nothing
        m = scrape(hub.url, "s3cret")
        assert value(m, "mesh_hub_scrapes") == 1
        # gzip when asked (Prometheus asks), plain text when not
        z = httpx.get(f"{hub.url}/metrics", headers={"Authorization": "Bearer s3cret", "Accept-Encoding": "gzip"}, timeout=30)
        plain = httpx.get(f"{hub.url}/metrics", headers={"Authorization": "Bearer s3cret", "Accept-Encoding": "identity"}, timeout=30)
        assert z.headers.get("content-encoding") == "gzip" and "content-encoding" not in plain.headers
        assert z.num_bytes_downloaded < len(z.content) and "mesh_hub_scrapes 2.0" in z.text
        assert "mesh_hub_scrapes 3.0" in plain.text
    finally:
        hub.stop()
    with pytest.raises(ValueError):
        HubConfig(db_path=tmp_path / "x.sqlite3", metrics_endpoint_detail="everything")


def test_metrics_on_postgresql(tmp_path: Any, pg_url: str) -> None:  # noqa: F811
    """The scrape's reads (endpoints, backlog, the results cursor with its joins, FL) are portable
    SQL: they run on a hub on PostgreSQL, twice (the second with the cursor set)."""
    cfg = HubConfig(db_path=tmp_path / "unused.sqlite3", database_url=pg_url, port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*",
                    bootstrap_user="demo")
    hub = HubThread(cfg).start()
    try:
        for i in (1, 2):
            m = scrape(hub.url)
            assert value(m, "mesh_hub_scrapes") == i
            assert value(m, "mesh_tasks", state="queued") == 0
            assert value(m, "mesh_fl_runs", status="failed") == 0
            assert "mesh_hub_disk_free_bytes" not in m  # PostgreSQL: the database host's disk is not ours to watch
    finally:
        hub.stop()


def _put_round(client: Any, run_id: str, rnd: int, participants: list[str], dropped: dict[str, str], round_time_s: float,
               status: str = "running") -> None:
    """A round record through the hub's FL API (what ``fl.Federation`` stores after each round)."""
    import base64

    import numpy as np

    from fl.wire import encode_weights

    weights = base64.b64encode(encode_weights([np.zeros(4, dtype=np.float32)])).decode()
    record = {"round": rnd, "participants": participants, "stragglers": [], "dropped": dropped, "round_time_s": round_time_s}
    client.request("PUT", f"/v1/fl/runs/{run_id}/rounds/{rnd}", json={"record": record, "weights": weights, "status": status})


def test_metrics_of_sites_fl_scheduler_and_full_detail(tmp_path: Any) -> None:
    """One mesh, ``metrics_endpoint_detail: full``, a site gateway (a real ``mesh-agent gateway``)
    with a real device behind it: online counts by site, the site's uplink, per-endpoint bytes and
    device counters, the scheduler's prediction error of placed tasks, FL rounds and runs as the FL
    API stored them; then the gateway is SIGKILLed and its site's uplink reads 0."""
    with LocalMesh(tmp_path, heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0,
                   hub_overrides={"metrics_endpoint_detail": "full", "site_hold_s": 60.0}) as mesh:
        gw = mesh.add_gateway("gw-metrics", hold=8, workers=1)
        dev = mesh.add_site_device("pi-behind", gw)
        mesh.wait_online(gw, dev, timeout=60)
        assert mesh.hub is not None
        url, g, d = mesh.hub.url, gw.endpoint_id, dev.endpoint_id

        # ---- sites: the device counts under its gateway's site, the gateway under the direct ones
        def sites() -> Any:
            m = scrape(url)
            online = {(lab["transport"], lab["site"]): v for lab, v in m.get("mesh_endpoints_online", [])}
            return m if sum(v for (_, site), v in online.items() if site == g) == 1 and sum(online.values()) == 2 else None

        m = wait_for(sites, "the device online under its site", timeout=60, step=0.3)
        assert sum(v for lab, v in m["mesh_endpoints_online"] if lab["site"] == "") == 1  # the gateway itself
        assert value(m, "mesh_site_uplink_up", site=g, name="gw-metrics") == 1
        assert value(m, "mesh_site_devices", site=g) == 1
        assert [lab for lab, _ in m["mesh_site_uplink_up"]] == [{"site": g, "name": "gw-metrics"}]  # only gateways with devices
        # a device behind a gateway has two availability models (its own, its uplink's): it gets an allowance too
        assert value(m, "mesh_endpoint_silence_allowed_seconds", endpoint=d, name="pi-behind") >= mesh.hub_cfg.lost_after_s

        # ---- the scheduler's prediction error: tasks placed by a selector (a list), not pinned
        with Executor(mesh.client, endpoint=[d]) as ex:
            assert [f.result(60) for f in [ex.submit(double, i) for i in range(4)]] == [0, 2, 4, 6]
        with Executor(mesh.client, endpoint_id=d) as ex:  # a concrete id: no placement, no prediction
            assert ex.submit(double, 9).result(60) == 18
        decisions = mesh.client.scheduler_decisions()["decisions"]
        predicted = [x for x in decisions if x.get("predicted_s")]
        assert len(decisions) == 4 and len(predicted) == 4, decisions
        m = scrape(url)
        assert value(m, "mesh_scheduler_prediction_error_ratio_count") == 4
        assert value(m, "mesh_scheduler_prediction_error_ratio_sum") >= 0
        assert value(m, "mesh_scheduler_prediction_error_ratio_bucket", le="+Inf") == 4
        assert value(m, "mesh_task_submit_to_result_seconds_count") == 5

        # ---- full detail: per-endpoint frame bytes and device counters, for both endpoints
        def detail() -> Any:
            m = scrape(url)
            disk = {lab["endpoint"]: v for lab, v in m.get("mesh_device_disk_free_bytes", [])}
            return m if set(disk) == {g, d} and all(v > 0 for v in disk.values()) else None

        m = wait_for(detail, "device counters of both endpoints", timeout=60, step=0.3)
        for ep in (g, d):
            assert value(m, "mesh_endpoint_frame_bytes_received_total", endpoint=ep) > 0
            assert value(m, "mesh_endpoint_frame_bytes_sent_total", endpoint=ep) > 0
            assert value(m, "mesh_device_worker_restarts", endpoint=ep) == 0
        assert {lab["endpoint"] for lab, _ in m["mesh_endpoint_frame_bytes_received_total"]} == {g, d}
        assert sum(v for _, v in m["mesh_endpoint_frame_bytes_received_total"]) == sum(v for _, v in m["mesh_frame_bytes_received_total"])

        # ---- FL, through the hub's FL API: one run of two rounds (the second loses a client), one failed run
        c = mesh.client
        base = scrape(url)
        assert value(base, "mesh_fl_rounds_total") == 0 and value(base, "mesh_fl_round_seconds_count") == 0
        run = c.request("POST", "/v1/fl/runs", json={"name": "tiny", "strategy": "fedavg", "rounds_planned": 2, "clients": [g, d]})
        _put_round(c, run["id"], 1, [g, d], {}, 2.0)
        _put_round(c, run["id"], 2, [g], {d: "timed out"}, 7.0, status="finished")
        bad = c.request("POST", "/v1/fl/runs", json={"name": "doomed", "strategy": "fedavg", "rounds_planned": 1, "clients": [g]})
        c.request("PATCH", f"/v1/fl/runs/{bad['id']}", json={"status": "failed", "error": "client crashed"})
        m = scrape(url)
        assert value(m, "mesh_fl_rounds_total") == 2
        assert value(m, "mesh_fl_clients_asked_total") == 4
        assert value(m, "mesh_fl_clients_answered_total") == 3
        assert value(m, "mesh_fl_round_seconds_count") == 2
        assert value(m, "mesh_fl_round_seconds_sum") == pytest.approx(9.0)
        assert value(m, "mesh_fl_round_seconds_bucket", le="5.0") == 1  # 2 s in, 7 s not
        assert value(m, "mesh_fl_runs", status="finished") == 1
        assert value(m, "mesh_fl_runs", status="failed") == 1
        assert value(m, "mesh_fl_runs", status="running") == 0
        assert value(scrape(url), "mesh_fl_rounds_total") == 2  # counted once

        # ---- the gateway dies: its site's uplink reads 0 (what MeshSiteUplinkDown watches)
        gw.kill()
        mesh.wait_online(gw, online=False, timeout=60)
        m = wait_for(lambda: (lambda m: m if value(m, "mesh_site_uplink_up", site=g, name="gw-metrics") == 0 else None)(scrape(url)),
                     "the site's uplink to read 0", timeout=60, step=0.3)
        assert value(m, "mesh_site_devices", site=g) == 1
