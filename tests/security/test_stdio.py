"""Its own stdio (issue 25, item 5): stdout and stderr of a sandboxed worker are pipes the agent
reads, bounded and attributed to the task, never the agent's log file. Reopening /proc/self/fd/1 or
/proc/self/fd/2 does not reach the agent's log; flooding them does not fill the agent's log or disk;
output cannot forge lines of the agent's log. No descriptor the worker inherits names a host file."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest

from tests.security.conftest import SharedEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def stdio_facts() -> dict[str, Any]:
    import os
    import stat

    out: dict[str, Any] = {}
    for fd in (0, 1, 2):
        try:
            st = os.fstat(fd)
        except OSError as exc:
            out[str(fd)] = {"error": str(exc)}
            continue
        kind = ("fifo" if stat.S_ISFIFO(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else
                "char" if stat.S_ISCHR(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else oct(st.st_mode))
        out[str(fd)] = {"kind": kind, "link": os.readlink(f"/proc/self/fd/{fd}"), "size": st.st_size}
    for fd in (1, 2):  # reopen through /proc: for a file this is the agent's log, from its first byte
        try:
            f = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            out[f"reopen{fd}"] = f"{type(exc).__name__}: {exc.strerror}"
            continue
        try:
            data = os.read(f, 1 << 20)
        except BlockingIOError:
            data = b""
        except OSError as exc:
            data = f"{type(exc).__name__}: {exc.strerror}".encode()
        finally:
            os.close(f)
        out[f"reopen{fd}"] = data[:8192].decode(errors="replace")
    return out


def flood_stdio(mb: int, token: str, seconds: float) -> dict[str, Any]:
    import os
    import time

    line = (token + " " + "y" * 1000 + "\n").encode()
    block = line * ((1 << 20) // len(line))
    out: dict[str, Any] = {}
    for fd in (1, 2):
        n = 0
        os.set_blocking(fd, False)
        deadline = time.monotonic() + seconds
        while n < mb << 20 and time.monotonic() < deadline:
            try:
                n += os.write(fd, block)
            except BlockingIOError:
                time.sleep(0.005)
            except OSError as exc:
                out[f"error{fd}"] = f"{type(exc).__name__}: {exc.strerror}"
                break
        os.set_blocking(fd, True)
        out[str(fd)] = n
    return out


def forge_log_lines(token: str) -> str:
    import os
    import sys

    fake = f"2026-01-01 00:00:00,000 INFO mesh_agent.agent: {token} endpoint revoked by the hub, key rotated"
    print(f"harmless\n{fake}\r{fake}\x1b[2K\x1b[1A\x1b]0;{token}\x07", flush=True)
    sys.stderr.write(f"{token} \x00nul \x08backspace\r\n{fake}\n")
    sys.stderr.flush()
    os.write(1, f"\n{fake}\n".encode())
    return "done"


def inherited_fds() -> dict[str, str]:
    import os

    fds = os.listdir("/proc/self/fd")
    out = {}
    for n in fds:
        try:
            out[n] = os.readlink(f"/proc/self/fd/{n}")
        except OSError:
            pass  # the descriptor listdir itself used, closed by now
    return out


def _log_fingerprints(shared: SharedEndpoint) -> list[str]:
    lines = [ln.strip() for ln in shared.log_text().splitlines() if len(ln.strip()) > 30]
    return lines[:20] + lines[-20:]


def test_stdout_and_stderr_are_pipes_not_the_agents_log(shared: SharedEndpoint) -> None:
    seen = shared.run("b", stdio_facts).expect()
    log = str(shared.agent.log_path)
    for fd in ("1", "2"):
        assert log not in seen[fd].get("link", ""), f"fd {fd} of a sandboxed worker IS THE AGENT'S LOG FILE: {seen[fd]}"
        assert seen[fd].get("kind") == "fifo", f"fd {fd} of a sandboxed worker is not a pipe: {seen[fd]}"


def test_reopening_proc_self_fd_1_and_2_does_not_read_the_agents_log(shared: SharedEndpoint) -> None:
    prints = _log_fingerprints(shared)
    seen = shared.run("b", stdio_facts).expect()
    for fd in ("1", "2"):
        got = seen.get(f"reopen{fd}", "")
        leaked = [p for p in prints if p in got]
        assert not leaked and shared.ep not in got, \
            f"reopening /proc/self/fd/{fd} in the sandbox read the agent's log: {got[:600]!r}"


def test_flooding_stdout_and_stderr_does_not_grow_the_agents_log_or_disk(shared: SharedEndpoint) -> None:
    token = f"FLOOD-{uuid.uuid4().hex[:12]}"
    size0 = shared.agent.log_path.stat().st_size
    st0 = os.statvfs(shared.data_dir)
    ex, fut = shared.submit("b", flood_stdio, 64, token, 25.0, task_timeout_s=60)
    out = shared.wait(ex, fut, 120)
    time.sleep(1.5)  # what the agent still reads and logs
    grew = shared.agent.log_path.stat().st_size - size0
    st1 = os.statvfs(shared.data_dir)
    lost_mb = (st0.f_bavail - st1.f_bavail) * st0.f_frsize / 2**20
    assert grew < 1 << 20, f"128 MiB written to a sandboxed task's stdout/stderr grew the agent's log by {grew / 2**20:.1f} MiB ({out.describe()})"
    assert lost_mb < 64, f"the agent's disk lost {lost_mb:.0f} MiB while a sandbox flooded its stdout"
    task_id = getattr(fut, "task_id", None)
    mine = [ln for ln in shared.log_text().splitlines() if token in ln]
    if task_id is not None:
        stray = [ln for ln in mine if task_id not in ln]
        assert not stray, f"output in the agent's log is not attributed to its task {task_id}: {stray[:3]}"


def test_output_cannot_forge_lines_in_the_agents_log(shared: SharedEndpoint) -> None:
    token = f"FORGE-{uuid.uuid4().hex[:12]}"
    ex, fut = shared.submit("b", forge_log_lines, token, task_timeout_s=60)
    out = shared.wait(ex, fut, 120)
    assert out.ok, out.describe()
    time.sleep(1.0)
    task_id = getattr(fut, "task_id", None)
    raw = shared.agent.log_path.read_bytes().decode(errors="replace")
    mine = [ln for ln in raw.split("\n") if token in ln]
    bad_chars = [ln for ln in mine if any(c in ln for c in ("\x1b", "\r", "\x00", "\x08", "\x07"))]
    assert not bad_chars, f"control characters from a sandboxed task reached the agent's log raw: {bad_chars[:3]!r}"
    forged = [ln for ln in mine if ln.startswith("2026-01-01 00:00:00,000") or (task_id is not None and task_id not in ln)]
    assert not forged, f"a sandboxed task wrote lines into the agent's log that look like the agent's own: {forged[:3]!r}"


def test_no_inherited_descriptor_points_at_a_host_file(shared: SharedEndpoint) -> None:
    seen = shared.run("b", inherited_fds).expect()
    harmless = ("pipe:", "socket:", "anon_inode:", "/dev/null", "/tmp/", "/dev/pts/", "/dev/urandom")
    host = {fd: t for fd, t in seen.items() if not t.startswith(harmless) and not t.startswith("/proc/")}
    assert not host, f"a sandboxed worker holds descriptors of host files or directories: {host}"
