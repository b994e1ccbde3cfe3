"""``./taskw demo``: a whole mesh on this machine running a real workload.

Starts Mosquitto, the hub (SQLite), three agent processes (two over MQTT, one over ZeroMQ),
then runs thousands of small calls and some numpy work on every endpoint through the SDK,
kills one agent in the middle to show that nothing is lost, and prints a summary table.
Everything stops at the end or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh

console = Console(width=None if Console().is_terminal else 120)


def monte_carlo_pi(samples: int, seed: int) -> float:
    """A small CPU-bound call: thousands of these make the workload."""
    import random

    rng = random.Random(seed)
    inside = sum(1 for _ in range(samples) if rng.random() ** 2 + rng.random() ** 2 <= 1.0)
    return 4.0 * inside / samples


def spectral_radius(n: int, seed: int) -> float:
    """Some numpy work: eigenvalues of a random symmetric matrix."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    return float(np.max(np.abs(np.linalg.eigvalsh(a + a.T))))


def _auto_placement(mesh: LocalMesh, agents: list[Any], n: int) -> bool:
    """Let the scheduler place work (``endpoint="auto"``) in two waves: the first explores an
    unprofiled function, the second uses what it measured. Shows where tasks went and how far
    the predictions were from the actual times."""
    if n <= 0:
        return True
    names = {a.endpoint_id: a.cfg.name for a in agents}
    table = Table(title=f'Scheduler placement (endpoint="auto"), 2 waves of {n // 2} tasks')
    for col in ("wave", *names.values(), "median |predicted - actual|"):
        table.add_column(col, justify="right")
    ok = True
    with Executor(mesh.client, endpoint="auto") as ex:
        for wave in (1, 2):
            fs = [ex.submit(spectral_radius, 120, i) for i in range(n // 2)]
            done, not_done = wait(fs, timeout=300)
            ok = ok and not not_done and all(f.exception() is None for f in done)
            placed = Counter(getattr(f, "endpoint_id", "") for f in fs)
            ids = {f.task_id for f in fs}  # type: ignore[attr-defined]
            rows = [d for d in mesh.client.scheduler_decisions(limit=n)["decisions"]
                    if d["task_id"] in ids and d.get("actual_s") is not None and d.get("predicted_s") is not None]
            err = statistics.median(abs(d["actual_s"] - d["predicted_s"]) for d in rows) if rows else float("nan")
            table.add_row(str(wave), *(str(placed[e]) for e in names), f"{err * 1e3:.0f} ms")
    console.print(table)
    console.print("each decision, with the predictions it compared: GET /v1/scheduler/decisions")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=3000, help="small calls per endpoint")
    ap.add_argument("--matrices", type=int, default=20, help="numpy tasks per endpoint")
    ap.add_argument("--auto", type=int, default=300, help="tasks placed by the scheduler (endpoint='auto')")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    ap.add_argument("--no-kill", action="store_true", help="do not SIGKILL an agent mid-run")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="continuum-demo-"))
    console.print(f"[bold]Continuum Mesh demo[/bold] in {workdir}")
    try:
        with LocalMesh(workdir, heartbeat_s=1.0, lost_after_s=4.0) as mesh:
            console.print(f"hub {mesh.url}, mosquitto 127.0.0.1:{mesh.broker.port}, ZeroMQ {mesh.hub.hub.zmq_address}")  # type: ignore[union-attr]
            agents = [mesh.add_agent("pi-field-1", "mqtt"), mesh.add_agent("pi-field-2", "mqtt"), mesh.add_agent("hpc-login", "zmq")]
            mesh.wait_online(timeout=60)
            console.print("three agents online: " + ", ".join(f"{a.cfg.name} ({a.cfg.transport})" for a in agents))
            t0 = time.perf_counter()
            futures: dict[str, list[Future[Any]]] = {}
            executors = {a.endpoint_id: Executor(mesh.client, a.endpoint_id) for a in agents}
            for a in agents:
                ex = executors[a.endpoint_id]
                fs = [ex.submit(monte_carlo_pi, 2000, i) for i in range(args.calls)]
                fs += [ex.submit(spectral_radius, 200, i) for i in range(args.matrices)]
                futures[a.endpoint_id] = fs
            total = sum(len(v) for v in futures.values())
            console.print(f"submitted {total} tasks")
            if not args.no_kill:
                victim = agents[0]
                while sum(f.done() for f in futures[victim.endpoint_id]) < len(futures[victim.endpoint_id]) // 3:
                    time.sleep(0.05)
                victim.kill()
                console.print(f"[yellow]SIGKILLed {victim.cfg.name} mid-run (a power cut); restarting it[/yellow]")
                time.sleep(0.5)
                victim.start()
            all_fs = [f for fs in futures.values() for f in fs]
            with console.status("waiting for results"):
                done, not_done = wait(all_fs, timeout=600)
            elapsed = time.perf_counter() - t0
            for ex in executors.values():
                ex.shutdown(wait=False)
            table = Table(title=f"{total} tasks in {elapsed:.1f}s ({total / elapsed:.0f} tasks/s)")
            for col in ("endpoint", "transport", "tasks", "ok", "failed", "mean run ms", "pi estimate", "mean spectral radius"):
                table.add_column(col, justify="right" if col not in ("endpoint", "transport") else "left")
            for a in agents:
                fs = futures[a.endpoint_id]
                ok = [f for f in fs if f.done() and f.exception() is None]
                runs = [(f.finished - f.started) * 1e3 for f in ok if getattr(f, "started", None) and getattr(f, "finished", None)]  # type: ignore[attr-defined]
                pis = [f.result() for f in fs[: args.calls] if f.done() and f.exception() is None]
                radii = [f.result() for f in fs[args.calls :] if f.done() and f.exception() is None]
                table.add_row(
                    a.cfg.name, a.cfg.transport, str(len(fs)), str(len(ok)), str(len(fs) - len(ok)),
                    f"{statistics.mean(runs):.2f}" if runs else "-",
                    f"{statistics.mean(pis):.4f}" if pis else "-",
                    f"{statistics.mean(radii):.1f}" if radii else "-",
                )
            console.print(table)
            lost = len(not_done)
            console.print(f"lost: {lost}, results delivered: {len(done)} of {total}")
            auto_ok = _auto_placement(mesh, agents, args.auto)
            console.print(f"console: {mesh.url}/console (sign in with token {mesh.token})")
            return 0 if lost == 0 and auto_ok and all(f.exception() is None for f in done) else 1
    except KeyboardInterrupt:
        console.print("interrupted; everything stopped")
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
