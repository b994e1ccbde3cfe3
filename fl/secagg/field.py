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

The mask generator is AES-256 in CTR mode from the ``cryptography`` package (a standard PRG
built from a standard cipher; nothing here is a primitive of our own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["FieldCodec", "MODULUS", "prg", "flatten", "unflatten"]

MODULUS = 1 << 32  # arithmetic in uint32 wraps modulo 2^32 by itself
_HALF = 1 << 31


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
