"""Helpers for tests that act as an operator: real `mesh-hub` / `mesh-agent` processes, their logs
in files, bounded waits for a log line or an HTTP answer, and another local user to read files as."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

import httpx
import pytest

BIN = Path(sys.executable).parent

__all__ = ["BIN", "Proc", "wait_http", "read_as_other_user", "other_user_cmd"]


class Proc:
    """A CLI process whose stdout+stderr go to a file we can search while it runs."""

    def __init__(self, args: list[str], log: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.log = log
        self._fh = open(log, "ab")
        full_env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(args, stdout=self._fh, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0, *, after: int = 0) -> re.Match[str]:
        """First match of ``pattern`` in the log past offset ``after``; fails if the process exits first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.text(), after)
            if m:
                return m
            if self.proc.poll() is not None:
                m = rx.search(self.text(), after)
                if m:
                    return m
                raise AssertionError(f"process exited ({self.proc.returncode}) before /{pattern}/ appeared:\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"/{pattern}/ did not appear within {timeout}s:\n{self.text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._fh.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (agent and its workers), as a power cut would."""
        self.stop(signal.SIGKILL)


def wait_http(url: str, *, status: int | None = 200, timeout: float = 60.0) -> httpx.Response:
    """GET ``url`` until it answers (with ``status`` if given); bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=5)
            if status is None or r.status_code == status:
                return r
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {timeout}s (last: {last})")


def other_user_cmd(user: str = "nobody") -> list[str] | None:
    """A command prefix that runs as ``user`` (we are root in CI), or None when not possible."""
    if os.geteuid() != 0:
        return None
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--"]
    if shutil.which("setpriv"):
        import pwd

        pw = pwd.getpwnam(user)
        return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
    return None


def read_as_other_user(path: Path, user: str = "nobody") -> subprocess.CompletedProcess[bytes]:
    """``cat path`` as ``user``; skips the test (with the reason) where we cannot switch users."""
    prefix = other_user_cmd(user)
    if prefix is None:
        pytest.skip("cannot run a command as another user here (not root, or no runuser/setpriv)")
    return subprocess.run([*prefix, "cat", str(path)], capture_output=True, timeout=30)
