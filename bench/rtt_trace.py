"""Per-hop trace of the warm round trip: where the milliseconds of one ``submit(noop).result()`` go.

A LocalMesh per transport (real Mosquitto, hub as its own process, one agent process with 2
workers). ``N`` sequential no-op round trips through the SDK's stream and ``N`` through REST
(``Executor(stream=False)``), interleaved in rounds. Each step is the difference between two
wall-clock timestamps (one machine, one clock): the SDK's, the hub's task row (``created``,
``dispatched``, ``acked``) and result row (``received``), the agent's result (``started``,
``finished``). The p50 of each step goes out as JSON (stdout and bench/results/rtt_trace-<UTC>.json).

    python bench/rtt_trace.py [--samples 150] [--transports zmq,mqtt] [--smoke]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import time
from typing import Any

import _common as c

STEPS = [
    ("sdk_submit_to_task_row", "t0", "created", "SDK submit() -> hub has validated and placed it (task row's created)"),
    ("task_commit_and_dispatch", "created", "dispatched", "insert + commit, dispatcher leases (commit) and sends"),
    ("dispatch_to_agent_start", "dispatched", "started", "transport, agent stores the task (commit), worker starts"),
    ("run", "started", "finished", "worker runs noop"),
    ("finished_to_hub_stored", "finished", "received", "agent stores the result (commit), sends; hub receives it"),
    ("hub_stored_to_sdk", "received", "t1", "hub commits the result, wakes the stream/long poll, SDK completes the future"),
]


def noop() -> None:
    return None


def trace(mesh: Any, ex: Any, n: int, budget_s: float) -> list[dict[str, float]]:
    marks: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        m: dict[str, Any] = {}
        m["t0"] = time.time()
        f = ex.submit(noop)
        f.add_done_callback(lambda _f, m=m: m.__setitem__("t1", time.time()))
        f.result(timeout=30)
        while "t1" not in m:  # the callback runs right after the result is set, on the reader thread
            time.sleep(0.0001)
        m["task_id"] = f.task_id  # type: ignore[attr-defined]
        marks.append(m)
    with sqlite3.connect(mesh.hub_cfg.db_path, timeout=30) as db:
        for m in marks:
            row = db.execute("SELECT t.created, t.dispatched, t.acked, r.started, r.finished, r.received FROM tasks t "
                             "JOIN results r ON r.task_id = t.id WHERE t.id=?", (m["task_id"],)).fetchone()
            if row is not None:
                m.update(zip(("created", "dispatched", "acked", "started", "finished", "received"), row))
    return [m for m in marks if "received" in m]


def summarize(marks: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": len(marks)}
    for name, a, b, _ in STEPS:
        vals = [(m[b] - m[a]) * 1e3 for m in marks if m.get(a) is not None and m.get(b) is not None]
        out[name + "_ms"] = round(statistics.median(vals), 3) if vals else None
    tot = [(m["t1"] - m["t0"]) * 1e3 for m in marks]
    out["total_p50_ms"] = round(statistics.median(tot), 3) if tot else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=150, help="round trips per path (default 150)")
    p.add_argument("--rounds", type=int, default=5)
    c.add_common_args(p)
    args = p.parse_args()
    warmup = 20  # untimed round trips per path first
    if args.quick:
        args.samples, args.rounds = min(args.samples, 30), min(args.rounds, 2)
    if c.smoke(args):
        args.samples, args.rounds, warmup = min(args.samples, 3), 1, 2
    started = time.monotonic()
    out = c.header("rtt_trace", args)
    out["steps"] = {name: what for name, _, _, what in STEPS}
    from cloud_hub.client import Executor

    for t in [t for t in args.transports.split(",") if t]:
        c.log(f"starting LocalMesh with one {t} agent (2 workers)")
        with c.local_mesh(t, workers=2, workdir=args.workdir) as (mesh, agent):
            with Executor(mesh.client, agent.endpoint_id) as streamed, Executor(mesh.client, agent.endpoint_id, stream=False) as rest, \
                    Executor(mesh.client, agent.endpoint_id, early_results=True) as early:
                paths = (("stream", streamed), ("rest", rest), ("stream_early", early))
                for _, ex in paths:
                    for _ in range(warmup):
                        ex.submit(noop).result(timeout=30)
                got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in paths}
                per = max(1, args.samples // args.rounds)
                for _ in range(args.rounds):
                    for name, ex in paths:
                        got[name] += trace(mesh, ex, per, 60.0)
                out[t] = {name: summarize(marks) for name, marks in got.items()}
                out[t]["stream_connected"] = streamed._stream is not None and streamed._stream.connected
    c.finish("rtt_trace", out, args, started)
    c.smoke_check([f"{t} {name}: {r['samples']} traced round trips" for t in args.transports.split(",") if t
                   for name, r in out[t].items() if isinstance(r, dict) and not r["samples"]])


if __name__ == "__main__":
    main()
