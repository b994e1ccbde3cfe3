"""Fair share under a flood (issue 16 item 3): user B's latency while user A floods a shared endpoint.

User A (the endpoint's owner) submits ``--flood`` no-ops (default 50,000) to one shared endpoint;
then user B submits ``--b-tasks`` short tasks (default 100, 10 ms each) to it. B's per-task
latency (submit to result, in B's process) is measured three ways in the same run:

* ``idle``: B alone on the idle endpoint (the floor);
* ``fair``: under A's flood with fair dispatch (the hub's default, ``fair_dispatch: true``);
* ``fifo``: under A's flood in plain arrival order (``fair_dispatch: false``), the baseline.

Each case gets a fresh mesh (Mosquitto, ``mesh-hub serve`` as its own process, one ZeroMQ agent
with ``--workers`` workers and ``--prefetch``), all on 127.0.0.1. Also reported: how many of A's
tasks finished before B's last one (from the hub's result sequence). Prints JSON, writes
bench/results/fairness-<UTC>.json.

    .venv/bin/python bench/fairness.py [--flood 50000] [--b-tasks 100] [--workers 2] [--prefetch 64] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import latency_stats, loadavg, log, machine_info, ratio, utc_now, write_result  # noqa: E402

from cloud_hub.client import Client, Executor  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402
from cloud_hub.store import SqliteStore  # noqa: E402
from mesh_agent.protocol import serialize  # noqa: E402


def noop() -> None:
    return None


def short(i: int, secs: float) -> int:
    import time

    time.sleep(secs)
    return i


def _b_latencies(b: Client, ep: str, n: int, secs: float, timeout_s: float) -> tuple[list[float], list[str], bool]:
    lat: list[float] = []
    lock = threading.Lock()
    with Executor(b, endpoint=ep) as ex:
        futs = []
        for i in range(n):
            t0 = time.perf_counter()
            f = ex.submit(short, i, secs)
            f.add_done_callback(lambda _f, t0=t0: (lock.acquire(), lat.append(time.perf_counter() - t0), lock.release()))
            futs.append(f)
        deadline = time.monotonic() + timeout_s
        truncated = False
        for f in futs:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                truncated = True
                break
        ids = [getattr(f, "task_id", None) for f in futs]
    return sorted(lat), [i for i in ids if i], truncated


def _case(name: str, fair: bool, flood: int, n_b: int, secs: float, workers: int, prefetch: int, timeout_s: float) -> dict[str, Any]:
    os.environ["MESH_HUB_FAIR_DISPATCH"] = "true" if fair else "false"  # the hub process reads it
    with tempfile.TemporaryDirectory(prefix=f"bench-fair-{name}-") as tmp:
        with LocalMesh(Path(tmp) / "mesh", hub_process=True, lost_after_s=10.0) as mesh:
            agent = mesh.add_agent("shared", "zmq", workers=workers, prefetch=prefetch)
            mesh.wait_online(agent, timeout=120)
            ep = agent.endpoint_id

            async def mint() -> str:
                store = await SqliteStore(mesh.hub_cfg.db_path).open()
                try:
                    return await store.create_api_token(await store.create_user("bob"), "bench")
                finally:
                    await store.close()

            b = Client(mesh.url, asyncio.run(mint()), trusted_endpoints=[ep])
            a = mesh.client
            a.share_endpoint(ep, "bob")
            fid = a.register_function(noop)
            args = base64.b64encode(serialize(((), {}))).decode()
            t0 = time.perf_counter()
            for k in range(0, flood, 5000):
                a.submit_batch_placed([{"endpoint_id": ep, "function_id": fid, "args": args}] * min(5000, flood - k))
            flood_submit_s = time.perf_counter() - t0
            if flood:
                log(f"{name}: A submitted {flood} no-ops in {flood_submit_s:.1f}s; B submits {n_b}")
            lat, ids, truncated = _b_latencies(b, ep, n_b, secs, timeout_s)
            with sqlite3.connect(mesh.hub_cfg.db_path) as c:
                users = dict(c.execute("SELECT name, id FROM users").fetchall())
                last_b = c.execute(f"SELECT MAX(seq) FROM results WHERE task_id IN ({','.join('?' * len(ids))})", ids).fetchone()[0] if ids else None
                a_before = c.execute("SELECT COUNT(*) FROM results WHERE user_id=? AND seq < ?", (users["demo"], last_b)).fetchone()[0] if last_b else None
            b.close()
    out = {"case": name, "fair_dispatch": fair, "flood": flood, "a_done_before_b_last": a_before, **latency_stats(lat, wanted=n_b, truncated=truncated)}
    if flood:
        out["flood_submit_s"] = round(flood_submit_s, 2)
    return out


def _lease_cost(flood: int, n_lease: int, rounds: int) -> dict[str, Any]:
    """Milliseconds per lease of ``n_lease`` tasks from a queue of ``flood`` (user A) + 100 (user B)
    tasks on one endpoint, fair against oldest-first, on the hub's SQLite store (each lease is
    put back, so every round sees the same queue)."""
    from cloud_hub.admission import parse_policy
    from cloud_hub.store import SqliteStore

    async def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-lease-") as tmp:
            store = await SqliteStore(Path(tmp) / "hub.sqlite3").open()
            try:
                a, b = await store.create_user("a"), await store.create_user("b")
                fid = "f" * 64
                await store.put_function(a, fid, b"body", "noop")
                tok = await store.create_enroll_token(a, 60, 1)
                ep = (await store.enroll_endpoint(tok, "pi", "zmq", b"k" * 32))["id"]  # type: ignore[index]
                now = time.time()
                rows = [{"id": f"a{i:06d}", "user_id": a, "endpoint_id": ep, "function_id": fid, "args": b"x", "created": now + i * 1e-6,
                         "expires": now + 3600, "timeout": None} for i in range(flood)]
                rows += [{"id": f"b{i:06d}", "user_id": b, "endpoint_id": ep, "function_id": fid, "args": b"x", "created": now + 1,
                          "expires": now + 3600, "timeout": None} for i in range(100)]
                for k in range(0, len(rows), 10_000):
                    await store.insert_tasks(rows[k : k + 10_000])
                out: dict[str, Any] = {}
                for name, policy in (("fifo", None), ("fair", parse_policy())):
                    times = []
                    for _ in range(rounds):
                        t0 = time.perf_counter()
                        tasks, _ = await store.lease(ep, n_lease, 30.0, 8 << 20, policy=policy)
                        times.append(time.perf_counter() - t0)
                        await store.unlease(ep, [t["id"] for t in tasks])
                    times.sort()
                    out[f"{name}_lease_ms_p50"] = round(times[len(times) // 2] * 1e3, 3)
                    out[f"{name}_lease_ms_max"] = round(times[-1] * 1e3, 3)
                out.update(queue=flood + 100, lease=n_lease, rounds=rounds)
                return out
            finally:
                await store.close()

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood", type=int, default=50_000)
    ap.add_argument("--b-tasks", type=int, default=100)
    ap.add_argument("--b-task-s", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=400.0, help="longest wait for B's tasks per case")
    _common.add_smoke_arg(ap)
    a = ap.parse_args()
    lease_rounds = 200
    if _common.smoke(a):
        a.flood, a.b_tasks, a.timeout, lease_rounds = min(a.flood, 300), min(a.b_tasks, 5), min(a.timeout, 120.0), 5
    started = utc_now()
    load_before = loadavg()
    cases = [("idle", True, 0), ("fair", True, a.flood), ("fifo", False, a.flood)]
    rows = []
    for name, fair, flood in cases:
        rows.append(_case(name, fair, flood, a.b_tasks, a.b_task_s, a.workers, a.prefetch, a.timeout))
        log(f"{name}: B p50 {rows[-1].get('p50_ms')} ms, p99 {rows[-1].get('p99_ms')} ms")
    log("lease cost: fair against oldest-first on the same queue")
    cost = _lease_cost(a.flood, a.workers + a.prefetch, lease_rounds)
    by = {r["case"]: r for r in rows}
    write_result("fairness", {
        "bench": "fairness", "smoke": a.smoke, "date": started.isoformat(), "machine": machine_info(), "load_before": load_before, "load_after": loadavg(),
        "settings": {"flood": a.flood, "b_tasks": a.b_tasks, "b_task_s": a.b_task_s, "workers": a.workers, "prefetch": a.prefetch,
                     "transport": "zmq", "hub": "mesh-hub serve process, SQLite", "baseline": "fifo: the same flood, fair_dispatch false, same run"},
        "cases": rows,
        "fifo_over_fair_p50": ratio(by["fifo"].get("p50_ms"), by["fair"].get("p50_ms")),
        "fifo_over_fair_p99": ratio(by["fifo"].get("p99_ms"), by["fair"].get("p99_ms")),
        "fair_over_idle_p99": ratio(by["fair"].get("p99_ms"), by["idle"].get("p99_ms")),
        "lease_cost": cost,
    })
    _common.smoke_check([f"{r['case']}: {r['n']} of {r['wanted']} of B's tasks done" for r in rows if r["truncated"]])


if __name__ == "__main__":
    main()
