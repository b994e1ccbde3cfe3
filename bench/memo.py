"""Memoization in the style of funcX's Table 3 (HPDC'20, section 5.3; issue 16 item 2).

2,000 tasks of 100 ms (``time.sleep(0.1)``) with 0, 25, 50, 75 and 100 % repeated calls, each
run twice in the same mesh: without memoization (every call runs) and with ``cache=True``. A
third column resubmits the cached workload from a new Executor once it has finished: every call
is then a hub-side hit, with no dispatch at all. Prints JSON, writes bench/results/memo-<UTC>.json.

Repeats: with r % repeats, ``2000 * (1 - r)`` distinct calls (at least one), the rest drawn at
random from them, the whole list shuffled (seeded). Each run uses fresh argument values, so no run
hits a previous run's cache. The mesh: Mosquitto, the hub as its own ``mesh-hub serve`` process,
one ZeroMQ agent with ``--workers`` warm worker processes (default 32, so a 200 worker-second
run takes seconds); everything on 127.0.0.1.

    .venv/bin/python bench/memo.py [--tasks 2000] [--workers 32] [--task-s 0.1] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import loadavg, log, machine_info, ratio, utc_now, write_result  # noqa: E402

from cloud_hub.client import Client, Executor  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402

REPEATS = (0, 25, 50, 75, 100)


def work(x: Any, secs: float) -> Any:
    import time

    time.sleep(secs)
    return x


def _workload(n: int, pct: int, salt: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    distinct = max(1, round(n * (100 - pct) / 100))
    calls = [f"{salt}-{i}" for i in range(distinct)]
    calls += [calls[rng.randrange(distinct)] for _ in range(n - distinct)]
    rng.shuffle(calls)
    return calls


def _run(client: Client, ep: str, calls: list[str], secs: float, cache: bool) -> float:
    t0 = time.perf_counter()
    with Executor(client, endpoint=ep) as ex:
        futs = [ex.submit(work, c, secs, cache=cache) for c in calls]
        got = [f.result(timeout=600) for f in futs]
    elapsed = time.perf_counter() - t0
    if got != calls:
        raise SystemExit("wrong results: memoization answered a call with another call's value")
    return elapsed


def _hub_counts(db: Path, since: float) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        ran = c.execute("SELECT COUNT(*) FROM tasks WHERE created >= ? AND dispatched IS NOT NULL", (since,)).fetchone()[0]
        hits = c.execute("SELECT COUNT(*) FROM tasks WHERE created >= ? AND memo_key IS NOT NULL AND dispatched IS NULL", (since,)).fetchone()[0]
    return {"tasks_run": int(ran), "hub_hits": int(hits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--task-s", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=16)
    _common.add_smoke_arg(ap)
    a = ap.parse_args()
    if _common.smoke(a):
        a.tasks, a.workers, a.task_s = min(a.tasks, 20), min(a.workers, 2), min(a.task_s, 0.01)
    started = utc_now()
    load_before = loadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-memo-") as tmp:
        with LocalMesh(Path(tmp) / "mesh", hub_process=True) as mesh:
            agent = mesh.add_agent("memo", "zmq", workers=a.workers, prefetch=512)
            mesh.wait_online(agent, timeout=120)
            client = Client(mesh.url, mesh.token)
            db = mesh.hub_cfg.db_path
            log(f"warming {a.workers} workers")
            _run(client, agent.endpoint_id, [f"warm-{i}" for i in range(a.workers * 4)], a.task_s, False)
            for pct in REPEATS:
                calls_off = _workload(a.tasks, pct, f"off{pct}", a.seed + pct)
                calls_on = _workload(a.tasks, pct, f"on{pct}", a.seed + pct)
                off = _run(client, agent.endpoint_id, calls_off, a.task_s, False)
                since = time.time()
                on = _run(client, agent.endpoint_id, calls_on, a.task_s, True)
                counts = _hub_counts(db, since)
                since_warm = time.time()
                warm = _run(client, agent.endpoint_id, calls_on, a.task_s, True)  # a new Executor: every call a hub hit
                warm_counts = _hub_counts(db, since_warm)
                row = {"repeats_pct": pct, "distinct_calls": len(set(calls_on)), "without_memo_s": round(off, 3), "with_memo_s": round(on, 3),
                       "speedup": ratio(off, on), "warm_cache_s": round(warm, 3), "warm_speedup": ratio(off, warm),
                       "with_memo_tasks_run": counts["tasks_run"], "with_memo_hub_hits": counts["hub_hits"],
                       "with_memo_joined_in_sdk": a.tasks - counts["tasks_run"] - counts["hub_hits"],
                       "warm_cache_tasks_run": warm_counts["tasks_run"], "warm_cache_hub_hits": warm_counts["hub_hits"],
                       "warm_cache_joined_in_sdk": a.tasks - warm_counts["tasks_run"] - warm_counts["hub_hits"]}
                rows.append(row)
                log(f"{pct}% repeats: {off:.2f}s without, {on:.2f}s with memoization, {warm:.2f}s from a warm cache")
            client.close()
    write_result("memo", {
        "bench": "memo", "smoke": a.smoke, "date": started.isoformat(), "machine": machine_info(), "load_before": load_before, "load_after": loadavg(),
        "settings": {"tasks": a.tasks, "task_s": a.task_s, "workers": a.workers, "prefetch": 512, "transport": "zmq",
                     "hub": "mesh-hub serve process, SQLite", "seed": a.seed,
                     "baseline": "the same workload, same mesh, same run, without cache=True"},
        "rows": rows,
    })


if __name__ == "__main__":
    main()
