"""The frames between the agent and its workers: plain fields, never pickle.

Why (issue 25): a worker runs another user's code, and the agent used to unpickle every frame its
workers sent, so a function that wrote its own frame to the inherited channel fd ran code in the
agent, with the agent's key in reach. Now each frame is a one-byte kind and fixed fields packed
with :mod:`struct`, checked field by field and bounded in size; a result's value travels as the
opaque bytes the worker serialized, which the agent stores and forwards and never decodes. The
agent's frames to a worker use the same codec (the worker is on the other side of the sandbox,
but one format is simpler to check than two).

Framing on the socket is :class:`multiprocessing.connection.Connection`'s: a 4-byte big-endian
length (or -1 and an 8-byte length), then the frame.

* agent -> worker: ``C`` + a chunk of tasks ``(task_id, function_id, body or None, args)``;
  ``S``: stop.
* worker -> agent: ``Y`` + pid once ready; ``R`` + one result per task, in task order.

Stdlib only: the worker imports this before any user code, on every start.
"""

from __future__ import annotations

import math
import struct

__all__ = ["ChannelError", "MAX_ID", "MAX_RESULT_BYTES", "MAX_FRAME", "encode_chunk", "decode_chunk", "STOP",
           "encode_ready", "encode_result", "decode_worker_frame"]

#: The largest result value a worker may send (bigger values: return a ref, docs/data.md).
MAX_RESULT_BYTES = 64 * 2**20
MAX_ID = 256  # bytes of a task or function id
#: The largest frame the agent accepts from a worker: one result and its fixed fields.
MAX_FRAME = MAX_RESULT_BYTES + MAX_ID + 64

STOP = b"S"
_TASK = struct.Struct("!HHqQ")  # len(task_id), len(function_id), len(body) or -1, len(args)
_RESULT = struct.Struct("!?ddH")  # ok, started, finished, len(task_id)
_READY = struct.Struct("!q")


class ChannelError(ValueError):
    """A frame that breaks the channel's format: the worker that sent it is ended."""


def encode_chunk(tasks: list[tuple[str, str, bytes | None, bytes]]) -> bytes:
    parts = [b"C", struct.pack("!I", len(tasks))]
    for task_id, function_id, body, args in tasks:
        tid, fid = task_id.encode(), function_id.encode()
        parts += [_TASK.pack(len(tid), len(fid), -1 if body is None else len(body), len(args)), tid, fid]
        if body is not None:
            parts.append(body)
        parts.append(args)
    return b"".join(parts)


def decode_chunk(frame: bytes) -> list[tuple[str, str, bytes | None, bytes]] | None:
    """A chunk of tasks, or None for :data:`STOP` (worker side)."""
    view = memoryview(frame)
    if view[:1] == STOP:
        return None
    if view[:1] != b"C":
        raise ChannelError(f"unknown frame kind {bytes(view[:1])!r}")
    (n,) = struct.unpack_from("!I", view, 1)
    pos, out = 5, []
    for _ in range(n):
        lt, lf, lb, la = _TASK.unpack_from(view, pos)
        pos += _TASK.size
        tid = bytes(view[pos:pos + lt]).decode()
        pos += lt
        fid = bytes(view[pos:pos + lf]).decode()
        pos += lf
        body = None
        if lb >= 0:
            body = bytes(view[pos:pos + lb])
            pos += lb
        args = bytes(view[pos:pos + la])
        pos += la
        out.append((tid, fid, body, args))
    return out


def encode_ready(pid: int) -> bytes:
    return b"Y" + _READY.pack(pid)


def encode_result(task_id: str, ok: bool, data: bytes, started: float, finished: float) -> bytes:
    tid = task_id.encode()
    return b"R" + _RESULT.pack(ok, started, finished, len(tid)) + tid + data


def decode_worker_frame(frame: bytes | memoryview) -> tuple:
    """``("ready", pid)`` or ``("r", task_id, ok, data, started, finished)`` from a worker's frame;
    anything else, or any field out of bounds, raises :class:`ChannelError` (agent side)."""
    view = memoryview(frame)
    kind = bytes(view[:1])
    if kind == b"Y":
        if len(view) != 1 + _READY.size:
            raise ChannelError(f"ready frame of {len(view)} bytes")
        (pid,) = _READY.unpack_from(view, 1)
        return ("ready", pid)
    if kind != b"R":
        raise ChannelError(f"unknown frame kind {kind!r}")
    if len(view) < 1 + _RESULT.size:
        raise ChannelError(f"result frame of {len(view)} bytes")
    ok, started, finished, lt = _RESULT.unpack_from(view, 1)
    pos = 1 + _RESULT.size
    if lt > MAX_ID or pos + lt > len(view):
        raise ChannelError("result frame with a bad task id length")
    if not (math.isfinite(started) and math.isfinite(finished)):
        raise ChannelError("result frame with a non-finite timestamp")
    try:
        task_id = bytes(view[pos:pos + lt]).decode()
    except UnicodeDecodeError:
        raise ChannelError("result frame with a task id that is not UTF-8") from None
    data = bytes(view[pos + lt:])
    if len(data) > MAX_RESULT_BYTES:
        raise ChannelError(f"result of {len(data)} bytes, over the {MAX_RESULT_BYTES} byte limit")
    return ("r", task_id, bool(ok), data, started, finished)
