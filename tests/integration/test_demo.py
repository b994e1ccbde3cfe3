"""The demo as a newcomer meets it (issue 10, item 6): it finishes with exit 0 and a placement
table that shows each endpoint's measured speed next to its share; with ``--serve`` the console
link it prints keeps working until Ctrl-C, which ends it cleanly."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.integration

_SMALL = ["--calls", "40", "--matrices", "2", "--auto", "20", "--fl-rounds", "0", "--no-kill"]


def _demo(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    return subprocess.Popen([sys.executable, "-m", "cloud_hub.demo", *_SMALL, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def test_demo_without_a_terminal_exits_with_its_tables() -> None:
    p = _demo()
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    assert "lost: 0" in out
    assert re.search(r"mean run ms.*wave 1 share.*wave 2 share", out, re.S), out
    for name in ("pi-field-1", "pi-field-2", "hpc-login"):
        assert re.search(rf"{name}\s*│\s*\d\s*│", out), f"no placement row for {name}:\n{out}"
    assert "serving" not in out  # no terminal: it does not hang a script or CI


def test_demo_serves_its_console_until_ctrl_c() -> None:
    p = _demo("--serve")
    assert p.stdout is not None
    lines: "queue.Queue[str]" = queue.Queue()
    # A thread reads the pipe: select() on it would miss lines already in the reader's buffer.
    threading.Thread(target=lambda: [lines.put(line) for line in p.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen = ""
    deadline = time.monotonic() + 240
    try:
        while "until Ctrl-C" not in seen:
            assert time.monotonic() < deadline and p.poll() is None, f"demo did not reach serving:\n{seen}"
            with contextlib.suppress(queue.Empty):
                seen += lines.get(timeout=1.0)
        url = re.search(r"console (http://127\.0\.0\.1:\d+)/console \(token (cm_\S+)\)", seen)
        assert url, seen
        time.sleep(1.0)  # the link still works a while after the demo printed it
        r = httpx.get(f"{url.group(1)}/v1/endpoints", headers={"Authorization": f"Bearer {url.group(2)}"}, timeout=10)
        assert r.status_code == 200 and sum(e["online"] for e in r.json()) == 3
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0, seen
        time.sleep(0.5)  # the reader thread drains what was printed last
        rest = "".join(lines.get_nowait() for _ in range(lines.qsize()))
        assert "stopping the mesh" in rest, seen + rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
