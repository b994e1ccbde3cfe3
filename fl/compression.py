"""Lossy update compression for rural links, on top of the lossless ``fl.wire`` format.

A client's update leaves the device as a *delta* against the global weights it trained from,
compressed by an opt-in pipeline (``Federation.fit(..., compression=...)``):

* ``"fp16"`` -- the delta in float16 (2x before zlib);
* ``"q8"`` -- 8-bit stochastic quantization (QSGD-style, unbiased): per block of values
  ``lo``/``scale`` in float32 and one byte per value, rounded up or down at random with the
  probability that keeps the expectation exact;
* ``"topk:0.01"`` -- top-k sparsification: only the ``ratio`` largest-magnitude coordinates of
  the whole model are sent (their indices as gaps in the smallest unsigned type, or as a bitmap
  when that is smaller), with **error
  feedback** (Stich et al. 2018; Karimireddy et al. 2019): what was not sent (and the
  quantization error of what was) is kept on the device and added to the next round's delta.
  The residual lives in the device's durable store, ``$MESH_ENDPOINT_DATA_DIR/fl-state/``, written
  atomically (temporary file, fsync, rename), so an agent killed and restarted keeps it;
* ``"topk:0.05+q8"`` / ``"topk:0.1+fp16"`` -- sparsify, then quantize the values kept.

Objects work as well: ``TopK(0.05) + Q8()``, ``FP16()``, ``Compression(TopK(0.1), FP16())``.

The downlink is separate and lossless by default; ``fit(..., downlink="fp16")`` sends the global
model as float16 (half the bytes; the driver keeps and aggregates in float32, and a device's
compressed delta is applied to the float32 model).

The compressed form is a list of numpy arrays (values or codes, block parameters, index gaps,
and any non-float tensors as they are), encoded with :func:`fl.wire.encode_weights`, so it gets
the wire format's byte shuffling, zlib and safe decoding. The update dict carries
``encoding = {"codec", "spec", "n", "k", "ef"}`` next to the blob; the driver decodes it
against the global weights of the update's base version, checking every count, index and code
before it allocates (:class:`CompressionError` otherwise: the update is dropped with the
reason). Pure numpy and stdlib: runs on the device without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from fl.wire import WireError, decode_weights, encode_weights

__all__ = [
    "CompressionError", "TopK", "FP16", "Q8", "Compression", "parse", "from_spec",
    "encode_update", "decode_update", "ResidualStore", "residual_store", "ENV_DATA_DIR",
    "check_downlink", "encode_global",
]

ENV_DATA_DIR = "MESH_ENDPOINT_DATA_DIR"  # (mesh_agent.datasets.ENV_DATA_DIR: the agent's data_dir)
_Q8_BLOCK = 256
_MAX_VALUES = 1 << 28  # far above any model a mesh task carries; refuses absurd counts early


class CompressionError(ValueError):
    """A compressed update is malformed, or a compression spec is not understood."""


# ------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class TopK:
    """Send the ``ratio`` largest-magnitude coordinates (at least one); ``error_feedback``
    keeps the rest on the device for the next round."""

    ratio: float
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], got {self.ratio!r}")

    def __add__(self, other: "Quantizer") -> "Compression":
        return Compression(self, other)


@dataclass(frozen=True)
class FP16:
    """The values as float16."""

    def __add__(self, other: Any) -> "Compression":  # (FP16() + ... makes no sense: quantize last)
        raise TypeError("quantization comes last: TopK(...) + FP16()")


@dataclass(frozen=True)
class Q8:
    """8-bit stochastic quantization in blocks of ``block`` values."""

    block: int = _Q8_BLOCK

    def __post_init__(self) -> None:
        if not 1 <= int(self.block) <= 1 << 20:
            raise ValueError("q8 block must be 1..1048576")

    def __add__(self, other: Any) -> "Compression":
        raise TypeError("quantization comes last: TopK(...) + Q8()")


Quantizer = Union[FP16, Q8]


@dataclass(frozen=True)
class Compression:
    """A pipeline: an optional sparsifier, then an optional quantizer (at least one)."""

    sparsify: Optional[TopK] = None
    quantize: Optional[Quantizer] = None

    def __post_init__(self) -> None:
        if self.sparsify is None and self.quantize is None:
            raise ValueError("a compression needs topk, fp16 or q8 (use compression=None for none)")
        if self.sparsify is not None and not isinstance(self.sparsify, TopK):
            raise TypeError(f"sparsify must be TopK, got {type(self.sparsify).__name__}")
        if self.quantize is not None and not isinstance(self.quantize, (FP16, Q8)):
            raise TypeError(f"quantize must be FP16 or Q8, got {type(self.quantize).__name__}")

    @property
    def error_feedback(self) -> bool:
        return self.sparsify is not None and self.sparsify.error_feedback

    def spec(self) -> Dict[str, Any]:
        """The JSON form a task carries to the device."""
        out: Dict[str, Any] = {"v": 1}
        if self.sparsify is not None:
            out["topk"] = float(self.sparsify.ratio)
            out["ef"] = bool(self.sparsify.error_feedback)
        if isinstance(self.quantize, FP16):
            out["quant"] = "fp16"
        elif isinstance(self.quantize, Q8):
            out["quant"] = "q8"
            out["block"] = int(self.quantize.block)
        return out

    def describe(self) -> str:
        parts = []
        if self.sparsify is not None:
            parts.append(f"topk:{self.sparsify.ratio:g}" + ("" if self.sparsify.error_feedback else ":noef"))
        if isinstance(self.quantize, FP16):
            parts.append("fp16")
        elif isinstance(self.quantize, Q8):
            parts.append("q8" if self.quantize.block == _Q8_BLOCK else f"q8:{self.quantize.block}")
        return "+".join(parts)

    def __str__(self) -> str:
        return self.describe()


def from_spec(spec: Any) -> Compression:
    """The :class:`Compression` a task's ``uplink`` spec (``Compression.spec()``) describes."""
    if not isinstance(spec, dict) or spec.get("v") != 1:
        raise CompressionError(f"not a compression spec: {spec!r}")
    unknown = set(spec) - {"v", "topk", "ef", "quant", "block"}
    if unknown:
        raise CompressionError(f"compression spec has unknown fields {sorted(unknown)}")
    try:
        sp = TopK(float(spec["topk"]), bool(spec.get("ef", True))) if "topk" in spec else None
        q: Optional[Quantizer] = None
        if spec.get("quant") == "fp16":
            q = FP16()
        elif spec.get("quant") == "q8":
            q = Q8(int(spec.get("block", _Q8_BLOCK)))
        elif spec.get("quant") is not None:
            raise ValueError(f"unknown quantizer {spec.get('quant')!r}")
        return Compression(sp, q)
    except (TypeError, ValueError) as exc:
        raise CompressionError(f"bad compression spec {spec!r}: {exc}") from None


def parse(value: Any) -> Optional[Compression]:
    """``None``/``"none"``; ``"fp16"``, ``"q8"``, ``"topk:0.01"``, ``"topk:0.05+q8"``
    (``"topk:0.1:noef"`` without error feedback); a :class:`TopK`, :class:`FP16`, :class:`Q8`
    or :class:`Compression`; or a spec dict."""
    if value is None or value == "none" or value == "":
        return None
    if isinstance(value, Compression):
        return value
    if isinstance(value, TopK):
        return Compression(value, None)
    if isinstance(value, (FP16, Q8)):
        return Compression(None, value)
    if isinstance(value, dict):
        return from_spec(value)
    if not isinstance(value, str):
        raise TypeError(f"compression must be a string like 'topk:0.01+q8' or a Compression, got {type(value).__name__}")
    sp: Optional[TopK] = None
    q: Optional[Quantizer] = None
    for part in value.lower().replace(" ", "").split("+"):
        name, _, arg = part.partition(":")
        if name == "topk" and sp is None and q is None:
            ratio, _, flag = arg.partition(":")
            if not ratio or flag not in ("", "noef", "ef"):
                raise ValueError(f"bad top-k part {part!r}: write topk:0.01 (or topk:0.01:noef)")
            sp = TopK(float(ratio), flag != "noef")
        elif name == "fp16" and q is None and not arg:
            q = FP16()
        elif name == "q8" and q is None:
            q = Q8(int(arg)) if arg else Q8()
        else:
            raise ValueError(f"cannot read compression {value!r} at {part!r}: use fp16, q8, topk:RATIO, "
                             "or topk:RATIO+fp16 / topk:RATIO+q8")
    return Compression(sp, q)


# ------------------------------------------------------------------------------------ downlink
DOWNLINK = ("fp16",)


def check_downlink(value: Any) -> Optional[str]:
    """``None`` or ``"fp16"``: the global model sent down as float16 (the driver keeps float32)."""
    if value in (None, "", "none"):
        return None
    if isinstance(value, FP16) or value == "fp16":
        return "fp16"
    raise ValueError(f"downlink compression must be None or 'fp16', not {value!r}")


def encode_global(weights: Sequence[np.ndarray], downlink: Optional[str]) -> bytes:
    """The global weights as a wire blob; ``downlink="fp16"``: float tensors as float16."""
    if downlink == "fp16":
        return encode_weights([np.clip(w, -65504.0, 65504.0).astype(np.float16) if _is_float(w) and np.asarray(w).dtype.itemsize > 2
                               else np.asarray(w) for w in weights])
    return encode_weights(weights)


# ------------------------------------------------------------------------------------ layout
def _is_float(a: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def _float_count(base: Sequence[np.ndarray]) -> int:
    return int(sum(np.asarray(b).size for b in base if _is_float(b)))


def _flatten_delta(new: Sequence[np.ndarray], base: Sequence[np.ndarray]) -> np.ndarray:
    parts = [(np.asarray(w, np.float64) - np.asarray(b, np.float64)).reshape(-1)
             for w, b in zip(new, base) if _is_float(b)]
    return np.concatenate(parts) if parts else np.zeros(0)


def _gap_dtype(max_gap: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_gap <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def _q8_encode(x: np.ndarray, block: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = x.size
    nb = max(1, -(-n // block)) if n else 0
    lo = np.zeros(nb, np.float32)
    scale = np.zeros(nb, np.float32)
    codes = np.zeros(n, np.uint8)
    for b in range(nb):
        seg = x[b * block : (b + 1) * block]
        a, z = float(seg.min()), float(seg.max())
        lo[b] = a
        s = np.float32((z - a) / 255.0)
        scale[b] = s
        if s > 0:
            t = (seg - float(lo[b])) / float(s)  # in [0, 255] up to rounding
            c = np.floor(t + rng.random(seg.size))
            codes[b * block : (b + 1) * block] = np.clip(c, 0, 255).astype(np.uint8)
    return codes, lo, scale


def _q8_decode(codes: np.ndarray, lo: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    idx = np.arange(codes.size) // block
    return lo[idx].astype(np.float64) + codes.astype(np.float64) * scale[idx].astype(np.float64)


def _quantize(vals: np.ndarray, q: Optional[Quantizer], rng: np.random.Generator) -> Tuple[List[np.ndarray], np.ndarray]:
    """Arrays to send for ``vals`` and the values the driver will decode from them."""
    if q is None:
        v32 = vals.astype(np.float32)
        return [v32], v32.astype(np.float64)
    if isinstance(q, FP16):
        v16 = np.clip(vals, -65504.0, 65504.0).astype(np.float16)
        return [v16], v16.astype(np.float64)
    codes, lo, scale = _q8_encode(vals, int(q.block), rng)
    return [codes, lo, scale], _q8_decode(codes, lo, scale, int(q.block))


# ------------------------------------------------------------------------------------ codec
def encode_update(new: Sequence[np.ndarray], base: Sequence[np.ndarray], comp: Compression, *, seed: int = 0,
                  residual: Optional[np.ndarray] = None) -> Tuple[bytes, Dict[str, Any], Optional[np.ndarray]]:
    """Compress ``new - base``. Returns ``(blob, encoding, residual_out)``; ``residual`` (the
    error-feedback memory, a flat float vector over the float tensors) is added first, and
    ``residual_out`` is what was not sent (None without error feedback)."""
    if len(new) != len(base):
        raise CompressionError(f"{len(new)} tensors against a base of {len(base)}")
    rng = np.random.default_rng(int(seed) & 0xFFFFFFFF)
    x = _flatten_delta(new, base)
    n = x.size
    ef = comp.error_feedback
    if ef and residual is not None and residual.size == n:
        x = x + residual.astype(np.float64)
    arrays: List[np.ndarray] = []
    k = n
    index_form = None
    if comp.sparsify is not None and n:
        k = max(1, min(n, int(math.ceil(comp.sparsify.ratio * n))))
        idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k :]) if k < n else np.arange(n)
        vals = x[idx]
        qa, sent_vals = _quantize(vals, comp.quantize, rng)
        gaps = np.diff(idx, prepend=0).astype(np.int64)  # idx[0] itself, then the steps (>= 1)
        gdt = _gap_dtype(int(gaps.max()) if gaps.size else 0)
        if -(-n // 8) < k * gdt.itemsize:  # dense enough: a bitmap of n bits is smaller
            bits = np.zeros(n, bool)
            bits[idx] = True
            arrays += qa + [np.packbits(bits)]
            index_form = "bitmap"
        else:
            arrays += qa + [gaps.astype(gdt)]
            index_form = "gaps"
        sent = np.zeros(n)
        sent[idx] = sent_vals
    else:
        qa, sent = _quantize(x, comp.quantize, rng)
        arrays += qa
    arrays += [np.asarray(w) for w, b in zip(new, base) if not _is_float(b)]
    residual_out = (x - sent).astype(np.float32) if ef else None
    enc = {"codec": comp.describe(), "spec": comp.spec(), "n": int(n), "k": int(k)}
    if index_form is not None:
        enc["index"] = index_form
    return encode_weights(arrays), enc, residual_out


def decode_update(blob: Any, encoding: Any, base: Sequence[np.ndarray], expected: Optional[Compression] = None) -> List[np.ndarray]:
    """The client's weights (``base + delta``) from a compressed update; any defect is a
    :class:`CompressionError`. ``expected``: the compression the run asked for (a device that
    answers with another one is refused)."""
    if not isinstance(encoding, dict):
        raise CompressionError(f"encoding must be a dict, got {type(encoding).__name__}")
    comp = from_spec(encoding.get("spec"))
    if expected is not None and comp.spec() != expected.spec():
        raise CompressionError(f"update compressed as {comp.describe()}, the run asked for {expected.describe()}")
    n = _float_count(base)
    try:
        en, k = int(encoding.get("n", -1)), int(encoding.get("k", -1))
    except (TypeError, ValueError):
        raise CompressionError("encoding n/k are not integers") from None
    if en != n:
        raise CompressionError(f"update has {en} float values, the model has {n}")
    if not (1 <= k <= n if n else k == 0) or k > _MAX_VALUES:
        raise CompressionError(f"bad value count k={k} for {n} values")
    if comp.sparsify is None and k != n:
        raise CompressionError(f"dense update with k={k} != n={n}")
    try:
        arrays = decode_weights(blob, max_bytes=16 * (n + 1024) + sum(np.asarray(b).nbytes for b in base))
    except WireError as exc:
        raise CompressionError(str(exc)) from None
    pos = 0

    def take(kind: str, count: int) -> np.ndarray:
        nonlocal pos
        if pos >= len(arrays):
            raise CompressionError(f"compressed update is missing its {kind}")
        a = arrays[pos]
        pos += 1
        if a.ndim != 1 or a.size != count:
            raise CompressionError(f"{kind}: expected {count} values, got shape {a.shape}")
        return a

    q = comp.quantize
    if q is None:
        v = take("values", k)
        if v.dtype != np.float32:
            raise CompressionError(f"values: expected float32, got {v.dtype}")
        vals = v.astype(np.float64)
    elif isinstance(q, FP16):
        v = take("values", k)
        if v.dtype != np.float16:
            raise CompressionError(f"values: expected float16, got {v.dtype}")
        vals = v.astype(np.float64)
    else:
        nb = max(1, -(-k // int(q.block))) if k else 0
        codes, lo, scale = take("codes", k), take("block offsets", nb), take("block scales", nb)
        if codes.dtype != np.uint8 or lo.dtype != np.float32 or scale.dtype != np.float32:
            raise CompressionError("q8: codes must be uint8, offsets and scales float32")
        vals = _q8_decode(codes, lo, scale, int(q.block))
    if not np.all(np.isfinite(vals)):
        raise CompressionError("values contain non-finite numbers")
    if comp.sparsify is not None:
        form = encoding.get("index", "gaps")
        if form == "bitmap":
            bm = take("index bitmap", -(-n // 8))
            if bm.dtype != np.uint8:
                raise CompressionError(f"index bitmap must be uint8, got {bm.dtype}")
            bits = np.unpackbits(bm)
            if bits[n:].any():
                raise CompressionError("index bitmap has bits past the model's end")
            idx = np.flatnonzero(bits[:n])
            if idx.size != k:
                raise CompressionError(f"index bitmap marks {idx.size} values, the update holds {k}")
        elif form == "gaps":
            gaps = take("indices", k)
            if gaps.dtype.kind != "u":
                raise CompressionError(f"indices must be unsigned, got {gaps.dtype}")
            g = gaps.astype(np.int64)
            if k and (np.any(g[1:] < 1)):
                raise CompressionError("indices are not strictly increasing")
            idx = np.cumsum(g)
            if k and (idx[-1] >= n or idx[0] < 0):
                raise CompressionError(f"index {int(idx[-1])} out of range for {n} values")
        else:
            raise CompressionError(f"unknown index form {form!r}")
        delta = np.zeros(n)
        delta[idx] = vals
    else:
        delta = vals
    rest = arrays[pos:]
    out: List[np.ndarray] = []
    off = 0
    for b in base:
        b = np.asarray(b)
        if _is_float(b):
            d = delta[off : off + b.size].reshape(b.shape)
            off += b.size
            out.append((b.astype(np.float64) + d).astype(b.dtype))
        else:
            if not rest:
                raise CompressionError("compressed update is missing a non-float tensor")
            t = rest.pop(0)
            if t.shape != b.shape:
                raise CompressionError(f"non-float tensor has shape {t.shape}, expected {b.shape}")
            out.append(t)
    if rest:
        raise CompressionError(f"compressed update holds {len(rest)} array(s) more than the model")
    return out


# ------------------------------------------------------------------------------------ residuals
_MAGIC = b"FLEF1"
_LEN = struct.Struct("!I")
_memory: Dict[Tuple[str, str], Tuple[int, Optional[np.ndarray], np.ndarray]] = {}
_mem_lock = threading.Lock()


class ResidualStore:
    """Error-feedback residuals of one device, one file per (run, client) under ``root``
    (``None``: this process's memory only, for a worker outside an agent).

    A file holds the round that produced it, the residual that round started from and the one
    it left, so a task that runs again (the device rebooted before its result left) uses the
    same input residual rather than applying it twice. Writes are atomic (temporary file in the
    same folder, fsync, rename, fsync of the folder); a file that cannot be read counts as no
    residual. Files untouched for ``keep_days`` are removed when another is written."""

    def __init__(self, root: Optional[Path], keep_days: float = 30.0) -> None:
        self.root = None if root is None else Path(root)
        self.keep_s = float(keep_days) * 86400.0

    @property
    def kind(self) -> str:
        return "memory" if self.root is None else "file"

    def _path(self, run_id: str, client_id: str) -> Path:
        assert self.root is not None
        h = hashlib.sha256(f"{run_id}\0{client_id}".encode()).hexdigest()[:32]
        return self.root / f"ef-{h}.bin"

    def _read(self, run_id: str, client_id: str) -> Optional[Tuple[int, Optional[np.ndarray], np.ndarray]]:
        if self.root is None:
            with _mem_lock:
                return _memory.get((run_id, client_id))
        p = self._path(run_id, client_id)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            if not raw.startswith(_MAGIC):
                return None
            (hl,) = _LEN.unpack_from(raw, len(_MAGIC))
            start = len(_MAGIC) + _LEN.size
            head = json.loads(raw[start : start + hl])
            if head.get("run_id") != run_id or head.get("client_id") != client_id:
                return None
            arrs = decode_weights(raw[start + hl :])
            inp = arrs[0] if head.get("has_input") else None
            return int(head["round"]), inp, arrs[-1]
        except (ValueError, KeyError, IndexError, struct.error, WireError):
            return None

    def load(self, run_id: str, client_id: str, round: int) -> Tuple[Optional[np.ndarray], Dict[str, Any]]:
        """The residual to add in ``round``, and what happened (for the update's ``encoding``)."""
        got = self._read(run_id, client_id)
        if got is None:
            return None, {"store": self.kind, "from_round": None}
        r, inp, out = got
        if r < round:
            return out, {"store": self.kind, "from_round": r}
        if r == round:  # this round ran before (a reboot before its result left): same input again
            return inp, {"store": self.kind, "from_round": "rerun"}
        return None, {"store": self.kind, "from_round": None, "stale": True}  # an older round's task, late

    def save(self, run_id: str, client_id: str, round: int, inp: Optional[np.ndarray], out: np.ndarray) -> None:
        if self.root is None:
            with _mem_lock:
                _memory[(run_id, client_id)] = (int(round), inp, out)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"run_id": run_id, "client_id": client_id, "round": int(round), "has_input": inp is not None,
                           "saved": time.time()}).encode()
        arrays = ([inp.astype(np.float32)] if inp is not None else []) + [out.astype(np.float32)]
        data = _MAGIC + _LEN.pack(len(head)) + head + encode_weights(arrays, level=1)
        target = self._path(run_id, client_id)
        fd, tmp = tempfile.mkstemp(prefix=".ef-", dir=str(self.root))
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:
            dfd = os.open(str(self.root), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        self._prune(keep=target)

    def _prune(self, keep: Path) -> None:
        assert self.root is not None
        now = time.time()
        for p in self.root.glob("ef-*.bin"):
            try:
                if p != keep and now - p.stat().st_mtime > self.keep_s:
                    p.unlink()
            except OSError:
                pass


def residual_store() -> ResidualStore:
    """This device's store: ``$MESH_ENDPOINT_DATA_DIR/fl-state`` in an agent's worker, else memory."""
    root = os.environ.get(ENV_DATA_DIR)
    return ResidualStore(Path(root) / "fl-state" if root else None)
