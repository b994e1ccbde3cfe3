"""Nothing from a sandbox is unpickled outside it (issue 25, item 1).

A sandboxed worker inherits its channel to the agent. Its function finds that fd (the worker's boot
arguments in its argv, the sockets and pipes in /proc/self/fd) and writes what it likes there: a
pickle whose ``__reduce__`` would run code in whatever process loads it, a frame that claims to be
a terabyte long, results for tasks that are not its own. At worst its own task fails or its worker
is replaced; no code runs in the agent, the agent does not buffer without bound, and it keeps
serving the owner (checked after every test by the ``shared`` fixture)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.security.conftest import SharedEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def channel_fds() -> dict[int, str]:
    """The fds that could be this worker's channel to the agent: the one its boot arguments name,
    and every socket or pipe beyond stdio."""
    import json
    import os
    import sys

    found: dict[int, str] = {}
    for arg in sys.argv[1:]:
        try:
            boot = json.loads(arg)
        except ValueError:
            continue
        if isinstance(boot, dict) and isinstance(boot.get("fd"), int):
            found[boot["fd"]] = "boot args"
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if fd > 2 and target.startswith(("socket:", "pipe:")):
            found.setdefault(fd, target)
    return found


def write_pickle_bomb(marker: str) -> dict[str, Any]:
    """Frame a pickle that, when loaded, writes ``marker`` (a host path) and then looks like a
    harmless 'ready' message, and write it to every candidate channel fd."""
    import os
    import pickle
    import struct
    import time

    class Bomb:
        def __reduce__(self) -> Any:
            code = (f"(open({marker!r}, 'w').write('unpickled in pid %d uid %d' % (__import__('os').getpid(), "
                    f"__import__('os').getuid())), ('ready', 1))[1]")
            return (eval, (code,))

    blob = pickle.dumps(Bomb(), protocol=2)
    frame = struct.pack("!i", len(blob)) + blob
    fds = channel_fds()
    written: dict[int, Any] = {}
    for fd in fds:
        try:
            written[fd] = os.write(fd, frame)
        except OSError as exc:
            written[fd] = f"{type(exc).__name__}: {exc}"
    time.sleep(1.0)  # let the agent read it while this task is still running
    return {"fds": fds, "written": written, "argv": __import__("sys").argv[1:2]}


def flood_with_huge_frame(total_mb: int, seconds: float) -> dict[str, Any]:
    """A frame header claiming 2**40 bytes, then as much junk as the agent will take."""
    import os
    import struct
    import time

    header = struct.pack("!i", -1) + struct.pack("!Q", 1 << 40)
    chunk = b"\x00" * (1 << 20)
    sent: dict[int, Any] = {}
    for fd in channel_fds():
        n = 0
        try:
            os.set_blocking(fd, False)
            os.write(fd, header)
            deadline = time.monotonic() + seconds
            while n < total_mb << 20 and time.monotonic() < deadline:
                try:
                    n += os.write(fd, chunk)
                except BlockingIOError:
                    time.sleep(0.01)
            sent[fd] = n
        except OSError as exc:
            sent[fd] = f"{n} then {type(exc).__name__}: {exc}"
    return {"sent": sent}


def forge_frames() -> dict[str, Any]:
    """Frames in the channel's own format and in the old one, each lying: a result for a task
    that is not this one, a second 'ready', a NaN timestamp, an unknown kind, bad lengths."""
    import math
    import os
    import pickle
    import struct

    def framed(b: bytes) -> bytes:
        return struct.pack("!i", len(b)) + b

    tid = b"task-that-is-not-mine"
    frames = [
        b"R" + struct.pack("!?ddH", True, 0.0, 0.0, len(tid)) + tid + b"json\n42",
        b"Y" + struct.pack("!q", 1),
        b"R" + struct.pack("!?ddH", True, math.nan, math.inf, 3) + b"abc",
        b"R" + struct.pack("!?ddH", True, 0.0, 0.0, 60000) + b"short",
        b"Z" * 40,
        pickle.dumps(("r", "task-that-is-not-mine", True, b"json\n42", 0.0, 0.0), protocol=5),
        b"",
    ]
    written: dict[int, Any] = {}
    for fd in channel_fds():
        try:
            written[fd] = sum(os.write(fd, framed(f)) for f in frames)
        except OSError as exc:
            written[fd] = f"{type(exc).__name__}: {exc}"
    return {"written": written}


def test_pickle_written_to_the_worker_channel_never_runs_in_the_agent(shared: SharedEndpoint) -> None:
    marker = shared.marker("pickle-on-channel")
    out = shared.run("b", write_pickle_bomb, str(marker), timeout=120, task_timeout_s=60)
    time.sleep(2.0)
    assert not marker.exists(), f"THE AGENT UNPICKLED A SANDBOX'S BYTES AND RAN THEM: {marker.read_text()!r}"
    if out.ok:  # the worker survived its own frame: it must at least have found a channel to write to
        assert any(isinstance(n, int) and n > 0 for n in out.value["written"].values()), \
            f"the attack found no channel fd to write to, so it proved nothing: {out.value}"


def test_oversized_frame_on_the_channel_is_not_buffered_by_the_agent(shared: SharedEndpoint) -> None:
    before = shared.agent_status("VmHWM")
    out = shared.run("b", flood_with_huge_frame, 256, 20.0, timeout=90, task_timeout_s=40)
    grew_mb = (shared.agent_status("VmHWM") - before) / 1024
    assert grew_mb < 64, (f"the agent's peak memory grew by {grew_mb:.0f} MB while a worker streamed a frame that "
                          f"claimed 1 TiB ({out.describe()})")


def test_forged_and_malformed_channel_frames_fail_only_the_attackers_task(shared: SharedEndpoint) -> None:
    started = time.monotonic()
    out = shared.run("b", forge_frames, timeout=120, task_timeout_s=45)
    assert not out.timed_out, "forged frames made the agent lose the attacker's own task: no result came back at all"
    assert time.monotonic() - started < 100
    if out.ok:  # accepted as the attacker's own result: harmless, but the forged value must not be what came back
        assert out.value != 42, "a forged result frame was delivered as the task's result"
