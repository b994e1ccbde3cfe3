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

Update compression (issue 11): on the same mesh, the same job again for each setting of
``--compression`` (default ``fp16,q8,topk:0.01,topk:0.1+q8,topk:0.25+q8``): model bytes up per
update and down per client per round (from the round records), their ratio to uncompressed
float32 (today's lossless wire blob, and the raw 4 bytes per weight), and the final accuracy next
to the uncompressed run's over the same rounds (same seeds). Targets: >= 8x fewer uplink bytes
with <= 1 point of final accuracy lost.

Differential privacy (issue 11, item 3): on the same mesh, the same job with central
client-level DP (``Federation(dp=...)``) whose noise multiplier dp-accounting calibrates to
``--dp-epsilon`` (default 8) at ``--dp-delta`` over the run's rounds, clip norm ``--dp-clip``;
reported: epsilon per round from the accountant, final accuracy next to the run without DP.

Time to accuracy over a shaped link (``--link-kbps 256``; 0 skips it): a second mesh whose
agents each reach the broker through their own ``sim.emulate.proxy.FaultProxy`` capped at that
bandwidth per direction (one rural link per device), running ``--tta-rounds`` rounds uncompressed
and with ``--tta-compression``; then Flower with its defaults, each SuperNode reaching the
SuperLink through its own capped proxy. Reported: time from round 1 (and from launch) to the
first global model at >= ``--tta-target`` test accuracy, and the bytes each link carried.

One JSON object on stdout and in bench/results/fl-<UTC>.json; progress on stderr.

    python bench/fl.py [--rounds 5] [--clients 5] [--local-epochs 2] [--quick] [--smoke] [--no-flower]
                       [--compression LIST] [--link-kbps 256] [--tta-rounds 10] [--no-shaped-flower]
                       [--dp-epsilon 8] [--dp-clip 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as c

# Run as a script, bench/ is first on sys.path and bench/scheduler.py would shadow the
# `scheduler` package the hub imports: keep bench/ off the path once _common is loaded.
sys.path[:] = [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != c.BENCH_DIR]
sys.path.insert(0, str(c.REPO))

from cloud_hub.broker import free_port  # noqa: E402 (after the path fix above)

FLOWER_APP = c.BENCH_DIR / "flower_app"
TRAINER = {"threads": 1, "lr": 0.05, "batch_size": 32}


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
def _split(setting: str) -> tuple[str | None, str | None]:
    """``"UPLINK|DOWNLINK"`` (e.g. ``"topk:0.25+q8|fp16"``; ``"none"``: neither)."""
    up, _, down = setting.partition("|")
    return (None if up in ("", "none") else up), (down or None)


def _mesh_job(client: Any, ids: list[str], args: argparse.Namespace, rounds: int, setting: str | None,
              name: str, dp: Any = None) -> tuple[Any, dict[str, Any]]:
    """The benchmark job once on the mesh (with client-level DP when ``dp`` is an
    ``fl.privacy.DPConfig``); returns the history and its timings."""
    compression, downlink = _split(setting or "none")
    import torch

    from fl import FedAvg, Federation
    from fl.data import load_test_data
    from fl.models import MLP

    stamps: list[float] = []
    first_start: list[float] = []

    def on_round_start(r: int, _tasks: dict[str, str]) -> None:
        if not first_start:
            first_start.append(time.time())

    torch.manual_seed(0)
    fed = Federation(client, ids, dp=dp)
    t0 = time.time()
    hist = fed.fit(MLP(), "digits", rounds=rounds, strategy=FedAvg(min_clients=args.clients),
                   local_epochs=args.local_epochs, deadline_s=600, trainer=TRAINER, eval_data=load_test_data(),
                   seed=0, name=name, on_round=lambda rec, w: stamps.append(time.time()),
                   on_round_start=on_round_start, compression=compression, downlink=downlink)
    return hist, {"t0": t0, "first_start": first_start[0], "stamps": stamps, "t_end": time.time()}


def _raw_float32_bytes() -> int:
    import torch

    from fl.models import MLP

    torch.manual_seed(0)
    return int(sum(p.numel() for p in MLP().state_dict().values() if p.is_floating_point()) * 4)


def _traffic(hist: Any) -> dict[str, Any]:
    """Model bytes up and down per round of a mesh run, from its history's round records."""
    t = hist.traffic()
    per_round_up = [r["up"] for r in t["rounds"]]
    return {"model_bytes_up_per_update": round(t["up_per_update"], 1) if t["up_per_update"] else None,
            "model_bytes_down_per_client": round(t["down_per_client"], 1) if t["down_per_client"] else None,
            "model_bytes_up_per_round": per_round_up, "model_bytes_down_per_round": [r["down"] for r in t["rounds"]]}


def run_mesh(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    from cloud_hub.localmesh import LocalMesh
    from fl.localmesh import add_digits_agents

    with LocalMesh(workdir / "mesh", heartbeat_s=1.0, lost_after_s=10.0, lease_s=10.0, hub_process=True) as mesh:
        agents = add_digits_agents(mesh, args.clients, scheme="dirichlet", alpha=args.alpha, seed=0)
        mesh.wait_online(timeout=120)
        ids = [a.endpoint_id for a in agents]
        c.log(f"mesh: {args.clients} agents online; fit {args.rounds} rounds")
        hist, tm = _mesh_job(mesh.client, ids, args, args.rounds, None, "bench-fl")
        start = tm["first_start"]
        bounds = [start] + tm["stamps"]
        round_s = [b - a for a, b in zip(bounds, bounds[1:])]
        train_s = [float(r.extra.get("max_train_time_s", 0.0)) for r in hist]
        out = _summary(round_s, train_s, [float(r.accuracy) for r in hist], start - tm["t0"], tm["t_end"] - tm["t0"])
        out["warmup"] = hist.metadata.get("warmup", {}).get("time_s")
        out["participants_per_round"] = [len(r.participants) for r in hist]
        out.update(_traffic(hist))
        sweep = compression_sweep(args, mesh, ids, out)
        if args.dp_epsilon > 0:
            out["dp"] = dp_leg(args, mesh, ids, out)
        return out, ids, sweep


def dp_leg(args: argparse.Namespace, mesh: Any, ids: list[str], base: dict[str, Any]) -> dict[str, Any]:
    """The same job with central client-level DP calibrated to ``--dp-epsilon`` over its rounds
    (every client every round: sample rate 1), on the same mesh, next to the run without DP."""
    import numpy as np

    from fl.privacy import DPConfig, noise_for_epsilon

    z = noise_for_epsilon(args.dp_epsilon, args.rounds, 1.0, args.dp_delta)
    cfg = DPConfig(noise_multiplier=z, clip_norm=args.dp_clip, mode="central", delta=args.dp_delta)
    c.log(f"mesh: central DP to epsilon {args.dp_epsilon} over {args.rounds} rounds: z={z:.3f}, C={args.dp_clip}")
    hist, tm = _mesh_job(mesh.client, ids, args, args.rounds, None, "bench-fl-dp", dp=cfg)
    acc = [round(float(r.accuracy), 4) for r in hist]
    norms = [float(n) for r in hist for n in (r.extra.get("dp_update_norms") or {}).values()]
    eps = [r.extra.get("dp", {}).get("epsilon") for r in hist]
    out = {
        "target_epsilon": args.dp_epsilon, "delta": args.dp_delta, "mode": "central", "noise_multiplier": round(z, 4),
        "clip_norm": args.dp_clip, "clients_per_round": len(ids), "sample_rate": 1.0,
        "noise_std_on_mean_per_weight": round(z * args.dp_clip / max(1, len(ids)), 4),
        "update_norm_median_before_clip": round(float(np.median(norms)), 4) if norms else None,
        "epsilon_per_round": eps, "final_epsilon": eps[-1] if eps else None,
        "final_accuracy": acc[-1] if acc else None, "accuracy_per_round": acc,
        "no_dp_final_accuracy": base["final_accuracy"], "no_dp_accuracy_per_round": base["accuracy_per_round"],
        "accuracy_lost_points": round((base["final_accuracy"] - acc[-1]) * 100, 2) if acc else None,
        "mean_s_per_round": round((tm["t_end"] - tm["first_start"]) / max(1, len(hist)), 3),
    }
    c.log(f"  dp: epsilon {out['final_epsilon']}, accuracy {out['final_accuracy']} (no DP {base['final_accuracy']:.4f})")
    return out


def compression_sweep(args: argparse.Namespace, mesh: Any, ids: list[str], base: dict[str, Any]) -> dict[str, Any]:
    """The same job with each compression setting, on the same (warm) mesh."""
    raw = _raw_float32_bytes()
    wire = base["model_bytes_up_per_update"]
    out: dict[str, Any] = {"raw_float32_bytes_per_update": raw, "settings": {}}
    out["settings"]["none"] = {"final_accuracy": base["final_accuracy"], "accuracy_per_round": base["accuracy_per_round"],
                               "model_bytes_up_per_update": wire, "model_bytes_down_per_client": base["model_bytes_down_per_client"],
                               "uplink_reduction_vs_wire": 1.0, "uplink_reduction_vs_raw_float32": round(raw / wire, 2) if wire else None}
    for spec in [x for x in args.compression.split(",") if x and x != "none"]:
        c.log(f"mesh: compression {spec}, {args.rounds} rounds")
        hist, tm = _mesh_job(mesh.client, ids, args, args.rounds, spec, f"bench-fl-{spec}")
        tr = _traffic(hist)
        up = tr["model_bytes_up_per_update"]
        acc = [round(float(r.accuracy), 4) for r in hist]
        diff = (base["final_accuracy"] - acc[-1]) * 100
        out["settings"][spec] = {
            "final_accuracy": acc[-1], "accuracy_per_round": acc, **tr,
            "uplink_reduction_vs_wire": round(wire / up, 2) if up and wire else None,
            "uplink_reduction_vs_raw_float32": round(raw / up, 2) if up else None,
            "accuracy_lost_points": round(diff, 2),
            "target_8x_met": bool(up and wire and wire / up >= 8),
            "target_accuracy_met": diff <= 1.0,
            "mean_s_per_round": round((tm["t_end"] - tm["first_start"]) / max(1, len(hist)), 3),
        }
        c.log(f"  {spec}: up {up} B/update ({out['settings'][spec]['uplink_reduction_vs_wire']}x), accuracy {acc[-1]:.4f}")
    return out


# ------------------------------------------------------------------------------- shaped links
class _Links:
    """Fault proxies (sim/emulate/proxy.py) capped at a bandwidth, on an event loop in a thread."""

    def __init__(self, kbps: float | None) -> None:
        self.kbps = None if kbps is None else float(kbps)  # None: no cap, the proxies only count bytes
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="links", daemon=True)
        self.thread.start()
        self.proxies: dict[str, Any] = {}

    def add(self, name: str, upstream_port: int) -> int:
        from sim.emulate.proxy import FaultProxy, LinkShape

        shape = LinkShape(bandwidth_bps=self.kbps * 1000) if self.kbps else LinkShape()
        proxy = asyncio.run_coroutine_threadsafe(FaultProxy(name, ("127.0.0.1", upstream_port), shape).start(), self.loop).result(10)
        self.proxies[name] = proxy
        return int(proxy.port)

    def counters(self, prefix: str = "") -> dict[str, int]:
        up = sum(p.stats["bytes_up"] for n, p in self.proxies.items() if n.startswith(prefix))
        down = sum(p.stats["bytes_down"] for n, p in self.proxies.items() if n.startswith(prefix))
        return {"up": int(up), "down": int(down)}

    def close(self) -> None:
        for p in self.proxies.values():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(p.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _time_to(acc: list[float], ends: list[float], start: float, target: float) -> float | None:
    for a, t in zip(acc, ends):
        if a >= target:
            return round(t - start, 3)
    return None


def run_mesh_shaped(args: argparse.Namespace, workdir: Path, links: _Links) -> tuple[dict[str, Any], list[str]]:
    from cloud_hub.localmesh import LocalMesh
    from fl.localmesh import add_digits_agents

    out: dict[str, Any] = {}
    with LocalMesh(workdir / "mesh-shaped", heartbeat_s=1.0, lost_after_s=10.0, lease_s=10.0, hub_process=True) as mesh:
        agents = add_digits_agents(mesh, args.clients, scheme="dirichlet", alpha=args.alpha, seed=0, prefix="fl-rural", start=False)
        for a in agents:
            port = links.add(f"mesh/{a.cfg.name}", mesh.broker.port)
            a.cfg = a.cfg.model_copy(update={"mqtt": a.cfg.mqtt.model_copy(update={"host": "127.0.0.1", "port": port})})
            a.cfg.save(a.config_path)
            a.start()
        mesh.wait_online(timeout=180)
        ids = [a.endpoint_id for a in agents]
        for spec in ["none"] + [x for x in args.tta_compression.split(",") if x and x != "none"]:
            c.log(f"mesh over {links.kbps:g} kbps links: compression {spec}, {args.tta_rounds} rounds")
            before = links.counters("mesh/")
            hist, tm = _mesh_job(mesh.client, ids, args, args.tta_rounds, spec, f"bench-fl-shaped-{spec}")
            after = links.counters("mesh/")
            acc = [round(float(r.accuracy), 4) for r in hist]
            n = max(1, len(hist))
            res = {
                "accuracy_per_round": acc, "final_accuracy": acc[-1],
                "round_end_s": [round(t - tm["first_start"], 3) for t in tm["stamps"]],
                "time_to_target_s": _time_to(acc, tm["stamps"], tm["first_start"], args.tta_target),
                "time_to_target_from_launch_s": _time_to(acc, tm["stamps"], tm["t0"], args.tta_target),
                "startup_s": round(tm["first_start"] - tm["t0"], 3),
                "mean_s_per_round": round((tm["t_end"] - tm["first_start"]) / n, 3),
                "link_bytes_up_per_round": round((after["up"] - before["up"]) / n),
                "link_bytes_down_per_round": round((after["down"] - before["down"]) / n),
                **_traffic(hist),
            }
            out[spec] = res
            c.log(f"  {spec}: {res['mean_s_per_round']} s/round, {args.tta_target:.0%} after {res['time_to_target_s']} s, "
                  f"link up {res['link_bytes_up_per_round']} B/round")
    return out, ids


# ------------------------------------------------------------------------------- flower
class _Procs:
    """Processes this benchmark started; each in its own session, stopped by process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        fh = open(log, "ab")
        # cwd: the run's own folder, so what an app's ServerApp saves (a model file) lands there, not in the repo
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=log.parent)
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


def run_flower(args: argparse.Namespace, workdir: Path, seed_keys: list[str], rounds: int | None = None,
               links: "_Links | None" = None, tag: str = "") -> dict[str, Any]:
    """The job on Flower's Deployment Engine; with ``links``, each SuperNode reaches the
    SuperLink through its own bandwidth-capped proxy."""
    n_rounds = int(rounds or args.rounds)
    venv_bin = Path(sys.executable).parent
    flwr = shutil.which("flwr", path=str(venv_bin)) or shutil.which("flwr")
    if flwr is None:
        raise RuntimeError("flwr CLI not found: pip install flwr (the 'flower' extra)")
    workdir = workdir / f"flower{tag}"
    workdir.mkdir(parents=True)
    home, out = workdir / "flwr-home", workdir / "flwr-out"
    home.mkdir(parents=True)
    out.mkdir(parents=True)
    port = free_port()
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
            link_port = links.add(f"flower{tag}/{k}", port) if links is not None else port
            procs.start([str(venv_bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                         "--node-config", node_cfg, "--port", str(free_port())], workdir / f"supernode-{k}.log", env)
        c.log(f"flower: SuperLink on :{port}, {args.clients} SuperNodes" + (f" over {links.kbps:g} kbps links" if links else "")
              + f"; flwr run, {n_rounds} rounds")
        run_cfg = (f"num-server-rounds={n_rounds} num-nodes={args.clients} local-epochs={args.local_epochs} "
                   f"alpha={args.alpha} out-dir='{out}'")
        before = links.counters(f"flower{tag}/") if links is not None else None
        t0 = time.time()
        run = subprocess.run([flwr, "run", str(FLOWER_APP), "bench", "--run-config", run_cfg, "--stream"],
                             env=env, cwd=workdir, capture_output=True, text=True, timeout=args.flower_timeout)
        t_end = time.time()
        (workdir / "flwr-run.log").write_text(run.stdout + run.stderr)
        rounds = sorted(_jsonl(out / "flower-rounds.jsonl"), key=lambda d: d["round"])
        clients = _jsonl(out / "flower-clients.jsonl")
        if run.returncode != 0 or len(rounds) != n_rounds + 1:
            raise RuntimeError(f"flwr run exited {run.returncode} with {len(rounds)} evaluations: {(run.stdout + run.stderr)[-3000:]}")
        ts = [d["t"] for d in rounds]  # round 0 = the initial model, evaluated before round 1
        round_s = [b - a for a, b in zip(ts, ts[1:])]
        train_s = [max((d["train_s"] for d in clients if d["round"] == r), default=0.0) for r in range(1, n_rounds + 1)]
        acc = [float(d["accuracy"]) for d in rounds[1:]]
        res = _summary(round_s, train_s, acc, ts[0] - t0, t_end - t0)
        res["participants_per_round"] = [sum(1 for d in clients if d["round"] == r) for r in range(1, n_rounds + 1)]
        handler = [d["handler_s"] - d["train_s"] for d in clients]
        res["mean_clientapp_handler_minus_train_s"] = round(statistics.fmean(handler), 4) if handler else None
        if links is not None:
            assert before is not None
            after = links.counters(f"flower{tag}/")
            res["round_end_s"] = [round(t - ts[0], 3) for t in ts[1:]]
            res["time_to_target_s"] = _time_to(acc, ts[1:], ts[0], args.tta_target)
            res["time_to_target_from_launch_s"] = _time_to(acc, ts[1:], t0, args.tta_target)
            res["link_bytes_up_per_round"] = round((after["up"] - before["up"]) / n_rounds)
            res["link_bytes_down_per_round"] = round((after["down"] - before["down"]) / n_rounds)
        return res
    finally:
        procs.stop()


# ------------------------------------------------------------------------------- Flower App, both sides
def _flower_final_metrics(text: str) -> dict[str, float]:
    """The last round's aggregated ClientApp-side evaluate metrics from ``flwr run --stream``."""
    import re

    block = text.split("Aggregated ClientApp-side Evaluate Metrics", 1)[-1].split("ServerApp-side", 1)[0]
    rounds = re.findall(r"(\d+): \{([^}]*)\}", block)
    if not rounds:
        return {}
    return {k: float(v) for k, v in re.findall(r"'([\w-]+)': '([-+0-9.e]+)'", rounds[-1][1])}


def _round_app_s(rec: dict[str, Any]) -> float:
    """The clients' own time in one round: the slowest training plus the slowest evaluation
    (clients run in parallel), from the ClientApp runner's clock on each endpoint."""
    app = rec["extra"].get("client_app_s") or {}
    return max((app.get("train") or {}).values(), default=0.0) + max((app.get("evaluate") or {}).values(), default=0.0)


def _endpoint_wire_bytes(client: Any, ids: list[str]) -> int:
    """Bytes on the wire both ways, all of ``ids``: the hub's per-endpoint frame counters.
    (Not :func:`_traffic`, which reads a history's model bytes per round.)"""
    total = 0
    for e in client.list_endpoints():
        if e["id"] in ids:
            t = (e.get("info") or {}).get("traffic") or {}
            total += int(t.get("bytes_in", 0)) + int(t.get("bytes_out", 0))
    return total


def run_flower_app_mesh(args: argparse.Namespace, workdir: Path, app: Path) -> dict[str, Any]:
    """The Flower App on the mesh: ``fl.flower.run_app`` against N agents (one worker each).
    Overhead per round = round time minus the clients' time in the app (:func:`_round_app_s`);
    wire bytes per round = the hub's frame counters of the N endpoints (MQTT payloads both
    ways, heartbeats included) from round 1's record to the end of the run (counters settled),
    over the rounds in between, i.e. after delivery and warm-up."""
    from cloud_hub.localmesh import LocalMesh
    from fl.flower.run import run_app
    from fl.localmesh import add_digits_agents

    with LocalMesh(workdir / "mesh-app", heartbeat_s=1.0, lost_after_s=10.0, lease_s=10.0, hub_process=True) as mesh:
        agents = add_digits_agents(mesh, args.clients, prefix="flwr-app", workers=1)
        mesh.wait_online(timeout=120)
        ids = [a.endpoint_id for a in agents]
        traffic0 = {e["id"]: dict((e.get("info") or {}).get("traffic") or {}) for e in mesh.client.list_endpoints()}
        snaps: list[int] = []
        t0 = time.time()
        with contextlib.redirect_stdout(sys.stderr):  # the app's ServerApp prints; stdout carries only the JSON
            res = run_app(app, mesh.client, endpoints=ids, dataset="digits", workdir=workdir / "mesh-app-out",
                          run_config={"num-server-rounds": args.rounds},
                          on_round=lambda rec: snaps.append(_endpoint_wire_bytes(mesh.client, ids)))
        total = time.time() - t0
        time.sleep(2.5)  # the last beats' counters
        traffic1 = {e["id"]: dict((e.get("info") or {}).get("traffic") or {}) for e in mesh.client.list_endpoints()}
        rounds = res.rounds
        first_start = total - sum(float(r["round_time_s"]) for r in rounds)
        fe = (rounds[-1]["extra"].get("federated_eval") or {}).get("metrics") or {}
        overhead = [float(r["round_time_s"]) - _round_app_s(r) for r in rounds]
        # the hub updates an endpoint's counters in steps (not per frame): rounds shorter than that
        # show 0 or a lump, so per round = (after the run, counters settled) - (at round 1's record)
        # over the rounds in between; heartbeats of those seconds included
        settled = _endpoint_wire_bytes(mesh.client, ids)
        wire = [b - a for a, b in zip(snaps, snaps[1:])]
        whole = sum(int(t.get("bytes_in", 0)) + int(t.get("bytes_out", 0)) for e, t in traffic1.items() if e in ids) - \
            sum(int(t.get("bytes_in", 0)) + int(t.get("bytes_out", 0)) for e, t in traffic0.items() if e in ids)
        return {
            "status": res.status, "rounds": len(rounds), "total_s": round(total, 3),
            "mean_s_per_round": round(statistics.fmean(float(r["round_time_s"]) for r in rounds), 4) if rounds else None,
            "round_s": [round(float(r["round_time_s"]), 4) for r in rounds],
            "clients_app_s_per_round": [round(_round_app_s(r), 4) for r in rounds],
            "mean_overhead_s_per_round": round(statistics.fmean(overhead), 4) if overhead else None,
            "startup_s_delivery_and_warmup": round(first_start, 3),
            "final_federated_eval": fe,
            "message_bytes_out": res.bytes_out, "message_bytes_in": res.bytes_in,
            "message_bytes_per_round": round((res.bytes_out + res.bytes_in) / max(1, len(rounds))),
            "wire_bytes_per_round_both_ways": round((settled - snaps[0]) / (len(snaps) - 1)) if len(snaps) > 1 else None,
            "wire_bytes_per_round_samples_lumpy": wire,
            "wire_bytes_whole_run_both_ways": whole,
            "app_fab_bytes_delivered": res.delivery.get("fab_bytes_sent"),
            "endpoint_traffic_before": traffic0, "endpoint_traffic_after": traffic1,
        }


def run_flower_app_flower(args: argparse.Namespace, workdir: Path, app: Path, clients_app_s: float | None = None) -> dict[str, Any]:
    """The same app directory on Flower's Deployment Engine (SuperLink + N SuperNodes, flwr run).
    The SuperNodes reach the SuperLink through one counting TCP proxy on loopback
    (sim/emulate/proxy.py, unshaped): bytes per round are its counters between consecutive
    ``[ROUND n/N]`` lines of ``flwr run --stream`` (each line's arrival time stamped here), and
    round time is the time between those lines. Flower reports no per-client training time, so
    overhead per round = round time minus ``clients_app_s`` (the same app's client time measured
    on the mesh, same machine): an estimate, labelled as such."""
    venv_bin = Path(sys.executable).parent
    flwr = shutil.which("flwr", path=str(venv_bin)) or shutil.which("flwr")
    if flwr is None:
        raise RuntimeError("flwr CLI not found: pip install flwr (the 'flower' extra)")
    home = workdir / "flwr-app-home"
    home.mkdir(parents=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(home), PYTHONPATH=str(c.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=str(venv_bin) + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")
    procs = _Procs()
    links = _Links(None)
    try:
        procs.start([str(venv_bin / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                     "--host", "127.0.0.1", "--port", str(port)], workdir / "superlink-app.log", env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        proxy_port = links.add("supernodes", port)
        for k in range(args.clients):
            procs.start([str(venv_bin / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{proxy_port}",
                         "--node-config", f"partition-id={k} num-partitions={args.clients}", "--port", str(free_port())],
                        workdir / f"supernode-app-{k}.log", env)
        c.log(f"flower: SuperLink on :{port} (SuperNodes through a counting proxy :{proxy_port}), {args.clients} SuperNodes; "
              f"flwr run {app.name}")
        out_dir = workdir / "flwr-app-out"
        out_dir.mkdir()
        t0 = time.time()
        bytes0 = links.counters()
        marks: list[tuple[float, dict[str, int]]] = []  # at each [ROUND n/N] line, then at the end
        lines: list[str] = []
        proc = subprocess.Popen([flwr, "run", str(app), "bench", "--run-config", f"num-server-rounds={args.rounds}", "--stream"],
                                env=env, cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        kill = threading.Timer(args.flower_timeout, proc.kill)
        kill.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if "[ROUND " in line:
                    marks.append((time.time(), links.counters()))
                elif marks and len(marks) == args.rounds and ("Strategy execution finished" in line or "Final results" in line):
                    marks.append((time.time(), links.counters()))
            proc.wait()
        finally:
            kill.cancel()
        total = time.time() - t0
        text = "".join(lines)
        (workdir / "flwr-app-run.log").write_text(text)
        done = text.count("[ROUND ")
        if proc.returncode != 0 or done < args.rounds:
            raise RuntimeError(f"flwr run exited {proc.returncode} after {done} rounds: {text[-3000:]}")
        if len(marks) == args.rounds:
            marks.append((time.time(), links.counters()))  # no end line seen: the process end
        round_s = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
        wire = [(b[1]["up"] + b[1]["down"]) - (a[1]["up"] + a[1]["down"]) for a, b in zip(marks, marks[1:])]
        bytes1 = links.counters()
        out = {"status": "finished", "rounds": done, "total_s": round(total, 3), "mean_s_per_round_incl_startup": round(total / done, 4),
               "round_s": [round(x, 3) for x in round_s], "mean_s_per_round": round(statistics.fmean(round_s), 4) if round_s else None,
               "wire_bytes_per_round_both_ways": round(statistics.fmean(wire)) if wire else None,
               "wire_bytes_per_round_samples": wire,
               "wire_bytes_whole_run_both_ways": (bytes1["up"] + bytes1["down"]) - (bytes0["up"] + bytes0["down"]),
               "wire_bytes_whole_run_up_down": {"up": bytes1["up"] - bytes0["up"], "down": bytes1["down"] - bytes0["down"]},
               "final_federated_eval": _flower_final_metrics(text)}
        if clients_app_s is not None and round_s:
            out["mean_overhead_s_per_round_estimate"] = round(statistics.fmean(round_s) - clients_app_s, 4)
            out["clients_app_s_per_round_from_the_mesh_run"] = round(clients_app_s, 4)
        return out
    finally:
        procs.stop()
        links.close()


def flower_app_main(args: argparse.Namespace, out: dict[str, Any], workdir: Path) -> None:
    app = Path(args.flower_app).resolve()
    la = c.loadavg()
    mesh = run_flower_app_mesh(args, workdir, app)
    mesh["loadavg_before"], mesh["loadavg_after"] = la, c.loadavg()
    out["flower_app"] = {"app": str(app.relative_to(c.REPO)) if app.is_relative_to(c.REPO) else str(app), "continuum_mesh": mesh}
    c.log(f"mesh: {mesh['rounds']} rounds in {mesh['total_s']} s ({mesh['mean_s_per_round']} s/round, overhead "
          f"{mesh['mean_overhead_s_per_round']} s/round, {mesh['wire_bytes_per_round_both_ways']} B/round on the wire), "
          f"{mesh['final_federated_eval']}")
    if c.SMOKE:
        out["flower_app"]["flower"] = c.smoke_skipped("the Flower App on Flower's Deployment Engine", "15-20 s even at 1 round")
    elif not args.no_flower:
        try:
            app_s = mesh.get("clients_app_s_per_round") or []
            la = c.loadavg()
            fl = run_flower_app_flower(args, workdir, app, statistics.fmean(app_s) if app_s else None)
            fl["loadavg_before"], fl["loadavg_after"] = la, c.loadavg()
            out["flower_app"]["flower"] = fl
            c.log(f"flower: {fl['rounds']} rounds in {fl['total_s']} s ({fl['mean_s_per_round']} s/round between round lines, "
                  f"{fl['wire_bytes_per_round_both_ways']} B/round on the wire), {fl['final_federated_eval']}")
        except Exception as exc:  # reported, not hidden
            out["flower_app"]["flower"] = {"error": f"{type(exc).__name__}: {exc}"}


def shaped_main(args: argparse.Namespace, out: dict[str, Any], workdir: Path) -> None:
    """Time to ``--tta-target`` accuracy over ``--link-kbps`` links: mesh uncompressed, mesh
    compressed, Flower with its defaults."""
    links = _Links(args.link_kbps)
    res: dict[str, Any] = {"link_kbps": args.link_kbps, "rounds": args.tta_rounds, "target_accuracy": args.tta_target,
                           "compressed_settings": args.tta_compression, "loadavg_before": c.loadavg()}
    out["shaped_link"] = res
    try:
        mesh, ids = run_mesh_shaped(args, workdir, links)
        res["continuum_mesh_uncompressed"] = mesh.pop("none")
        res["continuum_mesh_compressed"] = mesh
        res["loadavg_after_mesh"] = c.loadavg()
        if c.SMOKE:
            res["flower"] = c.smoke_skipped("Flower over the shaped links", "15-20 s even at 1 round of 2 clients")
        elif not args.no_shaped_flower:
            try:
                fl = run_flower(args, workdir, ids, rounds=args.tta_rounds, links=links, tag="-shaped")
                res["flower"] = fl
                c.log(f"flower over {args.link_kbps:g} kbps: {fl['mean_s_per_round']} s/round, "
                      f"{args.tta_target:.0%} after {fl.get('time_to_target_s')} s")
            except Exception as exc:  # reported, not hidden
                res["flower"] = {"error": f"{type(exc).__name__}: {exc}"}
                c.log(f"flower over shaped links failed: {exc}")
        res["loadavg_after"] = c.loadavg()
        un, fl = res["continuum_mesh_uncompressed"], res.get("flower") or {}
        res["speedup_over_uncompressed"] = {k: c.ratio(un["time_to_target_s"], v["time_to_target_s"]) for k, v in mesh.items()}
        res["speedup_over_flower"] = {k: c.ratio(fl.get("time_to_target_s"), v["time_to_target_s"])
                                      for k, v in [("none", un), *mesh.items()]}
    finally:
        links.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--flower-timeout", type=float, default=1800, help="give up on `flwr run` after this (s)")
    p.add_argument("--no-flower", action="store_true", help="only the mesh side")
    p.add_argument("--quick", action="store_true", help="3 rounds, 3 clients")
    c.add_smoke_arg(p)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--workdir", default=None)
    p.add_argument("--compression", default="fp16,q8,topk:0.01,topk:0.1+q8,topk:0.25+q8,topk:0.25+q8|fp16",
                   help="compression settings (UPLINK or UPLINK|DOWNLINK) to run the job with after the uncompressed run")
    p.add_argument("--link-kbps", type=float, default=256, help="shaped-link legs: bandwidth per device link (0: skip them)")
    p.add_argument("--tta-rounds", type=int, default=10, help="rounds of each shaped-link leg")
    p.add_argument("--tta-target", type=float, default=0.90, help="test accuracy the shaped-link legs time")
    p.add_argument("--tta-compression", default="q8,topk:0.25+q8,q8|fp16,topk:0.25+q8|fp16",
                   help="compressed shaped-link legs (UPLINK or UPLINK|DOWNLINK each), after the uncompressed one")
    p.add_argument("--no-shaped-flower", action="store_true", help="skip Flower over the shaped links")
    p.add_argument("--dp-epsilon", type=float, default=8.0,
                   help="DP leg: central client-level DP calibrated to this epsilon over --rounds (0: skip it)")
    p.add_argument("--dp-clip", type=float, default=1.0, help="DP leg: clip norm of each client's model delta")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="DP leg: delta of (epsilon, delta)-DP")
    p.add_argument("--flower-app", default=None,
                   help="a Flower App directory (e.g. tests/fixtures/flower_apps/quickstart-sklearn): run it unchanged "
                        "on the mesh (mesh-fl's run_app) and on Flower's Deployment Engine instead of the MLP job")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.clients, args.tta_rounds = 3, 3, 3
    if c.smoke(args):
        # every leg once, at the smallest size: 2 rounds of 2 clients, one compression setting per
        # sweep, the shaped legs over faster links; Flower's legs take 15-20 s each (SuperLink,
        # SuperNodes, a ClientApp process per round), so the smoke run leaves them out
        args.rounds, args.clients, args.local_epochs, args.tta_rounds = 2, 2, 1, 2
        args.compression, args.tta_compression = "q8", "topk:0.25+q8|fp16"
        args.link_kbps = 4096 if args.link_kbps > 0 else 0
        args.no_flower = args.no_shaped_flower = True
    started = time.monotonic()
    out = c.header("fl", args)
    out["machine"]["versions"].update({m: c._version(m) for m in ("torch", "flwr", "numpy")})
    workdir = Path(tempfile.mkdtemp(prefix="bench-fl-", dir=args.workdir))
    try:
        if args.flower_app:
            out["flower_app_examples_commit"] = "fdef7afb1dca3030553be302366cfd285ed6632c (adap/flower; see tests/fixtures/flower_apps/NOTICE)"
            flower_app_main(args, out, workdir)
            c.finish("fl", out, args, started)
            return
        la = c.loadavg()
        mesh, ids, sweep = run_mesh(args, workdir)
        mesh["loadavg_before"], mesh["loadavg_after"] = la, c.loadavg()
        out["continuum_mesh"] = mesh
        sweep["loadavg_after"] = c.loadavg()
        out["compression"] = sweep
        c.log(f"mesh: {mesh['mean_s_per_round']} s/round, overhead {mesh['mean_overhead_s_per_round']} s, "
              f"accuracy {mesh['final_accuracy']:.4f}")
        if c.SMOKE:
            out["flower"] = c.smoke_skipped("Flower (the same job on its Deployment Engine)", "15-20 s even at 1 round of 2 clients")
        elif not args.no_flower:
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
        if args.link_kbps > 0:
            shaped_main(args, out, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    c.finish("fl", out, args, started)


if __name__ == "__main__":
    main()
