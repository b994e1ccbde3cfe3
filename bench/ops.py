"""What operating a hub costs: online backup, restore, and structured log lines.

1. Backup and restore of a SQLite hub database holding N finished tasks (real SqliteStore,
   cloud_hub/backup.py): seconds and bytes, against ``cp`` of the same file in the same run as the
   baseline (a copy that is not safe while the hub runs, but is the floor for moving the bytes).
2. The hub's writes while a backup runs: commit latency (one durable transaction of 50 results, as
   the dispatcher stores them) with and without a backup reading the database at the same time.
3. Log lines: bytes per line, text against JSON, for the lines an agent writes most (SD card
   writes on a Pi), formatted by mesh_agent/_logs.py.

Prints one JSON object and writes it to bench/results/ops-<UTC>.json.

    python bench/ops.py [--quick] [--smoke] [--tasks 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import _common as c

FID = "f" * 64


async def _fill(path: Path, n: int) -> None:
    from cloud_hub.store import SqliteStore

    store = await SqliteStore(path).open()
    try:
        uid = await store.create_user("bench")
        await store.put_function(uid, FID, b"x" * 200, "noop")
        tok = await store.create_enroll_token(uid, 60, 1)
        ep = (await store.enroll_endpoint(tok, "bench-ep", "mqtt", b"k" * 32))["id"]
        now = time.time()
        for start in range(0, n, 5000):
            rows = [{"id": uuid.uuid4().hex, "user_id": uid, "endpoint_id": ep, "function_id": FID, "args": b"a" * 64,
                     "created": now, "expires": now + 3600, "timeout": None} for _ in range(start, min(n, start + 5000))]
            await store.insert_tasks(rows)
            await store.store_results(ep, [{"id": r["id"], "ok": True, "data": b"r" * 200, "started": now, "finished": now, "pid": 1}
                                           for r in rows])
    finally:
        await store.close()


def _commit_latencies(db_path: Path, stop: threading.Event, out: list[float], limit_s: float) -> None:
    """A second writer standing in for the hub: durable transactions of 50 result rows."""
    import sqlite3

    db = sqlite3.connect(db_path, isolation_level=None, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    deadline = time.monotonic() + limit_s
    try:
        while not stop.is_set() and time.monotonic() < deadline and len(out) < 100_000:
            t0 = time.perf_counter()
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO results (task_id, user_id, ok, data, received) VALUES (?, 'bench', 1, ?, 0)",
                           [(uuid.uuid4().hex, b"r" * 200) for _ in range(50)])
            db.execute("COMMIT")
            out.append(time.perf_counter() - t0)
    finally:
        db.close()


def _writer_during(db_path: Path, seconds: float, during: Any = None) -> dict[str, Any]:
    samples: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_commit_latencies, args=(db_path, stop, samples, seconds + 120), daemon=True)
    t.start()
    t0 = time.monotonic()
    extra = during() if during is not None else None
    while time.monotonic() - t0 < seconds:
        time.sleep(0.05)
    stop.set()
    t.join(60)
    s = sorted(samples)
    return {"commits": len(s), "p50_ms": round(c.percentile(s, 50) * 1000, 2) if s else None,
            "p99_ms": round(c.percentile(s, 99) * 1000, 2) if s else None, "max_ms": round(s[-1] * 1000, 2) if s else None,
            **({"during": extra} if extra else {})}


def _log_bytes() -> dict[str, Any]:
    from mesh_agent._logs import setup_logging

    lines = [
        ("mesh_agent.agent", logging.INFO, "online: %s via %s to %s (hub %s)", ("ep-0123456789ab", "mqtt", "mqtts://hub.example.org:8883",
                                                                                 "https://hub.example.org:8700"), {}),
        ("mesh_agent.transport.mqtt", logging.WARNING, "link down (%s); retrying in %.1fs", ("connection refused", 4.2), {}),
        ("mesh_agent.engine.local", logging.WARNING, "task %s: %s", ("9f1c2e3d4b5a69788796a5b4c3d2e1f0", "task exceeded its 30 s timeout; "
                                                                      "worker 4242 was killed"),
         {"task_id": "9f1c2e3d4b5a69788796a5b4c3d2e1f0", "function_id": FID}),
    ]
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out: dict[str, Any] = {}
    try:
        for fmt in ("text", "json"):
            sizes = []
            for name, level, msg, args, extra in lines:
                buf = io.StringIO()
                setup_logging("INFO", stream=buf, fmt=fmt, fields={"endpoint_id": "ep-0123456789ab"})
                logging.getLogger(name).log(level, msg, *args, extra=extra)
                sizes.append(len(buf.getvalue().encode()))
            out[fmt] = {"bytes_per_line": sizes, "mean": round(sum(sizes) / len(sizes))}
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    out["json_over_text"] = round(out["json"]["mean"] / out["text"]["mean"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="10,000 tasks, 2 s writer windows")
    c.add_smoke_arg(ap)
    args = ap.parse_args()
    n = 10_000 if args.quick else max(1000, min(args.tasks, 2_000_000))
    window = 2.0 if args.quick else 5.0
    # the full run keeps its files beside bench/ (on disk, as a hub's would be); a smoke run leaves bench/ alone
    tmp_parent: str | None = str(c.RESULTS_DIR.parent)
    if c.smoke(args):
        n, window, tmp_parent = 1000, 0.5, None
    from cloud_hub.backup import backup_sqlite, restore_sqlite

    out: dict[str, Any] = {"bench": "ops", "smoke": args.smoke, "machine": c.machine_info(), "load_before": c.loadavg(), "tasks": n}
    with tempfile.TemporaryDirectory(dir=tmp_parent) as d:
        tmp = Path(d)
        db = tmp / "hub.sqlite3"
        c.log(f"filling a hub database with {n} finished tasks")
        asyncio.run(_fill(db, n))
        size = db.stat().st_size
        t0 = time.perf_counter()
        shutil.copyfile(db, tmp / "copy.sqlite3")
        subprocess.run(["sync"], check=False, timeout=120)
        cp_s = time.perf_counter() - t0
        info = backup_sqlite(db, tmp / "backup.sqlite3")
        t0 = time.perf_counter()
        report = restore_sqlite(tmp / "backup.sqlite3", tmp / "restored.sqlite3")
        restore_s = time.perf_counter() - t0
        out["backup"] = {"db_bytes": size, "backup_bytes": info.bytes, "backup_s": round(info.seconds, 3), "restore_s": round(restore_s, 3),
                         "baseline_cp_and_sync_s": round(cp_s, 3), "backup_over_cp": round(info.seconds / cp_s, 2) if cp_s else None,
                         "restored_tasks": report.backup.tasks}
        c.log("hub-like writer alone, then with a backup running")
        alone = _writer_during(db, window)
        backups: list[float] = []

        def backup_loop() -> dict[str, Any]:
            def run() -> None:
                t_end = time.monotonic() + window
                i = 0
                while time.monotonic() < t_end and i < 50:
                    target = tmp / f"b{i}.sqlite3"
                    backups.append(backup_sqlite(db, target).seconds)
                    target.unlink()
                    i += 1

            threading.Thread(target=run, daemon=True).start()
            return {}

        during = _writer_during(db, window, backup_loop)
        time.sleep(0.5)
        out["writer"] = {"alone": alone, "during_backups": {**during, "backups": len(backups),
                                                            "backup_s_mean": round(sum(backups) / len(backups), 3) if backups else None}}
        if alone["p50_ms"] and during["p50_ms"]:
            out["writer"]["p50_ratio"] = round(during["p50_ms"] / alone["p50_ms"], 2)
        out["fsync_ms"] = c.fsync_latency_ms(d)
    out["logs"] = _log_bytes()
    out["load_after"] = c.loadavg()
    c.write_result("ops", out)  # prints the JSON object too


if __name__ == "__main__":
    main()
