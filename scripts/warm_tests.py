"""Compile the project once before the test suite's workers start (``./taskw test`` runs this first).

Why: every pytest-xdist worker collects the whole suite, and every hub, agent, sandbox and
benchmark process the suite starts imports our packages. On a machine that sets
PYTHONDONTWRITEBYTECODE (many container images do), each of them compiled every module again, and
each worker rewrote every test module's asserts again: about 100 CPU-seconds of a run on two cores
(docs/testing.md, "Why the suite writes bytecode"). Here the source is byte-compiled once
(compileall) and pytest's rewritten test modules are cached once (a collect-only run per half of
the test files, side by side), so the workers and processes load them instead.

Nothing here decides a test's outcome: a collection error is reported again by the suite itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["cloud_hub", "mesh_agent", "scheduler", "fl", "sim", "bench"]
TIMEOUT_S = 300


def _halves() -> list[list[str]]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    return [files[0::2], files[1::2]]


def main() -> int:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    started = time.monotonic()
    cmds = [[sys.executable, "-m", "compileall", "-q", "-j", "0", *SOURCES]]
    cmds += [[sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *half] for half in _halves() if half]
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
    bad = 0
    for cmd, p in zip(cmds, procs):
        try:
            _, err = p.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            err = f"no answer in {TIMEOUT_S} s"
        if p.returncode:
            bad += 1
            print(f"warm_tests: {' '.join(cmd[2:5])} ... exited {p.returncode}: {err.strip()[-300:]}", file=sys.stderr)
    print(f"warm_tests: compiled and cached in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0  # the suite reports any real error itself


if __name__ == "__main__":
    sys.exit(main())
