"""Availability per uplink and per device (scheduler/availability.py: BehindGateway, SiteOutages):
a site's uplink outage is not charged to its devices, a device's own outage is, and work already
at the gateway waits only for the device."""

from __future__ import annotations

import pytest

from scheduler.availability import Availability, BehindGateway, SiteOutages


def _models() -> tuple[dict[str, Availability], SiteOutages]:
    models: dict[str, Availability] = {}

    def model(eid: str) -> Availability:
        return models.setdefault(eid, Availability(prior_up=3600.0, prior_down=600.0))

    sites = SiteOutages(model, grace=30.0)
    sites.set_gateway("d1", "gw")
    sites.set_gateway("d2", "gw")
    for e in ("gw", "d1", "d2", "lone"):
        sites.heartbeat(e, 0.0)
    return models, sites


def test_uplink_outage_is_the_uplinks_not_the_devices() -> None:
    models, sites = _models()
    # the uplink drops at t=1000: the hub's watchdog loses a device first, then the gateway, then the other device
    assert sites.mark_offline("d1", 1010.0, since=1000.0) is True  # held back: is it the device's or the uplink's?
    assert sites.pending() == ["d1"]
    sites.mark_offline("gw", 1012.0, since=1001.0)
    assert sites.pending() == []  # it went with the gateway
    assert sites.mark_offline("d2", 1015.0, since=1002.0) is False
    assert models["d1"].online is True and models["d2"].online is True and models["gw"].online is False
    v = sites.view("d1")
    assert isinstance(v, BehindGateway)
    assert v.state() == "site-only" and v.can_take_held_work() and not v.reachable()
    # an hour later the uplink is back and everyone is heard from again
    for e in ("gw", "d1", "d2"):
        sites.heartbeat(e, 4600.0)
    assert models["gw"].n_outages > 0.5 and models["gw"].down_total == pytest.approx(3599.0)
    assert models["d1"].n_outages == 0 and models["d2"].n_outages == 0 and models["d1"].down_total == 0
    assert sites.view("d1").state() == "online"


def test_a_devices_own_outage_is_the_devices() -> None:
    models, sites = _models()
    sites.mark_offline("d1", 1010.0, since=1000.0)
    sites.settle(1020.0)  # within grace: still undecided
    assert sites.pending() == ["d1"] and models["d1"].online is True
    sites.settle(1040.0)  # the gateway stayed up for longer than grace: the device's own outage
    assert sites.pending() == [] and models["d1"].online is False
    assert sites.view("d1").state() == "offline" and not sites.view("d1").can_take_held_work()
    sites.heartbeat("d1", 1600.0)
    assert models["d1"].n_outages > 0.5 and models["d1"].down_total == pytest.approx(600.0)
    assert models["gw"].n_outages == 0


def test_device_back_before_settle_still_counts_its_outage() -> None:
    models, sites = _models()
    sites.mark_offline("d2", 1010.0, since=1000.0)
    assert sites.heartbeat("d2", 1025.0) is True
    assert models["d2"].n_outages > 0.5 and sites.pending() == []


def test_endpoint_without_gateway_is_unchanged() -> None:
    models, sites = _models()
    assert sites.view("lone") is models["lone"]
    assert sites.mark_offline("lone", 100.0, since=90.0) is True and models["lone"].online is False
    sites.set_gateway("d1", None)
    assert sites.view("d1") is models["d1"]


def test_held_work_waits_only_for_the_device() -> None:
    models, sites = _models()
    sites.mark_offline("gw", 1012.0, since=1000.0)
    v = sites.view("d1")
    assert isinstance(v, BehindGateway)
    now = 1100.0
    new = v.expected_delay(now, now, 60.0)
    held = v.expected_delay(now, now, 60.0, held=True)
    up_back = models["gw"].time_until_back(now)
    assert up_back > 0
    # new work first waits for the uplink; held work runs now, only its result waits for the uplink
    assert new >= up_back
    assert held < new
    assert held == pytest.approx(models["d1"].expected_delay(now, now, 60.0) + max(0.0, now + up_back - (now + models["d1"].expected_delay(now, now, 60.0) + 60.0)))
    # both up: the uplink adds only its steady-state chance of holding a result back
    for e in ("gw",):
        sites.heartbeat(e, 1200.0)
    v2 = sites.view("d1")
    assert v2.p_offline(1200.0, 1300.0) >= models["d1"].p_offline(1200.0, 1300.0)
    assert 0.0 < v2.share_online(1300.0) <= models["d1"].share_online(1300.0)


def test_scheduler_predicts_with_the_uplink_apart() -> None:
    """Through the scheduler's own path (Profiles -> Fleet -> predictor's node.avail): an uplink
    outage leaves the devices' models clean, and their nodes carry the combined view."""
    from scheduler.core import Scheduler
    from scheduler.model import EndpointState

    s = Scheduler(policy="delta")
    s.profiles.set_gateway("d1", "gw")
    for e in ("gw", "d1", "d2"):
        s.add_endpoint(EndpointState(e), now=0.0)
    assert isinstance(s.fleet.node("d1").avail, BehindGateway)
    assert isinstance(s.fleet.node("d2").avail, Availability)
    s.endpoint_offline("gw", 1010.0, 1000.0)
    s.endpoint_offline("d1", 1011.0, 1001.0)
    s.endpoint_offline("d2", 1012.0, 1002.0)
    assert s.profiles.availability("d1").online is True  # went with the uplink
    assert s.profiles.availability("d2").online is False  # no gateway: its own outage
    assert s.fleet.node("d1").avail.state() == "site-only"
