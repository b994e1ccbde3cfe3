"""The signed, versioned envelope every message between hub and agent travels in.

Frame layout (all of it covered by the MAC except the MAC itself)::

    b"CM" | version (1 byte) | len(endpoint) (1 byte) | endpoint id (ascii) | mac (32 bytes) | payload

``payload`` is msgpack: ``{"k": kind, "id": message id, "ts": sent at, "exp": expires at, "b": body}``.
The MAC is HMAC-SHA256 with the endpoint's own key. The endpoint id sits in clear text in
front so the receiver can pick the key *before* it parses anything; the MAC is checked before
the payload is unpacked, and freshness and replay are checked before any body is used. Nothing
in a body is ever unpickled by this module: task code and arguments stay opaque bytes until the
engine runs an already-verified task.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "Kind",
    "Envelope",
    "ProtocolError",
    "BadFrame",
    "BadSignature",
    "Stale",
    "Replayed",
    "encode",
    "decode",
    "check_freshness",
    "peek_endpoint",
    "ReplayGuard",
    "new_key",
    "MAX_FRAME_BYTES",
]

PROTOCOL_VERSION = 1
_MAGIC = b"CM"
_MAC_LEN = 32
#: Hard cap on one frame; a batch larger than this is split by the sender.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Kind(str, Enum):
    """Message kinds. Agent to hub: hello, fetch, ack, results, heartbeat. Hub to agent: the rest."""

    HELLO = "hello"  # register on (re)connect: capacity, what the agent already holds
    WELCOME = "welcome"  # hub's answer to hello: its clock, heartbeat period
    FETCH = "fetch"  # credit: "I can take this many more tasks"
    TASKS = "tasks"  # a batch of tasks, each function body at most once
    ACK = "ack"  # agent stored these tasks durably
    RESULTS = "results"  # a batch of results
    RESULT_ACK = "result_ack"  # hub stored these results durably
    HEARTBEAT = "heartbeat"  # liveness, capacity, queue depth, resources
    ERROR = "error"  # hub refuses something (unknown endpoint, disabled, ...)


class ProtocolError(ValueError):
    """A frame was refused; ``reason`` is short and safe to log."""

    reason = "bad frame"


class BadFrame(ProtocolError):
    reason = "malformed"


class BadSignature(ProtocolError):
    reason = "bad signature"


class Stale(ProtocolError):
    reason = "stale or from the future"


class Replayed(ProtocolError):
    reason = "replayed"


@dataclass(frozen=True)
class Envelope:
    kind: Kind
    endpoint: str
    body: dict[str, Any]
    id: str = field(default_factory=lambda: os.urandom(12).hex())
    ts: float = field(default_factory=time.time)
    exp: float = 0.0  # 0 = ts + default TTL at encode time


def new_key() -> bytes:
    return os.urandom(32)


def _prefix(endpoint: str) -> bytes:
    try:
        ep = endpoint.encode("ascii")
    except UnicodeEncodeError:
        raise BadFrame("endpoint id must be ascii") from None
    if not ep or len(ep) > 255:
        raise BadFrame("endpoint id must be 1-255 ascii characters")
    return _MAGIC + bytes((PROTOCOL_VERSION, len(ep))) + ep


def encode(env: Envelope, key: bytes, ttl: float = 120.0) -> bytes:
    """Serialize and sign. ``ttl`` applies when the envelope has no explicit expiry."""
    exp = env.exp or env.ts + ttl
    payload = msgpack.packb(
        {"k": env.kind.value, "id": env.id, "ts": env.ts, "exp": exp, "b": env.body},
        use_bin_type=True,
    )
    prefix = _prefix(env.endpoint)
    mac = hmac.new(key, prefix + payload, hashlib.sha256).digest()
    return prefix + mac + payload


def peek_endpoint(frame: bytes) -> str:
    """The endpoint id in a frame's clear header, to choose the verification key. Trust nothing else."""
    if len(frame) < 4 + _MAC_LEN or frame[:2] != _MAGIC:
        raise BadFrame("not a Continuum Mesh frame")
    if frame[2] != PROTOCOL_VERSION:
        raise BadFrame(f"unsupported protocol version {frame[2]} (this side speaks {PROTOCOL_VERSION})")
    n = frame[3]
    if n == 0 or len(frame) < 4 + n + _MAC_LEN:
        raise BadFrame("truncated frame header")
    try:
        return bytes(frame[4 : 4 + n]).decode("ascii")
    except UnicodeDecodeError:
        raise BadFrame("endpoint id is not ascii") from None


def decode(
    frame: bytes,
    key: bytes,
    *,
    now: float | None = None,
    max_skew: float = 30.0,
    check_fresh: bool = True,
    replay: "ReplayGuard | None" = None,
) -> Envelope:
    """Verify MAC, then unpack, then check freshness and replay. Raises :class:`ProtocolError`."""
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    endpoint = peek_endpoint(frame)
    start = 4 + len(endpoint)
    mac = frame[start : start + _MAC_LEN]
    payload = frame[start + _MAC_LEN :]
    want = hmac.new(key, bytes(frame[:start]) + bytes(payload), hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        raise BadSignature("MAC does not match the endpoint's key")
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        kind = Kind(d["k"])
        mid, ts, exp = d["id"], d["ts"], d["exp"]
        if not isinstance(mid, str) or len(mid) > 256:
            raise TypeError("id must be a short string")
        if not all(type(x) in (int, float) and math.isfinite(x) for x in (ts, exp)):
            raise TypeError("ts and exp must be finite numbers")
        env = Envelope(kind, endpoint, d["b"], mid, float(ts), float(exp))
        if not isinstance(env.body, dict):
            raise TypeError("body is not a map")
    except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadFrame(f"signed payload is malformed: {exc}") from None
    if check_fresh:
        check_freshness(env, now=now, max_skew=max_skew)
    if replay is not None:
        replay.check(env, now=now)
    return env


def check_freshness(env: Envelope, *, now: float | None = None, max_skew: float = 30.0) -> None:
    """Refuse an expired envelope, or one stamped further in the future than clocks can drift."""
    t = time.time() if now is None else now
    if not (math.isfinite(env.ts) and math.isfinite(env.exp)):
        raise Stale("timestamps are not finite")
    if t > env.exp:
        raise Stale(f"expired {t - env.exp:.1f}s ago")
    if env.ts > t + max_skew:
        raise Stale(f"sent {env.ts - t:.1f}s in the future")


class ReplayGuard:
    """Remembers message ids until they expire; a second sighting within that window is a replay.

    Memory is bounded: beyond ``max_ids`` the oldest entries go, and with them messages whose
    expiry is past anyway under any realistic rate.
    """

    def __init__(self, max_ids: int = 200_000) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._max = max_ids

    def check(self, env: Envelope, now: float | None = None) -> None:
        """``now`` must be on the same clock as the freshness check (the agent uses the hub's)."""
        if env.id in self._seen:
            raise Replayed(f"message {env.id} seen before")
        self._seen[env.id] = env.exp
        now = time.time() if now is None else now
        while self._seen and (len(self._seen) > self._max or next(iter(self._seen.values())) < now - 600):
            self._seen.popitem(last=False)
