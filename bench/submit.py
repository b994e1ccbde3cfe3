"""How submitting feels to a user (issue 18): prints JSON from one run, writes bench/results/submit.json.

One mesh as deployed (Mosquitto, the hub as its own ``mesh-hub serve`` process, one ZeroMQ agent
with 2 workers), loopback only. Measured in the same run:

- submits/s of ``ex.submit(double, i)`` (one named function) and of ``ex.submit(lambda v: v * 2, i)``
  (a fresh lambda each time, the closure-in-a-loop pattern), their ratio, and end-to-end time;
- p50 / p99 latency of one ``submit()`` call;
- a steady stream of submits through a hub SIGKILL and restart: refused submits, duplicated
  tasks, results delivered.

    .venv/bin/python bench/submit.py [--n 2000] [--stream 300] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import platform
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script, bench/ is first on sys.path and bench/scheduler.py would shadow the
# `scheduler` package the hub imports: the repository root instead.
_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != _BENCH]

from cloud_hub.client import Client, Executor  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402


def double(v: int) -> int:
    return v * 2


def _run(ex: Executor, n: int, fresh: bool) -> dict[str, Any]:
    lat: list[float] = []
    t0 = time.perf_counter()
    futs = []
    for i in range(n):
        s = time.perf_counter()
        futs.append(ex.submit((lambda v: v * 2) if fresh else double, i))
        lat.append(time.perf_counter() - s)
    submit_s = time.perf_counter() - t0
    assert [f.result(300) for f in futs] == [2 * i for i in range(n)]
    total_s = time.perf_counter() - t0
    lat.sort()
    return {"submits_per_s": round(n / submit_s), "submit_s": round(submit_s, 4), "end_to_end_s": round(total_s, 3),
            "p50_submit_us": round(statistics.median(lat) * 1e6, 1), "p99_submit_us": round(lat[int(0.99 * (n - 1))] * 1e6, 1)}


def _restart_stream(m: LocalMesh, ep: str, n: int) -> dict[str, Any]:
    client = Client(m.url, m.token, timeout=10)
    ex = Executor(client, endpoint_id=ep, submit_timeout_s=120, task_group_id="bench-restart")
    futs: list[Any] = []
    refused = 0
    down: dict[str, float] = {}

    def bounce() -> None:
        while len(futs) < n // 3:
            time.sleep(0.005)
        down["at"] = time.perf_counter()
        m.kill_hub()
        time.sleep(2.0)
        m.start_hub()
        down["s"] = time.perf_counter() - down["at"]

    t = threading.Thread(target=bounce)
    t.start()
    for i in range(n):
        try:
            futs.append(ex.submit(double, i))
        except Exception:
            refused += 1
        time.sleep(0.02)
    t.join(120)
    failed = 0
    for i, f in enumerate(futs):
        try:
            ok = f.result(300) == 2 * i
        except Exception:
            ok = False
        failed += not ok
    ex.shutdown()
    client.close()
    with sqlite3.connect(m.hub_cfg.db_path) as db:
        stored = db.execute("SELECT COUNT(*) FROM tasks WHERE task_group_id='bench-restart'").fetchone()[0]
    return {"submits": n, "refused": refused, "failed_futures": failed, "tasks_stored": stored,
            "duplicated": stored - (n - refused), "hub_down_s": round(down.get("s", 0.0), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--stream", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "submit.json")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: 20 submits each way, 30 through the hub restart; prints the JSON, writes no file")
    a = ap.parse_args()
    warm = 200
    if a.smoke:
        a.n, a.stream, warm = min(a.n, 20), min(a.stream, 30), 20
    with tempfile.TemporaryDirectory() as d, LocalMesh(Path(d), hub_process=True) as m:
        agent = m.add_agent("bench", "zmq", workers=2)
        m.wait_online(timeout=120)
        with Executor(Client(m.url, m.token), endpoint_id=agent.endpoint_id) as ex:
            _run(ex, warm, False)  # warm: workers, connections, the distributions scan
            _run(ex, warm, True)
            named = _run(ex, a.n, False)
            lam = _run(ex, a.n, True)
        restart = _restart_stream(m, agent.endpoint_id, a.stream)
    out = {
        "bench": "submit", "smoke": a.smoke, "n": a.n, "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
        "named_function": named, "fresh_lambda": lam,
        "lambda_to_named_rate_ratio": round(lam["submits_per_s"] / named["submits_per_s"], 3),
        "through_hub_restart": restart,
    }
    if not a.smoke:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    if a.smoke and (restart["failed_futures"] or restart["duplicated"] > 0):
        sys.exit(f"--smoke: FAILED through the hub restart: {restart}")


if __name__ == "__main__":
    main()
