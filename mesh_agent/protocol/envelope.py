"""The signed, versioned envelope every message between hub and agent travels in.

Frame layout, version 2 (all of it covered by the MAC except the MAC itself)::

    b"CM" | version (1) | n (1) | endpoint id (n, ascii) | kind (1) | m (1) | message id (m, ascii)
          | ts (8, float64 BE) | exp (8, float64 BE) | mac (32) | body (msgpack map)

The kind byte's high bit (0x80) says the body is zlib-compressed msgpack. A sender sets it only for
bodies over ``COMPRESS_MIN_BYTES`` that shrink, and only to a peer that said it reads them (the
agent in its hello, the hub in its welcome); a peer that predates it refuses such a frame as an
unknown kind, cleanly, instead of misreading it. The MAC covers the bytes as sent, so nothing is
decompressed before the MAC passed, and decompression stops at ``MAX_FRAME_BYTES``.

Everything a receiver needs to decide whether to trust a frame (who it is for, what kind, its
id, when it was sent and when it expires) sits in a fixed binary header in front of the body.
So the order is: parse the header by hand, check the MAC (HMAC-SHA256 with the endpoint's own
key), check freshness and replay, and only then hand the body to msgpack. A forged, tampered,
stale or replayed frame is refused before a single byte of its body is deserialized
(DESIGN invariant 3). Nothing in a body is ever unpickled by this module: task code and
arguments stay opaque bytes until the engine runs an already-verified task.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "Kind",
    "KIND_CODES",
    "UP_KINDS",
    "DOWN_KINDS",
    "Envelope",
    "Sealed",
    "ProtocolError",
    "BadFrame",
    "BadSignature",
    "Stale",
    "Replayed",
    "encode",
    "decode",
    "open_frame",
    "check_freshness",
    "peek_endpoint",
    "peek_kind",
    "ReplayGuard",
    "new_key",
    "MAX_FRAME_BYTES",
    "COMPRESS_MIN_BYTES",
]

PROTOCOL_VERSION = 2
_MAGIC = b"CM"
_MAC_LEN = 32
_TIMES = struct.Struct(">dd")
#: Hard cap on one frame; a batch larger than this is split by the sender.
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Bodies up to this size are never compressed: on a small frame zlib's header eats the gain.
COMPRESS_MIN_BYTES = 1024
_ZFLAG = 0x80  # in the kind byte: body is zlib-compressed


class Kind(str, Enum):
    """Message kinds. Agent to hub: hello, fetch, ack, results, heartbeat, gone, site_up. Hub to
    agent: the rest. The two site kinds pass only between the hub and a site gateway."""

    HELLO = "hello"  # register on (re)connect: capacity, what the agent already holds
    WELCOME = "welcome"  # hub's answer to hello: its clock, heartbeat period
    FETCH = "fetch"  # credit: "I can take this many more tasks"
    TASKS = "tasks"  # a batch of tasks, each function body at most once
    ACK = "ack"  # agent stored these tasks durably
    RESULTS = "results"  # a batch of results
    RESULT_ACK = "result_ack"  # hub stored these results durably
    HEARTBEAT = "heartbeat"  # liveness, capacity, queue depth, resources
    ERROR = "error"  # hub refuses something (unknown endpoint, disabled, ...)
    GONE = "gone"  # the agent's connection ended: its MQTT will, or said on a clean stop
    SITE_UP = "site_up"  # a site gateway's batch of its devices' frames, each unchanged (docs/sites.md)
    SITE_DOWN = "site_down"  # the hub's batch of frames for a gateway's devices, each unchanged


#: The one-byte kind code in the header. Fixed forever within a protocol version.
KIND_CODES: dict[Kind, int] = {
    Kind.HELLO: 1,
    Kind.WELCOME: 2,
    Kind.FETCH: 3,
    Kind.TASKS: 4,
    Kind.ACK: 5,
    Kind.RESULTS: 6,
    Kind.RESULT_ACK: 7,
    Kind.HEARTBEAT: 8,
    Kind.ERROR: 9,
    Kind.GONE: 10,
    Kind.SITE_UP: 11,
    Kind.SITE_DOWN: 12,
}
_KIND_OF = {code: kind for kind, code in KIND_CODES.items()}
#: Direction of each kind. Both sides share one key per endpoint, so a receiver refuses a kind that
#: only the other direction sends: a frame cannot be reflected back at its sender.
UP_KINDS = frozenset({Kind.HELLO, Kind.FETCH, Kind.ACK, Kind.RESULTS, Kind.HEARTBEAT, Kind.GONE, Kind.SITE_UP})
DOWN_KINDS = frozenset({Kind.WELCOME, Kind.TASKS, Kind.RESULT_ACK, Kind.ERROR, Kind.SITE_DOWN})


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


class _Stamped(Protocol):
    """What freshness and replay checks read: header fields only, never the body."""

    @property
    def endpoint(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def ts(self) -> float: ...
    @property
    def exp(self) -> float: ...


@dataclass(frozen=True)
class Sealed:
    """A frame whose header parsed and whose MAC matched; its body is still raw msgpack bytes.

    Callers check freshness and replay on this, then call :meth:`open`; until then nothing of
    the body has been parsed.
    """

    kind: Kind
    endpoint: str
    id: str
    ts: float
    exp: float
    payload: bytes
    compressed: bool = False

    def open(self, *, validate: bool = True) -> Envelope:
        """Unpack the body (msgpack, after zlib if flagged) and, by default, check its fields for this kind."""
        payload = _inflate(self.payload) if self.compressed else self.payload
        try:
            body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise BadFrame(f"signed body is malformed: {exc}") from None
        if not isinstance(body, dict):
            raise BadFrame(f"signed body is malformed: a {type(body).__name__}, not a map")
        if validate:
            from mesh_agent.protocol.bodies import validate_body

            validate_body(self.kind, body)
        return Envelope(self.kind, self.endpoint, body, self.id, self.ts, self.exp)


def new_key() -> bytes:
    return os.urandom(32)


def _inflate(data: bytes) -> bytes:
    """Decompress a flagged body, refusing corrupt or oversized input with a clear BadFrame."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, MAX_FRAME_BYTES)
    except zlib.error as exc:
        raise BadFrame(f"compressed body is corrupt: {exc}") from None
    if d.unconsumed_tail:
        raise BadFrame(f"compressed body inflates past {MAX_FRAME_BYTES} bytes")
    if not d.eof or d.unused_data:
        raise BadFrame("compressed body is truncated or has trailing bytes")
    return out


def _ascii_field(what: str, value: str) -> bytes:
    try:
        raw = value.encode("ascii")
    except (UnicodeEncodeError, AttributeError):
        raise BadFrame(f"{what} must be ascii") from None
    if not raw or len(raw) > 255:
        raise BadFrame(f"{what} must be 1-255 ascii characters")
    return raw


def _header(env: Envelope, exp: float, flags: int = 0) -> bytes:
    ep = _ascii_field("endpoint id", env.endpoint)
    mid = _ascii_field("message id", env.id)
    return (
        _MAGIC
        + bytes((PROTOCOL_VERSION, len(ep)))
        + ep
        + bytes((KIND_CODES[Kind(env.kind)] | flags, len(mid)))
        + mid
        + _TIMES.pack(float(env.ts), float(exp))
    )


def encode(env: Envelope, key: bytes, ttl: float = 120.0, *, compress: bool = False) -> bytes:
    """Serialize and sign. ``ttl`` applies when the envelope has no explicit expiry.

    ``compress``: the receiver reads compressed bodies; a body over ``COMPRESS_MIN_BYTES`` is then
    sent zlib-compressed when that makes it smaller (never a small frame)."""
    exp = env.exp or env.ts + ttl
    body = msgpack.packb(env.body, use_bin_type=True)
    flags = 0
    if compress and len(body) > COMPRESS_MIN_BYTES:
        packed = zlib.compress(body, 6)
        if len(packed) < len(body):
            body, flags = packed, _ZFLAG
    header = _header(env, exp, flags)
    mac = hmac.new(key, header + body, hashlib.sha256).digest()
    return header + mac + body


def _check_version(frame: bytes) -> None:
    if len(frame) < 4 or frame[:2] != _MAGIC:
        raise BadFrame("not a Continuum Mesh frame")
    if frame[2] != PROTOCOL_VERSION:
        raise BadFrame(f"unsupported protocol version {frame[2]} (this side speaks {PROTOCOL_VERSION})")


def peek_endpoint(frame: bytes) -> str:
    """The endpoint id in a frame's clear header, to choose the verification key. Trust nothing else."""
    _check_version(frame)
    n = frame[3]
    if n == 0 or len(frame) < 4 + n:
        raise BadFrame("truncated frame header")
    try:
        return bytes(frame[4 : 4 + n]).decode("ascii")
    except UnicodeDecodeError:
        raise BadFrame("endpoint id is not ascii") from None


def peek_kind(frame: bytes) -> Kind | None:
    """The kind in a frame's clear header, or None when the header does not parse. Trust nothing
    else: a relay uses it to route a frame, never to accept one."""
    try:
        return _parse_header(frame)[0]
    except (BadFrame, ValueError, IndexError):
        return None


def _parse_header(frame: bytes) -> tuple[Kind, str, str, float, float, int, bool]:
    """Fields of the header and its length; raises BadFrame. Reads no byte past the header."""
    endpoint = peek_endpoint(frame)
    pos = 4 + len(endpoint)
    if len(frame) < pos + 2:
        raise BadFrame("truncated frame header")
    kind = _KIND_OF.get(frame[pos] & ~_ZFLAG)
    if kind is None:
        raise BadFrame(f"unknown message kind code {frame[pos]}")
    compressed = bool(frame[pos] & _ZFLAG)
    m = frame[pos + 1]
    pos += 2
    if m == 0 or len(frame) < pos + m + _TIMES.size + _MAC_LEN:
        raise BadFrame("truncated frame header")
    try:
        mid = bytes(frame[pos : pos + m]).decode("ascii")
    except UnicodeDecodeError:
        raise BadFrame("message id is not ascii") from None
    pos += m
    ts, exp = _TIMES.unpack_from(frame, pos)
    return kind, endpoint, mid, ts, exp, pos + _TIMES.size, compressed


def open_frame(frame: bytes, key: bytes) -> Sealed:
    """Check size, header and MAC; return the still-unparsed body. Raises BadFrame or BadSignature."""
    if len(frame) > MAX_FRAME_BYTES:
        raise BadFrame(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    frame = bytes(frame)
    kind, endpoint, mid, ts, exp, end, compressed = _parse_header(frame)
    mac = frame[end : end + _MAC_LEN]
    payload = frame[end + _MAC_LEN :]
    want = hmac.new(key, frame[:end] + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, want):
        raise BadSignature("MAC does not match the endpoint's key")
    return Sealed(kind, endpoint, mid, ts, exp, payload, compressed)


def decode(
    frame: bytes,
    key: bytes,
    *,
    now: float | None = None,
    max_skew: float = 30.0,
    check_fresh: bool = True,
    replay: "ReplayGuard | None" = None,
    validate: bool = True,
) -> Envelope:
    """Verify MAC, then freshness, then replay, and only then unpack the body. Raises :class:`ProtocolError`."""
    sealed = open_frame(frame, key)
    if check_fresh:
        check_freshness(sealed, now=now, max_skew=max_skew)
    elif not (math.isfinite(sealed.ts) and math.isfinite(sealed.exp)):
        raise Stale("timestamps are not finite")
    if replay is not None:
        replay.check(sealed, now=now)
    return sealed.open(validate=validate)


def check_freshness(env: _Stamped, *, now: float | None = None, max_skew: float = 30.0) -> None:
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

    def check(self, env: _Stamped, now: float | None = None) -> None:
        """``now`` must be on the same clock as the freshness check (the agent uses the hub's)."""
        # Keyed per endpoint: one endpoint's ids can never block another's.
        key = f"{env.endpoint}\0{env.id}"
        if key in self._seen:
            raise Replayed(f"message {env.id} seen before")
        self._seen[key] = env.exp
        now = time.time() if now is None else now
        while self._seen and (len(self._seen) > self._max or next(iter(self._seen.values())) < now - 600):
            self._seen.popitem(last=False)

    def forget(self, env: _Stamped) -> None:
        """The receiver could not act on this message (its link dropped mid-way, its disk was full):
        let the same message in again. A site gateway re-delivers the very frame it holds, where
        the hub would have sent a new one (docs/sites.md)."""
        self._seen.pop(f"{env.endpoint}\0{env.id}", None)
