"""Outsider checks of issue 27 (the scheduler under load), written from docs/scheduler.md and
README.md only, against a real LocalMesh: Mosquitto, an in-process hub (SQLite), three
``mesh-agent start`` processes of 1 / 2 / 3 workers (MQTT, ZeroMQ, MQTT).

Scenario (``measure.run_scenario``, smaller than the timed one): a flood of no-op tasks NAMED to
each endpoint with the 2-worker ZeroMQ agent SIGKILLed a third of the way and restarted; two
waves of ``endpoint="auto"`` tasks of a function whose run time depends on the endpoint
(30 / 45 / 120 ms, read from ``MESH_ENDPOINT_NAME``); then a drift wave in which the 2-worker
agent turns 6x slower (a flag file the task checks, unknown to the scheduler) while tasks NAMED
to it are in the same wave. Every execution appends a line to a log file, so runs are counted
where they happen.

Only non-timed promises are asserted here (exactly once, counts, moved decisions, named tasks
never moved, API fields present and sane, latency not inflated by the flood). The timed figures
(makespan vs ideal, share gaps, prediction error) come from ``measure.py``.

Run: ``.venv/bin/python -m pytest tests/outsider_issue27 -q -p no:cacheprovider``.
"""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import wait
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from tests.outsider_issue27.measure import AGENTS, DRIFTER, VICTIM, run_scenario, wave_task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FLOOD_PER_EP = 1000
WAVE = 150
WAVES = 2
NAMED = 20


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from cloud_hub.broker import find_mosquitto

    if find_mosquitto() is None:
        pytest.fail("mosquitto is required")
    d = tmp_path_factory.mktemp("outsider27")
    extra: dict[str, Any] = {}

    def inspect(mesh: LocalMesh, out: dict[str, Any]) -> None:
        # decisions of the named tasks, looked up one by one (a named task records none)
        drift = out["raw"].get("drift")
        if drift is not None:
            extra["named_decisions"] = {f.task_id: mesh.client.scheduler_decisions(limit=10, task_id=f.task_id)["decisions"]
                                        for f in drift.named}
        extra["summary"] = mesh.client.scheduler_decisions(limit=1)["summary"]

    out = run_scenario(d, flood_per_ep=FLOOD_PER_EP, wave=WAVE, waves=WAVES, drift=True, n_named=NAMED, drift_factor=6.0,
                       down_s=1.0, heartbeat_s=0.5, lost_after_s=4.0, log=print, inspect=inspect)
    out["extra"] = extra
    yield out


def _runs(out: dict[str, Any]) -> list[tuple[str, int, str, int]]:
    lines = Path(out["raw"]["log_path"]).read_text().splitlines()
    rows = []
    for ln in lines:
        wave, seq, name, pid = ln.split()
        rows.append((wave, int(seq), name, int(pid)))
    return rows


def _all_waves(out: dict[str, Any]) -> list[Any]:
    return list(out["raw"]["waves"]) + ([out["raw"]["drift"]] if out["raw"].get("drift") is not None else [])


# ---------------------------------------------------------------------------- flood
def test_flood_all_results_after_sigkill(scenario: dict[str, Any]) -> None:
    fl = scenario["flood"]
    assert fl["tasks"] == FLOOD_PER_EP * len(AGENTS)
    assert fl["not_done"] == 0, fl
    assert fl["failed"] == 0, fl
    assert fl["victim_done_at_kill"] < FLOOD_PER_EP, f"{VICTIM} had finished its flood before the kill: {fl}"


# ---------------------------------------------------------------------------- waves: exactly once
def test_every_wave_task_done_ok(scenario: dict[str, Any]) -> None:
    for w in _all_waves(scenario):
        fs = w.futures + w.named
        assert all(f.done() for f in fs), f"wave {w.name}: {sum(not f.done() for f in fs)} of {len(fs)} not done"
        errs = [f.exception() for f in fs if f.exception() is not None]
        assert not errs, f"wave {w.name}: {errs[:3]}"


def test_each_task_ran_exactly_once(scenario: dict[str, Any]) -> None:
    runs = _runs(scenario)
    counts = Counter((w, s) for w, s, _n, _p in runs)
    expected = {(w.name, i) for w in _all_waves(scenario) for i in range(len(w.futures))}
    drift = scenario["raw"].get("drift")
    if drift is not None:
        expected |= {(f"{drift.name}-named", i) for i in range(len(drift.named))}
    missing = expected - counts.keys()
    twice = {k: c for k, c in counts.items() if c > 1}
    assert not missing, f"{len(missing)} tasks never ran, e.g. {sorted(missing)[:5]}"
    assert not twice, f"{len(twice)} tasks ran more than once, e.g. {list(twice.items())[:5]}"
    assert set(counts) == expected


def test_result_says_where_it_ran(scenario: dict[str, Any]) -> None:
    """future.endpoint_id after the result = the endpoint whose worker ran it (the task returns
    MESH_ENDPOINT_NAME) = the endpoint in the run log."""
    ids = scenario["raw"]["endpoint_ids"]
    ran = {(w, s): n for w, s, n, _p in _runs(scenario)}
    bad = []
    for w in _all_waves(scenario):
        for i, f in enumerate(w.futures):
            name = f.result()
            if ids[name] != f.endpoint_id or ran.get((w.name, i)) != name:
                bad.append((w.name, i, name, f.endpoint_id, ran.get((w.name, i))))
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:5]}"


# ---------------------------------------------------------------------------- late binding
def test_drift_moves_waiting_tasks_and_counts_them(scenario: dict[str, Any]) -> None:
    d = scenario["drift"]
    w = scenario["raw"]["drift"]
    assert d["summary_moved_after"] > d["summary_moved_before"], d
    moved_tasks = {tid: ds for tid, ds in w.decisions.items() if any(x["state"] == "moved" for x in ds)}
    assert moved_tasks, "no decision of the drift wave was moved"
    drifter = scenario["raw"]["endpoint_ids"][DRIFTER]
    away = 0
    for tid, ds in moved_tasks.items():  # newest first
        assert ds[0]["state"] == "done", (tid, [x["state"] for x in ds])
        assert all(x["state"] == "moved" for x in ds[1:]), (tid, [x["state"] for x in ds])
        for newer, older in zip(ds, ds[1:]):
            assert newer["seq"] > older["seq"] and newer["endpoint_id"] != older["endpoint_id"], (tid, ds)
        away += ds[-1]["endpoint_id"] == drifter
    assert away > 0, "no task placed on the slowed endpoint was taken over by another"
    # the moved count the API reports covers at least what we saw
    assert scenario["extra"]["summary"]["moved"] >= sum(
        1 for ww in _all_waves(scenario) for ds in ww.decisions.values() for x in ds if x["state"] == "moved")


def test_moved_task_ran_where_its_last_decision_says(scenario: dict[str, Any]) -> None:
    for w in _all_waves(scenario):
        by_id = {f.task_id: f for f in w.futures}
        for tid, ds in w.decisions.items():
            assert ds[0]["endpoint_id"] == by_id[tid].endpoint_id, (w.name, tid, ds[0]["endpoint_id"], by_id[tid].endpoint_id)


def test_drifter_gets_fewer_tasks_than_placed(scenario: dict[str, Any]) -> None:
    """The slowed endpoint ran fewer of the drift wave's tasks than it was first given."""
    w = scenario["raw"]["drift"]
    drifter = scenario["raw"]["endpoint_ids"][DRIFTER]
    first = sum(1 for ds in w.decisions.values() if ds[-1]["endpoint_id"] == drifter)
    ran = sum(1 for f in w.futures if f.endpoint_id == drifter)
    assert ran < first, (ran, first)


def test_named_tasks_never_moved(scenario: dict[str, Any]) -> None:
    w = scenario["raw"]["drift"]
    drifter = scenario["raw"]["endpoint_ids"][DRIFTER]
    assert len(w.named) == NAMED
    assert all(f.result() == DRIFTER and f.endpoint_id == drifter for f in w.named), \
        [(f.result(), f.endpoint_id) for f in w.named if f.result() != DRIFTER or f.endpoint_id != drifter]
    ran = [n for wave, _s, n, _p in _runs(scenario) if wave == f"{w.name}-named"]
    assert ran == [DRIFTER] * NAMED or sorted(ran) == [DRIFTER] * NAMED, Counter(ran)
    nd = scenario["extra"]["named_decisions"]
    assert all(v == [] for v in nd.values()), {k: [x["state"] for x in v] for k, v in nd.items() if v}


# ---------------------------------------------------------------------------- decisions API
def test_decisions_fields_sane(scenario: dict[str, Any]) -> None:
    for w in _all_waves(scenario):
        assert len(w.decisions) == len(w.futures), (w.name, len(w.decisions), len(w.futures))
        by_id = {f.task_id: f for f in w.futures}
        for tid, ds in w.decisions.items():
            d = ds[0]
            assert d["state"] == "done" and d["ok"] is True, d
            assert d["selector"]["kind"] == "auto"
            assert d["predicted_s"] is not None and d["predicted_s"] > 0
            assert d["actual_s"] is not None and d["actual_s"] > 0
            assert math.isclose(d["error_s"], d["actual_s"] - d["predicted_s"], abs_tol=1e-6), d
            assert d["completed_at"] >= d["placed_at"]
            assert d["predicted"]["endpoint_id"] == d["endpoint_id"]
            assert math.isclose(d["predicted"]["total"], d["predicted_s"], rel_tol=1e-3, abs_tol=1e-4)
            assert 1 <= len(d["compared"]) <= 8
            f = by_id[tid]
            assert math.isclose(d["runtime_s"], f.finished - f.started, abs_tol=2e-3), (d["runtime_s"], f.finished - f.started)
    s = scenario["extra"]["summary"]
    for k in ("decisions", "completed", "moved", "mean_abs_error_s", "mean_rel_error"):
        assert k in s, s
    n_waves = sum(len(w.futures) for w in _all_waves(scenario))
    assert s["decisions"] >= n_waves and s["completed"] >= n_waves, s


# ---------------------------------------------------------------------------- state API: links
def _eps(state: dict[str, Any], names: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {names[e["endpoint_id"]]: e for e in state["endpoints"] if e["endpoint_id"] in names}


def test_state_fields_present_and_sane(scenario: dict[str, Any]) -> None:
    names = scenario["raw"]["names"]
    st = scenario["raw"]["state_final"]
    assert st.get("policy") == "delta-outage-aware"
    eps = _eps(st, names)
    assert set(eps) == set(AGENTS)
    for name, e in eps.items():
        for k in ("latency_s", "bandwidth_bps", "link", "hub_lag_s", "throughput_per_s", "queue_s", "calibration", "workers"):
            assert k in e, (name, k)
        assert e["workers"] == AGENTS[name][1]
        link = e["link"]
        assert link and link["samples"] > 0, (name, link)
        assert link["rtt_min_s"] <= link["rtt_p10_s"] <= link["rtt_median_s"], (name, link)
        # latency = half the 10th percentile of the echoed round trips (docs: "Link timing")
        assert 0 < e["latency_s"] <= link["rtt_median_s"] / 2 + 1e-3, (name, e["latency_s"], link)
        assert link["latency_s"] == pytest.approx(link["rtt_p10_s"] / 2, rel=0.02, abs=1e-5), (name, link)
        assert e["hub_lag_s"] is not None and e["hub_lag_s"] >= 0
        cal = e["calibration"]
        assert "applied_bias_s" in cal and "applied_queue_scale" in cal, (name, cal)
        assert 0.5 <= cal["applied_queue_scale"] <= 2.5, (name, cal["applied_queue_scale"])
        assert -max(link["rtt_p10_s"], link["rtt_min_s"]) - 1e-6 <= cal["applied_bias_s"] <= 2.0, (name, cal["applied_bias_s"])


def test_latency_not_inflated_by_flood(scenario: dict[str, Any]) -> None:
    """Loopback: the latency the scheduler uses stays a loopback latency through and after the
    flood (a burst of hub lag must not survive in it)."""
    names = scenario["raw"]["names"]
    for key in ("state_after_flood", "state_after_waves", "state_final"):
        for name, e in _eps(scenario["raw"][key], names).items():
            assert e["latency_s"] is not None and e["latency_s"] < 0.05, (key, name, e["latency_s"], e.get("hub_lag_s"))
    during = [(s["t"], n, v["latency_s"]) for s in scenario["raw"]["state_samples_during_flood"]
              for n, v in s.get("endpoints", {}).items() if v.get("latency_s") is not None]
    assert during, "no state sample during the flood"
    # No bound on the samples taken during the flood itself: the hub's and the agents' CPU is
    # saturated then, and on a 2-core machine running other tests beside (load average 14) even a
    # round trip stamped at socket read took 1.4 s. The defect this guards against is that the
    # flood's lag stayed in the link term after it (470-960 ms, fading over two waves): the states
    # right after the flood, above, must be back at loopback latency.
    print("worst latency sampled during the flood:", max(during, key=lambda x: x[2]))


# ---------------------------------------------------------------------------- restart race
def test_wave_right_after_agent_restart_completes(mesh: LocalMesh, tmp_path: Path) -> None:
    """An agent SIGKILLed and restarted at once (the hub has not noticed: lost_after_s > the
    gap), then an auto wave: every task must still run, once. A task whose send failed goes back
    to the hub's queue ("re-queued") and must go out again when the agent is back, or be taken
    over by an idle endpoint (late binding)."""
    agents = {n: mesh.add_agent(n, t, workers=w) for n, (t, w, _s) in AGENTS.items()}
    mesh.wait_online(timeout=90)
    log_path = tmp_path / "runs.log"
    ex = Executor(mesh.client, endpoint="auto")
    try:
        fs = [ex.submit(wave_task, "warm", i, str(log_path), "", "", 1.0) for i in range(60)]
        _done, nd = wait(fs, timeout=60)
        assert not nd
        agents[VICTIM].kill()
        agents[VICTIM].start()
        fs = [ex.submit(wave_task, "w", i, str(log_path), "", "", 1.0) for i in range(60)]
        _done, nd = wait(fs, timeout=30)  # a 60-task wave takes ~1 s here
        stuck = {f.endpoint_id for f in nd}
        assert not nd, f"{len(nd)} of 60 tasks not done 30 s after submit, placed on {stuck}"
        counts = Counter(ln.split()[1] for ln in log_path.read_text().splitlines() if ln.startswith("w "))
        assert len(counts) == 60 and set(counts.values()) == {1}
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
