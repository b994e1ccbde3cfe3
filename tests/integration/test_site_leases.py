"""Leases confirmed cumulatively (issue 29 item 3, docs/sites.md "Leases confirmed cumulatively").

A real hub, Mosquitto, a site gateway and its devices; the gateway's uplink goes through the fault
proxy with 1.5 s of one-way latency, so every confirmation takes longer than the hub's 2 s lease.
Before site frames settled leases by number, every batch leased ahead to such a gateway ran out
unconfirmed while the gateway was connected and was sent again. Now nothing leased to a connected
gateway expires on a timer: each task is leased ahead exactly once, and each runs exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from sim.emulate.proxy import LinkShape
from tests.integration.test_gateway import count_runs, results_of, runs
from tests.proxy import ProxyThread
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def test_a_slow_uplink_gets_each_task_once_while_its_gateway_is_connected(tmp_path: Path) -> None:
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=12.0, lease_s=2.0, hub_overrides={"site_hold_s": 600.0}) as mesh:
        uplink = ProxyThread(("127.0.0.1", mesh.broker.port))
        try:
            uplink.proxy.shape = LinkShape(latency_s=1.5)
            gw = mesh.add_gateway("gw", hold=64, uplink_port=uplink.port, workers=1)
            devs = [mesh.add_site_device(f"dev{i}", gw, start=False) for i in range(2)]
            mesh.wait_online(gw, timeout=60)
            c = mesh.client
            fid = c.register_function(count_runs)
            out = tmp_path / "runs.txt"
            tags = [f"t{i}-{n}" for n in range(len(devs)) for i in range(12)]
            ids = [c.submit(devs[int(t.rsplit("-", 1)[1])].endpoint_id, fid, str(out), t) for t in tags]
            disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
            wait_for(lambda: disp.stats.get("site_leased", 0) >= len(ids), "all work leased ahead to the site", 60, logs=[gw])
            # Several unconfirmed leases' worth (2 s each) with confirmations 3 s or more away.
            time.sleep(10)
            assert disp.stats.get("site_leased", 0) == len(ids), "a task was leased ahead again while its gateway was connected"
            assert disp.stats.get("site_given_up", 0) == 0
            for d in devs:
                d.start()
            wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "every result through the slow uplink", 120, logs=[gw, *devs])
            assert all(r["ok"] for r in results_of(mesh, ids).values())
            assert sorted(runs(out)) == sorted(tags), "a task ran twice or not at all"
            assert disp.stats.get("site_leased", 0) == len(ids)
        finally:
            uplink.stop()
