"""Telling a broker (Mosquitto, nats-server) to re-read its files with SIGHUP, without killing it.

SIGHUP's default action ends a process. A broker installs its handler only some milliseconds
after it starts (Mosquitto after opening its listeners), so a SIGHUP sent in that window kills
the broker we meant to reload: a site gateway whose welcome listed new devices while its site
broker was starting lost that broker (an integration run showed "site broker exited with -1").
Linux says which signals a process catches (``SigCgt`` in ``/proc/<pid>/status``); we wait,
bounded, until SIGHUP is among them. Cost: one read of a small /proc file (tens of microseconds)
when the broker is already up, which is every reload after the first second.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["catches", "reload_process"]


def catches(pid: int, sig: int = signal.SIGHUP) -> bool | None:
    """Whether process ``pid`` has a handler for ``sig``; None where /proc cannot say (not Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def reload_process(pid: int, timeout: float = 5.0) -> bool:
    """SIGHUP ``pid`` once it catches SIGHUP. False when there is no such process, or when it still
    has no handler after ``timeout`` seconds: a broker that slow to start reads its files when it
    does, and a signal then would only kill it. Where /proc cannot say (not Linux, or another
    user's process behind hidepid), the signal goes at once, as it always did."""
    deadline = time.monotonic() + timeout
    while (state := catches(pid)) is False and time.monotonic() < deadline:
        time.sleep(0.01)
    if state is False:
        return False
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        return False
    return True
