"""``./taskw fl-demo`` (also the end of ``./taskw demo``): federated learning on local agents.

Starts Mosquitto, the hub and three agent processes (two over MQTT, one over ZeroMQ; one worker
each). Each agent declares its own non-IID share of scikit-learn's digits in its config (data
stays on the "device"); the driver trains a small MLP with FedAvg, printing each round's test
accuracy as it lands. Midway one agent is SIGKILLed (a power cut): its round finishes at the
deadline without it; it is restarted and rejoins. The history (JSON, CSV) and a PNG chart are
written to ``run/fl-demo/``; the run is also in the hub (``GET /v1/fl/runs``).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from cloud_hub.localmesh import LocalMesh

console = Console(width=None if Console().is_terminal else 120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha of the non-IID split (small = more skew)")
    ap.add_argument("--deadline", type=float, default=5.0, help="round deadline in seconds")
    ap.add_argument("--out", type=Path, default=Path("run/fl-demo"), help="where the history and chart go")
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL an agent mid-run")
    ap.add_argument("--keep", action="store_true", help="keep the mesh's working directory")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="continuum-fl-demo-"))
    try:
        with LocalMesh(workdir, heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0) as mesh:
            return run(mesh, rounds=args.rounds, clients=args.clients, alpha=args.alpha, deadline=args.deadline,
                       out=args.out, kill=not args.no_kill)
    except KeyboardInterrupt:
        console.print("interrupted; everything stopped")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def run(mesh: LocalMesh, *, rounds: int = 12, clients: int = 3, alpha: float = 0.5, deadline: float = 5.0,
        out: Path = Path("run/fl-demo"), kill: bool = True) -> int:
    """The FL demo on a running mesh: its own digits devices join it, so ``./taskw demo`` shows the
    FL run in the same console as the task workload. Returns the exit status."""
    import torch

    from fl import FedAvg, Federation
    from fl.data import load_test_data
    from fl.localmesh import add_digits_agents
    from fl.models import MLP

    out.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]Continuum Mesh FL demo[/bold]: FedAvg on digits, {clients} devices, "
                  f"non-IID (Dirichlet alpha={alpha}), {rounds} rounds")
    t_start = time.perf_counter()
    # mixed transports, as in the field: the last device is on the LAN (ZeroMQ)
    transports = ["mqtt"] * (clients - 1) + ["zmq"]
    agents = add_digits_agents(mesh, clients, alpha=alpha, transport=transports)
    mesh.wait_online(*agents, timeout=90)
    console.print("devices online: " + ", ".join(f"{a.cfg.name} ({a.cfg.transport}, holds digits part {k})"
                                                  for k, a in enumerate(agents)))
    victim = agents[0]
    kill_round = max(2, rounds // 3) if kill and rounds >= 4 else None
    names = {a.endpoint_id: a.cfg.name for a in agents}

    def on_round_start(r: int, tasks: dict[str, str]) -> None:
        if r == kill_round:
            victim.kill()
            console.print(f"[yellow]round {r}: SIGKILLed {victim.cfg.name} mid-round (a power cut)[/yellow]")

    def on_round(rec: Any, _w: Any) -> None:
        who = ", ".join(names.get(p, p) for p in rec.participants)
        late = f"  stragglers: {', '.join(names.get(s, s) for s in rec.stragglers)}" if rec.stragglers else ""
        acc = "   -  " if rec.accuracy is None else f"{rec.accuracy:6.1%}"
        console.print(f"round {rec.round:2d}  accuracy {acc}  loss {rec.loss or 0:5.3f}  "
                      f"{rec.round_time_s:5.2f}s  participants: {who}{late}")
        if kill_round is not None and rec.round == kill_round + 1:
            victim.start()
            mesh.wait_online(victim, timeout=60)
            console.print(f"[green]{victim.cfg.name} restarted; it rejoins from the next round[/green]")

    torch.manual_seed(0)
    fed = Federation(mesh.client, [a.endpoint_id for a in agents])
    console.print("warming up the devices (each loads torch, its model and its own data once)...")
    hist = fed.fit(MLP(), "digits", rounds=rounds, strategy=FedAvg(), local_epochs=2,
                   deadline_s=deadline, min_clients=max(1, clients - 1), max_extensions=1,
                   trainer={"threads": 1, "lr": 0.05}, eval_data=load_test_data(), name="fl-demo",
                   on_round=on_round, on_round_start=on_round_start)
    info = mesh.client.fl_run(fed.run_id)  # type: ignore[arg-type]
    hist.to_json(out / "history.json")
    hist.to_csv(out / "history.csv")
    png = hist.plot_png(out / "accuracy.png", title=f"FedAvg on digits, {clients} devices (Continuum Mesh)")
    rejoined = kill_round is not None and any(victim.endpoint_id in r.participants for r in hist if r.round > kill_round)
    console.print(f"final test accuracy {hist[-1].accuracy:.1%} after {len(hist)} rounds; "
                  f"run {fed.run_id} is '{info['status']}' in the hub; {time.perf_counter() - t_start:.0f}s in all")
    if kill_round is not None:
        console.print(f"{victim.cfg.name}: straggler in round {kill_round}, "
                      f"{'rejoined later' if rejoined else 'did not rejoin in time'}")
    console.print(f"chart: {png}   history: {out / 'history.json'}")
    return 0 if info["status"] == "finished" else 1


if __name__ == "__main__":
    raise SystemExit(main())
