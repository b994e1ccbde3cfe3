"""Hub store throughput: SQLite (the baseline, one file) against PostgreSQL (one and two replicas).

The hot path of the hub in store calls: accept a batch of tasks (insert), hand them to agents
(lease + ack), store their results. Each phase runs over the same N tasks in batches of 500, as
the dispatcher does; "2 replicas" runs the lease and result phases from two PostgresStore
instances at once, as two hubs on one database would. Prints one JSON object and writes it to
bench/results/store-<UTC>.json.

    python bench/store.py [--quick] [--smoke] [--tasks 20000] [--pg-url postgresql://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common as c

BATCH = 500
FID = "f" * 64


async def _setup(store: Any) -> tuple[str, str]:
    uid = await store.create_user("bench")
    await store.put_function(uid, FID, b"x" * 200, "noop")
    tok = await store.create_enroll_token(uid, 60, 1)
    ep = await store.enroll_endpoint(tok, "bench-ep", "mqtt", b"k" * 32)
    return uid, ep["id"]


async def _phases(stores: list[Any], n: int, deadline: float) -> dict[str, Any]:
    """insert / lease+ack / store_results rates (per second) over n tasks."""
    first = stores[0]
    uid, ep = await _setup(first)
    now = time.time()
    rows = [{"id": uuid.uuid4().hex, "user_id": uid, "endpoint_id": ep, "function_id": FID, "args": b"a" * 64,
             "created": now + i * 1e-6, "expires": now + 3600, "timeout": None} for i in range(n)]
    out: dict[str, Any] = {"tasks": n, "replicas": len(stores)}

    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        await first.insert_tasks(rows[i:i + BATCH])
    out["insert_per_s"] = round(n / (time.perf_counter() - t0))

    leased: list[str] = []

    async def lease(store: Any) -> None:
        while time.monotonic() < deadline:
            tasks, _ = await store.lease(ep, BATCH, 60.0, 8 * 2**20)
            if not tasks:
                return
            ids = [t["id"] for t in tasks]
            await store.ack(ep, ids)
            leased.extend(ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(lease(s) for s in stores))
    out["lease_ack_per_s"] = round(len(leased) / (time.perf_counter() - t0))
    out["leased_once"] = len(leased) == len(set(leased)) == n

    results = [{"id": tid, "ok": True, "data": b"r" * 64, "started": now, "finished": now, "pid": 1} for tid in leased]
    chunks = [results[i:i + BATCH] for i in range(0, len(results), BATCH)]
    stored = 0

    async def store_results(store: Any, mine: list[list[dict[str, Any]]]) -> None:
        nonlocal stored
        for chunk in mine:
            if time.monotonic() > deadline:
                return
            fresh = await store.store_results(ep, chunk)  # not `stored += await ...`: that reads stored before awaiting
            stored += len(fresh)

    t0 = time.perf_counter()
    await asyncio.gather(*(store_results(s, chunks[i::len(stores)]) for i, s in enumerate(stores)))
    out["results_per_s"] = round(stored / (time.perf_counter() - t0))
    out["results_stored_once"] = stored == n
    return out


async def _run_sqlite(n: int, deadline: float) -> dict[str, Any]:
    from cloud_hub.store import SqliteStore

    with tempfile.TemporaryDirectory() as d:
        store = await SqliteStore(Path(d) / "hub.sqlite3").open()
        try:
            return await _phases([store], n, deadline)
        finally:
            await store.close()


async def _run_pg(url: str, n: int, replicas: int, deadline: float) -> dict[str, Any]:
    import psycopg

    from cloud_hub.store.postgres import PostgresStore

    schema = "mesh_bench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in url else "?"
    scoped = f"{url}{sep}options=-csearch_path%3D{schema}"
    stores = []
    try:
        for _ in range(replicas):
            stores.append(await PostgresStore(scoped).open())
        out = await _phases(stores, n, deadline)
        out["serialization_retries"] = sum(s.stats["serialization_retries"] for s in stores)
        return out
    finally:
        for s in stores:
            await s.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tasks", type=int, default=20_000)
    p.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--workdir", default=None)
    c.add_smoke_arg(p)
    args = p.parse_args()
    n = 2_000 if args.quick else args.tasks
    if c.smoke(args):
        n = 1_000  # two batches: both replicas get one
    started = time.monotonic()
    out = c.header("store", args)
    deadline = time.monotonic() + 540  # every phase stops by then, whatever the machine does
    problems: list[str] = []
    c.log(f"sqlite, {n} tasks")
    out["sqlite"] = asyncio.run(_run_sqlite(n, deadline))
    for replicas in (1, 2):
        c.log(f"postgres, {replicas} replica(s), {n} tasks")
        try:
            out[f"postgres_{replicas}"] = asyncio.run(_run_pg(args.pg_url, n, replicas, deadline))
        except Exception as exc:  # no server: the baseline still prints
            out[f"postgres_{replicas}"] = {"error": repr(exc)}
            if c.SMOKE:
                why = _pg_unreachable(args.pg_url)
                if why is None or os.environ.get("CI"):  # a failure with the server up fails the smoke run, as in CI
                    problems.append(f"postgres, {replicas} replica(s): {exc!r}")
                else:
                    out[f"postgres_{replicas}"] = c.smoke_skipped(f"postgres, {replicas} replica(s)", why)
    base = out["sqlite"]
    out["ratio_vs_sqlite"] = {
        k: {m: c.ratio(out[k].get(m), base.get(m)) for m in ("insert_per_s", "lease_ack_per_s", "results_per_s")}
        for k in ("postgres_1", "postgres_2") if "error" not in out[k] and "skipped_in_smoke" not in out[k]
    }
    c.finish("store", out, args, started)
    for k in ("sqlite", "postgres_1", "postgres_2"):
        r = out[k]
        if "tasks" in r and not (r["leased_once"] and r["results_stored_once"]):
            problems.append(f"{k}: leased once {r['leased_once']}, results stored once {r['results_stored_once']}")
    c.smoke_check(problems)


def _pg_unreachable(url: str) -> str | None:
    """None when a PostgreSQL server answers at ``url``, else why not."""
    try:
        import psycopg

        with psycopg.connect(url, connect_timeout=3):
            return None
    except Exception as exc:
        return f"PostgreSQL not reachable at {url} ({type(exc).__name__}); ./taskw setup starts it"


if __name__ == "__main__":
    main()
