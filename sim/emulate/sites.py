"""Site gateways in the emulation (docs/sites.md, ``village.yaml``): who dials whom, a device moving
to another gateway mid-run, and the site figures of the report, with the same fleet without
gateways as the baseline.

Topology. A group with ``site_hold`` is a site gateway; its proxy is the site's **uplink** (to the
hub's broker). A group with ``gateway:`` sits on that site's LAN; its proxy is its LAN link (to
the gateway's site broker). **Without gateways** (the baseline, ``without_gateways=True``) the same
machines run as ordinary agents and a device's LAN proxy leads into its site's uplink proxy, so
all of the site's traffic crosses the uplink, is cut with it and is counted on it, as it would be
in a village whose Pis each dial the hub through the one router.

Moving a device (``faults.gateway_moves``): the hub is told (``PUT /v1/endpoints/{id}/gateway``,
what an operator does) and the device's LAN link is re-pointed at the new site (its DHCP/DNS
answer changes): the proxy resets its connections and dials the new upstream from then on.

The report's figures (:func:`site_figures`): bytes through each uplink proxy, tasks finished by a
site's devices while that site's uplink was down (from the hub's results: ``finished`` on the
device's clock, which the agent keeps in step with the hub's), and the share of time each uplink
was down. Pure functions below; the two that touch a run take it as an argument.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from typing import Any, Mapping, Sequence

from cloud_hub.store import readback

__all__ = ["gateway_slot", "lan_upstream", "move_device", "site_of_at", "tasks_during_outages", "site_figures", "compare"]


def gateway_slot(group: str) -> str:
    """The one agent of a gateway group (groups with ``site_hold`` have ``count: 1``)."""
    return f"{group}-0"


def lan_upstream(run: Any, group: Any, gateways: Mapping[str, Any]) -> tuple[str, int]:
    """Where a device's LAN proxy leads: the gateway's site broker, or without gateways the
    site's uplink proxy (so the device's traffic crosses the uplink)."""
    if run.without_gateways:
        return ("127.0.0.1", run.proxies[gateway_slot(group.gateway)].port)
    return ("127.0.0.1", gateways[group.gateway].cfg.site.listen_port)


async def move_device(run: Any, slot: str, to_group: str) -> None:
    """``slot`` moves to the site of gateway group ``to_group``: the hub learns it, its LAN link
    is re-pointed and its open connections reset (it reconnects to the new site at once)."""
    proxy = run.proxies[slot]
    to_slot = gateway_slot(to_group)
    if not run.without_gateways:
        eid, gw_eid = run.endpoints[slot], run.endpoints[to_slot]
        client = run.mesh.client

        def put() -> None:
            r = client._http.put(f"/v1/endpoints/{eid}/gateway", json={"gateway_id": gw_eid})
            if r.status_code >= 300:
                raise RuntimeError(f"moving {slot} to {to_group}: HTTP {r.status_code} {r.text[:300]}")

        await asyncio.to_thread(put)
        proxy.upstream = ("127.0.0.1", run.agents[to_slot].cfg.site.listen_port)
    else:
        proxy.upstream = ("127.0.0.1", run.proxies[to_slot].port)
    proxy.cut("gateway-move", "reset")
    proxy.restore("gateway-move")
    run.moves.append((time.time(), slot, run.site_now[slot], to_group))
    run.site_now[slot] = to_group


def site_of_at(initial: Mapping[str, str], moves: Sequence[tuple[float, str, str, str]], slot: str, t: float) -> str | None:
    """The site (gateway group) ``slot`` belonged to at time ``t``."""
    site = initial.get(slot)
    for when, who, _old, new in sorted(moves):
        if who == slot and when <= t:
            site = new
    return site


def _down_at(spans: Sequence[tuple[float, float]], t: float) -> bool:
    starts = [a for a, _ in spans]
    i = bisect.bisect_right(starts, t) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def tasks_during_outages(finished: Sequence[tuple[str, float]], initial: Mapping[str, str],
                         moves: Sequence[tuple[float, str, str, str]],
                         uplink_down: Mapping[str, Sequence[tuple[float, float]]]) -> dict[str, dict[str, int]]:
    """Per site: tasks its devices finished (``done``) and how many of them while the site's
    uplink was down (``during_outage``). ``finished``: (agent slot, finish time) of each result;
    ``uplink_down``: per site, sorted (start, end) spans; times on one clock."""
    out = {s: {"done": 0, "during_outage": 0} for s in uplink_down}
    for slot, t in finished:
        site = site_of_at(initial, moves, slot, t)
        if site is None or site not in out:
            continue
        out[site]["done"] += 1
        if _down_at(uplink_down[site], t):
            out[site]["during_outage"] += 1
    return out


def frame_bytes_by_kind(hub_url: str) -> dict[str, int]:
    """The hub's ``mesh_frame_bytes_by_kind_total`` as {"in:<kind>"/"out:<kind>": bytes} ({} when
    the hub does not answer: the report then lacks the split, not the run)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{hub_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "mesh_frame_bytes_by_kind":
            for sample in fam.samples:
                if sample.name.endswith("_total"):
                    out[f"{sample.labels['direction']}:{sample.labels['kind']}"] = int(sample.value)
    return dict(sorted(out.items()))


def site_figures(run: Any) -> dict[str, Any] | None:
    """The run's site figures (None when it has no gateway groups). Reads the hub's database, so
    call it after the run stopped."""
    sites = [g.name for g in run.sc.agents if g.site_hold is not None]
    if not sites:
        return None
    initial = {s.name: g.gateway for g in run.sc.agents if g.gateway is not None
               for s in run.schedule.agents if s.group == g.name}
    down: dict[str, list[tuple[float, float]]] = {}
    now = time.time()
    for site in sites:
        p = run.proxies[gateway_slot(site)]
        tr = p.transitions + [(now, "up")]
        down[site] = [(t, t2) for (t, st), (t2, _) in zip(tr, tr[1:]) if st != "up" and t2 > t]
    by_eid = {eid: name for name, eid in run.endpoints.items()}
    rows = readback.finished_results(run.mesh.hub_cfg.db_path)
    finished = [(by_eid[e], f) for e, f in rows if e in by_eid]
    counts = tasks_during_outages(finished, initial, run.moves, down)
    t0, T = run.t0, run.sc.duration_s
    out: dict[str, Any] = {"gateways": not run.without_gateways, "sites": {}}
    for site in sites:
        proxy = run.proxies[gateway_slot(site)]
        st = proxy.stats
        wire = proxy.wire_bytes()  # TCP/IP from the kernel's segment counts (sim/emulate/proxy.py)
        in_window = sum(max(0.0, min(b, t0 + T) - max(a, t0)) for a, b in down[site])
        out["sites"][site] = {
            "uplink_bytes": int(st["bytes_up"] + st["bytes_down"]), "uplink_bytes_up": int(st["bytes_up"]),
            "uplink_bytes_down": int(st["bytes_down"]), "uplink_connections": int(st["connections"]),
            "uplink_wire_bytes": int(wire["up"] + wire["down"]), "uplink_tcp_segments": int(st["segs_up"] + st["segs_down"]),
            "uplink_down_share": round(in_window / T, 4) if T > 0 else 0.0,
            "tasks_done_by_devices": counts[site]["done"], "tasks_done_during_uplink_outage": counts[site]["during_outage"],
        }
    tot = out["sites"].values()
    out["hub_frame_bytes_by_kind"] = getattr(run, "frame_kinds", {})
    out["total"] = {"uplink_bytes": sum(s["uplink_bytes"] for s in tot),
                    "uplink_wire_bytes": sum(s["uplink_wire_bytes"] for s in tot),
                    "tasks_done_during_uplink_outage": sum(s["tasks_done_during_uplink_outage"] for s in tot),
                    "tasks_done_by_devices": sum(s["tasks_done_by_devices"] for s in tot)}
    out["moves"] = [{"t": round(w - t0, 3), "agent": a, "from": f, "to": n} for w, a, f, n in run.moves]
    return out


def compare(with_gw: Mapping[str, Any], without: Mapping[str, Any]) -> dict[str, Any]:
    """The report's comparison: the same fleet, schedule and workload with and without gateways."""
    a, b = with_gw["total"], without["total"]
    return {
        "uplink_bytes": {"gateways": a["uplink_bytes"], "without_gateways": b["uplink_bytes"],
                         "ratio_without_to_with": round(b["uplink_bytes"] / a["uplink_bytes"], 3) if a["uplink_bytes"] else None},
        "uplink_wire_bytes": {"gateways": a.get("uplink_wire_bytes"), "without_gateways": b.get("uplink_wire_bytes"),
                              "ratio_without_to_with": round(b["uplink_wire_bytes"] / a["uplink_wire_bytes"], 3)
                              if a.get("uplink_wire_bytes") and b.get("uplink_wire_bytes") else None},
        "hub_frame_bytes_by_kind": {"gateways": with_gw.get("hub_frame_bytes_by_kind", {}),
                                    "without_gateways": without.get("hub_frame_bytes_by_kind", {})},
        "tasks_done_during_uplink_outage": {"gateways": a["tasks_done_during_uplink_outage"],
                                            "without_gateways": b["tasks_done_during_uplink_outage"]},
        "per_site": {s: {"gateways": with_gw["sites"][s], "without_gateways": without["sites"].get(s)} for s in with_gw["sites"]},
    }
