"""What an open console costs the hub's database, next to the dispatcher's own work on it.

The dispatcher's leases, acks and result writes run on the store's DB thread; the console reads
on a second, read-only connection with its own thread (``SqliteStore.read_parallel``), so it does not
queue them, but it shares the file, the disk and the CPU. This builds a real hub SQLite file with ``--tasks`` finished tasks of
one user (a tenth failed, spread over the last hour, on 3 endpoints and 2 functions), then times
on that file, in rounds that rotate through the operations:

* the live snapshot of one signed-in user (``console.live``: endpoints, task counts by state,
  throughput series), computed at most once a second per user, less often when it is slow;
* the page queries (overview's recent tasks, the failed-task filter, a task's detail, the
  functions page, an availability timeline);
* baseline from the same run: a 100-task submit (``insert_tasks``, one fsync'd transaction)
  and a 100-task lease, the dispatcher's own steps.

One JSON object on stdout and in bench/results/console-<UTC>.json; progress on stderr.

    python bench/console.py [--tasks 100000] [--rounds 15] [--quick] [--smoke] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import _common as c

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_hub.console import queries  # noqa: E402
from cloud_hub.console.live import BUCKET_S, BUCKETS, SNAPSHOT_COST_FACTOR, SNAPSHOT_TTL_S  # noqa: E402
from cloud_hub.store import SqliteStore  # noqa: E402
from cloud_hub.store.availability import events_between, record_transition  # noqa: E402


async def build(store: SqliteStore, n: int) -> dict[str, Any]:
    uid = await store.create_user("ops")
    eps = []
    for name in ("pi-field-1", "pi-field-2", "hpc-login-1"):
        tok = await store.create_enroll_token(uid, 60, 1)
        ep = await store.enroll_endpoint(tok, name, "mqtt", b"k" * 32)
        assert ep
        eps.append(ep["id"])
    fids = ["a" * 64, "b" * 64]
    for f in fids:
        await store.put_function(uid, f, b"dill\n" + f.encode(), f"fn-{f[0]}")
    now = time.time()
    rng = random.Random(7)
    batch = 5000
    for start in range(0, n, batch):
        rows = []
        for i in range(start, min(n, start + batch)):
            created = now - 3600 + 3600 * i / n
            rows.append((f"t{i:08d}", uid, eps[i % 3], fids[i % 2], created))

        def q(db: Any, rows: list[tuple[Any, ...]] = rows) -> None:
            db.executemany(
                "INSERT INTO tasks (id, user_id, endpoint_id, function_id, args, state, created, expires, attempts, dispatched, acked, done) "
                "VALUES (?, ?, ?, ?, NULL, 'done', ?5, ?5 + 1e6, 1, ?5 + 0.01, ?5 + 0.02, ?5 + 0.2)", rows)
            db.executemany(
                "INSERT INTO results (task_id, user_id, ok, data, started, finished, received, pid) VALUES (?, ?, ?, ?, ?, ?, ?, 1)",
                [(r[0], uid, int(rng.random() > 0.1), b"json\n1", r[4] + 0.05, r[4] + 0.15, r[4] + 0.2) for r in rows])

        await store.tx(q)
    for k, ep in enumerate(eps):
        for j in range(20):
            await store.tx(record_transition, ep, j % 2 == 0, now - 3600 + j * 170 + k)
    return {"user": uid, "endpoints": eps, "functions": fids, "task": f"t{n // 2:08d}"}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-console-", dir=args.workdir))
    store = await SqliteStore(workdir / "hub.sqlite3").open()
    try:
        t0 = time.perf_counter()
        ctx = await build(store, args.tasks)
        c.log(f"built {args.tasks} tasks in {time.perf_counter() - t0:.1f}s")
        uid = ctx["user"]
        submit_n = [0]

        async def snapshot() -> None:
            await store.list_endpoints(user_id=uid)
            await store.read_parallel(queries.state_counts, uid)
            await store.read_parallel(queries.throughput, uid, time.time(), BUCKET_S, BUCKETS)

        async def submit100() -> None:
            now = time.time()
            submit_n[0] += 1
            await store.insert_tasks([
                {"id": f"s{submit_n[0]}-{i}", "user_id": uid, "endpoint_id": ctx["endpoints"][0], "function_id": ctx["functions"][0],
                 "args": b"json\n[[1],{}]", "created": now, "expires": now + 1e6, "timeout": None} for i in range(100)])

        async def lease100() -> None:
            await store.lease(ctx["endpoints"][0], 100, 30.0, 8 * 2**20)

        ops: dict[str, Callable[[], Awaitable[Any]]] = {
            "snapshot": snapshot,
            "page_recent_tasks": lambda: store.read_parallel(lambda db: queries.list_tasks(db, uid, limit=51)),
            "page_failed_filter": lambda: store.read_parallel(lambda db: queries.list_tasks(db, uid, state="failed", limit=51)),
            "page_task_detail": lambda: store.read_parallel(queries.task_detail, uid, ctx["task"]),
            "page_functions": lambda: store.read_parallel(queries.function_stats, uid),
            "page_availability_1h": lambda: store.read_parallel(events_between, ctx["endpoints"], time.time() - 3600, time.time()),
            "baseline_submit_100": submit100,
            "baseline_lease_100": lease100,
        }
        samples: dict[str, list[float]] = {k: [] for k in ops}
        for fn in ops.values():  # warm caches
            await fn()
        deadline = time.monotonic() + args.budget_s
        for r in range(args.rounds):
            for name, fn in ops.items():
                t = time.perf_counter()
                await fn()
                samples[name].append(time.perf_counter() - t)
            if time.monotonic() > deadline:
                c.log(f"time budget reached after {r + 1} rounds")
                break
        out: dict[str, Any] = {}
        for name, s in samples.items():
            s.sort()
            out[name] = {"p50_ms": round(c.percentile(s, 50) * 1e3, 3), "p90_ms": round(c.percentile(s, 90) * 1e3, 3), "n": len(s)}
        snap = out["snapshot"]["p50_ms"]
        reuse_s = max(SNAPSHOT_TTL_S, SNAPSHOT_COST_FACTOR * snap / 1e3)  # what console.live does
        out["snapshot_reused_for_s"] = round(reuse_s, 2)
        out["snapshot_reader_busy_share_per_watching_user"] = round(snap / 1e3 / reuse_s, 4)
        out["snapshot_vs_submit_100"] = c.ratio(snap, out["baseline_submit_100"]["p50_ms"])
        return out
    finally:
        await store.close()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=100_000, help="finished tasks in the database (default 100,000)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds through all operations (default 15)")
    p.add_argument("--budget-s", type=float, default=90.0, help="time cap for the timed rounds (default 90)")
    p.add_argument("--quick", action="store_true", help="10,000 tasks, 5 rounds")
    c.add_smoke_arg(p)
    p.add_argument("--no-save", action="store_true", help="print the JSON but do not write bench/results/")
    p.add_argument("--workdir", default=None, help="directory for the SQLite file (default: system temp dir)")
    args = p.parse_args()
    if args.quick:
        args.tasks, args.rounds = min(args.tasks, 10_000), min(args.rounds, 5)
    if c.smoke(args):
        args.tasks, args.rounds = min(args.tasks, 1000), min(args.rounds, 2)
    started = time.monotonic()
    out = c.header("console", args)
    out["results"] = asyncio.run(run(args))
    c.finish("console", out, args, started)


if __name__ == "__main__":
    main()
