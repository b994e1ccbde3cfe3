"""Shamir secret sharing of 32-byte secrets (mask seeds, X25519 private keys), by PyCryptodome.

The ``cryptography`` package has no secret sharing, so the scheme comes from PyCryptodome's
:class:`Crypto.Protocol.SecretSharing.Shamir` (polynomials over GF(2^128), 16-byte secrets, the
coefficients from its CSPRNG): a 32-byte secret is split as two 16-byte halves, each shared
independently with the same threshold, and a share is the two 16-byte half-shares side by side.
Fewer than ``threshold`` shares reveal nothing about either half; ``threshold`` of them rebuild
both. Nothing here is arithmetic of our own.

Shares sit at the points ``1..n`` (PyCryptodome's indices): the protocol gives the holders of
one client's secrets, its neighbours and itself, the points ``1..n`` in sorted order
(:func:`positions`).
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

from Crypto.Protocol.SecretSharing import Shamir

__all__ = ["SECRET_BYTES", "SHARE_BYTES", "split", "combine", "positions", "ShamirError"]

SECRET_BYTES = 32
SHARE_BYTES = 32
_HALF = 16


class ShamirError(ValueError):
    """Too few or inconsistent shares to reconstruct a secret."""


def positions(holders: Sequence[str]) -> Dict[str, int]:
    """The share point of each holder of one secret: ``1..n`` in sorted order."""
    ids = sorted(str(h) for h in holders)
    if len(set(ids)) != len(ids):
        raise ValueError("share holders must be distinct")
    return {h: i + 1 for i, h in enumerate(ids)}


def split(secret: bytes, n: int, threshold: int) -> Dict[int, bytes]:
    """``n`` shares of a 32-byte ``secret`` at the points ``1..n``; any ``threshold`` of them
    reconstruct it, fewer reveal nothing about it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret is {SECRET_BYTES} bytes, not {len(secret)}")
    if not 2 <= threshold <= n:
        raise ValueError(f"threshold {threshold} must be 2..{n} (the number of shares)")
    if n >= 1 << 16:
        raise ValueError("at most 65535 shares")
    lo = dict(Shamir.split(threshold, n, bytes(secret[:_HALF])))
    hi = dict(Shamir.split(threshold, n, bytes(secret[_HALF:])))
    return {int(x): lo[x] + hi[x] for x in range(1, n + 1)}


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares ``{point: share}``."""
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} share(s), {threshold} needed")
    pts = sorted((int(x), bytes(y)) for x, y in shares.items())[:threshold]
    if any(not 0 < x < 1 << 16 or len(y) != SHARE_BYTES for x, y in pts):
        raise ShamirError(f"a share is a point in 1..65535 and {SHARE_BYTES} bytes")
    try:
        lo = Shamir.combine([(x, y[:_HALF]) for x, y in pts])
        hi = Shamir.combine([(x, y[_HALF:]) for x, y in pts])
    except ValueError as exc:
        raise ShamirError(f"shares do not combine: {exc}") from None
    return lo + hi
