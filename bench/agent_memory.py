"""Agent process-tree RSS, idle and while one worker runs a task, for two versions of the agent code
in the same run (e.g. the last commit before a change and the working tree).

Why a separate script from bench/footprint.py: that one measures everything a field device costs
(minutes of idle traffic); this one answers only "did the agent get smaller", quickly, with both
versions measured side by side on the same machine load, the same hub and the same config.

Each version is an exported source tree put first on the agent's PYTHONPATH (``--rev`` takes a git
revision and exports its ``mesh_agent/`` with ``git archive``; the working tree is ``.``). One hub
(in-process), one real Mosquitto, one agent (MQTT, 1 worker, profile metered: workers on demand,
so an idle agent has no worker). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, bench/ comes first on sys.path, where bench/multiprocessing.py would shadow the
# standard library's and bench/scheduler.py the `scheduler` package: the repository root instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if (Path(p).resolve() if p else Path.cwd()) != ROOT / "bench"]


def hold(seconds: float) -> None:
    import time as _t

    _t.sleep(seconds)


def tree_rss(pid: int) -> dict[str, Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"rss_mb": 0.0, "processes": []}
    total, rows = 0, []
    for p in procs:
        try:
            rss = p.memory_info().rss
            total += rss
            rows.append({"pid": p.pid, "cmd": " ".join(p.cmdline()[1:4])[:70], "rss_mb": round(rss / 2**20, 1)})
        except psutil.NoSuchProcess:
            continue
    return {"rss_mb": round(total / 2**20, 1), "processes": rows}


def export_rev(rev: str, dest: Path) -> Path:
    """``mesh_agent/`` of ``rev`` in ``dest`` (git archive), or the working tree for ``.``."""
    if rev == ".":
        return ROOT
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "mesh_agent"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def measure(mesh: Any, agent: Any, tree: Path, settle_s: float, busy_s: float = 3.0) -> dict[str, Any]:
    from cloud_hub.client import Executor

    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    with open(agent.log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(agent.config_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(tree))
    try:
        mesh.wait_online(agent, timeout=60)
        time.sleep(settle_s)
        idle = tree_rss(proc.pid)
        with Executor(mesh.client, agent.endpoint_id) as ex:
            fut = ex.submit(hold, busy_s)
            peak: dict[str, Any] = {"rss_mb": 0.0}
            deadline = time.monotonic() + 60
            while not fut.done() and time.monotonic() < deadline:
                m = tree_rss(proc.pid)
                if m["rss_mb"] > peak["rss_mb"]:
                    peak = m
                time.sleep(0.05)
            fut.result(timeout=60)
        return {"idle": idle, "busy_peak": peak}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        mesh.wait_online(agent, timeout=60, online=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", action="append", default=None,
                   help="git revision whose mesh_agent/ to measure, or '.' for the working tree (repeatable; default: HEAD and .)")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait after online before sampling idle RSS (default 3)")
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds: both versions, 0.2 s settle, a 0.5 s busy task; prints the JSON (it writes no file anyway)")
    args = p.parse_args()
    revs = args.rev or ["HEAD", "."]
    busy_s = 3.0
    if args.smoke:
        args.settle_s, busy_s = min(args.settle_s, 0.2), 0.5

    from cloud_hub.localmesh import LocalMesh

    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-memory-"))
    out: dict[str, Any] = {"bench": "agent_memory", "smoke": args.smoke, "targets_mb": {"idle": 40.0, "busy": 60.0}, "runs": {}}
    with LocalMesh(tmp / "mesh") as mesh:
        agent = mesh.add_agent("mem", "mqtt", workers=1, start=False, profile="metered")
        # Settings left at their defaults are left out, so an older tree (whose model may lack a
        # newer field, e.g. mqtt.hosts) reads the same config with its own defaults.
        import yaml

        agent.config_path.write_text(yaml.safe_dump(json.loads(agent.cfg.model_dump_json(exclude_defaults=True)), sort_keys=False))
        for rev in revs:
            tree = export_rev(rev, tmp / "trees" / rev.replace("/", "_"))
            r = measure(mesh, agent, tree, args.settle_s, busy_s)
            out["runs"][rev] = {"idle_rss_mb": r["idle"]["rss_mb"], "busy_rss_mb": r["busy_peak"]["rss_mb"],
                                "idle": r["idle"]["processes"], "busy": r["busy_peak"]["processes"]}
            print(f"{rev}: idle {r['idle']['rss_mb']} MB, busy {r['busy_peak']['rss_mb']} MB", file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
