"""Federated learning: the same job on Continuum Mesh and on Flower's Deployment Engine.

The job: scikit-learn's digits split non-IID (Dirichlet alpha=0.5) over N clients, the same
64-64-10 MLP (fl.models.MLP, torch.manual_seed(0)), the same local training code
(fl.torch_support.train_supervised: SGD lr 0.05, momentum 0.9, batch 32, E local epochs, one
torch thread per client), the same per-(round, client) seeds, FedAvg, R rounds, central
evaluation of every new global model on the held-out test split. Run one after the other in one
process, on 127.0.0.1:

* **Continuum Mesh**: Mosquitto, the hub as its own process (``mesh-hub serve``), N agent
  processes with one worker each (each declares its own partition), ``fl.Federation`` driving.
* **Flower** (the installed flwr): ``flower-superlink --insecure`` and N ``flower-supernode
  --insecure`` processes (``--node-config partition-id=k ...``), the Flower App in
  ``bench/flower_app`` submitted with ``flwr run``; Flower's message-API ``FedAvg`` with
  ``fraction_evaluate=0`` (no federated evaluation, as on the mesh) and ``evaluate_fn``.

Measured for each: round wall time (between consecutive central evaluations, so each interval
holds one round's dispatch, training, aggregation and evaluation), the longest local training
time in the round (timed inside the training function on both sides), their difference =
framework overhead per round, the start-up before round 1, and the final test accuracy.
Targets: mesh overhead per round <= Flower's; final accuracies within 1 point.

One JSON object on stdout and in bench/results/fl-<UTC>.json; progress on stderr.

    python bench/fl.py [--rounds 5] [--clients 5] [--local-epochs 2] [--quick] [--no-flower]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c

# Run as a script, bench/ is first on sys.path and bench/scheduler.py would shadow the
# `scheduler` package the hub imports: keep bench/ off the path once _common is loaded.
sys.path[:] = [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != c.BENCH_DIR]
sys.path.insert(0, str(c.REPO))

FLOWER_APP = c.BENCH_DIR / "flower_app"
TRAINER = {"threads": 1, "lr": 0.05, "batch_size": 32}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _summary(round_s: list[float], train_s: list[float], accuracy: list[float], startup_s: float,
             total_s: float) -> dict[str, Any]:
    over = [r - t for r, t in zip(round_s, train_s)]
    steady = slice(1, None) if len(round_s) > 1 else slice(None)

    def mean(xs: list[float]) -> float | None:
        return round(statistics.fmean(xs), 4) if xs else None

    return {
        "rounds": len(round_s),
        "mean_s_per_round": mean(round_s),
        "steady_mean_s_per_round": mean(round_s[steady]),
        "mean_train_s_per_round": mean(train_s),
        "mean_overhead_s_per_round": mean(over),
        "steady_mean_overhead_s_per_round": mean(over[steady]),
        "first_round_s": round(round_s[0], 4) if round_s else None,
        "startup_s": round(startup_s, 3),
        "total_s": round(total_s, 3),
        "final_accuracy": accuracy[-1] if accuracy else None,
        "accuracy_per_round": [round(a, 4) for a in accuracy],
        "round_s": [round(x, 4) for x in round_s],
        "max_train_s": [round(x, 4) for x in train_s],
    }


# ------------------------------------------------------------------------------- mesh
def run_mesh(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], list[str]]:
    import torch

    from cloud_hub.localmesh import LocalMesh
    from fl import FedAvg, Federation
    from fl.data import load_test_data
    from fl.localmesh import add_digits_agents
    from fl.models import MLP

    with LocalMesh(workdir / "mesh", heartbeat_s=1.0, lost_after_s=10.0, lease_s=10.0, hub_process=True) as mesh:
        agents = add_digits_agents(mesh, args.clients, scheme="dirichlet", alpha=args.alpha, seed=0)
        mesh.wait_online(timeout=120)
        ids = [a.endpoint_id for a in agents]
        c.log(f"mesh: {args.clients} agents online; fit {args.rounds} rounds")
        stamps: list[float] = []
        torch.manual_seed(0)
        fed = Federation(mesh.client, ids)
        t0 = time.time()
        first_start: list[float] = []

        def on_round_start(r: int, _tasks: dict[str, str]) -> None:
            if r == 1:
                first_start.append(time.time())

        hist = fed.fit(MLP(), "digits", rounds=args.rounds, strategy=FedAvg(min_clients=args.clients),
                       local_epochs=args.local_epochs, deadline_s=600, trainer=TRAINER, eval_data=load_test_data(),
                       seed=0, name="bench-fl", on_round=lambda rec, w: stamps.append(time.time()),
                       on_round_start=on_round_start)
        t_end = time.time()
        start = first_start[0]
        bounds = [start] + stamps
        round_s = [b - a for a, b in zip(bounds, bounds[1:])]
        train_s = [float(r.extra.get("max_train_time_s", 0.0)) for r in hist]
        out = _summary(round_s, train_s, [float(r.accuracy) for r in hist], start - t0, t_end - t0)
        out["warmup"] = hist.metadata.get("warmup", {}).get("time_s")
        out["participants_per_round"] = [len(r.participants) for r in hist]
        return out, ids


# ------------------------------------------------------------------------------- flower
class _Procs:
    """Processes this benchmark started; each in its own session, stopped by process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        fh = open(log, "ab")
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # SuperExec and ClientApp children too
            except ProcessLookupError:
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_flower(args: argparse.Namespace, workdir: Path, seed_keys: list[str]) -> dict[str, Any]:
    venv_bin = Path(sys.executable).parent
    flwr = shutil.which("flwr", path=str(venv_bin)) or shutil.which("flwr")
    if flwr is None:
        raise RuntimeError("flwr CLI not found: pip install flwr (the 'flower' extra)")
    home, out = workdir / "flwr-home", workdir / "flwr-out"
    home.mkdir(parents=True)
    out.mkdir(parents=True)
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(home), PYTHONPATH=str(c.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=str(venv_bin) + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")
    procs = _Procs()
    try:
        procs.start([str(venv_bin / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                     "--host", "127.0.0.1", "--port", str(port)], workdir / "superlink.log", env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"flower-superlink did not listen within 60 s: {(workdir / 'superlink.log').read_text()[-2000:]}")
        for k in range(args.clients):
            node_cfg = f"partition-id={k} num-partitions={args.clients} seed-key='{seed_keys[k]}'"
            procs.start([str(venv_bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                         "--node-config", node_cfg, "--port", str(_free_port())], workdir / f"supernode-{k}.log", env)
        c.log(f"flower: SuperLink on :{port}, {args.clients} SuperNodes; flwr run")
        run_cfg = (f"num-server-rounds={args.rounds} num-nodes={args.clients} local-epochs={args.local_epochs} "
                   f"alpha={args.alpha} out-dir='{out}'")
        t0 = time.time()
        run = subprocess.run([flwr, "run", str(FLOWER_APP), "bench", "--run-config", run_cfg, "--stream"],
                             env=env, cwd=workdir, capture_output=True, text=True, timeout=args.flower_timeout)
        t_end = time.time()
        (workdir / "flwr-run.log").write_text(run.stdout + run.stderr)
        rounds = sorted(_jsonl(out / "flower-rounds.jsonl"), key=lambda d: d["round"])
        clients = _jsonl(out / "flower-clients.jsonl")
        if run.returncode != 0 or len(rounds) != args.rounds + 1:
            raise RuntimeError(f"flwr run exited {run.returncode} with {len(rounds)} evaluations: {(run.stdout + run.stderr)[-3000:]}")
        ts = [d["t"] for d in rounds]  # round 0 = the initial model, evaluated before round 1
        round_s = [b - a for a, b in zip(ts, ts[1:])]
        train_s = [max((d["train_s"] for d in clients if d["round"] == r), default=0.0) for r in range(1, args.rounds + 1)]
        res = _summary(round_s, train_s, [float(d["accuracy"]) for d in rounds[1:]], ts[0] - t0, t_end - t0)
        res["participants_per_round"] = [sum(1 for d in clients if d["round"] == r) for r in range(1, args.rounds + 1)]
        handler = [d["handler_s"] - d["train_s"] for d in clients]
        res["mean_clientapp_handler_minus_train_s"] = round(statistics.fmean(handler), 4) if handler else None
        return res
    finally:
        procs.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--flower-timeout", type=float, default=1800, help="give up on `flwr run` after this (s)")
    p.add_argument("--no-flower", action="store_true", help="only the mesh side")
    p.add_argument("--quick", action="store_true", help="3 rounds, 3 clients (smoke run)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.clients = 3, 3
    started = time.monotonic()
    out = c.header("fl", args)
    out["machine"]["versions"].update({m: c._version(m) for m in ("torch", "flwr", "numpy")})
    workdir = Path(tempfile.mkdtemp(prefix="bench-fl-", dir=args.workdir))
    try:
        la = c.loadavg()
        mesh, ids = run_mesh(args, workdir)
        mesh["loadavg_before"], mesh["loadavg_after"] = la, c.loadavg()
        out["continuum_mesh"] = mesh
        c.log(f"mesh: {mesh['mean_s_per_round']} s/round, overhead {mesh['mean_overhead_s_per_round']} s, "
              f"accuracy {mesh['final_accuracy']:.4f}")
        if not args.no_flower:
            try:
                la = c.loadavg()
                fl = run_flower(args, workdir, ids)
                fl["loadavg_before"], fl["loadavg_after"] = la, c.loadavg()
                out["flower"] = fl
                c.log(f"flower: {fl['mean_s_per_round']} s/round, overhead {fl['mean_overhead_s_per_round']} s, "
                      f"accuracy {fl['final_accuracy']:.4f}")
            except Exception as exc:  # reported, not hidden: the mesh numbers still stand
                out["flower"] = {"error": f"{type(exc).__name__}: {exc}"}
                c.log(f"flower failed: {exc}")
        fl = out.get("flower") or {}
        if fl.get("mean_overhead_s_per_round") is not None:
            diff = abs(mesh["final_accuracy"] - fl["final_accuracy"]) * 100
            out["comparison"] = {
                "overhead_ratio_mesh_over_flower": c.ratio(mesh["mean_overhead_s_per_round"], fl["mean_overhead_s_per_round"]),
                "steady_overhead_ratio_mesh_over_flower": c.ratio(mesh["steady_mean_overhead_s_per_round"],
                                                                  fl["steady_mean_overhead_s_per_round"]),
                "s_per_round_ratio_mesh_over_flower": c.ratio(mesh["mean_s_per_round"], fl["mean_s_per_round"]),
                "accuracy_diff_points": round(diff, 3),
                "target_overhead_met": mesh["mean_overhead_s_per_round"] <= fl["mean_overhead_s_per_round"],
                "target_accuracy_met": diff <= 1.0,
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    c.finish("fl", out, args, started)


if __name__ == "__main__":
    main()
