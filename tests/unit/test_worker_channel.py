"""The agent <-> worker channel carries plain frames: what a worker sends is never unpickled by the
agent (issue 25), a malformed frame ends only that worker, and a worker's output is bounded."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import platform
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from mesh_agent.engine import EngineTask, LocalEngine
from mesh_agent.engine._channel import (MAX_RESULT_BYTES, ChannelError, decode_chunk, decode_worker_frame, encode_chunk,
                                        encode_ready, encode_result)
from mesh_agent.protocol.serialize import deserialize, function_id, serialize, serialize_function

# ---------------------------------------------------------------- codec


def test_frames_round_trip() -> None:
    chunk = [("t1", "f1", b"body", b"args"), ("t2", "f1", None, b"")]
    assert decode_chunk(encode_chunk(chunk)) == chunk
    assert decode_worker_frame(encode_ready(1234)) == ("ready", 1234)
    assert decode_worker_frame(encode_result("t1", True, b"json\n1", 1.5, 2.5)) == ("r", "t1", True, b"json\n1", 1.5, 2.5)


@pytest.mark.parametrize("frame, why", [
    (b"\x80\x05\x95" + b"x" * 20, "unknown frame kind"),  # a pickle is not a frame
    (b"", "unknown frame kind"),
    (b"Y12", "ready frame"),
    (b"R\x01", "result frame of"),
    (b"R" + struct.pack("!?ddH", True, 1.0, 2.0, 5000) + b"x" * 10, "task id length"),
    (b"R" + struct.pack("!?ddH", True, math.nan, 2.0, 1) + b"t", "non-finite"),
    (b"R" + struct.pack("!?ddH", True, 1.0, 2.0, 2) + b"\xff\xfe", "not UTF-8"),
])
def test_malformed_worker_frames_are_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ChannelError, match=why):
        decode_worker_frame(frame)


def test_an_oversize_result_is_refused() -> None:
    with pytest.raises(ChannelError, match="over the"):
        decode_worker_frame(encode_result("t", True, b"x" * (MAX_RESULT_BYTES + 1), 1.0, 2.0))


# ---------------------------------------------------------------- attacks through the engine


def _channel_fd() -> int:
    """The worker's channel fd, as a function running in it can find it: its boot arguments."""
    cmdline = open("/proc/self/cmdline", "rb").read().split(b"\0")
    return int(json.loads(cmdline[-2] if not cmdline[-1] else cmdline[-1])["fd"])


def write_pickle_frame(marker: str) -> str:
    import pickle

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(("r", "x", True, b"", 0.0, 0.0, Evil()))
    os.write(_channel_fd(), struct.pack("!i", len(payload)) + payload)
    import time

    time.sleep(2)
    return "not reached"


def claim_huge_frame() -> str:
    os.write(_channel_fd(), struct.pack("!i", -1) + struct.pack("!Q", 2**62))
    import time

    time.sleep(2)
    return "not reached"


def forge_result_for(other: str) -> str:
    from mesh_agent.engine._channel import encode_result

    frame = encode_result(other, True, b"json\n\"forged\"", 0.0, 0.0)
    os.write(_channel_fd(), struct.pack("!i", len(frame)) + frame)
    import time

    time.sleep(2)
    return "not reached"


def shout(nbytes: int) -> int:
    import sys

    sys.stdout.write("A" * 100 + "\n\x1b[31mfake record\n")
    sys.stdout.write("B" * nbytes)
    sys.stdout.flush()
    return nbytes


def whoami() -> int:
    return os.getpid()


class Sink:
    def __init__(self) -> None:
        self.results: list[Any] = []

    def __call__(self, batch: list[Any]) -> None:
        self.results.extend(batch)

    async def wait_for(self, n: int, timeout: float = 30.0) -> dict[str, Any]:
        for _ in range(int(timeout / 0.02)):
            if len(self.results) >= n:
                break
            await asyncio.sleep(0.02)
        assert len(self.results) >= n, f"only {len(self.results)} of {n} results"
        return {r.task_id: r for r in self.results}


def task(task_id: str, fn: Any, *args: Any) -> EngineTask:
    body = serialize_function(fn)
    return EngineTask(task_id, function_id(body), body, serialize((args, {})))


@pytest.fixture
async def engine() -> AsyncIterator[tuple[LocalEngine, Sink]]:
    sink = Sink()
    eng = LocalEngine(sink, workers=1)
    await eng.start()
    try:
        yield eng, sink
    finally:
        await eng.stop(grace=1)


async def test_a_pickle_written_to_the_channel_runs_nothing_in_the_agent(engine: Any, tmp_path: Path) -> None:
    eng, sink = engine
    marker = tmp_path / "owned"
    eng.submit([task("evil", write_pickle_frame, str(marker)), task("after", whoami)])
    res = await sink.wait_for(2)
    assert not marker.exists()  # os.system never ran: the frame was not unpickled
    assert not res["evil"].ok
    err = deserialize(res["evil"].data)
    assert "malformed frame" in err["message"] and "unknown frame kind" in err["message"]
    assert res["after"].ok  # the agent keeps serving, on a fresh worker
    assert eng.stats["protocol_violations"] == 1


async def test_a_worker_claiming_a_huge_frame_is_ended_not_buffered(engine: Any) -> None:
    eng, sink = engine
    eng.submit([task("huge", claim_huge_frame), task("after", whoami)])
    res = await sink.wait_for(2)
    assert "malformed frame" in deserialize(res["huge"].data)["message"]
    assert res["after"].ok


async def test_a_worker_cannot_answer_for_another_task(engine: Any) -> None:
    eng, sink = engine
    eng.submit([task("liar", forge_result_for, "victim"), task("victim", whoami)])
    res = await sink.wait_for(2)
    assert not res["liar"].ok and "not the one it runs" in deserialize(res["liar"].data)["message"]
    assert res["victim"].ok and isinstance(deserialize(res["victim"].data), int)  # its own result, not the forged one


async def test_worker_output_is_bounded_attributed_and_escaped(engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    eng, sink = engine
    caplog.set_level(logging.INFO, logger="mesh_agent.engine.local")
    eng.submit([task("loud", shout, 1_000_000), task("after", whoami)])
    res = await sink.wait_for(2)
    assert res["loud"].ok
    for _ in range(100):  # the pipe is read by the event loop: let it drain
        if any("dropped" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "task loud" in r.getMessage()]
    assert sum(len(m) for m in lines) < 40_000  # 1 MB printed, about 16 KB kept
    assert any("is dropped" in m for m in lines)
    assert not any("\x1b" in m for m in lines) and any("\\x1b[31mfake record" in m for m in lines)


# ---------------------------------------------------------------- the seccomp filter


_INT80 = textwrap.dedent("""
    import ctypes, mmap, sys
    if sys.argv[1] == "filter":
        sys.path.insert(0, sys.argv[2])
        from mesh_agent.engine._seccomp import deny_unix_sockets
        deny_unix_sockets()
    code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (getpid, i386 table); int 0x80; ret
    buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    print(ctypes.CFUNCTYPE(ctypes.c_int)(addr)())
""")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the int 0x80 gate is x86's")
def test_the_filter_kills_a_call_through_the_32_bit_gate() -> None:
    root = str(Path(__file__).resolve().parents[2])
    plain = subprocess.run([sys.executable, "-c", _INT80, "plain", root], capture_output=True, text=True, timeout=60)
    if plain.returncode != 0:
        pytest.skip(f"this kernel has no 32-bit syscall gate to attack: {plain.returncode}")
    filtered = subprocess.run([sys.executable, "-c", _INT80, "filter", root], capture_output=True, text=True, timeout=60)
    assert filtered.returncode == -signal.SIGSYS, (filtered.returncode, filtered.stdout, filtered.stderr)


def test_the_filter_denies_namespaces_and_kernel_surfaces() -> None:
    code = textwrap.dedent("""
        import ctypes, os, socket, sys
        sys.path.insert(0, sys.argv[1])
        from mesh_agent.engine._seccomp import deny_unix_sockets
        deny_unix_sockets()
        libc = ctypes.CDLL(None, use_errno=True)
        out = {}
        for name, call in [("unshare", lambda: libc.unshare(0x10000000)),
                           ("io_uring_setup", lambda: libc.syscall(425, 1, None)),
                           ("userfaultfd", lambda: libc.syscall(323 if os.uname().machine == "x86_64" else 282, 0)),
                           ("keyctl", lambda: libc.syscall(250 if os.uname().machine == "x86_64" else 219, 0, 0, 0, 0, 0))]:
            out[name] = (call(), ctypes.get_errno())
        try:
            socket.socket(socket.AF_UNIX)
            out["unix"] = "allowed"
        except PermissionError:
            out["unix"] = "EPERM"
        a, b = socket.socketpair()  # what the worker's channel is made of still works
        out["pid"] = os.fork() or os._exit(0)  # plain fork (clone without CLONE_NEW*) still works
        print(out)
    """)
    r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2])], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = eval(r.stdout)  # noqa: S307 - our own child's repr of a dict of ints and strs
    for name in ("unshare", "io_uring_setup", "userfaultfd", "keyctl"):
        assert out[name] == (-1, 1), (name, out[name])  # EPERM
    assert out["unix"] == "EPERM" and out["pid"] > 0
