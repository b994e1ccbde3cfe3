"""The console in a real browser against a real mesh: Mosquitto, the hub, three agent processes.

One flow, as an operator would go through it: sign in, see the fleet, watch work and failures
arrive without reloading, see a SIGKILLed agent turn offline, read a remote traceback, sign out.
Screenshots of every page (desktop and phone) land in ``test-artifacts/console/``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from tests.console.conftest import ARTIFACTS, PHONE

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


def read_sensor(tag: str) -> float:
    raise ValueError(f"sensor {tag} returned garbage")


def _put_round(mesh: LocalMesh, run: dict[str, Any], r: int, used: list[Any], late: list[Any], dropped: dict[str, str] | None = None) -> None:
    import numpy as np

    from fl.wire import encode_weights

    record = {
        "round": r, "loss": round(1.9 * 0.72 ** r, 4), "accuracy": round(min(0.97, 0.52 + 0.065 * r), 4),
        "participants": [a.endpoint_id for a in used], "stragglers": [a.endpoint_id for a in late],
        "dropped": dropped or {}, "round_time_s": 0.8 + 0.15 * r,
    }
    mesh.client.fl_put_round(run["id"], r, record, encode_weights([np.full((8, 4), r, np.float32)]))


def _fl_run(mesh: LocalMesh, agents: list[Any], rounds: int) -> dict[str, Any]:
    """A run as the FL driver records it: created, then one record and checkpoint per round."""
    run = mesh.client.fl_create_run(
        "digits-fedavg", strategy="fedavg", rounds_planned=8, clients=[a.endpoint_id for a in agents],
        client_names={a.endpoint_id: a.cfg.name for a in agents}, config={"dataset": "digits", "local_epochs": 2, "deadline_s": 30},
    )
    field1, field2, hpc = agents
    for r in range(1, rounds + 1):
        if r == 3:
            _put_round(mesh, run, r, [field1, hpc], [], {field2.endpoint_id: "update has NaN weights"})
        elif r >= 4:
            _put_round(mesh, run, r, [field1, field2], [hpc])
        else:
            _put_round(mesh, run, r, agents, [])
    return run


def _shoot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _phone_shot(ctx: Any, url: str, name: str) -> None:
    """The same page at 375x812 in a second tab (same session cookie)."""
    phone = ctx.new_page()
    try:
        phone.set_viewport_size(PHONE)
        phone.goto(url)
        width = phone.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"{url} scrolls sideways on a phone ({width}px wide)"
        _shoot(phone, name)
    finally:
        phone.close()


@pytest.mark.timeout(180)
def _info_of(mesh: LocalMesh, endpoint_id: str) -> dict[str, Any]:
    return next(e["info"] for e in mesh.client.list_endpoints() if e["id"] == endpoint_id)


def test_console_flow(mesh: LocalMesh, browser_context: Any) -> None:
    from playwright.sync_api import expect

    field1 = mesh.add_agent("pi-field-1", "mqtt")
    field2 = mesh.add_agent("pi-field-2", "mqtt")
    hpc = mesh.add_agent("hpc-login-1", "zmq")
    mesh.wait_online()
    base = mesh.url
    ctx = browser_context
    page = ctx.new_page()

    # --- sign in: a console page sends us to the form, and back after signing in
    page.goto(f"{base}/console/endpoints")
    assert "/console/login" in page.url
    _shoot(page, "01-sign-in-desktop")
    _phone_shot(ctx, f"{base}/console/login", "01-sign-in-phone")
    page.fill("#token", "cm_not-a-real-token")
    page.click("button[type=submit]")
    expect(page.locator(".alert")).to_contain_text("Unknown or revoked API token")
    page.fill("#token", mesh.token)
    page.click("button[type=submit]")
    expect(page).to_have_url(re.compile(r"/console/endpoints$"))
    cookie = next(c for c in ctx.cookies() if c["name"] == "cm_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    # --- three agents online
    expect(page.locator("[data-ep-state].is-on")).to_have_count(3)

    # --- the overview follows the mesh live: tasks and failures appear without a reload
    page.goto(f"{base}/console")
    expect(page.locator("#live-state")).to_have_attribute("data-state", "live")
    page.evaluate("window.__sameDocument = 'yes'")
    expect(page.locator("[data-count=succeeded]").first).to_have_text("0")
    with Executor(mesh.client, field1.endpoint_id) as ex1, Executor(mesh.client, field2.endpoint_id) as ex2:
        futs = [ex1.submit(square, i) for i in range(40)] + [ex2.submit(square, i) for i in range(20)]
        bad = ex2.submit(read_sensor, "soil-7")
        assert [f.result(60) for f in futs][:3] == [0, 1, 4]
        with pytest.raises(ValueError):
            bad.result(60)
    expect(page.locator("[data-count=succeeded]").first).to_have_text("60")
    expect(page.locator("[data-count=failed]").first).to_have_text("1")
    expect(page.locator("figure.chart rect.bar.ok").first).to_be_visible()
    assert page.evaluate("window.__sameDocument") == "yes", "the page reloaded"

    # --- tasks the scheduler places ("auto"): the Scheduler page joins the nav once decisions exist
    expect(page.locator("nav.nav a[href='/console/scheduler']")).to_have_count(0)
    with Executor(mesh.client, endpoint="auto") as auto:
        assert [f.result(60) for f in [auto.submit(square, i) for i in range(12)]] == [i * i for i in range(12)]
    expect(page.locator("[data-count=succeeded]").first).to_have_text("72")
    assert page.evaluate("window.__sameDocument") == "yes", "the page reloaded"

    # --- SIGKILL one agent: it turns offline within the heartbeat timeout, no reload
    hpc.kill()
    killed = time.monotonic()
    limit_s = mesh.hub_cfg.lost_after_s + 4.0  # + watchdog tick, snapshot age, push interval
    expect(page.locator(f'[data-ep-state="{hpc.endpoint_id}"]')).to_have_text("offline", timeout=limit_s * 1000)
    seen_after = time.monotonic() - killed
    expect(page.locator("[data-bind=online]").first).to_have_text("2")
    assert page.evaluate("window.__sameDocument") == "yes", "the page reloaded"
    print(f"agent SIGKILLed -> shown offline after {seen_after:.1f}s (lost_after_s={mesh.hub_cfg.lost_after_s})")

    # --- work for the dead endpoint waits in the hub queue; the counts say so, live
    fid = mesh.client.register_function(square)
    mesh.client.submit_batch([mesh.client.task_spec(hpc.endpoint_id, fid, (i,)) for i in range(5)])
    expect(page.locator("[data-count=queued]").first).to_have_text("5")
    assert page.evaluate("window.__sameDocument") == "yes"
    _shoot(page, "02-overview-desktop")
    _phone_shot(ctx, f"{base}/console", "02-overview-phone")

    # --- endpoints: list with availability, and the detail of the lost one
    page.goto(f"{base}/console/endpoints")
    expect(page.locator(f'tr[data-ep="{hpc.endpoint_id}"] .ep-state')).to_have_text("offline")
    segs = page.locator(f'tr[data-ep="{hpc.endpoint_id}"] .seg')
    expect(segs.last).to_have_class(re.compile(r"\boff\b"))  # its timeline ends offline ...
    expect(segs.nth(-2)).to_have_class(re.compile(r"\bon\b"))  # ... after an online span
    expect(page.locator(f'tr[data-ep="{hpc.endpoint_id}"] td[data-label="Hub queue"]')).to_have_text("5")
    # each endpoint's frame bytes per day, up and down, as GET /v1/endpoints reports them
    per_day = _info_of(mesh, field1.endpoint_id)["bytes_per_day"]
    assert per_day["up"] > 0 and per_day["down"] > 0
    expect(page.locator(f'tr[data-ep="{field1.endpoint_id}"] td[data-traffic]')).to_have_text(
        re.compile(r"^↑ [\d.]+ (B|KiB|MiB|GiB) · ↓ [\d.]+ (B|KiB|MiB|GiB)$"))
    _shoot(page, "03-endpoints-desktop")
    _phone_shot(ctx, page.url, "03-endpoints-phone")
    page.click(f'tr[data-ep="{hpc.endpoint_id}"] a.ep-name')
    expect(page.locator("h1")).to_contain_text("hpc-login-1")
    expect(page.locator(".transitions summary")).to_contain_text("Recent transitions (2)")
    _shoot(page, "04-endpoint-desktop")
    _phone_shot(ctx, page.url, "04-endpoint-phone")

    # --- tasks: filter to failures, open the failed one, read its remote traceback
    page.goto(f"{base}/console/tasks")
    expect(page.locator("table.tasks tbody tr")).to_have_count(50)  # one page
    _shoot(page, "05-tasks-desktop")
    _phone_shot(ctx, page.url, "05-tasks-phone")
    page.click(".chips a.st-failed")
    expect(page.locator("table.tasks tbody tr")).to_have_count(1)
    page.click("table.tasks tbody tr a.mono")
    expect(page.locator(".exc-type")).to_have_text("ValueError")
    tb = page.locator("pre.traceback")
    expect(tb).to_contain_text("Traceback (most recent call last)")
    expect(tb).to_contain_text("read_sensor")
    expect(tb).to_contain_text("sensor soil-7 returned garbage")
    expect(page.locator("table.hops tr.done")).to_have_count(6)  # created .. received
    _shoot(page, "06-task-failed-desktop")
    _phone_shot(ctx, page.url, "06-task-failed-phone")

    # --- functions
    page.goto(f"{base}/console/functions")
    expect(page.locator("table.functions tbody tr")).to_have_count(2)
    _shoot(page, "07-functions-desktop")
    _phone_shot(ctx, page.url, "07-functions-phone")

    # --- scheduler: each placement with predicted vs actual
    page.goto(f"{base}/console")
    page.click("nav.nav a[href='/console/scheduler']")
    expect(page.locator("table.decisions > tbody > tr")).to_have_count(12)
    expect(page.locator("svg.scatter-svg circle.pt")).to_have_count(12)
    page.locator("details.compared summary").first.click()
    expect(page.locator("table.preds tr.chosen").first).to_be_visible()
    _shoot(page, "08-scheduler-desktop")
    _phone_shot(ctx, page.url, "08-scheduler-phone")

    # --- an FL run, recorded through the FL API as fl.Federation does, with its charts
    expect(page.locator("nav.nav a[href='/console/fl']")).to_have_count(0)
    run = _fl_run(mesh, [field1, field2, hpc], rounds=6)
    page.goto(f"{base}/console")
    page.click("nav.nav a[href='/console/fl']")
    expect(page.locator("table.runs tbody tr")).to_have_count(1)
    _shoot(page, "09-fl-runs-desktop")
    _phone_shot(ctx, page.url, "09-fl-runs-phone")
    page.click("table.runs a.ep-name")
    expect(page.locator("h1")).to_contain_text("digits-fedavg")
    charts = page.locator("figure.chart")
    expect(charts.nth(0).locator("polyline.line")).to_have_count(1)  # loss
    expect(charts.nth(0).locator("path.dot")).to_have_count(6)
    expect(charts.nth(1).locator("path.dot")).to_have_count(6)  # accuracy
    expect(charts.nth(2).locator("rect.bar.late")).to_have_count(3)  # stragglers in rounds 4-6
    expect(page.locator("table.rounds tbody tr").first.locator(".late-names")).to_contain_text("hpc-login-1")
    page.evaluate("window.__sameDocument = 'fl'")
    _put_round(mesh, run, 7, [field1, field2], [hpc])  # the next round arrives while we watch
    expect(page.locator(".kpi-value").first).to_contain_text("7")
    expect(page.locator("figure.chart").nth(0).locator("path.dot")).to_have_count(7)
    assert page.evaluate("window.__sameDocument") == "fl", "the page reloaded"
    _shoot(page, "10-fl-run-desktop")
    _phone_shot(ctx, page.url, "10-fl-run-phone")

    # --- sign out ends the session: pages send us back to the form
    page.click(".signout button")
    expect(page).to_have_url(re.compile(r"/console/login"))
    page.goto(f"{base}/console/tasks")
    assert "/console/login" in page.url
