"""Run swarms of several sizes, write bench/results/swarm-<transport>-<N>.json, and draw the curves.

Each run is a fresh broker, hub and swarm (so one run's leftovers never load the next), in a
temporary directory unless one is given. The file carries the date, the machine and the load
average at the start and end of the run: the machine is shared, and figures mean little without it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from sim.swarm.harness import SwarmConfig, run_swarm

__all__ = ["run_and_save", "plot"]


def _machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "mem_total_mb": _mem_mb()}


def _mem_mb() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total // 2**20)
    except Exception:
        return None


def run_and_save(sizes: Sequence[int], transport: str, *, out_dir: Path, workdir: Path | None = None,
                 echo: Callable[[str], None] = lambda s: None, **settings: Any) -> list[dict[str, Any]]:
    """One run per size; each report is written as soon as it is done (a later size that fails
    leaves the earlier files)."""
    cfgs = [SwarmConfig(n, transport, **settings) for n in sizes]  # validate all before starting any
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = []
    for cfg in cfgs:
        echo(f"--- swarm: {cfg.endpoints} endpoints over {transport}")
        with tempfile.TemporaryDirectory(prefix="swarm-") as tmp:
            wd = (workdir / f"{transport}-{cfg.endpoints}") if workdir else Path(tmp)
            started = dt.datetime.now(dt.timezone.utc)
            try:
                rep = run_swarm(cfg, wd, echo=echo)
            except Exception as exc:  # one failed size is a result too, written as such
                rep = {"endpoints": cfg.endpoints, "transport": transport, "error": f"{type(exc).__name__}: {exc}"}
        rep.pop("_load", None)
        rep = {"benchmark": "swarm", "date": started.isoformat(timespec="seconds"), "machine": _machine(), **rep}
        (out_dir / f"swarm-{transport}-{cfg.endpoints}.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
        reports.append(rep)
    return reports


def plot(results_dir: Path, png: Path) -> Path:
    """Per-endpoint hub RSS, throughput, p50/p99 latency and reconnect time against N, one line per
    transport, from the swarm-*.json files in ``results_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(results_dir.glob("swarm-*.json")):
        r = json.loads(f.read_text())
        if r.get("benchmark") == "swarm" and "idle" in r:
            runs.setdefault(r["transport"], []).append(r)
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        (ax[0][0], "hub RSS per idle endpoint (KB)", lambda r: r["idle"]["hub_rss_per_endpoint_kb"], 50.0),
        (ax[0][1], "tasks/s (aggregate)", lambda r: (r.get("load") or {}).get("tasks_per_s"), 5000.0),
        (ax[1][0], "submit-to-result latency (ms)", None, None),
        (ax[1][1], "all reconnected after broker restart (s)", lambda r: (r.get("reconnect") or {}).get("s"), None),
    ]
    for a, title, get, target in panels:
        for transport, rs in sorted(runs.items()):
            rs = sorted(rs, key=lambda r: r["endpoints"])
            xs = [r["endpoints"] for r in rs]
            if get is None:
                for q, style in (("p50", "-o"), ("p99", "--s")):
                    ys = [((r.get("load") or {}).get("latency_ms") or {}).get(q) for r in rs]
                    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
                    if pts:
                        a.plot(*zip(*pts), style, label=f"{transport} {q}")
            else:
                pts = [(x, y) for x, y in ((x, get(r)) for x, r in zip(xs, rs)) if y is not None]
                if pts:
                    a.plot(*zip(*pts), "-o", label=transport)
        if target is not None:
            a.axhline(target, color="grey", linestyle=":", label="target")
        a.set_xscale("log")
        if get is None:
            a.set_yscale("log")
        a.set_xlabel("endpoints (N)")
        a.set_title(title, fontsize=10)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Swarm: one hub process + one Mosquitto, 2-core VM (2026-11-25)", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def markdown_table(results_dir: Path) -> str:
    """The swarm figures of every swarm-*.json as one markdown table (docs/benchmarks.md), so the
    page is generated from the result files, never retyped."""
    rows = []
    for f in sorted(results_dir.glob("swarm-*.json"), key=lambda p: (p.name.split("-")[1], int(p.stem.split("-")[-1]))):
        r = json.loads(f.read_text())
        if r.get("benchmark") != "swarm":
            continue
        c, i, ld, rc = r.get("connect") or {}, r.get("idle") or {}, r.get("load") or {}, r.get("reconnect") or {}
        lat = ld.get("latency_ms") or {}
        dl = ld.get("delivery") or {}
        rows.append("| " + " | ".join(str(x) for x in (
            r["transport"], r["endpoints"], r.get("date", "")[11:16], "/".join(str(x) for x in (r.get("loadavg_start") or [])[:1] + (r.get("loadavg_end") or [])[:1]),
            f"{c.get('s')} ({c.get('hellos')})", i.get("hub_cpu_pct"), i.get("heartbeats_per_s"), i.get("hub_rss_mb"), i.get("hub_rss_per_endpoint_kb"),
            i.get("broker_rss_mb"), ld.get("tasks_per_s"), f"{lat.get('p50')} / {lat.get('p99')}", ld.get("hub_cpu_pct"),
            f"{dl.get('delivered')}/{dl.get('submitted')}", f"{rc.get('s')} ({'all' if rc.get('all_back') else rc.get('back')})" if rc else "n/a",
        )) + " |")
    head = ("| transport | N | UTC | load avg start/end | connect s (hellos) | idle hub CPU % | heartbeats/s | idle hub RSS MB | hub KB/endpoint "
            "| broker RSS MB | tasks/s | latency p50 / p99 ms | load hub CPU % | delivered in bound | reconnect s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(rows)
