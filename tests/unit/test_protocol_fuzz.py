"""Property-based fuzzing (hypothesis) of the protocol decoder and the body validator.

The property everywhere: whatever the bytes, ``decode`` either returns an Envelope whose body has
the shape its kind requires, or raises a ``ProtocolError`` with a short, non-empty message. It
never crashes with another exception type, and it never accepts a frame that was changed after
signing. Examples are generated from three angles: raw bytes, mutations of real (golden) frames,
and correctly signed frames whose header fields and bodies are arbitrary (what a holder of the key,
e.g. a compromised device, could send).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mesh_agent.protocol import (
    PROTOCOL_VERSION,
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    ReplayGuard,
    decode,
    encode,
    open_frame,
    peek_endpoint,
    validate_body,
)

KEY = bytes(range(32))
EP = "ep-0123456789ab"
FRAMES = [bytes.fromhex(v["frame"]) for v in json.loads((Path(__file__).parent / "vectors" / "envelopes.json").read_text())["vectors"]]
REASONS = {"malformed", "bad signature", "stale or from the future", "replayed"}
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def refused_clearly(exc: ProtocolError) -> None:
    assert exc.reason in REASONS
    assert str(exc).strip(), "a refusal must say why"
    assert len(str(exc)) < 1000, "a refusal message must stay loggable"


def decode_or_refuse(frame: bytes, **kw: Any) -> Envelope | None:
    try:
        env = decode(frame, KEY, **kw)
    except ProtocolError as exc:
        refused_clearly(exc)
        return None
    validate_body(env.kind, env.body)  # anything decode accepts has the shape its kind requires
    return env


def sign(header: bytes, body: bytes, key: bytes = KEY) -> bytes:
    return header + hmac.new(key, header + body, hashlib.sha256).digest() + body


def header(endpoint: bytes, kind_code: int, msg_id: bytes, ts: float, exp: float, version: int = PROTOCOL_VERSION) -> bytes:
    return b"CM" + bytes([version, len(endpoint)]) + endpoint + bytes([kind_code, len(msg_id)]) + msg_id + struct.pack(">dd", ts, exp)


# ---------------------------------------------------------------------------------- raw bytes
@FUZZ
@given(st.binary(max_size=800))
def test_arbitrary_bytes_are_refused_with_a_reason(data: bytes) -> None:
    assert decode_or_refuse(data) is None
    for fn in (lambda: open_frame(data, KEY), lambda: peek_endpoint(data)):
        try:
            fn()
        except ProtocolError as exc:
            refused_clearly(exc)


@FUZZ
@given(st.binary(max_size=400))
def test_valid_magic_and_version_with_arbitrary_rest(rest: bytes) -> None:
    assert decode_or_refuse(b"CM" + bytes([PROTOCOL_VERSION]) + rest) is None


# ---------------------------------------------------------------------------------- mutations of real frames
_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("append"), st.just(0), st.binary(min_size=1, max_size=16)),
)


def mutate(frame: bytes, ops: list[tuple[str, int, Any]]) -> bytes:
    b = bytearray(frame)
    for op, pos, arg in ops:
        pos = pos % (len(b) + 1)
        if op == "flip" and b:
            b[pos % len(b)] ^= arg
        elif op == "insert":
            b[pos:pos] = arg
        elif op == "delete":
            del b[pos : pos + arg]
        elif op == "truncate":
            del b[pos:]
        elif op == "append":
            b += arg
    return bytes(b)


@FUZZ
@given(st.sampled_from(FRAMES), st.lists(_mutation, min_size=1, max_size=4))
def test_any_change_to_a_signed_frame_is_refused(frame: bytes, ops: list[tuple[str, int, Any]]) -> None:
    bad = mutate(frame, ops)
    assume(bad != frame)
    ts = open_frame(frame, KEY).ts
    assert decode_or_refuse(bad, now=ts) is None


@FUZZ
@given(st.sampled_from(FRAMES), st.sampled_from(FRAMES), st.integers(0, 400), st.integers(0, 400))
def test_spliced_frames_are_refused(a: bytes, b: bytes, cut_a: int, cut_b: int) -> None:
    spliced = a[: cut_a % (len(a) + 1)] + b[cut_b % (len(b) + 1) :]
    assume(spliced not in FRAMES)
    assert decode_or_refuse(spliced, check_fresh=False) is None


# ---------------------------------------------------------------------------------- signed by a key holder
_leaf = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8)
)
_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=4)
_keys = st.sampled_from(["tasks", "functions", "results", "ids", "want", "nonce", "capacity", "have", "reply_to",
                         "hub_time", "heartbeat_s", "code", "message", "warm", "cpu", "id", "fn", "args", "ok", "data"])
# Bodies that look like the real thing: the keys receivers read, values of every type, nested lists of maps.
_body = st.dictionaries(_keys, _leaf | _value | st.lists(st.dictionaries(_keys, _leaf, max_size=6), max_size=3), max_size=4)


@settings(FUZZ, max_examples=150)
@given(
    kind_code=st.integers(0, 255),
    msg_id=st.binary(min_size=0, max_size=20),
    ts=st.floats(allow_nan=True, allow_infinity=True),
    exp=st.floats(allow_nan=True, allow_infinity=True),
    body=_body,
)
def test_signed_frames_with_arbitrary_header_fields_and_bodies(kind_code: int, msg_id: bytes, ts: float, exp: float, body: dict[str, Any]) -> None:
    frame = sign(header(EP.encode(), kind_code, msg_id, ts, exp), msgpack.packb(body, use_bin_type=True))
    decode_or_refuse(frame, check_fresh=False)
    decode_or_refuse(frame, now=time.time(), replay=ReplayGuard())


@FUZZ
@given(kind=st.sampled_from(list(Kind)), raw=st.binary(max_size=300))
def test_signed_frames_with_arbitrary_body_bytes(kind: Kind, raw: bytes) -> None:
    from mesh_agent.protocol import KIND_CODES

    now = time.time()
    frame = sign(header(EP.encode(), KIND_CODES[kind], b"m", now, now + 60), raw)
    decode_or_refuse(frame, now=now)


@settings(FUZZ, max_examples=150)
@given(kind=st.sampled_from(list(Kind)), body=_body)
def test_validator_accepts_only_what_handlers_can_read(kind: Kind, body: dict[str, Any]) -> None:
    """When the validator passes, every field a handler reads has the type the handler assumes."""
    try:
        validate_body(kind, body)
    except BadFrame as exc:
        refused_clearly(exc)
        return
    if kind is Kind.TASKS:
        assert all(isinstance(t["id"], str) and isinstance(t["fn"], str) and isinstance(t["args"], bytes) for t in body["tasks"])
        assert all(isinstance(v, bytes) for v in (body.get("functions") or {}).values())
    elif kind is Kind.RESULTS:
        assert all(isinstance(r["id"], str) and isinstance(r["ok"], bool) and isinstance(r["data"], bytes) for r in body["results"])
    elif kind in (Kind.ACK, Kind.RESULT_ACK):
        assert all(isinstance(i, str) for i in body["ids"])
    elif kind is Kind.FETCH:
        assert isinstance(body["want"], int) and body["want"] >= 0
    elif kind is Kind.HELLO:
        assert isinstance(body["nonce"], str) and all(isinstance(i, str) for i in body.get("have", []))


# ---------------------------------------------------------------------------------- round trip
_ascii_id = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None, database=None)
@given(kind=st.sampled_from(list(Kind)), body=st.dictionaries(st.text(max_size=6), _value, max_size=4), ts=st.floats(0, 4e9), msg_id=_ascii_id)
def test_encode_decode_round_trip(kind: Kind, body: dict[str, Any], ts: float, msg_id: str) -> None:
    env = Envelope(kind, EP, body, id=msg_id, ts=ts, exp=ts + 60)
    out = decode(encode(env, KEY), KEY, now=ts, validate=False)
    assert (out.kind, out.endpoint, out.id, out.ts, out.exp) == (kind, EP, msg_id, ts, ts + 60)
    assert msgpack.packb(out.body, use_bin_type=True) == msgpack.packb(body, use_bin_type=True)  # NaN-safe equality


@settings(max_examples=100, deadline=None, database=None)
@given(key=st.binary(min_size=32, max_size=32), other=st.binary(min_size=32, max_size=32))
def test_a_frame_verifies_only_under_its_own_key(key: bytes, other: bytes) -> None:
    assume(key != other)
    frame = encode(Envelope(Kind.FETCH, EP, {"want": 1}), key)
    assert decode(frame, key).body == {"want": 1}
    try:
        decode(frame, other)
    except BadSignature as exc:
        refused_clearly(exc)
    else:
        raise AssertionError("accepted under a foreign key")
