"""Promise 6 (issue 30): ``bench/hotpath.py --smoke`` runs and prints JSON with per-stage CPU rows
for the hub and the agent; with ``MESH_COST_LEDGER`` unset no ledger file is written anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_hub.client import Executor

from ._mesh import REPO, mesh

DB_STAGES = {"db.insert_tasks", "db.lease", "db.store_results"}


def _run_smoke(*extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MESH_COST_LEDGER"}
    before = set((REPO / "bench" / "results").glob("*")) if (REPO / "bench" / "results").exists() else set()
    out = subprocess.run([sys.executable, "bench/hotpath.py", "--smoke", *extra], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    after = set((REPO / "bench" / "results").glob("*")) if (REPO / "bench" / "results").exists() else set()
    assert after == before, f"--smoke wrote {after - before}"
    return json.loads(out.stdout)


def _check_mesh_rows(doc: dict, transport: str) -> list[str]:
    notes = []
    mesh_part = doc["mesh"][transport]
    for phase in ("batched", "sequential"):
        p = mesh_part[phase]
        assert p["completed"] == p["tasks"] and p["failed"] == 0, (transport, phase, p["tasks"], p["completed"], p["failed"])
        hub, agent = p["hub"]["stages"], p["agent"]["stages"]
        assert DB_STAGES <= set(hub), (transport, phase, sorted(hub))
        assert any(k.startswith("hub.") for k in hub), sorted(hub)
        assert agent and all(k.startswith("agent.") for k in agent), sorted(agent)
        for who in ("hub", "agent"):
            for name, row in p[who]["stages"].items():
                assert row["us_per_task"] >= 0 and row["blocks"] >= 1, (who, name, row)
            for th, row in p[who].get("threads", {}).items():
                if row.get("unaccounted_us_per_task", 0) < 0:
                    notes.append(f"{transport}/{phase}/{who}/{th}: unaccounted {row['unaccounted_us_per_task']} us/task < 0")
    seq = mesh_part["sequential"]
    n = seq["tasks"]
    blocks = {k: seq["hub"]["stages"][k]["blocks"] for k in DB_STAGES}
    # "a sequential round trip costs 3 transactions (insert, lease, results)": one of each per task
    assert all(b <= n * 1.2 + 1 for b in blocks.values()), (transport, n, blocks)
    return notes


@pytest.mark.timeout(200)
def test_hotpath_smoke_prints_per_stage_rows_for_both_transports():
    notes = []
    doc = _run_smoke()
    assert doc.get("smoke") is True
    for t in doc["mesh"]:
        notes += _check_mesh_rows(doc, t)
    doc2 = _run_smoke("--transports", "zmq")
    assert "zmq" in doc2["mesh"], list(doc2["mesh"])
    notes += _check_mesh_rows(doc2, "zmq")
    print("transports in the default --smoke:", list(doc["mesh"]), "notes:", notes)


def _ledger_like(roots: list[Path], pids: set[int], since: float) -> list[Path]:
    names = {f"{role}-{pid}.json" for pid in pids for role in ("hub", "agent")}
    found = []
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".venv", ".git", "node_modules", "proc")]
            if dirpath.count(os.sep) - str(root).count(os.sep) > 6:
                dirnames[:] = []
            for f in filenames:
                if f in names:
                    p = Path(dirpath) / f
                    try:
                        if p.stat().st_mtime >= since - 1:
                            found.append(p)
                    except OSError:
                        pass
    return found


@pytest.mark.timeout(90)
def test_no_ledger_files_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("MESH_COST_LEDGER", raising=False)
    since = time.time()
    with mesh(tmp_path) as m:
        za = m.add_agent("z", "zmq", workers=3, prefetch=1)
        mq = m.add_agent("q", "mqtt", workers=2, prefetch=1)
        m.wait_online(za, mq)
        for a in (za, mq):
            with Executor(m.client, endpoint=a.endpoint_id) as ex:
                assert sum(f.result(timeout=30) for f in [ex.submit(abs, -i) for i in range(300)]) == sum(range(300))
                for i in range(10):
                    ex.submit(abs, -i).result(timeout=10)
        time.sleep(1.5)  # the ledger writer's period is 0.5 s
        pids = {m._hub_proc.pid, za.proc.pid, mq.proc.pid}  # type: ignore[union-attr]
        roots = [tmp_path, REPO, Path("/tmp"), Path.home(), Path(os.getcwd())]
        found = _ledger_like(roots, pids, since)
        assert not found, f"ledger files written without MESH_COST_LEDGER: {found}"
