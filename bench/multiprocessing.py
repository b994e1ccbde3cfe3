"""Overheads of cloud_hub.client.multiprocessing next to the standard library's, in one run (issue 12).

One mesh as deployed on loopback (Mosquitto, the hub as its own ``mesh-hub serve`` process, two
agents, one MQTT and one ZeroMQ, 3 workers each) and a redis-server of its own on a free port.
Measured, each beside the standard library's ``multiprocessing`` on this machine:

- fork-join overhead: ``Pool.map(time.sleep, [S] * N)`` wall time minus S, for N workers (cold:
  the first map of a new Pool, counting Pool creation; warm: median of later maps);
- the time from ``Process.start()`` to its target running, on an idle fleet and on one whose
  every worker slot is busy (issue 28: a Process starts at once, on an extra worker if need be);
- the time from a driver's death (SIGKILL, its Processes waiting in a Barrier) to its tasks being
  cancelled and its workers free again (issue 28: its lease runs out);
- Pipe round-trip latency by payload size (driver -> remote echo Process -> driver), p50;
- Pipe and Queue throughput, MB/s, driver -> one remote consumer;
- then Pipe and Queue again with the proxies' state in the hub's embedded store instead of Redis.

Next to the Lithops paper's figures (FGCS 2023): about 1 s fork-join at low parallelism, under
1 ms Redis Pipe latency below 1 KB, about 90 MB/s Pipe throughput.

    .venv/bin/python bench/multiprocessing.py [--sleep 0.5] [--rounds 100] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != _BENCH]

import multiprocessing as std  # noqa: E402  (after the path fix: this file has the same name)

from cloud_hub.client import Client  # noqa: E402
from cloud_hub.client import multiprocessing as mesh  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402
from tests.integration.test_mp_proxies import RedisServer  # noqa: E402

LITHOPS = {"fork_join_overhead_s_low_parallelism": 1.0, "pipe_latency_ms_below_1KB": "< 1", "pipe_throughput_MBps": 90}


def echo(conn: Any, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(conn.recv_bytes())


def sink(conn: Any, n: int, ack: Any) -> None:
    for _ in range(n):
        conn.recv_bytes()
    ack.send(b"done")


def drain(q: Any, n: int, done: Any) -> None:
    for _ in range(n):
        q.get()
    done.put("done")


def started_at(q: Any) -> None:
    q.put(time.time())


def process_start(mod: Any, n: int) -> dict[str, float]:
    """Time from ``Process.start()`` being called to its target running (the target's first
    act), one Process at a time, p50 and max over ``n``; one clock (loopback)."""
    q, lat = mod.Queue(), []
    for _ in range(n):
        p = mod.Process(target=started_at, args=(q,))
        t0 = time.time()
        p.start()
        lat.append(q.get(timeout=300) - t0)
        p.join(300)
    return {"p50_ms": round(statistics.median(lat) * 1000, 1), "max_ms": round(max(lat) * 1000, 1)}


def process_start_busy(mod: Any, n: int, slots: int, busy_s: float) -> dict[str, float]:
    """As :func:`process_start` while every worker slot (``slots``) runs a sleeping task and as
    many again wait behind them: a mesh Process starts on an extra worker (docs/multiprocessing.md,
    "Start"); a stdlib one is forked next to a busy Pool."""
    with mod.Pool(slots) as pool:
        busy = pool.map_async(time.sleep, [busy_s] * (2 * slots), chunksize=1)
        time.sleep(1.0)  # let the sleeping tasks reach the workers
        out = process_start(mod, n)
        busy.wait()  # the fleet idle again before the next measurement
    return out


_DRIVER = """
import json, sys, time
from cloud_hub.client import multiprocessing as mp

def meet(b):
    b.wait()

if __name__ == "__main__":
    n = int(sys.argv[1])
    b = mp.Barrier(n + 1)  # one party more than the Processes: the driver, which never meets them
    ps = [mp.Process(target=meet, args=(b,)) for _ in range(n)]
    for p in ps:
        p.start()
    print(json.dumps([p.pid for p in ps]), flush=True)
    # Not b.wait(): had the driver reached the barrier before its SIGKILL, the Processes would pass
    # it and end by themselves, and nothing would be left for the lease to cancel (the wait for
    # that cancel then ran to its two-minute bound: a smoke run took 150 s).
    time.sleep(600)
"""


def driver_death(m: LocalMesh, redis: RedisServer, endpoint: str, n: int, lease_s: float) -> dict[str, Any]:
    """A driver whose ``n`` Processes wait in a Barrier on ``endpoint`` is SIGKILLed: seconds from
    its death to the hub cancelling its tasks (its hub lease ran out: 3/4 ``lease_s`` at most, plus
    the watchdog's pass) and to its workers being free again (the agent killed them and confirmed:
    ``ack.c``). Read from the hub's database, polled every 50 ms."""
    import signal
    import sqlite3
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "driver.py"
        script.write_text(_DRIVER)
        env = {**os.environ, "MESH_HUB_URL": m.url, "MESH_TOKEN": m.token, "MESH_REDIS_URL": redis.url, "MESH_MP_ENDPOINT": endpoint,
               "MESH_MP_LEASE_S": str(lease_s), "PYTHONPATH": str(_BENCH.parent)}
        proc = subprocess.Popen([sys.executable, str(script), str(n)], env=env, stdout=subprocess.PIPE, text=True)
        try:
            ids = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        died = time.time()
    cancelled = free = None
    db = sqlite3.connect(f"file:{m.hub_cfg.db_path}?mode=ro", uri=True)
    try:
        q = f"SELECT cancelled, cancel_pending FROM tasks WHERE id IN ({','.join('?' * len(ids))})"
        for _ in range(int((lease_s + 120) / 0.05)):  # bounded: the lease plus two minutes
            rows = db.execute(q, ids).fetchall()
            now = time.time()
            if cancelled is None and len(rows) == len(ids) and all(r[0] is not None for r in rows):
                cancelled = now
            if cancelled is not None and all(r[1] is None for r in rows):
                free = now
                break
            time.sleep(0.05)
    finally:
        db.close()
    if free is None:  # a measurement that did not happen is a failure, not a null in the JSON
        raise SystemExit(f"driver_death: the dead driver's {n} tasks were {'not cancelled' if cancelled is None else 'cancelled, but their workers not freed'} "
                         f"within lease_s + 120 s (lease_s={lease_s:g})")
    return {"lease_s": lease_s, "processes": n, "death_to_tasks_cancelled_s": round(cancelled - died, 2) if cancelled else None,
            "death_to_workers_free_s": round(free - died, 2)}


def fork_join(mod: Any, n: int, sleep_s: float, repeats: int) -> dict[str, float]:
    t0 = time.perf_counter()
    with mod.Pool(n) as pool:
        pool.map(time.sleep, [sleep_s] * n, chunksize=1)
        cold = time.perf_counter() - t0 - sleep_s
        warm = []
        for _ in range(repeats):
            t = time.perf_counter()
            pool.map(time.sleep, [sleep_s] * n, chunksize=1)
            warm.append(time.perf_counter() - t - sleep_s)
    return {"cold_s": round(cold, 4), "warm_s": round(statistics.median(warm), 4)}


def pipe_latency(mod: Any, size: int, rounds: int) -> float:
    a, b = mod.Pipe()
    p = mod.Process(target=echo, args=(b, rounds + 1))
    p.start()
    payload = os.urandom(size)
    a.send_bytes(payload)  # warm-up: the remote process is running once this comes back
    a.recv_bytes()
    rtts = []
    for _ in range(rounds):
        t = time.perf_counter()
        a.send_bytes(payload)
        a.recv_bytes()
        rtts.append(time.perf_counter() - t)
    p.join(60)
    return round(statistics.median(rtts) * 1000, 4)


def pipe_throughput(mod: Any, size: int, count: int) -> float:
    a, b = mod.Pipe()
    ack_r, ack_w = mod.Pipe()
    p = mod.Process(target=sink, args=(b, count, ack_w))
    p.start()
    payload = os.urandom(size)
    t = time.perf_counter()
    for _ in range(count):
        a.send_bytes(payload)
    ack_r.recv_bytes()
    dt = time.perf_counter() - t
    p.join(60)
    return round(size * count / dt / 1e6, 2)


def queue_throughput(mod: Any, size: int, count: int) -> float:
    q, done = mod.Queue(), mod.Queue()
    p = mod.Process(target=drain, args=(q, count, done))
    p.start()
    payload = os.urandom(size)
    t = time.perf_counter()
    for _ in range(count):
        q.put(payload)
    done.get(timeout=300)
    dt = time.perf_counter() - t
    p.join(60)
    return round(size * count / dt / 1e6, 2)


def wordcount(m: LocalMesh, redis: RedisServer) -> dict[str, Any]:
    """The word count of tests/integration/test_multiprocessing.py (6 maps of 20,000 words, 3
    reducers) over both agents: shuffle through refs vs every byte through the SDK."""
    from tests.integration import test_multiprocessing as wc

    class _Env:
        mesh, redis, mode = m, None, "redis"

    env = _Env()
    env.redis = redis
    env.store_url = redis.url  # the shuffle through this run's own redis-server (bench/data_tiers.py compares the tiers)
    res: dict[str, Any] = {}
    for name, run in (("through_sdk", wc.wordcount_via_sdk), ("through_refs", wc.wordcount_via_refs)):
        t = time.perf_counter()
        got = run(env)  # type: ignore[arg-type]
        res[name] = {"end_to_end_s": round(time.perf_counter() - t, 3), "sdk_http_bytes": got[1]}
        if name == "through_refs":
            res[name]["result_bytes_fetched_with_get"] = got[2]
    res["sdk_bytes_ratio"] = round(res["through_sdk"]["sdk_http_bytes"] / max(1, res["through_refs"]["sdk_http_bytes"]), 1)
    return res


def _label(size: int, count: int) -> str:
    """``1MiB x 64``, ``1KiB x 5000``: a payload size and a message count."""
    unit = next(((n, u) for n, u in ((1 << 20, "MiB"), (1 << 10, "KiB")) if size >= n and size % n == 0), (1, "B"))
    return f"{size // unit[0]}{unit[1]} x {count}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: every measurement once at small sizes, the standard library beside it; prints the JSON, "
                         "writes nothing under bench/results/")
    opts = ap.parse_args()
    workers, rtt_sizes = (1, 2, 4, 6), (64, 1024, 65536, 1 << 20)
    pipe_big, queue_small, queue_big = (1 << 20, 64), (1024, 5000), (1 << 20, 64)  # (payload bytes, messages)
    if opts.smoke:
        opts.sleep, opts.rounds, opts.repeats = 0.05, 3, 1
        workers, rtt_sizes, pipe_big, queue_small, queue_big = (1, 2), (64, 65536), (65536, 8), (1024, 50), (65536, 8)
    out: dict[str, Any] = {"bench": "multiprocessing", "smoke": opts.smoke, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
                           "lithops_paper": LITHOPS, "setup": "loopback: hub process, Mosquitto, 1 MQTT + 1 ZeroMQ agent x 3 workers, own redis-server"}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        m = LocalMesh(Path(tmp) / "mesh", heartbeat_s=1.0, hub_process=True)
        m.start()
        try:
            m.add_agent("mp-mqtt", "mqtt", workers=3)
            m.add_agent("mp-zmq", "zmq", workers=3)
            m.wait_online(timeout=90)
            mesh.config(client=Client(m.url, m.token), redis_url=redis.url)
            out["fork_join_overhead"] = {str(n): {"mesh": fork_join(mesh, n, opts.sleep, opts.repeats),
                                                  "stdlib": fork_join(std, n, opts.sleep, opts.repeats)} for n in workers}
            starts = 3 if opts.smoke else 20
            out["process_start_to_target_running"] = {
                "idle_fleet": {"mesh": process_start(mesh, starts), "stdlib": process_start(std, starts)},
                "busy_fleet (all 6 slots sleeping, 6 more queued)": {"mesh": process_start_busy(mesh, starts, 6, 4.0 if opts.smoke else 10.0),
                                                                     "stdlib": process_start_busy(std, starts, 6, 4.0 if opts.smoke else 10.0)},
            }
            zmq_ep = next(a.endpoint_id for a in m.agents if a.cfg.name == "mp-zmq")
            # A driver SIGKILLed while its Processes hold all 3 slots of one agent (issue 28): the
            # default lease, or a short one in a smoke run. The stdlib has no counterpart: its
            # orphaned children go on until they end by themselves.
            out["driver_death_to_workers_free"] = driver_death(m, redis, zmq_ep, 3, 8.0 if opts.smoke else 60.0)
            out["pipe_rtt_p50_ms"] = {str(s): {"mesh": pipe_latency(mesh, s, opts.rounds), "stdlib": pipe_latency(std, s, opts.rounds)}
                                      for s in rtt_sizes}
            out["pipe_throughput_MBps"] = {_label(*pipe_big): {"mesh": pipe_throughput(mesh, *pipe_big), "stdlib": pipe_throughput(std, *pipe_big)}}
            out["wordcount_map_shuffle_reduce"] = wordcount(m, redis)
            out["queue_throughput_MBps"] = {
                _label(*queue_small): {"mesh": queue_throughput(mesh, *queue_small), "stdlib": queue_throughput(std, *queue_small)},
                _label(*queue_big): {"mesh": queue_throughput(mesh, *queue_big), "stdlib": queue_throughput(std, *queue_big)},
            }
            # The same proxies with no Redis: state in the hub's embedded store (docs/data.md), same run.
            mesh.config(redis_url=str(Client(m.url, m.token).request("GET", "/v1/kv")["url"]))
            out["hub_store_vs_redis"] = {
                "pipe_rtt_p50_ms": {str(s): {"hub_store": pipe_latency(mesh, s, opts.rounds), "redis": out["pipe_rtt_p50_ms"][str(s)]["mesh"]}
                                    for s in rtt_sizes},
                f"pipe_throughput_MBps {_label(*pipe_big)}": {"hub_store": pipe_throughput(mesh, *pipe_big),
                                                             "redis": out["pipe_throughput_MBps"][_label(*pipe_big)]["mesh"]},
                f"queue_throughput_MBps {_label(*queue_small)}": {"hub_store": queue_throughput(mesh, *queue_small),
                                                                 "redis": out["queue_throughput_MBps"][_label(*queue_small)]["mesh"]},
            }
        finally:
            mesh._runner.shutdown_executor()
            m.stop()
            redis.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if opts.smoke:
        return
    (_BENCH / "results").mkdir(exist_ok=True)
    (_BENCH / "results" / "multiprocessing.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
