"""Word count (map -> shuffle -> reduce) over 3 agents, each way of moving the shuffle, in one run
(issue 12): bytes between the program and the hub (HTTP, metered in the SDK) and end-to-end time.

Same job every time: 6 maps of 20,000 words (40,000 distinct), 3 reducers, result checked
against a local count. Ways:

- ``through_sdk``: every bucket comes back to the program and goes out again (the baseline);
- ``refs_redis``: buckets in a Redis both agents reach (``tier="shared"``, MESH_REDIS_URL);
- ``refs_hub_store``: buckets in the hub's embedded store (``tier="shared"``, no Redis);
- ``refs_local``: buckets in each producing agent's own store (``tier="auto"``); reducers on
  the same endpoint read them there, the others get them staged through the hub's store;
- ``futures``: reducers get the map Futures as arguments (their agents read the map results,
  lists of local refs, from the hub), submitted before any map finished.

Then locality: 2 local refs of 8 MiB on each agent, one consumer per ref, placed by the
scheduler (``endpoint="auto"``) against forced onto another agent: time, how many ran where
their input lies, and the bytes staged through the hub.

One mesh on loopback (the hub as its own process, Mosquitto, one MQTT and two ZeroMQ agents, 2
workers each) and a redis-server of its own. Writes bench/results/data_tiers.json.

    .venv/bin/python bench/data_tiers.py [--repeats 3] [--smoke]
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
from collections import Counter
from pathlib import Path
from typing import Any, Callable

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != _BENCH]

from cloud_hub.client import Client, Executor, refs  # noqa: E402
from cloud_hub.client import multiprocessing as mesh_mp  # noqa: E402
from cloud_hub.localmesh import LocalMesh  # noqa: E402
from tests.integration.test_multiprocessing import (MAPS, REDUCERS, _buckets, _words, map_plain, reduce_plain,  # noqa: E402
                                                    reduce_ref)
from tests.integration.test_mp_proxies import RedisServer  # noqa: E402


def map_tier(seed: int, store: refs.Store, tier: str) -> list[refs.MeshRef]:
    return [store.put(b, tier=tier) for b in _buckets(seed)]


def make_block(seed: int, store: refs.Store, nbytes: int) -> refs.MeshRef:
    return store.put(bytes([seed % 256]) * nbytes)  # a local ref on the agent that ran this


def digest(block: bytes) -> tuple[int, str]:
    return len(block), os.environ.get("MESH_ENDPOINT_ID", "?")


def locality(m: LocalMesh, store: refs.Store, nbytes: int, per_agent: int) -> dict[str, Any]:
    """Each agent makes ``per_agent`` local refs of ``nbytes``; one consumer task per ref, placed
    by the scheduler (``endpoint="auto"``: the SDK sends where the ref lies) or forced onto the
    next agent (every input staged through the hub). Same refs, one after the other."""
    import redis as redis_lib

    agents = [a.endpoint_id for a in m.agents]
    made: list[refs.MeshRef] = []
    for i, ep in enumerate(agents):
        with Executor(client=Client(m.url, m.token), endpoint=ep, stream=False) as ex:
            made += [f.result(300) for f in [ex.submit(make_block, i * per_agent + j, store, nbytes) for j in range(per_agent)]]
    hub = redis_lib.Redis.from_url(store.url)
    out: dict[str, Any] = {"refs": len(made), "ref_bytes": nbytes}
    for name in ("forced_elsewhere", "scheduler_auto"):
        before = set(hub.keys("mesh:ref:*:staged"))
        t = time.perf_counter()
        execs = {ep: Executor(client=Client(m.url, m.token), endpoint=ep, stream=False) for ep in agents + ["auto"]}
        try:
            futs = []
            for r in made:  # all submitted before any is awaited, both ways
                other = agents[(agents.index(r.meta["endpoint"]) + 1) % len(agents)]
                futs.append((r, execs["auto" if name == "scheduler_auto" else other].submit(digest, r)))
            got = [(r, f.result(300)) for r, f in futs]
        finally:
            for ex in execs.values():
                ex.shutdown(wait=False)
        dt = time.perf_counter() - t
        staged = set(hub.keys("mesh:ref:*:staged")) - before
        out[name] = {"seconds": round(dt, 3), "ran_where_its_input_lies": sum(1 for r, (n, ep) in got if ep == r.meta["endpoint"]),
                     "staged_through_hub": len(staged), "bytes_staged_through_hub": len(staged) * nbytes}
        if name == "scheduler_auto":  # why a consumer went elsewhere: the predictions the scheduler compared
            c = Client(m.url, m.token)
            out[name]["misplaced_decisions"] = [
                {"input_on": r.meta["endpoint"], "ran_on": ep,
                 "compared": [{k: p[k] for k in ("endpoint_id", "total", "transfer_in", "queue", "cold", "run", "outage")}
                              for d in c.scheduler_decisions(task_id=f.task_id)["decisions"] for p in d["compared"]]}  # type: ignore[attr-defined]
                for (r, f), (_, (_, ep)) in zip(futs, got) if ep != r.meta["endpoint"]]
        for k in staged:
            hub.delete(k)  # the second way must stage again if it needs to
    return out


def reduce_futures(maps: list[list[refs.MeshRef]], r: int, store: refs.Store) -> refs.MeshRef:
    """``maps`` arrive as the map tasks' results (lists of refs), read by this agent from the hub."""
    return store.put(reduce_plain([refs.get(m[r]) for m in maps]))


class Metered:
    def __init__(self, m: LocalMesh) -> None:
        self.client = Client(m.url, m.token)
        self.bytes = 0

        def req(r: Any) -> None:
            self.bytes += len(r.content or b"")

        def resp(r: Any) -> None:
            r.read()
            self.bytes += len(r.content or b"")

        self.client._http.event_hooks["request"].append(req)
        self.client._http.event_hooks["response"].append(resp)


def run_sdk(m: LocalMesh, eps: list[str], _store: Any) -> tuple[dict[str, int], int]:
    mt = Metered(m)
    with Executor(client=mt.client, endpoint=eps, stream=False) as ex:
        parts = [f.result(300) for f in [ex.submit(map_plain, s) for s in range(MAPS)]]
        out = [f.result(300) for f in [ex.submit(reduce_plain, [p[r] for p in parts]) for r in range(REDUCERS)]]
    return {k: v for d in out for k, v in d.items()}, mt.bytes


def run_refs(tier: str) -> Callable[[LocalMesh, list[str], refs.Store], tuple[dict[str, int], int]]:
    def run(m: LocalMesh, eps: list[str], store: refs.Store) -> tuple[dict[str, int], int]:
        mt = Metered(m)
        with Executor(client=mt.client, endpoint=eps, stream=False) as ex:
            parts = [f.result(300) for f in [ex.submit(map_tier, s, store, tier) for s in range(MAPS)]]
            outs = [f.result(300) for f in [ex.submit(reduce_ref, [p[r] for p in parts], store) for r in range(REDUCERS)]]
        sdk = mt.bytes
        return {k: v for o in outs for k, v in refs.get(o).items()}, sdk

    return run


def run_futures(m: LocalMesh, eps: list[str], store: refs.Store) -> tuple[dict[str, int], int]:
    mt = Metered(m)
    with Executor(client=mt.client, endpoint=eps, stream=False) as ex:
        maps = [ex.submit(map_tier, s, store, "auto") for s in range(MAPS)]
        outs = [f.result(300) for f in [ex.submit(reduce_futures, maps, r, store) for r in range(REDUCERS)]]
    sdk = mt.bytes
    return {k: v for o in outs for k, v in refs.get(o).items()}, sdk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="every way once and the locality check with 256 KiB refs, 1 per agent; prints the JSON, writes nothing "
                         "under bench/results/")
    opts = ap.parse_args()
    ref_bytes, refs_per_agent = 8 << 20, 2
    if opts.smoke:
        opts.repeats, ref_bytes, refs_per_agent = 1, 256 << 10, 1
    expected = dict(Counter(w for s in range(MAPS) for w in _words(s)))
    out: dict[str, Any] = {"bench": "data_tiers", "smoke": opts.smoke, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                                       "loadavg_at_start": os.getloadavg()},
                           "setup": "loopback: hub process, Mosquitto, 1 MQTT + 2 ZeroMQ agents x 2 workers, own redis-server; "
                                    f"{MAPS} maps x 20,000 words, {REDUCERS} reducers; median of {opts.repeats} runs each",
                           "ways": {}}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        m = LocalMesh(Path(tmp) / "mesh", heartbeat_s=1.0, hub_process=True)
        try:
            m.start()  # inside: a start that fails half way (a port taken meanwhile) still stops what it started
            m.add_agent("wc-mqtt", "mqtt", workers=2)
            m.add_agent("wc-zmq", "zmq", workers=2)
            m.add_agent("wc-zmq2", "zmq", workers=2)
            m.wait_online(timeout=90)
            mesh_mp.config(client=Client(m.url, m.token))
            hub_url = str(Client(m.url, m.token).request("GET", "/v1/kv")["url"])
            eps = [a.endpoint_id for a in m.agents]
            ways: list[tuple[str, Callable[..., Any], str]] = [
                ("through_sdk", run_sdk, hub_url), ("refs_redis", run_refs("shared"), redis.url),
                ("refs_hub_store", run_refs("shared"), hub_url), ("refs_local", run_refs("auto"), hub_url),
                ("futures", run_futures, hub_url)]
            for rep in range(opts.repeats):  # interleaved, so load changes hit every way alike
                for name, fn, url in ways:
                    t = time.perf_counter()
                    got, sdk_bytes = fn(m, eps, refs.Store(url))
                    dt = time.perf_counter() - t
                    assert got == expected, f"{name}: wrong word count"
                    w = out["ways"].setdefault(name, {"end_to_end_s": [], "sdk_http_bytes": []})
                    w["end_to_end_s"].append(round(dt, 3))
                    w["sdk_http_bytes"].append(sdk_bytes)
            import redis as redis_lib

            hub = redis_lib.Redis.from_url(hub_url)
            out["staged_copies_in_hub_store"] = len(hub.keys("mesh:ref:*:staged"))
            out["locality_8MiB_inputs" if not opts.smoke else "locality_smoke_256KiB_inputs"] = locality(
                m, refs.Store(hub_url), ref_bytes, refs_per_agent)
            out["agent_local_store_bytes_on_disk"] = {
                a.cfg.name: sum(p.stat().st_size for p in Path(a.cfg.data_dir).glob("refs.sqlite3*")) for a in m.agents}
        finally:
            mesh_mp._runner.shutdown_executor()
            m.stop()
            redis.stop()
    base = out["ways"]["through_sdk"]
    for name, w in out["ways"].items():
        w["median_s"] = statistics.median(w["end_to_end_s"])
        w["median_sdk_bytes"] = int(statistics.median(w["sdk_http_bytes"]))
        w["sdk_bytes_vs_baseline"] = round(w["median_sdk_bytes"] / max(1, statistics.median(base["sdk_http_bytes"])), 4)
        w["time_vs_baseline"] = round(w["median_s"] / statistics.median(base["end_to_end_s"]), 2)
    out["loadavg_at_end"] = os.getloadavg()
    text = json.dumps(out, indent=2)
    print(text)
    if opts.smoke:
        return
    (_BENCH / "results").mkdir(exist_ok=True)
    (_BENCH / "results" / "data_tiers.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
