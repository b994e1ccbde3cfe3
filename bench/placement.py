"""What placing at submit costs the hub: ``endpoint="auto"`` against a concrete endpoint id.

The real ``PlacementService`` and ``SqliteStore`` (a temporary file, ``synchronous=FULL``)
without HTTP: for a batch of tasks it times

* ``place``: the scheduler's list-scheduled placement of the whole batch plus building the
  decision rows (JSON with the predictions compared);
* the insert transaction with the decision rows, against the same insert without them (what a
  concrete endpoint id costs).

Endpoints are enrolled through the store and come online through the dispatcher's hello hook;
the function is profiled on each first, so the predictions are the steady-state kind. Rounds
alternate between the two modes so that background load hits both alike. One JSON object goes
to stdout and to bench/results/placement-<UTC>.json.

    python bench/placement.py [--quick] [--smoke] [--fleets 10:0,200:0,200:4,1000:4] [--batch 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import _common as c


from cloud_hub.service.schemas import TaskIn  # noqa: E402
from cloud_hub.config import HubConfig  # noqa: E402
from cloud_hub.placement import PlacementService  # noqa: E402
from cloud_hub.store import SqliteStore  # noqa: E402
from mesh_agent.protocol import function_id, serialize, serialize_function  # noqa: E402


def noop() -> None:
    return None


async def one_fleet(n_endpoints: int, batch: int, rounds: int, workdir: Path, classes: int = 0) -> dict:
    store = await SqliteStore(workdir / f"hub-{n_endpoints}-{classes}.sqlite3").open()
    try:
        user = await store.create_user("bench")
        tok = await store.create_enroll_token(user, 3600, n_endpoints)
        eids = [(await store.enroll_endpoint(tok, f"ep{i}", "mqtt", b"k" * 32))["id"] for i in range(n_endpoints)]  # type: ignore[index]
        body = serialize_function(noop)
        fid = function_id(body)
        await store.put_function(user, fid, body, "noop")
        svc = PlacementService(HubConfig(db_path=workdir / "unused.sqlite3"), store)
        await svc.start()
        now = time.time()
        for i, e in enumerate(eids):  # mixed capacities; `classes` declared hardware classes, or none
            info = {"capacity": (1, 2, 4, 8)[i % 4], "tags": ["bench"], "hardware": f"hw{i % classes}" if classes else None,
                    "memory_mb": 4096}
            svc.endpoint_online(e, now, info)
            for k in range(4):  # profile the function there
                svc.sched.task_completed(f"learn-{e}-{k}", now, 0.05 * (1 + i % 3), endpoint_id=e, function_id=fid)
        args = base64.b64encode(serialize(((), {}))).decode()
        tasks = [TaskIn(endpoint_id="auto", function_id=fid, args=args) for _ in range(batch)]

        def rows(endpoint: str | None) -> list[dict]:
            t = time.time()
            return [{"id": uuid.uuid4().hex, "user_id": user, "endpoint_id": endpoint, "function_id": fid, "args": b"json\n[[],{}]",
                     "created": t, "expires": t + 3600, "timeout": None} for _ in range(batch)]

        place_s, place_cpu_s, insert_auto_s, insert_concrete_s, evaluated = [], [], [], [], []
        for _ in range(rounds):
            r = rows(eids[0])
            t0 = time.perf_counter()
            await store.insert_tasks(r)
            insert_concrete_s.append(time.perf_counter() - t0)

            r = rows(None)
            t0, c0 = time.perf_counter(), time.process_time()
            decisions = await svc.place(user, tasks, r, time.time())
            t1, c1 = time.perf_counter(), time.process_time()
            place_cpu_s.append(c1 - c0)
            await store.insert_tasks(r, also=svc.writer(decisions))
            t2 = time.perf_counter()
            place_s.append(t1 - t0)
            insert_auto_s.append(t2 - t1)
            evaluated.append(len({row["endpoint_id"] for row in r}))
            svc.sched.retract(row["id"] for row in r)  # same conditions for the next round
        await svc.stop()
        med = statistics.median
        return {
            "endpoints": n_endpoints,
            "hardware_classes": classes or "none (each endpoint profiled on its own)",
            "batch": batch,
            "rounds": rounds,
            "place_ms_median": round(med(place_s) * 1e3, 2),
            "place_us_per_task": round(med(place_s) / batch * 1e6, 1),
            # CPU time of this process: on a shared machine wall time also counts other work
            "place_cpu_us_per_task": round(med(place_cpu_s) / batch * 1e6, 1),
            "insert_ms_concrete_median": round(med(insert_concrete_s) * 1e3, 2),
            "insert_ms_with_decisions_median": round(med(insert_auto_s) * 1e3, 2),
            "decision_rows_us_per_task": round((med(insert_auto_s) - med(insert_concrete_s)) / batch * 1e6, 1),
            "endpoints_used_per_batch": evaluated[-1],
        }
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fleets", default="10:0,200:0,200:4,1000:4",
                    help="endpoints:declared hardware classes (0 = none), comma-separated")
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--workdir", default=None)
    c.add_smoke_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.rounds = 500, 2
    if c.smoke(args):
        args.fleets, args.batch, args.rounds = "10:0,20:2", 50, 2
    started = time.monotonic()
    out = c.header("placement", args)
    fleets = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        for spec in args.fleets.split(","):
            n, k = (int(x) for x in spec.split(":"))
            c.log(f"{n} endpoints, {k or 'no'} hardware classes, batches of {args.batch}")
            fleets.append(asyncio.run(one_fleet(n, args.batch, args.rounds, Path(d), k)))
    out["fleets"] = fleets
    c.finish("placement", out, args, started)


if __name__ == "__main__":
    main()
