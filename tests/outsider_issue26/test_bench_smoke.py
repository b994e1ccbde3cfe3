"""Promise 5: a benchmark's --smoke mode takes seconds, prints one JSON object with "smoke": true,
and writes nothing under bench/results/. Two picked by an outsider, run as real processes."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.outsider_issue26._util import PY, ROOT, clean_env, run

LIMIT_S = float(os.environ.get("OUTSIDER_BENCH_LIMIT_S", "60"))  # "a few seconds": generous on a loaded 2-core VM


def _listing() -> dict[str, float]:
    d = ROOT / "bench/results"
    return {p.name: p.stat().st_mtime for p in d.iterdir()} if d.exists() else {}


def _last_json(stdout: str) -> dict:
    start = stdout.find("{")
    assert start >= 0, stdout[-500:]
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


@pytest.mark.parametrize("bench", ["store.py", "placement.py"])
def test_smoke_run(bench: str, tmp_path) -> None:
    before = _listing()
    t0 = time.monotonic()
    r = run([PY, f"bench/{bench}", "--smoke"], timeout=240, env=clean_env(TMPDIR=str(tmp_path)))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-1500:]
    doc = _last_json(r.stdout)
    assert doc.get("smoke") is True, list(doc)[:20]
    assert _listing() == before, "a smoke run wrote under bench/results/"
    assert took < LIMIT_S, f"{bench} --smoke took {took:.1f}s"
    print(f"{bench}: {took:.1f}s, keys {sorted(doc)[:12]}")


def test_smoke_rejects_unknown_flag() -> None:
    r = run([PY, "bench/store.py", "--smoke", "--no-such-flag"], timeout=60, env=clean_env())
    assert r.returncode != 0
