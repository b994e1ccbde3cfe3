"""``mesh-sim``: run simulator scenarios. ``des`` drives the real scheduler with a simulated clock;
``run`` emulates outages against a real hub, broker and agent processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Continuum Mesh simulator.", no_args_is_help=True, pretty_exceptions_show_locals=False)
console = Console()


@app.callback()
def _main(
    log_level: str = typer.Option("WARNING", "--log-level", help="the simulator's own log lines (the hub it runs in-process included)"),
    log_format: Optional[str] = typer.Option(None, "--log-format", envvar="MESH_LOG_FORMAT",
                                             help="text or json, as for mesh-hub and mesh-agent (agents it starts inherit MESH_LOG_FORMAT)"),
) -> None:
    """Continuum Mesh simulator."""
    from mesh_agent._logs import setup_logging  # one set-up for hub, agent and simulator

    try:
        setup_logging(log_level, fmt=log_format)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def des(
    scenario: Path = typer.Argument(..., help="scenario YAML, e.g. sim/scenarios/des-heterogeneous.yaml"),
    policy: Optional[List[str]] = typer.Option(None, "--policy", "-p", help="policy to run (repeatable); default: the scenario's list"),
    out: Optional[Path] = typer.Option(None, "--out", help="write the JSON report here"),
) -> None:
    """Discrete-event simulation of a scenario under each policy; prints a table and JSON."""
    from sim.des import ScenarioError, run_scenario

    try:
        report = run_scenario(scenario, policy or None)
    except (ScenarioError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    t = Table(title=f"{report['scenario']}: {report['endpoints']} endpoints, {report['tasks']} tasks")
    phases = [ph["name"] for ph in next(iter(report["results"].values()), {}).get("phases", [])]
    for col in ("policy", "makespan s", "/ bound", *(f"{p} / bound" for p in phases), "mean completion s", "p99 completion s", "wall s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, m in report["results"].items():
        ph = [f"{x['makespan_vs_lower_bound']:.2f}" if x.get("makespan_vs_lower_bound") else "-" for x in m.get("phases", [])]
        t.add_row(name, f"{m['makespan_s']:.1f}", f"{m['makespan_vs_lower_bound']:.2f}", *ph, f"{m['completion_mean_s']:.2f}",
                  f"{m['completion_p99_s']:.2f}", f"{m['wall_s']:.1f}")
    console.print(t)
    console.print(f"/ bound: makespan over the lower bound ({report['results'][next(iter(report['results']))]['lower_bound_s']:.1f} s: "
                  "fleet work / capacity, each task's arrival plus its fastest run); per phase from its own start")
    text = json.dumps(report, indent=2, default=str)
    if out:
        out.write_text(text)
    else:
        print(text)


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="emulation scenario YAML, e.g. sim/scenarios/rural-outages.yaml"),
    reduced: bool = typer.Option(False, "--reduced", help="the scenario's small variant (what the test suite runs)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="directory for report.json and timeline.png (default sim/results/<name>)"),
    keep: bool = typer.Option(False, "--keep", help="keep the working directory (databases, logs) even after a passing run"),
) -> None:
    """Emulate a scenario with real processes behind fault-injecting proxies; check that every
    accepted task got exactly one result. Exit 0: invariants held; 1: they did not; 2: bad scenario."""
    from sim.emulate import ScenarioError, run_emulation
    from sim.emulate.flrun import summary as fl_summary

    try:
        report = run_emulation(scenario, reduced=reduced, seed=seed, out_dir=out, keep=keep, echo=console.print)
    except (ScenarioError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if report.get("skipped"):  # a device profile this machine cannot emulate (no cgroups, no compiler)
        console.print(f"[yellow]skipped:[/yellow] {report['skipped']}")
        raise typer.Exit(0)
    inv, ex, f = report["invariants"], report["executions"], report["faults"]
    t = Table(title=f"{report['scenario']}{' (reduced)' if report['reduced'] else ''}: seed {report['seed']}, "
                    f"{report['agents']['count']} agents, {report['wall_s']:.0f} s", show_header=False)
    rows = [
        ("tasks accepted / delivered", f"{inv['accepted']} / {inv['delivered']}"),
        ("lost / duplicated / wrong", f"{inv['lost']} / {inv['duplicated']} / {inv['wrong_results']}"),
        ("unexpected errors", str(inv["unexpected_errors"] or 0)),
        ("link down (share of agent-time)", f"{100 * f['outage_share']:.1f}% in {f['link_outages']} outages {f['link_outages_by_mode']}"),
        ("power cuts / hub / broker restarts", f"{f['agent_kills']} / {f['hub_restarts']} / {f['broker_restarts']}"),
        ("re-executions (tasks)", f"{ex['re_executions']} ({ex['tasks_re_executed']}); hub extra leases {ex['hub_extra_attempts']}"),
        ("delay after reconnect p50 / p99 s", f"{report['delay_after_reconnect_s']['p50']} / {report['delay_after_reconnect_s']['p99']} "
                                               f"({report['delay_after_reconnect_s']['count']} tasks)"),
        ("completion p50 / p99 s", f"{report['completion_s']['p50']} / {report['completion_s']['p99']}"),
        *([("device memory peak / limit MB (OOM kills)", ", ".join(
            f"{n}: {d['peak_mb']}/{d['limit_bytes'] // 2**20} ({d['oom_kills']})" for n, d in report["devices"].items()))]
          if report.get("devices") else []),
        *([("FL run", fl_summary(report["fl"]))] if report.get("fl") else []),
        *([("sites: with / without gateways", "uplink bytes {gateways:,} / {without_gateways:,}".format(**report["comparison"]["uplink_bytes"])
            + "; tasks done during uplink outages {gateways} / {without_gateways}".format(**report["comparison"]["tasks_done_during_uplink_outage"]))]
          if report.get("comparison") else []),
        ("expectations", ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report["expectations"].items())),
        ("report / timeline", f"{report['files']['report']} / {report['files'].get('timeline', report.get('timeline_missing'))}"),
    ]
    if report.get("workdir"):
        rows.append(("working directory (kept)", report["workdir"]))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    console.print("[green]OK[/green]: every accepted task has exactly one delivered result" if report["ok"]
                  else "[red]FAILED[/red]: see the report")
    raise typer.Exit(0 if report["ok"] else 1)



@app.command()
def swarm(
    endpoints: Optional[List[int]] = typer.Option(None, "--endpoints", "-n", help="endpoints in the swarm (repeatable: one run each)"),
    transport: str = typer.Option("mqtt", "--transport", help="mqtt or zmq"),
    sweep: bool = typer.Option(False, "--sweep", help="run N = 100, 1000, 5000, 10000 in turn"),
    load_s: float = typer.Option(60.0, "--load-s", help="seconds of task load per run"),
    idle_s: float = typer.Option(15.0, "--idle-s", help="seconds of idle measurement per run"),
    heartbeat_s: float = typer.Option(5.0, "--heartbeat-s", help="hub heartbeat period (every endpoint beats this often)"),
    batch: int = typer.Option(1000, "--batch", help="tasks per SDK batch submit"),
    per_endpoint: int = typer.Option(10, "--per-endpoint", help="consecutive tasks of a batch that go to one endpoint (round robin)"),
    procs: Optional[int] = typer.Option(None, "--procs", help="swarm processes (default: one per 2,500 endpoints, at most 4)"),
    no_restart: bool = typer.Option(False, "--no-restart", help="skip the broker restart (mqtt)"),
    out: Path = typer.Option(Path("bench/results"), "--out", help="directory for swarm-<transport>-<N>.json"),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="keep databases and logs here (default: a temporary directory)"),
) -> None:
    """N light endpoints speaking the real protocol against a real hub process and Mosquitto:
    hub CPU and RSS per endpoint, heartbeat and hello load, dispatch throughput and latency, broker
    memory, reconnect time after a broker restart. Prints JSON, writes one file per run."""
    from sim.swarm.report import run_and_save

    sizes = [100, 1000, 5000, 10000] if sweep else (endpoints or [100])
    try:
        reports = run_and_save(sizes, transport, out_dir=out, workdir=workdir, echo=console.print, load_s=load_s, idle_s=idle_s,
                               heartbeat_s=heartbeat_s, batch=batch, per_endpoint=per_endpoint, procs=procs, restart_broker=not no_restart)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    print(json.dumps(reports, indent=2, default=str))
    raise typer.Exit(0 if all(not r.get("error") for r in reports) else 1)


if __name__ == "__main__":
    app()
