"""The run's outputs: ``report.json`` (everything measured) and ``timeline.png``, a picture a
person can check at a glance: one row per agent with its link outages (red: reset, purple: black
hole) and power cuts (black), hub and broker restarts as shaded bands, and below it the tasks in
flight (accepted, result not yet delivered) over time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report", "draw_timeline"]

_COLORS = {"reset": "#d62728", "blackhole": "#7b4fa0", "dead": "#111111", "hub": "#ff7f0e", "broker": "#1f77b4"}


def write_report(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``report.json`` and ``timeline.png`` (if matplotlib is installed) into ``out_dir``;
    returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": out_dir / "report.json", "timeline": out_dir / "timeline.png"}
    try:
        draw_timeline(report, paths["timeline"])
    except ImportError:  # the run's verdict does not depend on the picture
        del paths["timeline"]
        report["timeline_missing"] = "matplotlib is not installed: pip install 'continuum-mesh[sim]'"
    report["files"] = {k: str(v) for k, v in paths.items()}
    paths["report"].write_text(json.dumps(report, indent=2, default=str))
    return paths


def _in_flight(tasks: list[list[float]], undelivered: list[float], t_end: float) -> tuple[list[float], list[int]]:
    events: list[tuple[float, int]] = [(a, 1) for a, _ in tasks] + [(b, -1) for _, b in tasks] + [(a, 1) for a in undelivered]
    events.sort()
    xs, ys, n = [0.0], [0], 0
    for t, d in events:
        n += d
        xs.append(t)
        ys.append(n)
    xs.append(max(t_end, xs[-1]))
    ys.append(n)
    return xs, ys


def draw_timeline(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl = report["timeline"]
    names = sorted(tl["links"], key=lambda n: (n.rsplit("-", 1)[0], int(n.rsplit("-", 1)[1]) if n.rsplit("-", 1)[1].isdigit() else 0))
    T = float(report["duration_s"])
    t_end = max([T] + [b for _, b in tl["tasks"]] + [b for v in tl["services"].values() for _, b in v])
    fig, (ax, ax2) = plt.subplots(
        2, 1, sharex=True, figsize=(13, 2.2 + 0.28 * len(names) + 2.6),
        gridspec_kw={"height_ratios": [max(2.0, 0.28 * len(names)), 2.6]},
    )
    for i, n in enumerate(names):
        for mode in ("reset", "blackhole"):
            spans = [(a, b - a) for a, b, st in tl["links"].get(n, []) if st == mode]
            if spans:
                ax.broken_barh(spans, (i - 0.38, 0.76), facecolors=_COLORS[mode], linewidth=0)
        dead = [(a, b - a) for a, b in tl["dead"].get(n, [])]
        if dead:
            ax.broken_barh(dead, (i - 0.18, 0.36), facecolors=_COLORS["dead"], linewidth=0)
    for svc in ("hub", "broker"):
        for a, b in tl["services"].get(svc, []):
            for axis in (ax, ax2):
                axis.axvspan(a, b, color=_COLORS[svc], alpha=0.25, linewidth=0)
    for axis in (ax, ax2):
        axis.axvline(T, color="#555555", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    inv = report["invariants"]
    f = report["faults"]
    ax.set_title(
        f"{report['scenario']} (seed {report['seed']}): {inv['accepted']} tasks on {report['agents']['count']} agents, "
        f"link down {100 * f['outage_share']:.0f}% of agent-time, {f['agent_kills']} power cuts, "
        f"{f['hub_restarts']} hub / {f['broker_restarts']} broker restarts\n"
        f"lost {inv['lost']}, duplicated {inv['duplicated']}, wrong {inv['wrong_results']}, "
        f"re-executions {report['executions']['re_executions']}, "
        f"p99 delay after reconnect {_fmt(report['delay_after_reconnect_s']['p99'])} s "
        f"— {'OK' if report['ok'] else 'FAILED'}",
        fontsize=10,
    )
    ax.legend(
        handles=[Patch(color=_COLORS["reset"], label="link cut (reset)"), Patch(color=_COLORS["blackhole"], label="link black-holed"),
                 Patch(color=_COLORS["dead"], label="agent killed (power cut)"),
                 Patch(color=_COLORS["hub"], alpha=0.4, label="hub down"), Patch(color=_COLORS["broker"], alpha=0.4, label="broker down")],
        loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=5, fontsize=8, frameon=False,
    )
    xs, ys = _in_flight(tl["tasks"], tl["undelivered"], t_end)
    ax2.step(xs, ys, where="post", color="#2ca02c", linewidth=1.2, label="tasks in flight (accepted, not yet delivered)")
    ax2.set_ylabel("tasks in flight")
    ax2.set_xlabel("seconds since the workload started (dashed: faults end, links healed)")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left", fontsize=8)
    ax2.set_xlim(0, t_end * 1.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"
