"""Shamir secret sharing of 32-byte seeds over the prime field GF(2^521 - 1).

Why written here: Shamir's scheme is polynomial arithmetic over a prime field, not a cipher or
a hash; the randomness comes from :mod:`secrets`. A 32-byte secret (< 2^256) always fits below
the Mersenne prime 2^521 - 1, so a seed is shared whole, in one polynomial.
"""

from __future__ import annotations

import secrets
from typing import Dict, List, Mapping, Sequence, Tuple

__all__ = ["PRIME", "split", "combine", "ShamirError"]

PRIME = (1 << 521) - 1
_SHARE_BYTES = 66


class ShamirError(ValueError):
    """Too few or inconsistent shares to reconstruct a secret."""


def split(secret: bytes, xs: Sequence[int], threshold: int) -> Dict[int, bytes]:
    """Shares of ``secret`` at the points ``xs`` (distinct, 1..2^16); any ``threshold`` of them
    reconstruct it, fewer reveal nothing about it."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be 1..{len(xs)} (the number of shares)")
    if len(set(xs)) != len(xs) or any(not 0 < x < 1 << 16 for x in xs):
        raise ValueError("share points must be distinct integers in 1..65535")
    s = int.from_bytes(secret, "big")
    if s >= PRIME or len(secret) > 64:
        raise ValueError("secret too large")
    coeffs = [s] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[int(x)] = y.to_bytes(_SHARE_BYTES, "big")
    return out


def combine(shares: Mapping[int, bytes], threshold: int, length: int = 32) -> bytes:
    """The secret from at least ``threshold`` shares ``{x: y}`` (Lagrange interpolation at 0)."""
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} share(s), {threshold} needed")
    pts: List[Tuple[int, int]] = [(int(x), int.from_bytes(y, "big")) for x, y in sorted(shares.items())][:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >> (8 * length):
        raise ShamirError("shares are inconsistent (reconstructed value out of range)")
    return secret.to_bytes(length, "big")
