"""Model weights on the wire: a list of numpy arrays as one compressed, self-describing blob.

Why our own tiny format rather than pickling the arrays: a blob arrives from a device we only
partly trust (signed, but the code that produced it may be buggy) and is decoded on the driver
and on gateways; this format holds only dtypes, shapes and raw bytes, so decoding runs no code,
checks every size before allocating, and refuses a decompression bomb. It is also smaller:
each float tensor's bytes are shuffled (all first bytes of every float, then all second bytes,
...) before zlib, the trick blosc uses; exponent bytes then repeat and compress well.

Layout: ``b"FLW1"`` | u32 header length | header (JSON: ``{"t": [[dtype, shape], ...],
"z": level, "s": shuffled}``) | zlib stream of the concatenated (shuffled) tensor bytes.
Pure numpy + stdlib: no torch here (the agent and the driver may not have it). Part of the wire
protocol (``mesh_agent/protocol``): the hub checks uploaded checkpoints with it (cloud_hub/api/fl.py)
without importing ``fl``; ``fl.wire`` re-exports it for FL code. numpy is imported with this module,
which ``mesh_agent.protocol`` never loads on its own (the agent does not need numpy).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import List, Sequence

import numpy as np

__all__ = ["WireError", "encode_weights", "decode_weights", "MAX_DECODED_BYTES"]

MAGIC = b"FLW1"
_LEN = struct.Struct("!I")
#: Largest decoded model we accept (1 GiB): far above any model a mesh task carries (the hub
#: refuses payloads over 10 MB), low enough that a crafted blob cannot exhaust memory.
MAX_DECODED_BYTES = 1 << 30
_MAX_TENSORS = 100_000
_ALLOWED_KINDS = "fiub"  # float, signed int, unsigned int, bool: what a state_dict holds


class WireError(ValueError):
    """A weights blob is malformed, truncated, too large or holds an unsupported dtype."""


def _shuffle(raw: np.ndarray) -> bytes:
    item = raw.dtype.itemsize
    if item == 1 or raw.size == 0:
        return raw.tobytes()
    return np.ascontiguousarray(raw.view(np.uint8).reshape(-1, item).T).tobytes()


def _unshuffle(buf: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    item = dtype.itemsize
    u8 = np.frombuffer(buf, dtype=np.uint8)
    if item == 1 or count == 0:
        return u8.view(dtype).copy()
    return np.ascontiguousarray(u8.reshape(item, count).T).view(dtype).reshape(count).copy()


def encode_weights(weights: Sequence[np.ndarray], level: int = 6, shuffle: bool = True) -> bytes:
    """Encode tensors (any numeric numpy arrays, e.g. a torch state_dict's values) into a blob."""
    if not 0 <= level <= 9:
        raise ValueError("zlib level must be 0-9")
    header = []
    comp = zlib.compressobj(level)
    parts: List[bytes] = []
    for i, w in enumerate(weights):
        a = np.asarray(w)
        if a.dtype.kind not in _ALLOWED_KINDS:
            raise WireError(f"tensor {i} has unsupported dtype {a.dtype}")
        a = np.asarray(a, order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
        le = a.dtype.newbyteorder("<") if a.dtype.byteorder not in ("|", "<") else a.dtype
        a = a.astype(le, copy=False)
        header.append([le.str, list(a.shape)])
        flat = a.reshape(-1)
        parts.append(comp.compress(_shuffle(flat) if shuffle else flat.tobytes()))
    parts.append(comp.flush())
    head = json.dumps({"t": header, "z": level, "s": bool(shuffle)}, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(head)) + head + b"".join(parts)


def decode_weights(blob: bytes, max_bytes: int = MAX_DECODED_BYTES) -> List[np.ndarray]:
    """Decode a blob from :func:`encode_weights`; any defect is a :class:`WireError`."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise WireError(f"weights must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < len(MAGIC) + _LEN.size or not blob.startswith(MAGIC):
        raise WireError("not a weights blob (bad magic)")
    (hlen,) = _LEN.unpack_from(blob, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if hlen > len(blob) - start or hlen > 16 * 2**20:
        raise WireError("weights blob header is truncated")
    try:
        head = json.loads(blob[start : start + hlen])
        specs = head["t"]
        shuffled = bool(head.get("s", False))
        if not isinstance(specs, list) or len(specs) > _MAX_TENSORS:
            raise TypeError("tensor list")
        tensors = []
        total = 0
        for spec in specs:
            dt = np.dtype(str(spec[0]))
            shape = tuple(int(d) for d in spec[1])
            if dt.kind not in _ALLOWED_KINDS or dt.hasobject or any(d < 0 for d in shape):
                raise TypeError(f"tensor spec {spec!r}")
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            total += count * dt.itemsize
            tensors.append((dt, shape, count))
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise WireError(f"bad weights blob header: {exc}") from None
    if total > max_bytes:
        raise WireError(f"weights blob would decode to {total} bytes, over the {max_bytes}-byte limit")
    d = zlib.decompressobj()
    try:
        raw = d.decompress(blob[start + hlen :], total)
        if len(raw) < total:
            raise WireError(f"weights blob is truncated: {len(raw)} of {total} bytes")
        tail = b"" if d.eof else d.decompress(d.unconsumed_tail, 1)
        if tail or not d.eof or d.unused_data:
            raise WireError("weights blob holds more or other data than its header declares")
    except zlib.error as exc:
        raise WireError(f"weights blob is corrupt: {exc}") from None
    out: List[np.ndarray] = []
    pos = 0
    for dt, shape, count in tensors:
        n = count * dt.itemsize
        chunk = raw[pos : pos + n]
        pos += n
        arr = _unshuffle(chunk, dt, count) if shuffled else np.frombuffer(chunk, dtype=dt).copy()
        out.append(arr.astype(dt.newbyteorder("="), copy=False).reshape(shape))
    return out
