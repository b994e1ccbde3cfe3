"""``mesh-fl``: run Flower Apps on the mesh.

    mesh-fl run APP_DIR|APP.fab (--endpoints ID,ID | --tags T,T | --auto [--clients N])
                [--run-config 'num-server-rounds=5 penalty="l2"'] [--dataset NAME]
                [--max-failed-rounds 2] [--warmup-s 120] [--out-dir DIR] [--json]

The hub and token come from ``mesh-hub login`` or ``MESH_HUB_URL`` / ``MESH_TOKEN`` (as for the
SDK); ``--hub``/``--token`` override them. Exit status: 0 when the run finished, 1 when it
failed (the reason is printed), 2 for bad input (nothing is stored).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run Flower Apps on Continuum Mesh endpoints.", pretty_exceptions_show_locals=False)


@app.callback()
def _main() -> None:
    """Run Flower Apps on Continuum Mesh endpoints."""


def _split(v: Optional[str]) -> List[str]:
    return [x.strip() for x in (v or "").split(",") if x.strip()]


@app.command("run")
def run(
    app_path: Path = typer.Argument(..., help="Flower App directory (pyproject.toml with [tool.flwr.app]) or a .fab"),
    endpoints: Optional[str] = typer.Option(None, "--endpoints", help="comma-separated endpoint ids or names"),
    tags: Optional[str] = typer.Option(None, "--tags", help="every endpoint carrying all these tags"),
    auto: bool = typer.Option(False, "--auto", help="endpoints of yours that are online, best first as the scheduler predicts"),
    clients: Optional[int] = typer.Option(None, "--clients", help="with --auto: take the N best (default: every online endpoint)"),
    run_config: Optional[List[str]] = typer.Option(None, "--run-config", help="overrides: 'key=value key2=\"text\"' or a .toml file"),
    dataset: str = typer.Option("flower", "--dataset", help="the endpoints' dataset declaration that gives node_config"),
    max_failed_rounds: int = typer.Option(2, "--max-failed-rounds", min=1, help="stop after this many rounds in which every client failed the same way"),
    warmup_s: float = typer.Option(120.0, "--warmup-s", min=1.0, help="how long delivery and warm-up wait for each endpoint"),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="working directory of the ServerApp (files it saves)"),
    hub: Optional[str] = typer.Option(None, "--hub", help="hub URL (default: MESH_HUB_URL or the login profile)"),
    token: Optional[str] = typer.Option(None, "--token", help="API token (default: MESH_TOKEN or the login profile)"),
    as_json: bool = typer.Option(False, "--json", help="print the run summary as JSON"),
) -> None:
    """Run a Flower App: deliver it, warm the clients, run its ServerApp against the endpoints."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from cloud_hub.client import Client
    from fl.flower.delivery import AppError, AppPackage
    from fl.flower.grid import RunFailed
    from fl.flower.run import run_app

    try:
        from flwr.common.config import parse_config_args

        overrides = parse_config_args(list(run_config)) if run_config else {}
        pkg = AppPackage.load(app_path)
        pkg.run_config(overrides)  # unknown keys fail here, before anything is stored
    except (AppError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except Exception as exc:  # click's exception for a malformed --run-config
        typer.echo(f"error: --run-config: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(2)
    try:
        client = Client(hub, token)
    except Exception as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    try:
        res = run_app(pkg, client, endpoints=_split(endpoints) or None, tags=_split(tags) or None, auto=auto,
                      run_config=overrides, dataset=dataset, warmup_s=warmup_s, max_failed_rounds=max_failed_rounds,
                      workdir=out_dir, clients=clients)
    except ValueError as exc:  # no such endpoint, bad selection
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    except (RunFailed, AppError) as exc:
        typer.echo(f"run failed: {exc}", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(res.to_dict(), default=str))
    else:
        last = res.rounds[-1] if res.rounds else {}
        typer.echo(f"run {res.run_id} {res.status}: {len(res.rounds)} round(s) on {len(res.ready)} endpoint(s); "
                   f"last loss {last.get('loss')} accuracy {last.get('accuracy')}; "
                   f"{res.bytes_out} B of messages out, {res.bytes_in} B back, app {res.delivery.get('fab_bytes_sent', 0)} B delivered")
        if res.selection is not None:
            sel = res.selection

            def pred(x: dict) -> str:
                return "no prediction" if x["predicted_s"] is None else f"{float(x['predicted_s']):.3f}s"

            ranking = ", ".join(f"{x['rank']}. {x['name'] or x['endpoint']} ({pred(x)})" for x in sel["ranking"])
            typer.echo(f"  --auto ({sel['policy']}): took {len(sel['chosen'])} of {sel['online']} online endpoint(s); {ranking}")
        for e, why in res.failed.items():
            typer.echo(f"  left out {e}: {why}", err=True)
    sys.exit(0)


if __name__ == "__main__":
    app()
