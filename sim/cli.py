"""``mesh-sim``: run simulator scenarios. ``des`` drives the real scheduler with a simulated clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Continuum Mesh simulator.", no_args_is_help=True)
console = Console()


@app.callback()
def _main() -> None:
    """Continuum Mesh simulator."""


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
    for col in ("policy", "makespan s", "mean completion s", "p99 completion s", "wall s"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, m in report["results"].items():
        t.add_row(name, f"{m['makespan_s']:.1f}", f"{m['completion_mean_s']:.2f}", f"{m['completion_p99_s']:.2f}", f"{m['wall_s']:.1f}")
    console.print(t)
    text = json.dumps(report, indent=2, default=str)
    if out:
        out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    app()
