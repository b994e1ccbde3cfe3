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


def wait_for(pred: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


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

    d = wait_for(devices, "a heartbeat with device counters")
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
