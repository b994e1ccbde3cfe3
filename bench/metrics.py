"""What ``/metrics`` costs: scrape size, scrape time and hub CPU per scrape at 1k and 10k endpoints
(the swarm harness's light endpoints, sim/swarm), and the heartbeat bytes the device counters add.

Per fleet size: a real Mosquitto, the hub as its own ``mesh-hub serve`` process, N endpoints
enrolled in bulk and connected by swarm processes (heartbeats every ``--heartbeat`` s). Then, in
the same run, the baseline: the hub's CPU over ``--idle`` seconds with no scrape, and the
measurement: ``--scrapes`` scrapes one a second, each timed on the client, the hub's CPU over
the same window minus the baseline rate. Heartbeat bytes come from the real encoder
(``mesh_agent.protocol.encode``) on the bodies ``Agent._beat_body`` builds, with and without the
device counters, for a lan beat (full body) and a metered beat (changed keys only).

    python bench/metrics.py                 # 1k and 10k endpoints
    python bench/metrics.py --sizes 200     # a small fleet
    python bench/metrics.py --smoke         # a few seconds: 20 endpoints, 2 scrapes; writes no file
Prints one JSON object; writes bench/results/metrics-<UTC>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # (puts the repository first on sys.path)
from _common import finish, header, log

import httpx


def heartbeat_bytes() -> dict[str, Any]:
    """Frame bytes of one heartbeat before and after the device counters (real encoder, real key
    size; body values as an idle Pi reports them)."""
    from mesh_agent.protocol import Envelope, Kind, encode, new_key

    key, eid = new_key(), "ep-0123456789ab"
    lan = {"capacity": 1, "running": 0, "queued": 0, "stored": 0, "outbox": 0, "want": 16, "warm": [],
           "cpu": 3.1, "mem_used": 41.7, "mem_avail_mb": 281}
    counters_lan = {"rs": 0, "df": 11234, "tx": 187, "sk": -12}
    metered_before = {"want": 16}  # an adaptive beat sends only what changed; want always
    metered_after = {"want": 16, "tx": 188}  # bytes sent moves each beat; disk (64 MiB steps) and skew (100 ms) rarely

    def size(body: dict[str, Any]) -> int:
        return len(encode(Envelope(Kind.HEARTBEAT, eid, body), key))

    out = {"lan_full_beat": {"before": size(lan), "after": size({**lan, **counters_lan})},
           "metered_changed_only": {"before": size(metered_before), "after": size(metered_after)},
           "metered_first_beat_of_session": {"before": size({**lan, "cpu": 3, "mem_used": 42, "mem_avail_mb": 272}),
                                             "after": size({**lan, "cpu": 3, "mem_used": 42, "mem_avail_mb": 272,
                                                            "rs": 0, "df": 11200, "tx": 187, "sk": 0})}}
    for v in out.values():
        v["added"] = v["after"] - v["before"]
    return out


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    from cloud_hub.localmesh import LocalMesh
    from sim.swarm.harness import _Proc, _Worker, enroll_bulk
    from sim.swarm.stats import split_evenly, sum_status
    from sim.swarm.worker import raise_nofile

    raise_nofile()
    work = Path(tempfile.mkdtemp(prefix=f"bench-metrics-{n}-", dir=args.workdir))
    res: dict[str, Any] = {"endpoints": n, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    mesh = LocalMesh(work / "mesh", heartbeat_s=args.heartbeat, lost_after_s=max(30.0, 6 * args.heartbeat), lease_s=30.0, hub_process=True)
    mesh.broker.extra_conf = "max_connections -1\n"
    workers: list[Any] = []
    try:
        mesh.start()
        assert mesh._hub_proc is not None
        hub = _Proc(mesh._hub_proc.pid)
        token = mesh.client.create_enrollment_token(uses=n)
        log(f"{n}: enrolling")
        creds = enroll_bulk(mesh.url, token, n, "mqtt")
        procs = max(1, min(4, -(-n // 2500)))
        for i, part in enumerate(split_evenly(creds, procs)):
            spec = work / f"swarm-{i}.json"
            import json

            spec.write_text(json.dumps({"creds": [c.to_json() for c in part], "heartbeat_s": args.heartbeat, "capacity": 1,
                                        "prefetch": 16, "seed": i}))
            spec.chmod(0o600)
            workers.append(_Worker(spec, work / f"swarm-{i}.log"))
        deadline = time.monotonic() + args.connect_timeout
        while time.monotonic() < deadline and sum_status(w.status for w in workers)["online"] < n:
            time.sleep(0.5)
        online = int(sum_status(w.status for w in workers)["online"])
        res["online"] = online
        log(f"{n}: {online} online")
        if online < n:  # a loaded machine: measure anyway (the series follow endpoints ever seen, not online ones)
            res["warning"] = f"only {online} of {n} online within {args.connect_timeout}s"
        if online == 0:
            return res
        time.sleep(min(args.heartbeat, 5.0))
        # a first scrape outside the window: it sets up the collector and ingests nothing
        first = httpx.get(f"{mesh.url}/metrics", timeout=120)
        first.raise_for_status()

        c0, t0 = hub.cpu(), time.monotonic()
        time.sleep(args.idle)
        idle_rate = (hub.cpu() - c0) / (time.monotonic() - t0)

        times: list[float] = []
        sizes: list[int] = []
        wire: list[int] = []
        c0, t0 = hub.cpu(), time.monotonic()
        for _ in range(args.scrapes):
            s = time.perf_counter()
            r = httpx.get(f"{mesh.url}/metrics", timeout=120)
            times.append(time.perf_counter() - s)
            r.raise_for_status()
            sizes.append(len(r.content))
            wire.append(r.num_bytes_downloaded)  # gzip: httpx asks for it, as Prometheus does
            time.sleep(max(0.0, 1.0 - times[-1]))
        span, cpu = time.monotonic() - t0, hub.cpu() - c0
        last = httpx.get(f"{mesh.url}/metrics", timeout=120)  # its counter holds the window's scrapes
        own = _counter(last.text, "mesh_hub_scrape_cpu_seconds_total") - _counter(first.text, "mesh_hub_scrape_cpu_seconds_total")
        times.sort()
        text = r.text
        series = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
        per_ep = sum(1 for ln in text.splitlines() if ln.startswith("mesh_endpoint_"))
        res.update({
            "baseline_idle_hub_cpu_pct": round(100 * idle_rate, 2),
            "scrape_bytes": sizes[-1], "scrape_bytes_on_the_wire_gzip": wire[-1],
            "series": series, "per_endpoint_series": per_ep,
            "scrape_s": {"p50": round(times[len(times) // 2], 4), "max": round(times[-1], 4)},
            "hub_cpu_s_per_scrape": round(own / args.scrapes, 4),  # thread CPU the hub measured on its scrape paths
            "hub_cpu_s_per_scrape_vs_idle_baseline": round((cpu - idle_rate * span) / args.scrapes, 4),  # process CPU minus baseline: noisy
            "hub_cpu_pct_while_scraping_1_per_s": round(100 * cpu / span, 2),
            "hub_rss_mb": round(hub.rss() / 2**20, 1),
        })
        log(f"{n}: {res}")
        return res
    finally:
        for w in workers:
            w.stop()
        res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        mesh.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000", help="comma-separated endpoint counts")
    p.add_argument("--scrapes", type=int, default=10)
    p.add_argument("--idle", type=float, default=10.0, help="seconds of baseline (no scrape)")
    p.add_argument("--heartbeat", type=float, default=5.0)
    p.add_argument("--connect-timeout", type=float, default=600.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--no-save", action="store_true")
    _common.add_smoke_arg(p)
    args = p.parse_args()
    if _common.smoke(args):
        args.sizes, args.scrapes, args.idle, args.heartbeat = "20", min(args.scrapes, 2), min(args.idle, 1.0), min(args.heartbeat, 1.0)
        args.connect_timeout = min(args.connect_timeout, 60.0)
    started = time.monotonic()
    out = header("metrics", args)
    out["heartbeat_bytes"] = heartbeat_bytes()
    out["fleets"] = [measure(int(s), args) for s in args.sizes.split(",") if s.strip()]
    finish("metrics", out, args, started)
    _common.smoke_check([f"{f['endpoints']} endpoints: {f.get('warning') or 'not measured'}" for f in out["fleets"]
                         if f.get("online") != f["endpoints"] or "scrape_bytes" not in f])


if __name__ == "__main__":
    sys.exit(main())
