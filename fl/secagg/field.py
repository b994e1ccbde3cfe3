"""Finite-field encoding of model updates for secure aggregation, and the mask generator.

Why a field: masks only cancel exactly under modular arithmetic, so every client maps its
float update into Z_{2^32} with the same fixed-point scale; the masked vectors, the pairwise
masks and the sum all live there, and only the unmasked sum is mapped back to floats. The same
integer representation is what a compressed (8-bit, top-k) update dequantizes into before it is
masked, so compression and masking compose: compress -> decompress on the device -> quantize ->
mask.

The scale is chosen so that the sum of ``max_clients`` clipped values cannot wrap around:
``scale = (2^31 - 1 - max_clients) / (clip * max_clients)``. Rounding is stochastic (unbiased), seeded per
client and round, so quantization adds zero-mean noise of at most one unit per coordinate.

With a quantizing uplink compression (``fit(compression="q8")`` or ``"fp16"``), the update is
quantized on a grid *shared by all clients* (:class:`QuantCodec`): ``2^b`` levels (b = 8 for
q8, 16 for fp16) spanning ``[-range, range]`` per coordinate, stochastic rounding (unbiased
inside the range), and the field shrinks to the smallest byte width that holds the sum of
``max_clients`` codes without wrapping: ``max_clients * (2^b - 1) < 2^bits``. q8 with up to 257
clients lives in Z_{2^16} (2 bytes a coordinate instead of 4), up to 65,793 in Z_{2^24}; fp16
(16-bit codes) with up to 256 clients in Z_{2^24} (3 bytes), up to 65,537 in Z_{2^32}. The grid
must be shared because masks cancel only in the sum: per-client block scales (the plain q8
wire format) cannot be summed code by code.

The mask generator is AES-256 in CTR mode from the ``cryptography`` package (a standard PRG
built from a standard cipher; nothing here is a primitive of our own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["FieldCodec", "QuantCodec", "MODULUS", "FIELD_BITS", "prg", "flatten", "unflatten", "pack", "unpack",
           "field_mask"]

MODULUS = 1 << 32  # arithmetic in uint32 wraps modulo 2^32 by itself
_HALF = 1 << 31
#: the field widths a masked vector may use (whole bytes on the wire)
FIELD_BITS = (16, 24, 32)


def field_mask(bits: int) -> np.uint32:
    """``2^bits - 1`` as uint32: ``x & field_mask(bits)`` is ``x mod 2^bits``."""
    if bits not in FIELD_BITS:
        raise ValueError(f"field width must be one of {FIELD_BITS} bits, not {bits!r}")
    return np.uint32((1 << bits) - 1)


def pack(vec: np.ndarray, bits: int) -> bytes:
    """Field elements (uint32, already reduced mod 2^bits) as ``bits/8`` little-endian bytes each."""
    field_mask(bits)
    v = np.asarray(vec, dtype="<u4")
    if bits == 32:
        return v.tobytes()
    if bits == 16:
        return v.astype("<u2").tobytes()
    return np.ascontiguousarray(v.view(np.uint8).reshape(-1, 4)[:, :3]).tobytes()


def unpack(data: bytes, bits: int) -> np.ndarray:
    """Inverse of :func:`pack` (ValueError when the byte count is not a whole number of elements)."""
    field_mask(bits)
    width = bits // 8
    raw = bytes(data)
    if len(raw) % width:
        raise ValueError(f"{len(raw)} bytes is not a whole number of {width}-byte field elements")
    if bits == 32:
        return np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    if bits == 16:
        return np.frombuffer(raw, dtype="<u2").astype(np.uint32)
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.uint32)
    return b[:, 0] | (b[:, 1] << np.uint32(8)) | (b[:, 2] << np.uint32(16))


@dataclass(frozen=True)
class FieldCodec:
    """Fixed-point encoding into Z_{2^32}: clip each coordinate to ``[-clip, clip]``, scale, round.

    ``max_clients`` bounds how many encoded vectors may be summed without overflow."""

    clip: float = 1.0
    max_clients: int = 1000

    def __post_init__(self) -> None:
        if not (self.clip > 0 and np.isfinite(self.clip)):
            raise ValueError("clip must be a positive finite number")
        if not 1 <= self.max_clients <= 1 << 20:
            raise ValueError("max_clients must be 1..2^20")

    #: the masked vector's field: Z_{2^32}
    field_bits = 32

    @property
    def scale(self) -> float:
        # room for one unit of rounding per summed vector, so a full-scale sum never wraps
        return (_HALF - 1 - self.max_clients) / (self.clip * self.max_clients)

    def encode(self, vec: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Floats -> uint32 field elements (clipped, scaled, stochastically rounded)."""
        x = np.clip(np.asarray(vec, dtype=np.float64), -self.clip, self.clip) * self.scale
        low = np.floor(x)
        q = low + (rng.random(x.shape) < (x - low))
        return q.astype(np.int64).astype(np.uint32)  # two's complement into the field

    def decode(self, total: np.ndarray, count: int = 1) -> np.ndarray:
        """A sum of ``count`` encoded vectors (uint32) -> float64 sum (not the mean)."""
        if count > self.max_clients:
            raise ValueError(f"{count} vectors summed, but the codec allows at most {self.max_clients}")
        t = np.asarray(total, dtype=np.uint32).astype(np.int64)
        signed = np.where(t >= _HALF, t - MODULUS, t)
        return signed.astype(np.float64) / self.scale


@dataclass(frozen=True)
class QuantCodec:
    """Stochastic quantization on a grid shared by every client, into a narrow field.

    ``code_bits`` (8: q8, 16: fp16's width) levels ``0..L`` (``L = 2^code_bits - 1``) span
    ``[-range, range]``: a value ``v`` (clipped to the range) becomes ``floor(t + U)`` with
    ``t = (v + range) * L / (2 range)`` and ``U`` uniform in [0, 1), so ``E[code] = t`` (unbiased).
    The last coordinate is the client's weight in [0, 1], on its own grid ``w * L`` (so a
    tight ``range`` does not clip it). The sum of ``m`` clients' codes is at most ``m * L``;
    :attr:`field_bits` is the narrowest of 16/24/32 bits that holds ``max_clients * L``, so the
    sum never wraps and decodes exactly to the sum of the dequantized values."""

    code_bits: int
    range: float
    max_clients: int = 1000

    def __post_init__(self) -> None:
        if self.code_bits not in (8, 16):
            raise ValueError(f"quantized secure aggregation uses 8- or 16-bit codes, not {self.code_bits!r}")
        if not (self.range > 0 and np.isfinite(self.range)):
            raise ValueError(f"quantization range must be a positive finite number, not {self.range!r}")
        if not 1 <= self.max_clients <= 1 << 20:
            raise ValueError("max_clients must be 1..2^20")
        if self.max_clients * self.levels >= 1 << 32:
            raise ValueError(f"{self.max_clients} clients x {self.code_bits}-bit codes do not fit a 32-bit field")

    @property
    def levels(self) -> int:
        return (1 << self.code_bits) - 1

    @property
    def field_bits(self) -> int:
        need = self.max_clients * self.levels
        return next(b for b in FIELD_BITS if need < 1 << b)

    @property
    def step(self) -> float:
        """The grid's spacing (a value's dequantized form is ``code * step - range``)."""
        return 2.0 * self.range / self.levels

    def encode(self, vec: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Floats (the last one the weight, in [0, 1]) -> codes in ``0..L`` as uint32."""
        x = np.asarray(vec, dtype=np.float64)
        if x.ndim != 1 or x.size < 1:
            raise ValueError("a quantized update is a flat vector ending in its weight")
        t = np.empty_like(x)
        t[:-1] = (np.clip(x[:-1], -self.range, self.range) + self.range) * (self.levels / (2.0 * self.range))
        t[-1] = np.clip(x[-1], 0.0, 1.0) * self.levels
        codes = np.floor(t + rng.random(t.shape))
        return np.clip(codes, 0, self.levels).astype(np.uint32)

    def dequantize(self, codes: np.ndarray) -> np.ndarray:
        """One client's codes -> the floats they stand for (what its update counts as)."""
        return self.decode(codes, 1)

    def decode(self, total: np.ndarray, count: int = 1) -> np.ndarray:
        """The field sum of ``count`` clients' codes -> float64 sum of their dequantized values."""
        if not 1 <= count <= self.max_clients:
            raise ValueError(f"{count} vectors summed, the codec allows 1..{self.max_clients}")
        t = np.asarray(total, dtype=np.uint32).astype(np.float64)
        out = np.empty_like(t)
        out[:-1] = t[:-1] * self.step - count * self.range
        out[-1] = t[-1] / self.levels
        return out


def prg(seed: bytes, length: int) -> np.ndarray:
    """``length`` uniform field elements from a 32-byte seed (AES-256-CTR keystream).

    Every seed is used once (seeds are derived per round and per pair), so a fixed nonce is
    safe."""
    if len(seed) != 32:
        raise ValueError("a mask seed is 32 bytes")
    enc = Cipher(algorithms.AES(seed), modes.CTR(b"\x00" * 16)).encryptor()
    stream = enc.update(b"\x00" * (4 * int(length))) + enc.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


def flatten(weights: Sequence[np.ndarray]) -> Tuple[np.ndarray, List[Tuple[Tuple[int, ...], str]]]:
    """Weights (list of arrays) -> one float64 vector and the shapes/dtypes to restore them."""
    spec = [(tuple(np.shape(w)), str(np.asarray(w).dtype)) for w in weights]
    if not weights:
        return np.zeros(0), spec
    return np.concatenate([np.asarray(w, dtype=np.float64).reshape(-1) for w in weights]), spec


def unflatten(vec: np.ndarray, spec: Sequence[Tuple[Tuple[int, ...], str]]) -> List[np.ndarray]:
    out, pos = [], 0
    for shape, dtype in spec:
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        out.append(np.asarray(vec[pos:pos + n]).reshape(shape).astype(dtype))
        pos += n
    if pos != len(vec):
        raise ValueError(f"vector has {len(vec)} values, the model {pos}")
    return out
