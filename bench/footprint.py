"""What one field device costs: the agent measured from outside, with hub defaults as shipped.

A real hub process (``HubConfig`` defaults: heartbeat, offline bounds, lease), a real Mosquitto,
and one real ``mesh-agent start`` process (1 worker) whose MQTT link goes through a
byte-counting TCP proxy (:class:`sim.emulate.proxy.FaultProxy`, never cut). The agent's profile
is what a field device resolves to (``metered``: its broker is not on its own machine), set
explicitly because here the broker is on loopback (``--profile`` to change it).

Reported, each next to the issue's target (issue 10):

* **idle traffic**: MQTT bytes both ways over ``--window-s`` after start-up settled, scaled to a
  day. Packets are estimated as 2 x the proxy's reads (one TCP segment per read: the agent and
  Mosquitto write with TCP_NODELAY; plus one bare ACK per segment, an upper bound); TCP/IP
  overhead = packets x 52 B (IPv4 20 + TCP 20 + timestamps 12); TLS overhead = records x 29 B
  (TLS 1.3 AEAD: 5 B header + 1 B type + 16 B tag, rounded up for padding/alignment), one
  record per data segment. The TLS handshake (once per connection) is not in the idle figure.
* **memory**: RSS of the whole agent tree (psutil, children recursive), idle (before any task)
  and busy (max while one worker runs a task that sleeps 2 s, sampled every 50 ms); PSS too,
  where the kernel gives it (shared libraries counted once).
* **start-to-online**: from spawning the agent process to the hub listing it online (polled every
  20 ms).
* **per no-op task** (``--tasks`` no-ops, once all submitted at once (``batched``: the figures
  compared with the targets, as the issue's baseline was measured) and once one at a time
  (``sequential``: ``submit(noop).result()``, what a sparse field workload pays)): wire bytes up/down (the
  idle rate over the same time subtracted), disk bytes (``/proc/<pid>/io`` write_bytes of the
  agent tree: bytes it dirtied for storage) and fsyncs (fsync + fdatasync calls of the whole tree,
  counted by the LD_PRELOAD shim of ``sim/emulate/_fsync_shim.c`` with no delay; SQLite calls
  fdatasync through libc, so every commit is seen).
* **TLS**: ``bench/tls.py``'s ``tls_vs_plain()`` when that module exists (RTT and throughput with
  and without TLS, same run); otherwise ``"not measured"``.

One JSON object goes to stdout and to bench/results/footprint.json; progress to stderr.

    python bench/footprint.py [--window-s 600] [--tasks 200] [--profile metered|lan|default] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import _common as c

DAY_S = 86400.0
TCPIP_B = 52  # IPv4 20 + TCP 20 + timestamps option 12
TLS_RECORD_B = 29  # TLS 1.3 AEAD record overhead (header, inner type, tag, rounding)
TARGETS = {
    "idle_bytes_per_day_incl_overhead": 150_000,
    "rss_idle_mb": 40.0,
    "rss_busy_mb": 60.0,
    "start_to_online_s": 1.0,
    "wire_bytes_per_task_round_trip": 400,
    "disk_bytes_per_task": 2048,
    "fsyncs_per_task": 0.05,
}


def noop() -> None:
    return None


def hold(seconds: float) -> None:
    import time as _t

    _t.sleep(seconds)


class ProxyThread:
    """A counting FaultProxy on its own event loop thread (the benchmark itself is synchronous)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        from sim.emulate.proxy import FaultProxy

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="footprint-proxy", daemon=True)
        self.thread.start()
        self.proxy = asyncio.run_coroutine_threadsafe(FaultProxy("field-pi", upstream).start(), self.loop).result(10)

    @property
    def port(self) -> int:
        return self.proxy.port

    def snapshot(self) -> dict[str, int]:
        return asyncio.run_coroutine_threadsafe(self._snap(), self.loop).result(5)

    async def _snap(self) -> dict[str, int]:
        return dict(self.proxy.stats)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


def tree(pid: int) -> list[Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_memory(pid: int) -> dict[str, Any]:
    """RSS (and PSS where readable) of the agent and all its descendants, in MB."""
    import psutil

    rss = pss = 0
    procs = []
    pss_ok = True
    for p in tree(pid):
        try:
            mi = p.memory_info()
            rss += mi.rss
            try:
                pss += p.memory_full_info().pss
            except (psutil.AccessDenied, AttributeError):
                pss_ok = False
            procs.append({"pid": p.pid, "name": " ".join(p.cmdline()[1:4])[:60] or p.name(), "rss_mb": round(mi.rss / 2**20, 1)})
        except psutil.NoSuchProcess:
            continue
    return {"rss_mb": round(rss / 2**20, 1), "pss_mb": round(pss / 2**20, 1) if pss_ok else None, "processes": procs}


def tree_io(pid: int, seen: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """Cumulative (write_bytes, wchar) of the tree; ``seen`` keeps the last value of processes
    that have exited since (a reaped worker's writes still count)."""
    for p in tree(pid):
        try:
            io = p.io_counters()
            seen[p.pid] = (io.write_bytes, io.write_chars)
        except Exception:
            continue
    return sum(v[0] for v in seen.values()), sum(v[1] for v in seen.values())


def traffic(d: dict[str, int], seconds: float) -> dict[str, Any]:
    """Bytes and estimated packets of a window, and the same scaled to a day."""
    payload = d["bytes_up"] + d["bytes_down"]
    segments = d["reads_up"] + d["reads_down"]
    packets = 2 * segments
    tcpip = packets * TCPIP_B
    tls = segments * TLS_RECORD_B
    scale = DAY_S / seconds if seconds > 0 else float("nan")
    return {
        "window_s": round(seconds, 1),
        "mqtt_bytes_up": d["bytes_up"], "mqtt_bytes_down": d["bytes_down"],
        "segments": segments, "packets_est": packets,
        "per_day": {
            "mqtt_bytes": round(payload * scale), "packets_est": round(packets * scale),
            "tcpip_overhead_bytes": round(tcpip * scale), "tls_overhead_bytes": round(tls * scale),
            "total_bytes": round((payload + tcpip + tls) * scale),
            # every ACK piggybacked on a data segment (e.g. PINGRESP acking PINGREQ): the lower bound
            "total_bytes_low": round((payload + segments * TCPIP_B + tls) * scale),
        },
    }


def per_task(run: Callable[[], None], n: int, pid: int, proxy: ProxyThread, counter: Path | None,
             idle_rate: tuple[float, float]) -> dict[str, Any]:
    """Wire, disk and fsync cost per task of ``run()`` (which runs ``n`` tasks to completion)."""
    from sim.emulate.constrain import read_fsync_counter

    seen: dict[int, tuple[int, int]] = {}
    io0 = tree_io(pid, seen)
    f0 = read_fsync_counter(counter) if counter else None
    s0, t0 = proxy.snapshot(), time.monotonic()
    run()
    time.sleep(1.0)  # the last acks and the queue's batched commit
    s1, t1 = proxy.snapshot(), time.monotonic()
    io1 = tree_io(pid, seen)
    f1 = read_fsync_counter(counter) if counter else None
    d = _delta(s0, s1)
    up = (d["bytes_up"] - idle_rate[0] * (t1 - t0)) / n
    down = (d["bytes_down"] - idle_rate[1] * (t1 - t0)) / n
    flushes = None if f0 is None or f1 is None else {k: f1[k] - f0[k] for k in f1}
    return {
        "tasks": n, "seconds": round(t1 - t0, 2),
        "wire_bytes_up": round(up, 1), "wire_bytes_down": round(down, 1), "wire_bytes_round_trip": round(up + down, 1),
        "wire_raw": {"bytes_up": d["bytes_up"], "bytes_down": d["bytes_down"], "segments": d["reads_up"] + d["reads_down"]},
        "disk_write_bytes": round((io1[0] - io0[0]) / n, 1),
        "write_syscall_bytes": round((io1[1] - io0[1]) / n, 1),
        "fsyncs": None if flushes is None else round(sum(flushes.values()) / n, 4),
        "fsync_detail": flushes,
    }


def wait_online(client: Any, endpoint: str, timeout: float, poll_s: float = 0.02) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["id"] == endpoint and e["online"] for e in client.list_endpoints()):
            return time.monotonic()
        time.sleep(poll_s)
    return None


def _tls_numbers() -> Any:
    path = c.BENCH_DIR / "tls.py"
    if not path.exists():
        return "not measured (bench/tls.py does not exist yet)"
    try:
        spec = importlib.util.spec_from_file_location("bench_tls", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fn: Callable[[], Any] | None = getattr(mod, "tls_vs_plain", None)
        if fn is None:
            return "not measured (bench/tls.py has no tls_vs_plain())"
        return fn()
    except Exception as exc:
        return f"not measured: bench/tls.py failed: {type(exc).__name__}: {exc}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window-s", type=float, default=600.0,
                   help="idle measurement window, seconds (default 600: several MQTT keepalive periods of a metered agent)")
    p.add_argument("--settle-s", type=float, default=60.0,
                   help="wait after online before the idle window, so start-up beats are not counted as idle (default 60)")
    p.add_argument("--tasks", type=int, default=200, help="sequential no-op tasks for per-task figures (default 200)")
    p.add_argument("--profile", default="metered", choices=["metered", "lan", "default"],
                   help="agent profile (default metered: what a field device resolves to; 'default': leave unset)")
    p.add_argument("--no-tls", action="store_true", help="skip bench/tls.py's comparison")
    p.add_argument("--no-save", action="store_true", help="print the JSON but do not write bench/results/")
    p.add_argument("--workdir", default=None, help="directory for the mesh's SQLite files (default: system temp dir, on disk)")
    c.add_smoke_arg(p)
    args = p.parse_args()
    args.quick = False
    busy_s = 2.0  # how long the task runs whose RSS is sampled
    if c.smoke(args):
        args.window_s, args.settle_s, args.tasks, busy_s = min(args.window_s, 2.0), min(args.settle_s, 0.5), min(args.tasks, 5), 0.5
    if args.window_s <= 0 or args.tasks < 1:
        p.error("--window-s must be > 0 and --tasks >= 1")
    started = time.monotonic()
    out = c.header("footprint", args)

    from cloud_hub.broker import find_mosquitto
    from cloud_hub.client import Executor
    from cloud_hub.config import HubConfig
    from cloud_hub.localmesh import LocalMesh
    from mesh_agent.config import AgentConfig
    from sim.emulate.constrain import ConstrainedAgent, Unavailable, build_fsync_shim, fsync_env

    if find_mosquitto() is None:
        raise SystemExit("mosquitto is not installed: run ./taskw setup (apt-get install mosquitto)")
    shipped = {k: HubConfig.model_fields[k].default for k in ("heartbeat_s", "lost_after_s", "lease_s")}
    tmp = Path(tempfile.mkdtemp(prefix="bench-footprint-", dir=args.workdir))
    counter = tmp / "fsync.count"
    try:
        shim: Path | None = build_fsync_shim()
        fsync_note = "fsync + fdatasync calls of the agent tree, counted by the LD_PRELOAD shim (sim/emulate/_fsync_shim.c, no delay)"
    except Unavailable as exc:
        shim, fsync_note = None, f"not measured: {exc}"
    proxy: ProxyThread | None = None
    res: dict[str, Any] = {}
    try:
        with LocalMesh(tmp / "mesh", hub_process=True, **shipped) as mesh:
            proxy = ProxyThread(("127.0.0.1", mesh.broker.port))
            base = mesh.add_agent("field-pi", "mqtt", workers=1, start=False)
            settings: dict[str, Any] = {"mqtt": base.cfg.mqtt.model_copy(update={"host": "127.0.0.1", "port": proxy.port})}
            if args.profile != "default":
                if "profile" not in AgentConfig.model_fields:
                    raise SystemExit("this agent has no 'profile' setting: run with --profile default")
                settings["profile"] = args.profile
            cfg = base.cfg.model_copy(update=settings)
            cfg = AgentConfig.model_validate(cfg.model_dump())
            cfg.save(base.config_path)
            base.cfg = cfg
            agent = ConstrainedAgent(base, [], fsync_env(shim, counter=counter) if shim else {})
            mesh.agents[mesh.agents.index(base)] = agent
            client = mesh.client
            res["agent"] = {"transport": "mqtt", "workers": 1, "profile": args.profile,
                            "config": {k: v for k, v in cfg.model_dump(mode="json").items()
                                       if k in ("profile", "worker_idle_s", "heartbeat_s", "heartbeat_min_s", "heartbeat_max_s", "workers", "prefetch")},
                            "keepalive": cfg.mqtt.keepalive}
            res["hub"] = {**shipped, **{k: getattr(mesh.hub_cfg, k) for k in ("mqtt_lost_after_s", "beat_max_s") if hasattr(mesh.hub_cfg, k)}}

            # start-to-online
            c.log("starting the agent behind the counting proxy")
            t_spawn = time.monotonic()
            agent.start()
            assert agent.proc is not None
            t_on = wait_online(client, agent.endpoint_id, 60)
            if t_on is None:
                raise SystemExit(f"agent not online within 60 s:\n{agent.log_path.read_text()[-3000:]}")
            res["start_to_online_s"] = round(t_on - t_spawn, 3)
            c.log(f"online after {res['start_to_online_s']} s; settling {args.settle_s:g} s")
            time.sleep(args.settle_s)

            # idle
            c.log(f"idle window: {args.window_s:g} s")
            s0, w0 = proxy.snapshot(), time.monotonic()
            time.sleep(args.window_s)
            s1, w1 = proxy.snapshot(), time.monotonic()
            idle = traffic(_delta(s0, s1), w1 - w0)
            res["idle"] = idle
            res["rss_idle"] = tree_memory(agent.proc.pid)
            c.log(f"idle: {idle['mqtt_bytes_up'] + idle['mqtt_bytes_down']} B in {idle['window_s']} s "
                  f"-> {idle['per_day']['total_bytes']} B/day incl. overhead; RSS {res['rss_idle']['rss_mb']} MB")

            # per task
            with Executor(client, agent.endpoint_id) as ex:
                ex.submit(noop).result(timeout=120)  # first task: function cached, worker started (not counted)
                rate = ((s1["bytes_up"] - s0["bytes_up"]) / (w1 - w0), (s1["bytes_down"] - s0["bytes_down"]) / (w1 - w0))

                def sequential() -> None:
                    for _ in range(args.tasks):
                        ex.submit(noop).result(timeout=60)

                def batched() -> None:
                    futs = [ex.submit(noop) for _ in range(args.tasks)]
                    for f in futs:
                        f.result(timeout=120)

                res["per_task"] = {}
                for mode, run in (("batched", batched), ("sequential", sequential)):
                    c.log(f"{args.tasks} no-op tasks, {mode}")
                    res["per_task"][mode] = per_task(run, args.tasks, agent.proc.pid, proxy, counter if shim else None, rate)
                    pt = res["per_task"][mode]
                    c.log(f"  {mode}: {pt['wire_bytes_round_trip']} B on the wire, {pt['disk_write_bytes']} B to disk, {pt['fsyncs']} fsync per task")

                # busy: one worker runs a task long enough to sample
                fut = ex.submit(hold, busy_s)
                peak: dict[str, Any] = {"rss_mb": 0.0}
                deadline = time.monotonic() + 30
                while not fut.done() and time.monotonic() < deadline:
                    m = tree_memory(agent.proc.pid)
                    if m["rss_mb"] > peak["rss_mb"]:
                        peak = m
                    time.sleep(0.05)
                fut.result(timeout=30)
                res["rss_busy"] = {**peak, "how": f"max over 50 ms samples while one worker runs hold({busy_s:g}): time.sleep({busy_s:g})"}
            agent.stop(15)
    finally:
        if proxy is not None:
            proxy.close()
        shutil.rmtree(tmp, ignore_errors=True)

    idle_total = res["idle"]["per_day"]["total_bytes"]
    pt = res["per_task"]["batched"]
    seq = res["per_task"]["sequential"]
    figures = {
        "idle_bytes_per_day_incl_overhead": idle_total,
        "rss_idle_mb": res["rss_idle"]["rss_mb"],
        "rss_busy_mb": res["rss_busy"]["rss_mb"],
        "start_to_online_s": res["start_to_online_s"],
        "wire_bytes_per_task_round_trip": pt["wire_bytes_round_trip"],
        "disk_bytes_per_task": pt["disk_write_bytes"],
        "fsyncs_per_task": pt["fsyncs"],
    }
    # the same per-task figures when tasks come one at a time (a sparse field workload)
    sequential_figures = {"wire_bytes_per_task_round_trip": seq["wire_bytes_round_trip"],
                          "disk_bytes_per_task": seq["disk_write_bytes"], "fsyncs_per_task": seq["fsyncs"]}
    out.update(res)
    out["formulas"] = {
        "packets_est": "2 x proxy reads (one TCP segment per read; + one bare ACK each: an upper bound); "
                       "total_bytes_low counts 1 packet per read (every ACK piggybacked: the lower bound)",
        "tcpip_overhead_bytes": f"packets_est x {TCPIP_B} B (IPv4 20 + TCP 20 + timestamps 12)",
        "tls_overhead_bytes": f"segments x {TLS_RECORD_B} B (one TLS 1.3 AEAD record per data segment; handshake not included)",
        "per_day": f"window figures x {DAY_S:g} / window_s",
        "per_task_wire": "(bytes during the task run - idle rate x its duration) / tasks, MQTT bytes (no TCP/IP, no TLS); "
                         "batched: all tasks submitted at once; sequential: submit(noop).result() one after another",
        "idle_caveat": "events rarer than the window (e.g. the hub's beat_max_s longest silence) are not sampled",
        "disk": "/proc/<pid>/io write_bytes summed over the agent tree (bytes dirtied for storage), per task",
        "fsyncs": fsync_note,
    }
    out["targets"] = {k: {"target": f"<= {TARGETS[k]:g}", "measured": v, "met": None if v is None else v <= TARGETS[k]}
                      for k, v in figures.items()}
    low = res["idle"]["per_day"]["total_bytes_low"]
    out["targets"]["idle_bytes_per_day_incl_overhead"].update(measured_low=low, met_low=low <= TARGETS["idle_bytes_per_day_incl_overhead"])
    for k, v in sequential_figures.items():
        out["targets"][k]["measured_sequential"] = v
        out["targets"][k]["met_sequential"] = None if v is None else v <= TARGETS[k]
    out["targets"]["note"] = ("per-task targets are compared with the batched run (all --tasks submitted at once, as the "
                              "issue's baseline was measured); measured_sequential: one task at a time, each waited for")
    if c.SMOKE:
        out["tls"] = c.smoke_skipped("TLS vs plaintext", "bench/tls.py --smoke runs the same comparison on its own")
    elif not args.no_tls:
        c.log("TLS vs plaintext (bench/tls.py)")
        try:
            out["tls"] = _tls_numbers()
        except Exception:
            out["tls"] = f"not measured: {traceback.format_exc(limit=1)}"
    else:
        out["tls"] = "not measured (--no-tls)"
    out["loadavg_end"] = c.loadavg()
    out["runtime_s"] = round(time.monotonic() - started, 2)
    text = c.json.dumps(out, indent=2)
    print(text, flush=True)
    if not args.no_save:
        c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (c.RESULTS_DIR / "footprint.json").write_text(text + "\n")
        c.log("wrote bench/results/footprint.json")


if __name__ == "__main__":
    main()
