"""Every benchmark under bench/ in its ``--smoke`` mode, as a real subprocess (issue 26, item 5).

A smoke run takes seconds: the benchmark's own code path at tiny sizes, with the same-run
baselines where they are cheap (docs/benchmarks.md, "Smoke runs"). Each test runs one with
``sys.executable`` from the repository root and asserts that it exits 0, that its stdout is one
parseable JSON object saying ``"smoke": true``, and that it wrote nothing under bench/results/ (a
smoke run must not overwrite a full run's figures). So a benchmark that no longer runs fails CI
instead of whoever runs it next. No figure is asserted (no timed assertions: docs/testing.md).

Two static checks come with them: every runnable script in bench/ has a smoke test here, and no
bench module defines the same top-level function or class twice (bench/fl.py once had two
``_traffic``, the later one silently replacing the earlier, which ruff's F811 does not catch when
the first is referenced from a function body).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cloud_hub.broker import find_mosquitto

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"

#: id -> (script in bench/, extra arguments). One test each; about 150 s together on the 2-core VM.
SMOKES: dict[str, tuple[str, list[str]]] = {
    "agent_memory": ("agent_memory.py", []),
    "coldstart": ("coldstart.py", []),
    "console": ("console.py", []),
    "data_tiers": ("data_tiers.py", []),
    "fairness": ("fairness.py", []),
    "fl": ("fl.py", []),
    "fl_flower_app": ("fl.py", ["--flower-app", "tests/fixtures/flower_apps/quickstart-sklearn"]),
    "footprint": ("footprint.py", []),
    "hotpath": ("hotpath.py", []),
    "latency": ("latency.py", []),
    "memo": ("memo.py", []),
    "metrics": ("metrics.py", []),
    "multiprocessing": ("multiprocessing.py", []),
    "ops": ("ops.py", []),
    "placement": ("placement.py", []),
    "rtt_trace": ("rtt_trace.py", []),
    "scheduler": ("scheduler.py", []),
    "security": ("security.py", []),
    "site": ("site.py", []),
    "store": ("store.py", []),
    "submit": ("submit.py", []),
    "throughput": ("throughput.py", []),
    "tls": ("tls.py", []),
}

#: Longest a smoke run may take before it counts as hung: several times the slowest (bench/site.py,
#: about 25 s idle), so a loaded machine makes the test slower, not red.
TIMEOUT_S = 240.0


def _runnable_scripts() -> set[str]:
    return {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_") and "__main__" in p.read_text()}


def _bench_state() -> dict[str, int]:
    """What a smoke run must leave alone: bench/results/ (names and modification times) and bench/'s own entries."""
    state = {f"results/{p.name}": p.stat().st_mtime_ns for p in RESULTS.iterdir()} if RESULTS.is_dir() else {}
    state.update({p.name: 0 for p in BENCH.iterdir() if p.name not in ("__pycache__", "results")})
    return state


def _stop(proc: subprocess.Popen[str]) -> None:
    """A hung benchmark: Ctrl-C first (its context managers stop the meshes it started), then
    SIGKILL for it and every process it had started, wherever they went."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    if proc.poll() is None:
        proc.kill()
    for p in kids:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(10)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", list(SMOKES))
def test_benchmark_smoke_run(name: str) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required: run ./taskw setup (apt-get install mosquitto)")
    script, extra = SMOKES[name]
    before = _bench_state()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(BENCH / script), "--smoke", *extra], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        pytest.fail(f"bench/{script} --smoke still running after {TIMEOUT_S:g} s; stderr tail:\n{err[-4000:]}")
    took = time.monotonic() - t0
    assert proc.returncode == 0, f"bench/{script} --smoke exited {proc.returncode} after {took:.1f} s; stderr tail:\n{err[-4000:]}"
    try:
        doc = json.loads(out)
    except ValueError as exc:
        pytest.fail(f"bench/{script} --smoke: stdout is not one JSON object ({exc}); stdout head:\n{out[:2000]}")
    assert isinstance(doc, dict), f"bench/{script} --smoke printed {type(doc).__name__}, not a JSON object"
    assert doc.get("smoke") is True, f"bench/{script} --smoke: the JSON does not say \"smoke\": true (was --smoke honoured?)"
    after = _bench_state()
    changed = sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k))
    # what this benchmark could have written: entries of bench/ itself and its own result files
    # (not another benchmark's, which a full run beside this test may write meanwhile)
    stem = Path(script).stem
    mine = [k for k in changed if not k.startswith("results/") or k.removeprefix("results/").startswith(stem)]
    assert not mine, f"bench/{script} --smoke wrote or removed {mine} (a smoke run must write nothing under bench/)"


def test_every_benchmark_has_a_smoke_test() -> None:
    assert _runnable_scripts() == {script for script, _ in SMOKES.values()}, \
        "a runnable script in bench/ without a smoke test here (or one listed here that is gone): add it to SMOKES"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_no_top_level_name_is_defined_twice(path: Path) -> None:
    seen: dict[str, int] = {}
    twice = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{node.name} (lines {seen[node.name]} and {node.lineno})")
            seen[node.name] = node.lineno
    assert not twice, f"bench/{path.name} defines {', '.join(twice)} twice: the later silently replaces the earlier"
