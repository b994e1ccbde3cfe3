"""Warm round-trip latency: SDK -> hub -> agent -> hub -> SDK, per transport, next to its floors.

For each transport (MQTT, ZeroMQ) a LocalMesh (real Mosquitto, hub thread, one agent process
with 2 workers) runs ``Executor.submit(noop).result()`` sequentially. Measured in the same run:

* raw Mosquitto QoS 1 echo (two paho clients with TCP_NODELAY, against the MQTT mesh's broker);
* raw ZeroMQ ROUTER/DEALER echo;
* Parsl HighThroughputExecutor, 2 local workers, ``noop().result()`` through the DFK.

All systems are started first, warmed up, then timed in rounds that rotate through them, so
background load that drifts during the run (2-core machine, other jobs) hits them alike.

The mesh is timed twice: through the SDK's stream (the default, one WebSocket to the hub) and
through REST (``Executor(stream=False)``), so the stream's gain is measured in the same run, and a
third time with ``Executor(early_results=True)`` (results before the hub's own commit).

Target (issue 13): mesh warm p50 <= 2x Parsl HTEX's p50. One JSON object goes to stdout and to
bench/results/latency-<UTC>.json; progress goes to stderr.

    python bench/latency.py [--samples 300] [--warmup 30] [--rounds 10] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import _common as c

TARGET_RATIO = 2.0  # mesh p50 <= 2x Parsl HTEX p50 (issue 13)
BUDGET_S = 120.0  # time cap for all timed samples together
FLOOR_OF = {"mqtt": "mqtt_qos1_echo", "zmq": "zmq_router_dealer_echo"}


def noop() -> None:
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300, help="timed round trips per system (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed round trips per system first (default 30)")
    p.add_argument("--rounds", type=int, default=10, help="blocks the samples are split into, rotating systems (default 10)")
    p.add_argument("--tasks", type=int, default=None, help="alias of --samples, for symmetry with throughput.py")
    c.add_common_args(p)
    args = p.parse_args()
    if args.tasks is not None:
        args.samples = args.tasks
    if args.quick:
        args.samples, args.warmup, args.rounds = min(args.samples, 30), min(args.warmup, 5), min(args.rounds, 3)
    if c.smoke(args):
        args.samples, args.warmup, args.rounds = min(args.samples, 5), min(args.warmup, 2), 1
    started = time.monotonic()
    out = c.header("latency", args)
    transports = [t for t in args.transports.split(",") if t]

    with contextlib.ExitStack() as stack:
        from cloud_hub.client import Executor

        systems = {}
        for t in transports:
            c.log(f"starting LocalMesh with one {t} agent (2 workers)")
            mesh, agent = stack.enter_context(c.local_mesh(t, workers=2, workdir=args.workdir))
            ex = stack.enter_context(Executor(mesh.client, agent.endpoint_id))
            if ex._stream is None:
                raise RuntimeError("the hub offers no stream: the mesh would be timed over REST twice")
            systems[f"mesh_{t}"] = lambda ex=ex: ex.submit(noop).result(timeout=30)
            rest = stack.enter_context(Executor(mesh.client, agent.endpoint_id, stream=False))
            systems[f"mesh_{t}_rest"] = lambda ex=rest: ex.submit(noop).result(timeout=30)
            early = stack.enter_context(Executor(mesh.client, agent.endpoint_id, early_results=True))
            systems[f"mesh_{t}_early"] = lambda ex=early: ex.submit(noop).result(timeout=30)
            if t == "mqtt":
                # The mesh's broker admits only enrolled endpoints (per-endpoint logins, ACLs): the raw
                # floor runs on a second Mosquitto with the same tuning and anonymous access.
                import tempfile

                from cloud_hub.broker import MosquittoBroker

                floor = stack.enter_context(MosquittoBroker(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "floor-broker"))
                systems["mqtt_qos1_echo"] = stack.enter_context(c.mqtt_echo(floor.host, floor.port))
        systems["zmq_router_dealer_echo"] = stack.enter_context(c.zmq_echo())
        if not args.no_parsl:
            c.log("starting Parsl HTEX (2 local workers)")
            app = stack.enter_context(c.parsl_htex(2))(noop)
            app().result(timeout=120)  # the first task waits for the worker pool to start
            systems["parsl_htex"] = lambda: app().result(timeout=30)
        c.log(f"timing {args.samples} sequential round trips each ({', '.join(systems)}), {args.rounds} rounds")
        stats = c.interleaved_rtt(systems, samples=args.samples, warmup=args.warmup, rounds=args.rounds, budget_s=BUDGET_S)
        c.log("stopping")

    parsl = stats.get("parsl_htex")
    if parsl is not None:
        parsl["settings"] = c.PARSL_SETTINGS
    out["mesh"] = {t: {**stats[f"mesh_{t}"], "agent": {"transport": t, "workers": 2}, "sdk_link": "stream"} for t in transports}
    out["mesh_rest"] = {t: {**stats[f"mesh_{t}_rest"], "agent": {"transport": t, "workers": 2}, "sdk_link": "rest"} for t in transports}
    out["mesh_early"] = {t: {**stats[f"mesh_{t}_early"], "agent": {"transport": t, "workers": 2}, "sdk_link": "stream, early_results"}
                         for t in transports}
    out["floors"] = {k: stats[k] for k in ("mqtt_qos1_echo", "zmq_router_dealer_echo") if k in stats}
    out["parsl_htex"] = parsl
    targets = {}
    for t in transports:
        m = stats[f"mesh_{t}"]
        r = c.ratio(m.get("p50_ms"), (parsl or {}).get("p50_ms"))
        targets[t] = {
            "target": f"mesh p50 <= {TARGET_RATIO:g}x Parsl HTEX p50",
            "mesh_p50_ms": m.get("p50_ms"),
            "parsl_p50_ms": (parsl or {}).get("p50_ms"),
            "ratio_vs_parsl": r,
            "met": None if r is None else r <= TARGET_RATIO,
            "ratio_vs_raw_floor": c.ratio(m.get("p50_ms"), stats.get(FLOOR_OF[t], {}).get("p50_ms")),
            "rest_p50_ms": stats[f"mesh_{t}_rest"].get("p50_ms"),
            "rest_ratio_vs_parsl": c.ratio(stats[f"mesh_{t}_rest"].get("p50_ms"), (parsl or {}).get("p50_ms")),
            "early_p50_ms": stats[f"mesh_{t}_early"].get("p50_ms"),
            "early_ratio_vs_parsl": c.ratio(stats[f"mesh_{t}_early"].get("p50_ms"), (parsl or {}).get("p50_ms")),
        }
    out["targets"] = targets
    c.finish("latency", out, args, started)


if __name__ == "__main__":
    main()
