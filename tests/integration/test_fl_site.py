"""Hierarchical FL through a site gateway (issue 15 item 5, docs/sites.md "Hierarchical FL"), with
real parts only: the hub's Mosquitto and hub, a ``mesh-agent gateway`` process with its site
Mosquitto and site blob store, three device agents behind it that each declare their own share
of the digits, and the emulator's counting fault proxy as the uplink.

What is checked: the round's model is staged once per site and the children's updates stay on
the LAN (their results carry keys only; the gateway sends one aggregated update up), the run
learns, it works with update compression (q8 deltas decoded at the gateway), and what crosses the
uplink per round is less than one model per device each way would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from fl import FedAvg, Federation, Hierarchical
from fl.data import load_test_data
from fl.localmesh import add_digits_site
from fl.wire import encode_weights
from tests.proxy import ProxyThread

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

N = 3
TRAINER = {"threads": 1, "lr": 0.05, "batch_size": 32}


class Site:
    def __init__(self, mesh: LocalMesh, uplink: ProxyThread, gateway: Any, devices: list) -> None:
        self.mesh, self.uplink, self.gateway, self.devices = mesh, uplink, gateway, devices

    @property
    def ids(self) -> list[str]:
        return [d.endpoint_id for d in self.devices]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    m = LocalMesh(Path(tmp_path_factory.mktemp("flsite")), heartbeat_s=1.0, lost_after_s=6.0, lease_s=10.0)
    m.start()
    up = ProxyThread(("127.0.0.1", m.broker.port))
    try:
        gw = m.add_gateway("site-gw", hold=64, uplink_port=up.port, workers=1)
        m.wait_online(gw, timeout=60)
        devs = add_digits_site(m, gw, N, workers=1)
        m.wait_online(gw, *devs, timeout=120)
        yield Site(m, up, gw, devs)
    finally:
        try:
            m.stop()
        finally:
            up.stop()


def _mlp() -> Any:
    from fl.models import MLP

    torch.manual_seed(0)
    return MLP(64, (64,), 10)


def _model_bytes() -> int:
    return len(encode_weights([w.detach().numpy() for w in _mlp().state_dict().values()]))


def test_site_round_stays_on_the_lan_and_learns(site: Site) -> None:
    gw = site.gateway.endpoint_id
    row = {e["id"]: e for e in site.mesh.client.list_endpoints()}[gw]
    assert row["info"]["site"]["store"] == f"127.0.0.1:{site.gateway.cfg.site.store_port}"
    # the hub's scheduler models the site's uplink apart from each device (scheduler/availability.py)
    from scheduler.availability import BehindGateway

    rows = {e["id"]: e for e in site.mesh.client.list_endpoints()}
    assert all(rows[d]["info"].get("gateway") == gw for d in site.ids), [rows[d]["info"] for d in site.ids]
    nodes = site.mesh.hub.hub.placement.sched.fleet.nodes  # type: ignore[union-attr]
    assert all(isinstance(nodes[d].avail, BehindGateway) and nodes[d].avail.state() == "online" for d in site.ids)
    fed = Federation(site.mesh.client, gateways={gw: site.ids})
    rounds = 4
    before = site.uplink.bytes()
    hist = fed.fit(_mlp(), "digits", rounds=rounds, strategy=Hierarchical(FedAvg(), FedAvg()), local_epochs=2,
                   deadline_s=60, trainer=TRAINER, eval_data=load_test_data())
    crossed = site.uplink.bytes() - before
    assert all(sorted(r.participants) == sorted(site.ids) for r in hist), [(r.participants, r.dropped) for r in hist]
    for r in hist:
        lan = r.extra["site_lan"][gw]
        assert lan["staged"] and lan["lan_updates"] == N, r.extra
        assert lan["bytes_lan"] > 0
        assert "gateway_fallback" not in r.extra
        # no model went to a child through the hub, and no child's result carried weights up
        assert r.extra["bytes_down_total"] == 0 and r.extra["bytes_up_total"] == 0, r.extra
    assert hist[-1].accuracy > hist.metadata["initial_eval"]["accuracy"] + 0.3, [r.accuracy for r in hist]
    flat_floor = rounds * 2 * N * _model_bytes()  # flat: one model down and one update up per device per round
    print(f"site run: {crossed} B crossed the uplink in {rounds} rounds; flat would need at least {flat_floor} B of models")
    assert crossed < 0.75 * flat_floor, (crossed, flat_floor)


def test_hierarchical_on_the_lan_equals_flat_fedavg_on_the_same_devices(site: Site) -> None:
    """At equal accuracy by construction: FedAvg of the site's FedAvg is FedAvg, so the same devices
    (same client ids and seeds) must end with the same model whether their round ran flat (the
    model staged once per site, each update relayed over the uplink) or on the site's LAN; and
    flat costs more uplink."""
    import numpy as np

    gw = site.gateway.endpoint_id
    finals, crossed = {}, {}
    for mode in ("flat", "site"):
        before = site.uplink.bytes()
        torch.manual_seed(0)
        fed = Federation(site.mesh.client, gateways={gw: site.ids}) if mode == "site" else Federation(site.mesh.client, site.ids)
        strategy = Hierarchical(FedAvg(), FedAvg()) if mode == "site" else FedAvg()
        hist = fed.fit(_mlp(), "digits", rounds=2, strategy=strategy, local_epochs=1, deadline_s=60, min_clients=N,
                       trainer=TRAINER, seed=0)
        assert all(len(r.participants) == N for r in hist), [(r.participants, r.dropped) for r in hist]
        crossed[mode] = site.uplink.bytes() - before
        finals[mode] = fed.final_weights
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in zip(finals["flat"], finals["site"]))
    assert diff < 1e-5, diff
    print(f"2 rounds on {N} devices: flat {crossed['flat']} B over the uplink, on the site's LAN {crossed['site']} B")
    assert crossed["site"] < crossed["flat"], crossed


def test_flat_rounds_send_the_model_down_once_per_site(site: Site) -> None:
    """Flat FedAvg on devices behind one site gateway (docs/sites.md, "Fetched once per site"):
    by default the global model crosses the uplink once per round (a stage task to the gateway,
    each device fetches it on the LAN against the key in its signed task), not once per device.
    The same run with site_models=False pays a copy per device; the final model is the same."""
    import numpy as np

    gw = site.gateway.endpoint_id
    finals, crossed = {}, {}
    for staged in (True, False):
        before = site.uplink.bytes()
        torch.manual_seed(0)
        fed = Federation(site.mesh.client, site.ids)
        hist = fed.fit(_mlp(), "digits", rounds=2, strategy=FedAvg(), local_epochs=1, deadline_s=60, min_clients=N,
                       trainer=TRAINER, seed=0, site_models=staged)
        crossed[staged] = site.uplink.bytes() - before
        finals[staged] = fed.final_weights
        assert all(len(r.participants) == N for r in hist), [(r.participants, r.dropped) for r in hist]
        if staged:
            # one model blob per round went to the gateway (the trained model compresses a little less than the first)
            assert all(set(r.extra.get("site_staged") or {}) == {gw} and r.extra["site_staged"][gw] > 0.8 * _model_bytes()
                       for r in hist), [r.extra.get("site_staged") for r in hist]
            assert all(r.extra["bytes_down_total"] == 0 for r in hist), "no device got the model through the hub"
        else:
            assert all("site_staged" not in r.extra and r.extra["bytes_down_total"] > 0.8 * N * _model_bytes() for r in hist)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in zip(finals[True], finals[False]))
    assert diff < 1e-5, diff
    saved = crossed[False] - crossed[True]
    print(f"2 flat rounds on {N} devices: {crossed[True]} B over the uplink with the model staged per site, "
          f"{crossed[False]} B with a copy per device (model {_model_bytes()} B)")
    # N-1 copies per round saved, less the stage task's own frames and the heartbeats of a round a
    # round trip longer (measured: 79 % of the copies' bytes)
    assert saved > 0.6 * 2 * (N - 1) * _model_bytes(), (crossed, _model_bytes())


@pytest.mark.parametrize("compression", ["q8", "topk:0.25+q8"])
def test_site_round_with_compressed_updates(site: Site, compression: str) -> None:
    """Children's updates compressed on the LAN, and the site's one update compressed up the
    uplink the same way (top-k with its error-feedback residual in the gateway's own store)."""
    gw = site.gateway.endpoint_id
    fed = Federation(site.mesh.client, gateways={gw: site.ids})
    hist = fed.fit(_mlp(), "digits", rounds=3, strategy=Hierarchical(FedAvg(), FedAvg()), local_epochs=2,
                   deadline_s=60, trainer=TRAINER, eval_data=load_test_data(), compression=compression)
    assert all(sorted(r.participants) == sorted(site.ids) for r in hist), [(r.participants, r.dropped) for r in hist]
    up = [r.extra["site_lan"][gw]["bytes_up"] for r in hist]
    print(f"{compression}: the site's update up the uplink per round {up} B (float32 model {_model_bytes()} B)")
    # q8 is about a quarter of float32; top-k of a quarter of the values, q8, plus their indices, well under that
    assert all(0 < b < _model_bytes() * (0.3 if compression == "q8" else 0.2) for b in up), up
    # q8 deltas are about a quarter of the float32 model: the gateway got compressed blobs and decoded them
    assert all(0 < r.extra["site_lan"][gw]["bytes_lan"] < N * _model_bytes() * 0.5 for r in hist), [r.extra for r in hist]
    assert hist[-1].accuracy > hist.metadata["initial_eval"]["accuracy"] + 0.3, [r.accuracy for r in hist]


def test_console_and_scheduler_know_the_uplink_is_down(site: Site) -> None:
    """Last in the module: the uplink goes down and comes back. The hub loses the gateway and its
    devices; the scheduler charges the outage to the uplink, not to the devices, and the console's
    site card says the devices work from the gateway."""
    import time

    import httpx

    gw = site.gateway.endpoint_id
    placement = site.mesh.hub.hub.placement  # type: ignore[union-attr]
    site.uplink.cut()
    try:
        site.mesh.wait_online(site.gateway, *site.devices, timeout=60, online=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and placement.sched.profiles.sites.pending():
            time.sleep(0.5)
        assert placement.sched.profiles.availability(gw).online is False
        assert all(placement.sched.profiles.availability(d).online is not False for d in site.ids)
        assert all(placement.sched.fleet.nodes[d].avail.state() == "site-only" for d in site.ids)
        with httpx.Client(base_url=site.mesh.url, headers={"Origin": site.mesh.url}) as web:
            web.post("/console/login", data={"token": site.mesh.token, "next": "/console"})
            page = web.get(f"/console/endpoints/{gw}").text
        assert "is-off\">down</span>" in page and page.count("data-site-only") == N, page[-3000:]
    finally:
        site.uplink.restore()
    site.mesh.wait_online(site.gateway, *site.devices, timeout=120)
    assert all(placement.sched.profiles.availability(d).n_outages == 0 for d in site.ids)
