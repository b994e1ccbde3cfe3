"""reload_process: a SIGHUP reaches a starting broker only once it has a handler for it (before
that, SIGHUP's default action would end it: a site gateway lost its broker that way)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh_agent.reload import catches, reload_process

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

# A stand-in for a broker that installs its SIGHUP handler some time after it starts, and writes a
# file when it is told to reload.
_LATE_HANDLER = """
import signal, sys, time
time.sleep(float(sys.argv[2]))
signal.signal(signal.SIGHUP, lambda *_: open(sys.argv[1], "w").write("reloaded"))
time.sleep(30)
"""


def _child(tmp_path: Path, delay: float) -> tuple[subprocess.Popen[bytes], Path]:
    marker = tmp_path / "reloaded"
    proc = subprocess.Popen([sys.executable, "-c", _LATE_HANDLER, str(marker), str(delay)])
    return proc, marker


def test_a_starting_process_is_told_once_it_catches_sighup(tmp_path: Path) -> None:
    proc, marker = _child(tmp_path, 0.5)
    try:
        assert catches(proc.pid) is False  # still starting: a plain kill(SIGHUP) would end it
        assert reload_process(proc.pid, timeout=10)
        for _ in range(100):  # bounded: 5 s for the handler to run
            if marker.exists():
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the reload killed the process"
        assert marker.read_text() == "reloaded"
    finally:
        proc.kill()
        proc.wait(5)


def test_no_signal_to_a_process_that_never_catches_it(tmp_path: Path) -> None:
    proc, marker = _child(tmp_path, 60)
    try:
        assert reload_process(proc.pid, timeout=0.3) is False
        assert proc.poll() is None and not marker.exists()
    finally:
        proc.kill()
        proc.wait(5)


def test_a_gone_process_is_not_reloaded(tmp_path: Path) -> None:
    proc, _ = _child(tmp_path, 0)
    proc.kill()
    proc.wait(5)
    assert reload_process(proc.pid, timeout=0.3) is False
    assert catches(proc.pid) is None
