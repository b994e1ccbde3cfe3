"""Emulation mode of the outage simulator: a real hub, a real Mosquitto and real agent processes,
each agent behind its own fault-injecting TCP proxy, driven by a seeded fault schedule and a
workload submitted through the SDK; an invariant check and a report at the end.

``run_emulation(path, ...)`` is the entry point (``mesh-sim run`` calls it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from .faults import FaultSchedule, build_schedule
from .scenario import EmulationScenario, ScenarioError, load_scenario
from .workload import plan_workload

__all__ = ["run_emulation", "load_scenario", "build_schedule", "plan_workload", "EmulationScenario", "FaultSchedule", "ScenarioError"]


def run_emulation(
    scenario: str | Path | dict[str, Any] | EmulationScenario,
    *,
    reduced: bool = False,
    seed: int | None = None,
    out_dir: Path | None = None,
    workdir: Path | None = None,
    keep: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run a scenario against real processes; write ``report.json`` and ``timeline.png`` to
    ``out_dir`` (default ``sim/results/<name>[-reduced]``) and return the report.

    The working directory (hub database, agent queues and logs, run logs) is removed after a
    run that passed, kept after one that failed (or with ``keep``) for a post-mortem.
    Raises :class:`ScenarioError` for an invalid scenario."""
    from .report import write_report
    from .runner import Emulation

    sc = load_scenario(scenario, reduced=reduced)
    if seed is not None:
        sc = sc.model_copy(update={"seed": seed})
    name = sc.name + ("-reduced" if reduced else "")
    out_dir = Path(out_dir) if out_dir is not None else Path("sim/results") / name
    devices = sorted({g.device for g in sc.agents if g.device})
    if devices:  # device profiles need cgroups and a C compiler: skip, with the reason, where there are none
        from .constrain import unavailable_reason

        why = unavailable_reason(devices)
        if why is not None:
            skipped = {"scenario": sc.name, "reduced": reduced, "seed": sc.seed, "ok": True, "skipped": why, "devices": devices}
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "report.json").write_text(json.dumps(skipped, indent=2) + "\n")
            return skipped
    own_workdir = workdir is None
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"mesh-sim-{name}-"))
    report = asyncio.run(Emulation(sc, work, echo=echo).run())
    report["reduced"] = reduced
    if sc.compare_without_gateways:  # the same fleet, schedule and workload without site gateways (sim/emulate/sites.py)
        from .sites import compare

        echo(f"{sc.name}: again without gateways (the baseline)")
        base = asyncio.run(Emulation(sc, work / "without-gateways", echo=echo, without_gateways=True).run())
        inv = base["invariants"]
        report["without_gateways"] = {k: base[k] for k in ("ok", "invariants", "faults", "sites", "completion_s", "wall_s")}
        if report.get("sites") and base.get("sites"):
            report["comparison"] = compare(report["sites"], base["sites"])
        report["expectations"]["the fleet without gateways also got exactly one result per accepted task"] = bool(inv["ok"])
        report["ok"] = bool(report["ok"] and inv["ok"])
    if report["ok"] and not keep and own_workdir:
        shutil.rmtree(work, ignore_errors=True)
        report["workdir"] = None
    write_report(report, out_dir)
    return report
