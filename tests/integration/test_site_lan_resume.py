"""LAN reconnects without a hello (issue 29 item 2, docs/sites.md "LAN reconnects").

A device behind a site-frames gateway whose LAN link flaps (its MQTT connection to the site broker
drops and comes back, the process lives on) used to say hello after every reconnect, and the
gateway relayed each hello up the uplink, with a welcome coming back down: with flapping LANs that
was most of what the gateway still cost over no gateway. Now such a device resumes: one heartbeat
on the LAN names its new connection, the gateway's liveness row takes a new connection epoch, and
the hub, which keeps the device's session through a LAN absence up to its offline bound, goes on
with the session it has. A device away longer than that is lost, and says hello when the hub asks;
a restarted device, and a device dialling the hub directly, say hello on every connection as before.

Real hub, real Mosquitto brokers, `mesh-agent start` and `mesh-agent gateway` processes; each
flapping link is the emulator's fault proxy (``reset``: connections cut and refused).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import AgentProcess, GatewayProcess, LocalMesh
from mesh_agent.config import AgentConfig
from tests.integration.test_gateway import results_of, runs
from tests.proxy import ProxyThread
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]


def slow_mark(path: str, tag: str, seconds: float) -> str:
    """Runs ``seconds``, then appends one line per run: how many times the task really ran."""
    import time as _t

    _t.sleep(seconds)
    with open(path, "a") as f:
        f.write(tag + "\n")
    return tag


def through(agent: AgentProcess, proxy: ProxyThread) -> None:
    """Point an enrolled, not yet started agent's MQTT link at ``proxy`` (its LAN or its uplink)."""
    cfg = AgentConfig.model_validate({**agent.cfg.model_dump(), "mqtt": {**agent.cfg.mqtt.model_dump(), "port": proxy.port}})
    cfg.save(agent.config_path)
    agent.cfg = cfg


@pytest.fixture
def mesh(tmp_path: Path):
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0, hub_overrides={"site_hold_s": 600.0}) as m:
        yield m


def site(mesh: LocalMesh) -> tuple[GatewayProcess, AgentProcess, ProxyThread]:
    """A site-frames gateway and one device whose LAN link goes through a fault proxy."""
    gw = mesh.add_gateway("gw", hold=8, workers=1)
    lan = ProxyThread((gw.cfg.site.listen_host, gw.cfg.site.listen_port), name="lan")
    dev = mesh.add_site_device("dev", gw, start=False, workers=2)
    through(dev, lan)
    dev.start()
    mesh.wait_online(gw, dev, timeout=45)
    return gw, dev, lan


def test_a_flapping_lan_costs_no_hello_and_runs_each_task_once(mesh: LocalMesh, tmp_path: Path) -> None:
    """Three LAN flaps while six tasks run: the device never goes offline at the hub, keeps the
    session its one hello opened (no hello crosses the uplink after it), and every task runs and
    is stored exactly once. Controls: a direct agent whose link flaps says hello again, and the
    device says hello when restarted."""
    gw, dev, lan = site(mesh)
    disp: Any = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    hub_link = ProxyThread(("127.0.0.1", mesh.broker.port), name="direct")
    try:
        direct = mesh.add_agent("direct", start=False)
        through(direct, hub_link)
        direct.start()
        mesh.wait_online(direct, timeout=30)
        wait_for(lambda: disp._sessions.get(dev.endpoint_id) is not None and disp._sessions[dev.endpoint_id].resume,
                 "the device's welcome told it to resume", 20, logs=[dev, gw])
        g = disp._sessions[gw.endpoint_id]
        assert g.site_frames and g.site_resume and g.site_bin, "the gateway said frames, resume and bin in its hello"
        session = disp._sessions[dev.endpoint_id]
        direct_session = disp._sessions[direct.endpoint_id]
        c = mesh.client
        fid = c.register_function(slow_mark)
        out = tmp_path / "runs.txt"
        tags = [f"t{i}" for i in range(6)]
        ids = [c.submit(dev.endpoint_id, fid, str(out), t, 1.5) for t in tags]
        connections = lan.stats["connections"]
        offline_seen = False
        for _ in range(3):
            lan.cut("reset")
            hub_link.cut("reset")
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                offline_seen |= not disp.online(dev.endpoint_id)
                time.sleep(0.05)
            lan.restore()
            hub_link.restore()
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                offline_seen |= not disp.online(dev.endpoint_id)
                time.sleep(0.05)
        wait_for(lambda: lan.stats["connections"] >= connections + 3, "the device dialled its LAN again after each flap", 20)
        wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "every result through the flapping LAN", 90, logs=[dev, gw])
        assert all(r["ok"] for r in results_of(mesh, ids).values())
        assert sorted(runs(out)) == sorted(tags), "a task ran twice or not at all"
        assert not offline_seen, "the hub ended the device's session on a short LAN absence"
        assert disp._sessions.get(dev.endpoint_id) is session, "the device said hello after a LAN reconnect"
        # control: a direct agent keeps its hello on every new connection
        wait_for(lambda: disp._sessions.get(direct.endpoint_id) not in (None, direct_session), "the direct agent's hello", 20)
        # a task submitted after the flaps goes through the resumed session
        after = c.submit(dev.endpoint_id, fid, str(out), "after", 0.0)
        assert c.get_result(after, timeout_s=30) == "after"
        assert disp._sessions.get(dev.endpoint_id) is session
        # control: a restarted device says hello
        dev.stop()
        dev.start()
        wait_for(lambda: disp._sessions.get(dev.endpoint_id) not in (None, session), "the restarted device's hello", 40, logs=[dev, gw])
    finally:
        hub_link.stop()
        lan.stop()


def test_a_device_lost_off_the_lan_says_hello_when_asked(mesh: LocalMesh, tmp_path: Path) -> None:
    """A LAN absence past the device's offline bound (lost_after_s, 4 s, on the lan profile): the
    hub keeps the session until then, not at the gateway's first row off the LAN, then ends it. When
    the device is back on the LAN its resumed row has no session to go on with: the hub asks it for
    a hello, it says one, and work runs again."""
    gw, dev, lan = site(mesh)
    disp: Any = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    wait_for(lambda: disp._sessions.get(dev.endpoint_id) is not None and disp._sessions[dev.endpoint_id].resume,
             "the device's welcome told it to resume", 20, logs=[dev, gw])
    session = disp._sessions[dev.endpoint_id]
    try:
        cut_at = time.monotonic()
        lan.cut("reset")
        wait_for(lambda: disp._on_lan.get(dev.endpoint_id) is False, "the gateway's row off the LAN", 20, logs=[gw])
        row_at = time.monotonic()
        wait_for(lambda: not disp.online(dev.endpoint_id), "the device lost after its offline bound", 30, logs=[gw])
        lost_at = time.monotonic()
        assert lost_at - row_at >= 3.0, f"lost {lost_at - row_at:.1f}s after the row off the LAN: not kept for its bound"
        assert lost_at - cut_at < 20.0
        lan.restore()
        wait_for(lambda: disp._sessions.get(dev.endpoint_id) not in (None, session), "the hello the hub asked for", 40, logs=[dev, gw])
        c = mesh.client
        fid = c.register_function(slow_mark)
        tid = c.submit(dev.endpoint_id, fid, str(tmp_path / "runs.txt"), "back", 0.0)
        assert c.get_result(tid, timeout_s=30) == "back"
    finally:
        lan.stop()
