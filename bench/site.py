"""A site of N devices behind one uplink, with and without a site gateway, in one run (docs/sites.md).

Both setups are real: the hub's Mosquitto and hub, N ``mesh-agent start`` device processes, and
for the gateway setup one ``mesh-agent gateway`` process with its own site Mosquitto. The uplink
is the emulator's counting fault proxy (:class:`sim.emulate.proxy.FaultProxy`) between the site
and the hub's broker: without a gateway all N devices dial through it (N MQTT sessions), with a
gateway only the gateway does (one session); the devices then dial the gateway on loopback (the
LAN), which the proxy does not see. Every agent, devices and gateway, runs the ``metered`` profile
(beats on change, MQTT keepalive from the hub's bound), the hub runs its shipped defaults.

Measured, per setup:

* **idle uplink bytes per day**: bytes on the wire through the proxy in both directions over
  ``--idle-s`` of an idle, online site, scaled to a day. The links speak TLS (``LocalMesh(tls=True)``,
  as any link off loopback must; ``--no-tls`` for plain MQTT), so the proxied bytes hold every TLS
  record and handshake (a reconnect's handshake too). TCP/IP is counted from the packets: the
  kernel's TCP_INFO segment counts of the proxy's device-side sockets (pure ACKs included), 52 B
  each, plus the extra segments a 1,448-byte MSS needs where loopback sent up to 64 KiB in one
  (sim/emulate/proxy.py, ``wire_bytes``). The same is reported per phase (idle, outage).
* **tasks completed during an uplink outage** of ``--outage-s``: ``--tasks-per-device`` tasks of
  ``--task-s`` seconds each are queued at the hub for every device; a few seconds later the uplink
  is cut (reset) for the outage; then restored. Counted from the results' ``finished`` times (the
  device's clock): tasks finished while the uplink was down. Without a gateway a device can only
  work off what it already held (workers + prefetch); with one, also what the hub leased ahead to
  the gateway (``--hold`` for the site).
* **LAN flaps** (``--lan-flaps N``, off by default): every device dials through a LAN link of its
  own (another fault proxy: to the site broker behind a gateway, into the uplink proxy without
  one, as in ``sim/scenarios/village.yaml``); after the idle window all of them are cut (reset) for
  ``--lan-down-s`` and restored for ``--lan-up-s``, N times. Reported: the hub's frame bytes by
  kind (hellos and welcomes above all), the hellos it read and the sessions it ended, the uplink's
  wire bytes and connections over the phase.
* **Compact ids** (gateway setup): every site_up the hub read and every site_down it signed is
  encoded again, compressed as the envelope does, once with the device table as strings and once
  with binary ids (mesh_agent/protocol/site.py): what the binary table saves per batch, measured
  on the batches the run really sent.
* **FL uplink bytes per round, flat against hierarchical** (setups ``fl_flat`` and ``fl_site``, and
  with ``--fl-compression`` also ``fl_flat_<spec>``/``fl_site_<spec>``): the same N devices, each
  declaring its own non-IID share of the digits, train the same MLP with the same seeds for
  ``--fl-rounds`` rounds; flat: FedAvg, every device through the uplink proxy; hierarchical:
  ``Hierarchical(FedAvg, FedAvg)`` with the devices behind one gateway (``fl.sites``: the model
  is staged once per site, updates stay on the LAN, one aggregated update comes up). Uplink bytes
  of each round (both directions, everything on the wire: frames, heartbeats, MQTT) are taken
  between the driver's ``on_round`` callbacks; the first round also carries warm-up, so the
  figure is the median of rounds 2..R. Accuracy of both is reported. The two fleets are different
  enrollments (other endpoint ids, so other per-client shuffling seeds), so their accuracies differ
  a little; for the comparison at equal accuracy the gateway fleet also trains **flat** FedAvg
  (each device's model and update relayed through the gateway over the uplink): same clients,
  same seeds, and FedAvg of one site's FedAvg is FedAvg, so the final models must be equal
  (``max_weight_difference_same_devices``) and the bytes are compared on those two runs too.

Every loop is bounded; all processes are stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as c
import sys

# bench/ off the path once _common is in: bench/multiprocessing.py would shadow the standard library's.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != c.BENCH_DIR]

DAY_S = 86400.0


def work(seconds: float) -> float:
    import time as _t

    _t.sleep(seconds)
    return _t.time()


class Uplink:
    """A counting FaultProxy on its own event loop thread."""

    def __init__(self, upstream: tuple[str, int], name: str = "uplink") -> None:
        from sim.emulate.proxy import FaultProxy

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"site-{name}", daemon=True)
        self.thread.start()
        self.proxy = asyncio.run_coroutine_threadsafe(FaultProxy(name, upstream).start(), self.loop).result(10)

    @property
    def port(self) -> int:
        return self.proxy.port

    def snapshot(self) -> dict[str, int]:
        """The proxy's counters, TCP segments of open connections included, and wire bytes."""
        async def snap() -> dict[str, int]:
            st = self.proxy.segments()
            wire = self.proxy.wire_bytes(st)
            return {**st, "wire_up": wire["up"], "wire_down": wire["down"]}

        return asyncio.run_coroutine_threadsafe(snap(), self.loop).result(5)

    def cut(self) -> None:
        self.loop.call_soon_threadsafe(self.proxy.cut, "outage", "reset")

    def restore(self) -> None:
        self.loop.call_soon_threadsafe(self.proxy.restore, "outage")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _results(mesh: Any, ids: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(0, len(ids), 5000):
        r = mesh.client._http.post("/v1/results/wait", json={"task_ids": ids[i : i + 5000], "timeout_s": 0})
        r.raise_for_status()
        out.update({x["task_id"]: x for x in r.json()["results"]})
    return out


def _kinds(mesh: Any) -> dict[str, int]:
    """The hub's frame bytes by "in:<kind>"/"out:<kind>" so far (the hub runs in this process)."""
    return dict(mesh.hub.hub.dispatcher.kind_bytes_by_name())


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in sorted(b) if b[k] - a.get(k, 0)}


def _dial(agent: Any, port: int) -> None:
    """Point an enrolled, not yet started agent's MQTT link at ``port`` (a proxy)."""
    from cloud_hub.localmesh import AgentConfig

    cfg = AgentConfig.model_validate({**agent.cfg.model_dump(), "mqtt": {**agent.cfg.mqtt.model_dump(), "port": port}})
    cfg.save(agent.config_path)
    agent.cfg = cfg


class _Spy:
    """Counts the hub's hellos read and sessions ended, per endpoint (the hub runs in this process)."""

    def __init__(self, dispatcher: Any) -> None:
        self.hellos: dict[str, int] = {}
        self.lost: dict[str, int] = {}
        observe = dispatcher._observe

        def spy(hook: str, *a: Any) -> None:
            if hook == "endpoint_online":
                self.hellos[a[0]] = self.hellos.get(a[0], 0) + 1
            elif hook == "endpoint_lost":
                self.lost[a[0]] = self.lost.get(a[0], 0) + 1
            observe(hook, *a)

        dispatcher._observe = spy

    def counts(self, eps: list[str]) -> tuple[int, int]:
        return sum(self.hellos.get(e, 0) for e in eps), sum(self.lost.get(e, 0) for e in eps)


class _SiteBatches:
    """Every site_up the hub reads and every site_down it signs, to encode each again with the
    device table as strings and as binary ids (compact ids, mesh_agent/protocol/site.py). Patches
    the in-process hub's dispatcher for the duration of one setup; restored on exit."""

    def __init__(self) -> None:
        self.up: list[tuple[str, dict[str, Any]]] = []
        self.down: list[tuple[str, dict[str, Any]]] = []

    def __enter__(self) -> "_SiteBatches":
        import cloud_hub.dispatcher as hub
        from mesh_agent.protocol import Kind
        from mesh_agent.protocol.site import site_body

        self._hub, self._on_up, self._signer = hub, hub._HANDLERS[Kind.SITE_UP], hub.Dispatcher._site_signer
        cap = self

        async def on_up(disp: Any, s: Any, body: dict[str, Any]) -> None:
            cap.up.append((s.endpoint_id, body))
            await cap._on_up(disp, s, body)

        def signer(disp: Any, gw: str) -> Any:
            sign = cap._signer(disp, gw)

            def wrapped(frames: list[tuple[str, bytes]], seq: int, epoch: str, floor: int) -> bytes:
                cap.down.append((gw, site_body(frames, seq=seq, epoch=epoch, floor=floor)))
                return sign(frames, seq, epoch, floor)
            return wrapped

        hub._HANDLERS[Kind.SITE_UP], hub.Dispatcher._site_signer = on_up, signer  # type: ignore[assignment, method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from mesh_agent.protocol import Kind

        self._hub._HANDLERS[Kind.SITE_UP], self._hub.Dispatcher._site_signer = self._on_up, self._signer  # type: ignore[method-assign]

    def mark(self) -> tuple[int, int]:
        return len(self.up), len(self.down)

    def savings(self, since: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        """Per direction: batches, their bytes as sent with string and with binary ids (whole
        envelopes, compressed as the envelope does: bodies over 1 KiB, when it shrinks them), the
        bytes saved per batch, and how many of the batches were small enough to go uncompressed."""
        from mesh_agent.protocol import Envelope, Kind, encode
        from mesh_agent.protocol.envelope import COMPRESS_MIN_BYTES
        from mesh_agent.protocol.site import device_table, pack_id

        import msgpack

        out: dict[str, Any] = {}
        key = bytes(32)
        for kind, batches in ((Kind.SITE_UP, self.up[since[0]:]), (Kind.SITE_DOWN, self.down[since[1]:])):
            plain = compact = small = ids = 0
            for gw, body in batches:
                table = device_table(body)
                ids += len(table)
                sizes = []
                for d in (table, [pack_id(x) for x in table]):
                    b = {**body, "d": d}
                    sizes.append(len(encode(Envelope(kind, gw, b, id="0" * 24, ts=0.0, exp=1.0), key, compress=True)))
                plain, compact = plain + sizes[0], compact + sizes[1]
                small += len(msgpack.packb({**body, "d": table}, use_bin_type=True)) <= COMPRESS_MIN_BYTES
            n = len(batches)
            out[kind.value] = {"batches": n, "device_ids": ids, "uncompressed_batches": small, "bytes_string_ids": plain,
                               "bytes_binary_ids": compact, "saved_per_batch": round((plain - compact) / n, 1) if n else 0.0,
                               "saved_pct": round(100.0 * (plain - compact) / plain, 2) if plain else 0.0}
        return out


def _lan_flaps(mesh: Any, up: Uplink, lans: list[Uplink], devs: list[Any], spy: _Spy, args: argparse.Namespace) -> dict[str, Any]:
    """Cut every device's LAN link (reset) for lan_down_s, restore it for lan_up_s, lan_flaps times."""
    k0, w0 = _kinds(mesh), up.snapshot()
    h0, l0 = spy.counts([d.endpoint_id for d in devs])
    for _ in range(args.lan_flaps):
        for lan in lans:
            lan.cut()
        time.sleep(args.lan_down_s)
        for lan in lans:
            lan.restore()
        time.sleep(args.lan_up_s)
    w1 = up.snapshot()
    h1, l1 = spy.counts([d.endpoint_id for d in devs])
    online = {e["id"]: e["online"] for e in mesh.client.list_endpoints()}
    return {"flaps": args.lan_flaps, "down_s": args.lan_down_s, "up_s": args.lan_up_s,
            "device_hellos": h1 - h0, "device_sessions_ended": l1 - l0,
            "devices_online_after": sum(1 for d in devs if online.get(d.endpoint_id)),
            "uplink_wire_bytes": (w1["wire_up"] + w1["wire_down"]) - (w0["wire_up"] + w0["wire_down"]),
            "uplink_connections_opened": w1["connections"] - w0["connections"],
            "hub_frame_bytes_by_kind": _delta(k0, _kinds(mesh))}


def run_setup(gateway: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import contextlib

    from cloud_hub.localmesh import LocalMesh

    name = "gateway" if gateway else "no_gateway"
    workdir = root / name
    out: dict[str, Any] = {"setup": name, "devices": args.devices}
    batches = _SiteBatches() if gateway else None
    lans: list[Uplink] = []
    with contextlib.ExitStack() as stack:
        if batches is not None:
            stack.enter_context(batches)
        mesh = stack.enter_context(LocalMesh(workdir, heartbeat_s=5.0, lost_after_s=20.0, lease_s=30.0, tls=args.tls))
        up = Uplink(("127.0.0.1", mesh.broker.tls_port or mesh.broker.port))  # the TLS listener when tls
        spy = _Spy(mesh.hub.hub.dispatcher)  # type: ignore[union-attr]
        try:
            metered = {"profile": "metered"}
            devs = []
            if gateway:
                gw = mesh.add_gateway("gw", hold=args.hold, uplink_port=up.port, workers=1, **metered)
                mesh.wait_online(gw, timeout=60)
            for i in range(args.devices):
                if gateway:
                    dev = mesh.add_site_device(f"dev{i}", gw, workers=1, prefetch=args.prefetch, start=False, **metered)
                    upstream = (gw.cfg.site.listen_host, gw.cfg.site.listen_port)  # type: ignore[union-attr]
                else:
                    dev = mesh.add_agent(f"dev{i}", workers=1, prefetch=args.prefetch, start=False, **metered)
                    upstream = ("127.0.0.1", up.port)
                    _dial(dev, up.port)
                if args.lan_flaps:  # the device's own LAN link, in front of the site broker or the router
                    lans.append(Uplink(upstream, name=f"lan{i}"))
                    _dial(dev, lans[-1].port)
                devs.append(dev.start())
            mesh.wait_online(*devs, timeout=120)
            c.log(f"{name}: {len(devs)} devices online; settling {args.settle_s:.0f}s")
            time.sleep(args.settle_s)
            # --- idle
            mark = batches.mark() if batches is not None else (0, 0)
            a, ka = up.snapshot(), _kinds(mesh)
            time.sleep(args.idle_s)
            b, kb = up.snapshot(), _kinds(mesh)
            d = {k: b[k] - a.get(k, 0) for k in b}
            link_b = d["bytes_up"] + d["bytes_down"]
            wire_b = d["wire_up"] + d["wire_down"]
            scale = DAY_S / args.idle_s
            out["idle"] = {
                "window_s": args.idle_s,
                "tls": args.tls,
                "uplink_link_bytes": link_b,  # MQTT, inside TLS records when tls
                "uplink_link_bytes_per_day": round(link_b * scale),
                "uplink_wire_bytes": wire_b,
                "uplink_wire_bytes_per_day": round(wire_b * scale),
                "uplink_tcp_segments": d["segs_up"] + d["segs_down"],
                "uplink_connections_opened": d["connections"],  # each one a TLS handshake when tls
                "uplink_sessions": 1 if gateway else args.devices,
                # The hub's frame bytes by direction and kind (both setups; a site_up/site_down
                # counts as itself, compressed, and its inner frames again under their kinds)
                "hub_frame_bytes_by_kind": _delta(ka, kb),
            }
            c.log(f"{name}: idle {out['idle']}")
            if batches is not None:
                out["idle"]["compact_ids"] = batches.savings(mark)
            if args.lan_flaps:
                out["lan_flaps"] = _lan_flaps(mesh, up, lans, devs, spy, args)
                c.log(f"{name}: LAN flaps {out['lan_flaps']}")
            # --- outage
            k_out, w_out = _kinds(mesh), up.snapshot()
            client = mesh.client
            fid = client.register_function(work)
            ids = [client.submit(dv.endpoint_id, fid, args.task_s) for dv in devs for _ in range(args.tasks_per_device)]
            time.sleep(args.lead_s)
            cut_at = time.time()
            up.cut()
            c.log(f"{name}: uplink down for {args.outage_s:.0f}s")
            time.sleep(args.outage_s)
            restore_at = time.time()
            up.restore()
            deadline = time.monotonic() + args.drain_s
            got: dict[str, Any] = {}
            while time.monotonic() < deadline:
                got = _results(mesh, ids)
                if len(got) == len(ids):
                    break
                time.sleep(1.0)
            during = sum(1 for r in got.values() if r.get("finished") and cut_at <= r["finished"] <= restore_at)
            out["outage"] = {
                "outage_s": args.outage_s, "tasks_queued": len(ids), "task_s": args.task_s,
                "tasks_done_during_outage": during,
                "results_after_drain": len(got), "drain_s": args.drain_s,
                "failed": sum(1 for r in got.values() if not r["ok"]),
                "hub_frame_bytes_by_kind": _delta(k_out, _kinds(mesh)),
            }
            w_end = up.snapshot()
            out["outage"]["uplink_wire_bytes"] = (w_end["wire_up"] + w_end["wire_down"]) - (w_out["wire_up"] + w_out["wire_down"])
            out["outage"]["uplink_connections_opened"] = w_end["connections"] - w_out["connections"]
            c.log(f"{name}: outage {out['outage']}")
            if gateway:
                out["site_leased"] = mesh.hub.hub.dispatcher.stats.get("site_leased", 0)  # type: ignore[union-attr]
            if batches is not None:
                out["compact_ids"] = batches.savings()
                c.log(f"{name}: compact ids {out['compact_ids']}")
        finally:
            for lan in lans:
                lan.close()
            up.close()
    return out


def run_fl(site: bool, compression: str | None, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One FL run of ``--fl-rounds`` rounds on a fresh mesh of N digits devices: flat through the
    uplink, or behind a gateway (hierarchical on the site's LAN)."""
    import statistics

    import torch

    from cloud_hub.localmesh import AgentConfig, LocalMesh
    from fl import FedAvg, Federation, Hierarchical
    from fl.data import load_test_data
    from fl.localmesh import add_digits_agents, add_digits_site
    from fl.models import MLP

    name = ("fl_site" if site else "fl_flat") + (f"_{compression}" if compression else "")
    out: dict[str, Any] = {"setup": name, "devices": args.devices, "rounds": args.fl_rounds, "compression": compression}
    trainer = {"threads": 1, "lr": 0.05, "batch_size": 32}
    with LocalMesh(root / name, heartbeat_s=5.0, lost_after_s=30.0, lease_s=30.0, tls=args.tls) as mesh:
        up = Uplink(("127.0.0.1", mesh.broker.tls_port or mesh.broker.port))  # the TLS listener when tls
        try:
            metered = {"profile": "metered"}
            if site:
                gw = mesh.add_gateway("gw", hold=args.hold, uplink_port=up.port, workers=1, **metered)
                mesh.wait_online(gw, timeout=60)
                devs = add_digits_site(mesh, gw, args.devices, alpha=0.5, seed=0, workers=1, **metered)
            else:
                devs = add_digits_agents(mesh, args.devices, alpha=0.5, seed=0, start=False)
                for d in devs:
                    cfg = AgentConfig.model_validate({**d.cfg.model_dump(), **metered,
                                                      "mqtt": {**d.cfg.mqtt.model_dump(), "port": up.port}})
                    cfg.save(d.config_path)
                    d.cfg = cfg
                    d.start()
            mesh.wait_online(*devs, timeout=180)
            c.log(f"{name}: {len(devs)} devices online; fit {args.fl_rounds} rounds")
            ids = [d.endpoint_id for d in devs]

            def fit(hierarchical: bool) -> tuple[dict[str, Any], Any]:
                snaps: list[dict[str, int]] = [up.snapshot()]
                torch.manual_seed(0)
                fed = Federation(mesh.client, gateways={gw.endpoint_id: ids}) if hierarchical else Federation(mesh.client, ids)
                strategy = Hierarchical(FedAvg(), FedAvg()) if hierarchical else FedAvg()
                hist = fed.fit(MLP(), "digits", rounds=args.fl_rounds, strategy=strategy, local_epochs=2, deadline_s=600,
                               min_clients=args.devices, trainer=trainer, eval_data=load_test_data(), seed=0, name=name,
                               compression=compression, on_round=lambda rec, w: snaps.append(up.snapshot()))
                # on the wire: TLS records and TCP/IP from the packets (Uplink.snapshot)
                per = [{k: b[k] - a.get(k, 0) for k in ("wire_up", "wire_down")} for a, b in zip(snaps, snaps[1:])]
                tot = [p["wire_up"] + p["wire_down"] for p in per]
                res: dict[str, Any] = {
                    "uplink_bytes_per_round": tot,
                    "uplink_bytes_to_hub_per_round": [p["wire_up"] for p in per],
                    "uplink_bytes_from_hub_per_round": [p["wire_down"] for p in per],
                    "uplink_bytes_per_round_median_after_first": statistics.median(tot[1:] or tot),
                    "accuracy_per_round": [None if r.accuracy is None else round(r.accuracy, 4) for r in hist],
                    "final_accuracy": None if hist[-1].accuracy is None else round(hist[-1].accuracy, 4),
                    "participants_per_round": [len(r.participants) for r in hist],
                }
                if hierarchical:
                    res["site_lan_bytes_per_round"] = [sum(v.get("bytes_lan", 0) for v in (r.extra.get("site_lan") or {}).values())
                                                       for r in hist]
                c.log(f"{name}{'' if hierarchical or not site else ' (flat through the gateway)'}: {tot} B per round, "
                      f"accuracy {res['accuracy_per_round']}")
                return res, fed.final_weights

            res, final = fit(site)
            out.update(res)
            if site:  # flat FedAvg on these very devices (through the gateway's relay): same clients, so the same model
                flat, flat_final = fit(False)
                import numpy as np

                flat["max_weight_difference_to_hierarchical"] = max(
                    float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) for a, b in zip(final, flat_final))
                out["flat_through_gateway"] = flat
        finally:
            up.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--idle-s", type=float, default=180.0)
    p.add_argument("--settle-s", type=float, default=20.0)
    p.add_argument("--outage-s", type=float, default=600.0)
    p.add_argument("--lead-s", type=float, default=5.0, help="between queuing the work and cutting the uplink")
    p.add_argument("--drain-s", type=float, default=240.0)
    p.add_argument("--tasks-per-device", type=int, default=40)
    p.add_argument("--task-s", type=float, default=2.0)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--hold", type=int, default=200, help="tasks the hub may lease ahead to the gateway")
    p.add_argument("--lan-flaps", type=int, default=0, help="after the idle window, cut every device's LAN link this many times")
    p.add_argument("--lan-down-s", type=float, default=1.5, help="each LAN flap: down this long (village.yaml: 1.5 s)")
    p.add_argument("--lan-up-s", type=float, default=20.0, help="each LAN flap: then up this long (village.yaml: 20 s)")
    p.add_argument("--quick", action="store_true", help="3 devices, short windows: a smoke run")
    p.add_argument("--no-tls", dest="tls", action="store_false", help="plain MQTT on the uplink (default: TLS, as off loopback)")
    p.add_argument("--setups", default="no_gateway,gateway,fl",
                   help="comma-separated: no_gateway,gateway,fl (fl: flat and hierarchical FL; default all, in one run)")
    p.add_argument("--fl-rounds", type=int, default=5)
    p.add_argument("--fl-compression", default="q8", help="also run flat and hierarchical with this update compression ('' for none)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (logs of every agent and the gateway)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--workdir", default=None)
    c.add_smoke_arg(p)
    args = p.parse_args()
    if args.quick:
        args.devices, args.idle_s, args.settle_s, args.outage_s, args.tasks_per_device, args.drain_s = 3, 20.0, 5.0, 30.0, 10, 90.0
        args.fl_rounds = 3
    if c.smoke(args):  # every setup once at the smallest size; FL without the compressed pass
        args.devices, args.idle_s, args.settle_s, args.outage_s, args.lead_s = 2, 1.0, 0.0, 1.0, 0.3
        args.tasks_per_device, args.task_s, args.drain_s, args.fl_rounds, args.fl_compression = 3, 0.2, 60.0, 2, ""
    started = time.monotonic()
    out = c.header("site", args)
    root = Path(tempfile.mkdtemp(prefix="bench-site-", dir=args.workdir))
    setups = set(args.setups.split(","))
    base: dict[str, Any] | None = None
    site: dict[str, Any] | None = None
    try:
        if "no_gateway" in setups:
            base = out["no_gateway"] = run_setup(False, args, root)
        if "gateway" in setups:
            site = out["gateway"] = run_setup(True, args, root)
        if "fl" in setups:
            for comp in [None] + ([args.fl_compression] if args.fl_compression else []):
                flat = run_fl(False, comp, args, root)
                hier = run_fl(True, comp, args, root)
                key = "fl" + (f"_{comp}" if comp else "")
                same = hier.pop("flat_through_gateway")
                out[key] = {"flat": flat, "hierarchical": hier, "flat_through_gateway": same,
                            "uplink_bytes_per_round_ratio": c.ratio(
                                flat["uplink_bytes_per_round_median_after_first"], hier["uplink_bytes_per_round_median_after_first"]),
                            "uplink_bytes_per_round_ratio_same_devices": c.ratio(
                                same["uplink_bytes_per_round_median_after_first"], hier["uplink_bytes_per_round_median_after_first"]),
                            "final_accuracy": {"flat": flat["final_accuracy"], "hierarchical": hier["final_accuracy"],
                                               "flat_through_gateway": same["final_accuracy"]},
                            "max_weight_difference_same_devices": same["max_weight_difference_to_hierarchical"]}
                c.log(f"{key}: flat/hierarchical uplink bytes per round = {out[key]['uplink_bytes_per_round_ratio']}")
    finally:
        if args.keep:
            c.log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    out["summary"] = {k: {"flat": out[k]["flat"]["uplink_bytes_per_round_median_after_first"],
                          "hierarchical": out[k]["hierarchical"]["uplink_bytes_per_round_median_after_first"],
                          "flat_through_gateway": out[k]["flat_through_gateway"]["uplink_bytes_per_round_median_after_first"],
                          "ratio": out[k]["uplink_bytes_per_round_ratio"],
                          "ratio_same_devices": out[k]["uplink_bytes_per_round_ratio_same_devices"],
                          "final_accuracy": out[k]["final_accuracy"],
                          "max_weight_difference_same_devices": out[k]["max_weight_difference_same_devices"]}
                      for k in list(out) if k.startswith("fl") and isinstance(out[k], dict) and "flat" in out[k]}
    problems = [f"{k}: {v['outage']['results_after_drain']} of {v['outage']['tasks_queued']} results, {v['outage']['failed']} failed"
                for k, v in (("no_gateway", base), ("gateway", site)) if v is not None
                and (v["outage"]["failed"] or v["outage"]["results_after_drain"] < v["outage"]["tasks_queued"])]
    if base is None or site is None:
        c.finish("site", out, args, started)
        c.smoke_check(problems)
        return
    out["summary"] |= {
        "idle_uplink_bytes_per_day": {"no_gateway": base["idle"]["uplink_wire_bytes_per_day"],
                                      "gateway": site["idle"]["uplink_wire_bytes_per_day"],
                                      "ratio": c.ratio(base["idle"]["uplink_wire_bytes_per_day"],
                                                       site["idle"]["uplink_wire_bytes_per_day"])},
        "tasks_done_during_outage": {"no_gateway": base["outage"]["tasks_done_during_outage"],
                                     "gateway": site["outage"]["tasks_done_during_outage"]},
    }
    c.finish("site", out, args, started)
    c.smoke_check(problems)


if __name__ == "__main__":
    main()
