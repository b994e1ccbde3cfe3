"""The swarm load harness: a real Mosquitto, a real hub process, N light endpoints in a few processes.

Phases, each bounded in time: start (broker with ``max_connections -1``, hub as its own
``mesh-hub serve`` process), bulk enrollment (``POST /v1/endpoints/enroll-batch``), connect (all
N say hello), idle (heartbeats only), load (tasks submitted through the SDK in batches spread
over all endpoints, results read from the result stream), drain, and for MQTT a broker restart
(SIGKILL, then a new Mosquitto on the same port; every endpoint must come back on its own).

Hub and broker figures come from psutil on their processes; frame rates from the swarm's own
counters (each up frame the swarm sends is one the hub receives through the broker or socket).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from sim.swarm.core import Creds
from sim.swarm.stats import check_delivery, per_endpoint_kb, percentile, rate, split_evenly, sum_status
from sim.swarm.worker import raise_nofile

__all__ = ["SwarmConfig", "run_swarm", "enroll_bulk", "noop"]

ENROLL_CHUNK = 2000  # endpoints per enroll-batch request (the route takes up to 10,000)


def noop() -> None:
    """The function every swarm task names; the swarm answers what it returns without running it."""
    return None


class SwarmConfig:
    """Settings of one swarm run (all times in seconds; every phase has a bound)."""

    def __init__(self, endpoints: int, transport: str = "mqtt", *, procs: int | None = None, heartbeat_s: float = 5.0,
                 lost_after_s: float = 30.0, idle_s: float = 15.0, load_s: float = 60.0, max_tasks: int | None = None,
                 batch: int = 1000, per_endpoint: int = 10, window: int = 4000, restart_broker: bool = True, after_restart_tasks: int = 0,
                 connect_timeout_s: float | None = None, reconnect_timeout_s: float | None = None, capacity: int = 1, prefetch: int = 16,
                 seed: int = 0) -> None:
        if endpoints < 1:
            raise ValueError("--endpoints must be at least 1")
        if transport not in ("mqtt", "zmq"):
            raise ValueError(f"--transport must be mqtt or zmq, not {transport!r}")
        if batch < 1 or per_endpoint < 1 or window < batch:
            raise ValueError("batch and per-endpoint must be >= 1, and window >= batch")
        self.endpoints = endpoints
        self.transport = transport
        self.procs = procs or max(1, min(4, math.ceil(endpoints / 2500)))
        self.heartbeat_s = heartbeat_s
        self.lost_after_s = lost_after_s
        self.idle_s = idle_s
        self.load_s = load_s
        self.max_tasks = max_tasks
        self.batch = batch
        self.per_endpoint = per_endpoint
        self.window = window
        self.restart_broker = restart_broker and transport == "mqtt"
        self.after_restart_tasks = after_restart_tasks
        self.connect_timeout_s = connect_timeout_s or 60 + endpoints / 50
        self.reconnect_timeout_s = reconnect_timeout_s or 90 + endpoints / 50
        self.capacity = capacity
        self.prefetch = prefetch
        self.seed = seed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def enroll_bulk(url: str, token: str, n: int, transport: str, *, name_prefix: str = "swarm") -> list[Creds]:
    """Enroll ``n`` endpoints through the bulk route, in chunks; ZeroMQ ones with fresh CURVE keypairs."""
    from mesh_agent.transport.zmq import curve_keypair

    out: list[Creds] = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for start in range(0, n, ENROLL_CHUNK):
            k = min(ENROLL_CHUNK, n - start)
            curves = [curve_keypair() for _ in range(k)] if transport == "zmq" else []
            items = [{"name": f"{name_prefix}-{start + i}", **({"curve_public": curves[i][0]} if curves else {})} for i in range(k)]
            r = http.post("/v1/endpoints/enroll-batch", json={"token": token, "transport": transport, "endpoints": items})
            if r.status_code != 201:
                raise RuntimeError(f"bulk enrollment failed: HTTP {r.status_code}: {r.text[:300]}")
            eps = r.json()["endpoints"]
            out += [Creds.from_enrollment(e, curves[i] if curves else None) for i, e in enumerate(eps)]
    return out


class _Worker:
    """One swarm process and the latest status line it printed."""

    def __init__(self, spec_path: Path, log_path: Path) -> None:
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "sim.swarm.worker", str(spec_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, start_new_session=True)
        self.status: dict[str, Any] = {}
        self.marked = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("marked"):
                self.marked.set()
            else:
                self.status = msg

    def command(self, cmd: str) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(cmd.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def stop(self) -> None:
        self.command("stop")
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._thread.join(5)
        self.log.close()


class _Proc:
    """CPU seconds and RSS of a process (the hub, the broker)."""

    def __init__(self, pid: int) -> None:
        self.p = psutil.Process(pid)

    def cpu(self) -> float:
        t = self.p.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        return int(self.p.memory_info().rss)


def _wait(pred: Callable[[], bool], timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


class _Load:
    """Submit no-op tasks through the SDK in batches spread over every endpoint (``per_endpoint``
    tasks each, round robin), at most ``window`` unfinished, and read results from the stream."""

    def __init__(self, url: str, token: str, endpoint_ids: list[str], cfg: SwarmConfig) -> None:
        from cloud_hub.client import Client

        self.sub, self.res = Client(url, token, timeout=120), Client(url, token, timeout=120)
        self.fid = self.sub.register_function(noop, "swarm-noop")
        self.eps = endpoint_ids
        self.cfg = cfg
        self.submit_t: dict[str, float] = {}
        self.done_t: dict[str, float] = {}
        self.delivered: list[str] = []
        self.errors: list[str] = []
        self.cursor = self.res.result_cursor()
        self.max_tasks = cfg.max_tasks
        self.stop_submit = threading.Event()
        self.stop_read = threading.Event()
        self.lock = threading.Lock()

    def submitter(self, deadline: float) -> None:
        from cloud_hub.client import Client

        args = Client.task_spec(self.eps[0], self.fid)["args"]  # the same (empty) args blob for every task
        i = 0
        while not self.stop_submit.is_set() and time.monotonic() < deadline:
            if self.max_tasks is not None and len(self.submit_t) >= self.max_tasks:
                break
            with self.lock:
                unfinished = len(self.submit_t) - len(self.done_t)
            if unfinished + self.cfg.batch > self.cfg.window:
                time.sleep(0.005)
                continue
            n = self.cfg.batch if self.max_tasks is None else min(self.cfg.batch, self.max_tasks - len(self.submit_t))
            specs = []
            for j in range(n):
                ep = self.eps[((i + j) // self.cfg.per_endpoint) % len(self.eps)]
                specs.append({"endpoint_id": ep, "function_id": self.fid, "args": args})
            i += n
            t0 = time.monotonic()
            try:
                ids, _ = self.sub.submit_batch_placed(specs, idempotency_key=uuid.uuid4().hex)
            except Exception as exc:  # reported, never retried blindly (the key would make a retry safe)
                self.errors.append(f"submit: {type(exc).__name__}: {exc}")
                time.sleep(0.5)
                continue
            with self.lock:
                for tid in ids:
                    self.submit_t[tid] = t0

    def reader(self) -> None:
        while not self.stop_read.is_set():
            try:
                rows, self.cursor = self.res.result_stream(self.cursor, timeout_s=1.0, limit=10_000)
            except Exception as exc:
                self.errors.append(f"stream: {type(exc).__name__}: {exc}")
                time.sleep(0.5)
                continue
            t = time.monotonic()
            with self.lock:
                for r in rows:
                    self.delivered.append(r["task_id"])
                    if not r["ok"]:
                        self.errors.append(f"task {r['task_id']} failed")
                    self.done_t.setdefault(r["task_id"], t)

    def close(self) -> None:
        self.sub.close()
        self.res.close()


def run_swarm(cfg: SwarmConfig, workdir: Path, echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run one swarm of ``cfg.endpoints`` endpoints through every phase and return the report."""
    from cloud_hub.localmesh import LocalMesh

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    nofile = raise_nofile()  # the broker and the hub inherit it
    report: dict[str, Any] = {"endpoints": cfg.endpoints, "transport": cfg.transport, "config": cfg.as_dict(),
                              "loadavg_start": [round(x, 2) for x in os.getloadavg()], "nofile": list(nofile)}
    mesh = LocalMesh(workdir / "mesh", heartbeat_s=cfg.heartbeat_s, lost_after_s=cfg.lost_after_s, lease_s=30.0, hub_process=True)
    mesh.broker.extra_conf = "max_connections -1\n"  # Mosquitto's own cap; the fd limit is raised above
    workers: list[_Worker] = []
    load: _Load | None = None
    try:
        mesh.start()
        assert mesh._hub_proc is not None
        hub, broker = _Proc(mesh._hub_proc.pid), _Proc(mesh.broker.proc.pid)  # type: ignore[union-attr]
        time.sleep(2.0)
        base_rss = hub.rss()
        report["hub_baseline"] = {"rss_mb": round(base_rss / 2**20, 1)}
        report["broker_baseline"] = {"rss_mb": round(broker.rss() / 2**20, 2)}

        # ---------------------------------------------------------- enroll
        echo(f"enrolling {cfg.endpoints} {cfg.transport} endpoints in bulk")
        t0, c0 = time.monotonic(), hub.cpu()
        token = mesh.client.create_enrollment_token(uses=cfg.endpoints)
        creds = enroll_bulk(mesh.url, token, cfg.endpoints, cfg.transport)
        report["enroll"] = {"s": round(time.monotonic() - t0, 2), "hub_cpu_s": round(hub.cpu() - c0, 2)}
        rss_enrolled = hub.rss()

        # ---------------------------------------------------------- connect
        echo(f"starting {cfg.procs} swarm processes")
        for i, part in enumerate(split_evenly(creds, cfg.procs)):
            spec = workdir / f"swarm-{i}.json"
            spec.write_text(json.dumps({"creds": [c.to_json() for c in part], "heartbeat_s": cfg.heartbeat_s, "capacity": cfg.capacity,
                                        "prefetch": cfg.prefetch, "seed": cfg.seed * 1000 + i}))
            spec.chmod(0o600)  # keys and broker passwords
            workers.append(_Worker(spec, workdir / f"swarm-{i}.log"))

        def total() -> dict[str, float]:
            return sum_status(w.status for w in workers)

        t0, c0 = time.monotonic(), hub.cpu()
        all_online = _wait(lambda: total()["online"] >= cfg.endpoints, cfg.connect_timeout_s)
        connect_s = time.monotonic() - t0
        st = total()
        report["connect"] = {"all_online": all_online, "online": int(st["online"]), "s": round(connect_s, 2),
                             "hellos": int(st["hellos"]), "hello_rate_per_s": round(rate(st["hellos"], connect_s), 1),
                             "frames_up_per_s": round(rate(st["frames_out"], connect_s), 1),
                             "hub_cpu_pct": round(100 * rate(hub.cpu() - c0, connect_s), 1), "connect_failures": int(st["connect_failures"])}
        echo(f"connect: {report['connect']}")
        if not all_online:
            report["error"] = f"only {int(st['online'])} of {cfg.endpoints} endpoints online within {cfg.connect_timeout_s:.0f}s"
            return report

        # ---------------------------------------------------------- idle
        time.sleep(min(cfg.heartbeat_s, 5.0))  # let the connect burst settle
        s0, t0, c0 = total(), time.monotonic(), hub.cpu()
        time.sleep(cfg.idle_s)
        s1, dt, dc = total(), time.monotonic() - t0, hub.cpu() - c0
        idle_rss = hub.rss()
        report["idle"] = {
            "s": round(dt, 1), "hub_cpu_pct": round(100 * rate(dc, dt), 1),
            "hub_cpu_s_per_endpoint_hour": round(rate(dc, dt) * 3600 / cfg.endpoints, 4),
            "hub_rss_mb": round(idle_rss / 2**20, 1), "hub_rss_per_endpoint_kb": round(per_endpoint_kb(idle_rss, base_rss, cfg.endpoints) or 0, 2),
            "hub_rss_per_endpoint_kb_connected_only": round(per_endpoint_kb(idle_rss, rss_enrolled, cfg.endpoints) or 0, 2),
            "heartbeats_per_s": round(rate(s1["heartbeats"] - s0["heartbeats"], dt), 1),
            "frames_up_per_s": round(rate(s1["frames_out"] - s0["frames_out"], dt), 1),
            "frames_down_per_s": round(rate(s1["frames_in"] - s0["frames_in"], dt), 1),
            "broker_rss_mb": round(broker.rss() / 2**20, 1), "swarm_rss_mb": round(s1["rss"] / 2**20, 1),
            "online": int(s1["online"]),
        }
        echo(f"idle: {report['idle']}")

        # ---------------------------------------------------------- load
        load = _Load(mesh.url, mesh.token, [c.endpoint_id for c in creds], cfg)
        reader = threading.Thread(target=load.reader, daemon=True)
        reader.start()
        s0, t0, c0 = total(), time.monotonic(), hub.cpu()
        echo(f"load: {cfg.load_s:.0f}s of no-op batches of {cfg.batch}, {cfg.per_endpoint} per endpoint")
        submitter = threading.Thread(target=load.submitter, args=(t0 + cfg.load_s,), daemon=True)
        submitter.start()
        peak_hub_rss = peak_broker_rss = 0
        while submitter.is_alive():
            peak_hub_rss, peak_broker_rss = max(peak_hub_rss, hub.rss()), max(peak_broker_rss, broker.rss())
            submitter.join(1.0)
        submitted = len(load.submit_t)
        drained = _wait(lambda: len(load.done_t) >= submitted, 60 + submitted / 2000, step=0.5)  # type: ignore[union-attr]
        t_end, c_end, s1 = time.monotonic(), hub.cpu(), total()
        load.stop_read.set()
        reader.join(5)
        with load.lock:
            lat = [load.done_t[t] - load.submit_t[t] for t in load.submit_t if t in load.done_t]
            last = max(load.done_t.values(), default=t0)
            delivery = check_delivery(load.submit_t, load.delivered)
        span = last - t0
        report["load"] = {
            "tasks": submitted, "done": len(lat), "drained": drained, "s": round(span, 1),
            "tasks_per_s": round(rate(len(lat), span), 1),
            "latency_ms": {"p50": _ms(percentile(lat, 50)), "p99": _ms(percentile(lat, 99)), "max": _ms(max(lat, default=None))},
            "hub_cpu_pct": round(100 * rate(c_end - c0, t_end - t0), 1), "hub_rss_peak_mb": round(peak_hub_rss / 2**20, 1),
            "broker_rss_peak_mb": round(peak_broker_rss / 2**20, 1),
            "frames_up_per_s": round(rate(s1["frames_out"] - s0["frames_out"], span), 1),
            "frames_down_per_s": round(rate(s1["frames_in"] - s0["frames_in"], span), 1),
            "swarm_tasks": int(s1["tasks"] - s0["tasks"]), "swarm_duplicates": int(s1["duplicates"]), "rejected_frames": int(s1["rejected"]),
            "delivery": delivery, "errors": load.errors[:5], "error_count": len(load.errors),
        }
        echo(f"load: {report['load']}")

        # ---------------------------------------------------------- broker restart
        if cfg.restart_broker:
            report["reconnect"] = _restart_broker(mesh, workers, cfg, total, echo)
            broker = _Proc(mesh.broker.proc.pid)  # type: ignore[union-attr]
            report["reconnect"]["broker_rss_after_mb"] = round(broker.rss() / 2**20, 1)
            if cfg.after_restart_tasks:  # the mesh still works: more tasks, every one exactly once
                report["after_restart"] = _more_tasks(load, cfg.after_restart_tasks)
        report["hub_alive"] = mesh._hub_proc.poll() is None
        report["endpoints_online_at_hub"] = sum(1 for e in mesh.client.list_endpoints() if e["online"])
        report["hub_rss_end_mb"] = round(hub.rss() / 2**20, 1) if report["hub_alive"] else None
        report["swarm_status"] = total()
        report["_load"] = load
        return report
    finally:
        for w in workers:
            w.stop()
        if load is not None:
            load.close()
        report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        mesh.stop()


def _more_tasks(load: _Load, n: int) -> dict[str, Any]:
    """Submit ``n`` more tasks (bounded wait) and check delivery over the whole run."""
    load.stop_read.clear()
    reader = threading.Thread(target=load.reader, daemon=True)
    reader.start()
    load.max_tasks = len(load.submit_t) + n
    load.submitter(time.monotonic() + 60)
    want = len(load.submit_t)
    drained = _wait(lambda: len(load.done_t) >= want, 60 + n / 500, step=0.5)
    load.stop_read.set()
    reader.join(5)
    with load.lock:
        return {"tasks": n, "drained": drained, "delivery": check_delivery(load.submit_t, load.delivered)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _restart_broker(mesh: Any, workers: list[_Worker], cfg: SwarmConfig, total: Callable[[], dict[str, float]],
                    echo: Callable[[str], None]) -> dict[str, Any]:
    """SIGKILL Mosquitto, wait until the swarm noticed, start a new one on the same port; time how
    long until every endpoint is welcomed again on a new connection, and whether the hub survived."""
    for w in workers:
        w.marked.clear()
        w.command("mark")
    for w in workers:
        w.marked.wait(10)
    echo("broker restart: SIGKILL mosquitto")
    proc = mesh.broker.proc
    proc.kill()
    proc.wait(10)
    mesh.broker.proc = None
    noticed = _wait(lambda: total()["connected"] == 0, 30 + 2 * cfg.heartbeat_s)
    time.sleep(1.0)
    mesh.broker.start()
    t0 = time.monotonic()
    samples: list[tuple[float, int]] = []

    def back() -> bool:
        n = int(total()["reconnected"])
        samples.append((round(time.monotonic() - t0, 2), n))
        return n >= cfg.endpoints

    all_back = _wait(back, cfg.reconnect_timeout_s, step=0.5)
    took = time.monotonic() - t0
    st = total()
    half = next((t for t, n in samples if n >= cfg.endpoints / 2), None)
    out = {"all_back": all_back, "back": int(st["reconnected"]), "s": round(took, 2), "half_back_s": half,
           "swarm_noticed_drop": noticed, "hub_alive": mesh._hub_proc.poll() is None, "timeline": samples[:: max(1, len(samples) // 40)]}
    echo(f"reconnect: { {k: v for k, v in out.items() if k != 'timeline'} }")
    return out
