"""The shipped alert rules (cloud_hub/alerts/rules.yml) with the real tools: ``promtool check
rules`` and ``promtool test rules`` on them, then Debian's Prometheus and Alertmanager, started
here on free loopback ports, scraping a real hub with real agent processes. SIGKILL one agent and
the device-silent alert fires in Alertmanager for it, and for it only.

The test runs a copy of the rules with short ``for:`` durations and a 1 s scrape and evaluation
interval; the expressions are the shipped ones. With ``MESH_DOCS_IMG=1`` it also saves the
screenshot of Prometheus's alerts page that docs/operations.md shows (docs/img/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from cloud_hub.alerts import RULES_PATH
from cloud_hub.broker import free_port
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "alert_rules_test.yml"
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img" / "prometheus-alert-device-silent.png"


def _need(path: str) -> None:
    if not Path(path).exists():
        pytest.fail(f"{path} is missing: ./taskw setup installs prometheus and prometheus-alertmanager")


def test_shipped_rules_pass_promtool(tmp_path: Path) -> None:
    _need(PROMTOOL)
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES_PATH)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # promtool's own unit tests of the rules: when they fire, when they must not, their text
    unit = tmp_path / "rules_test.yml"
    unit.write_text(FIXTURE.read_text().replace("RULES_PATH", str(RULES_PATH)))
    r = subprocess.run([PROMTOOL, "test", "rules", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # and the check can fail: a rule with a broken expression is refused
    bad = tmp_path / "bad.yml"
    bad.write_text(RULES_PATH.read_text().replace("mesh_site_uplink_up == 0", "mesh_site_uplink_up == == 0"))
    r = subprocess.run([PROMTOOL, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "parse error" in (r.stdout + r.stderr)


def _short_rules(dest: Path, for_s: str) -> Path:
    """The shipped rules with every ``for:`` shortened (the expressions untouched)."""
    doc = yaml.safe_load(RULES_PATH.read_text())
    for group in doc["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = for_s
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


class _Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)


def _wait(pred: Any, what: str, timeout: float, procs: tuple[_Proc, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for pr in procs:
            if pr.p.poll() is not None:
                raise AssertionError(f"{pr.log.name} exited with {pr.p.returncode}: {pr.log.read_text()[-2000:]}")
        try:
            last = pred()
        except httpx.HTTPError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture
def monitored_mesh(tmp_path: Path) -> Iterator[tuple[LocalMesh, str, str, tuple[_Proc, ...]]]:
    """A mesh (Mosquitto, hub, agents added by the test), an Alertmanager and a Prometheus that
    scrapes the hub every second and evaluates the shipped rules (short ``for:``) every second."""
    _need(PROMETHEUS)
    _need(ALERTMANAGER)
    mesh = LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=5.0, lease_s=10.0)
    procs: list[_Proc] = []
    try:
        mesh.start()
        assert mesh.hub is not None
        hub_addr = mesh.hub.url.removeprefix("http://")
        am_port = free_port()
        prom_port = next(p for p in (free_port() for _ in range(20)) if p != am_port)
        am_dir = tmp_path / "alertmanager"
        am_dir.mkdir()
        (am_dir / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "operators", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "operators"}],
        }))
        procs.append(_Proc([ALERTMANAGER, f"--config.file={am_dir / 'alertmanager.yml'}", f"--storage.path={am_dir / 'data'}",
                            f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="], am_dir / "alertmanager.log"))
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        rules = _short_rules(prom_dir / "rules.yml", "2s")
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "mesh-hub", "static_configs": [{"targets": [hub_addr]}]}],
        }))
        procs.append(_Proc([PROMETHEUS, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}", "--web.enable-lifecycle"], prom_dir / "prometheus.log"))
        yield mesh, f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", tuple(procs)
    finally:
        for pr in reversed(procs):
            pr.stop()
        mesh.stop()


def _am_alerts(am: str, name: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{am}/api/v2/alerts", params={"filter": f'alertname="{name}"'}, timeout=10)
    r.raise_for_status()
    return [a for a in r.json() if a["status"]["state"] == "active"]


def _prom_alerts(prom: str, name: str, state: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/alerts", timeout=10)
    r.raise_for_status()
    return [a for a in r.json()["data"]["alerts"] if a["labels"]["alertname"] == name and a["state"] == state]


def test_sigkilled_agent_fires_device_silent_in_alertmanager(monitored_mesh: Any) -> None:
    mesh, prom, am, procs = monitored_mesh
    doomed = mesh.add_agent("pi-doomed", "mqtt", workers=1)
    steady = mesh.add_agent("pi-steady", "mqtt", workers=1)
    mesh.wait_online(doomed, steady, timeout=60)

    def hub_scraped() -> bool:
        r = httpx.get(f"{prom}/api/v1/query", params={"query": "count(mesh_endpoint_last_seen_timestamp_seconds)"}, timeout=10)
        res = r.json()["data"]["result"] if r.status_code == 200 else []
        return bool(res) and res[0]["value"][1] == "2"

    _wait(hub_scraped, "Prometheus to scrape the hub's two endpoints", 90, procs)
    assert _prom_alerts(prom, "MeshDeviceSilent", "firing") == []  # both beat

    doomed.kill()  # SIGKILL: no goodbye; only silence tells
    killed = time.monotonic()
    fired = _wait(lambda: _am_alerts(am, "MeshDeviceSilent"), "MeshDeviceSilent in Alertmanager", 120, procs)
    took = time.monotonic() - killed
    assert [a["labels"]["endpoint"] for a in fired] == [doomed.endpoint_id], fired
    assert fired[0]["labels"]["name"] == "pi-doomed" and fired[0]["labels"]["severity"] == "warning"
    assert "pi-doomed" in fired[0]["annotations"]["summary"]
    # the live agent never fired, and Prometheus holds the same single firing alert
    assert [a["labels"]["endpoint"] for a in _prom_alerts(prom, "MeshDeviceSilent", "firing")] == [doomed.endpoint_id]
    print(f"MeshDeviceSilent reached Alertmanager {took:.1f} s after the SIGKILL (allowed silence 5 s, for: 2s, 1 s scrapes)")

    shot = mesh.workdir / "prometheus-alerts.png"
    # Debian's build serves Prometheus's classic UI (/classic/...), upstream's the React one at /alerts
    page = "/alerts" if httpx.get(f"{prom}/alerts", timeout=10).status_code == 200 else "/classic/alerts"
    _screenshot(f"{prom}{page}", shot, doomed.endpoint_id)
    if os.environ.get("MESH_DOCS_IMG"):
        DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_IMG)


def _screenshot(url: str, dest: Path, must_show: str) -> None:
    """Prometheus's alerts page in Debian's headless Chromium (as the console tests drive it),
    with the firing rule opened; the page must show the silent endpoint."""
    from tests.console.conftest import CHROMIUM, CHROMIUM_ARGS

    if not Path(CHROMIUM).exists():
        pytest.fail(f"the alerts-page screenshot needs Debian's Chromium at {CHROMIUM} (./taskw setup)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800}, locale="en-US", timezone_id="UTC")
            page.goto(url, wait_until="networkidle", timeout=60_000)
            page.get_by_text("MeshDeviceSilent", exact=False).first.click(timeout=30_000)
            page.get_by_text(must_show, exact=False).first.wait_for(state="visible", timeout=30_000)
            page.screenshot(path=str(dest), full_page=True)
        finally:
            browser.close()
    assert dest.stat().st_size > 10_000
