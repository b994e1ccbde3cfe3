"""The signed envelope (mesh_agent.protocol.envelope) against golden vectors and hostile input.

The golden vectors in ``vectors/envelopes.json`` pin the wire format byte for byte: a change that
alters any of them breaks every deployed agent and must come with a ``PROTOCOL_VERSION`` bump
(regenerate with ``python tests/unit/vectors/generate.py``). See docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh_agent.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    Replayed,
    ReplayGuard,
    Stale,
    check_freshness,
    decode,
    encode,
    peek_endpoint,
)

VECTORS_FILE = Path(__file__).parent / "vectors" / "envelopes.json"
DATA = json.loads(VECTORS_FILE.read_text())
VECTORS: list[dict[str, Any]] = DATA["vectors"]
KEY = bytes(range(32))
EP = "ep-0123456789ab"


def from_jsonable(v: Any) -> Any:
    """Undo the ``{"__bytes__": hex}`` convention of the vector files."""
    if isinstance(v, dict):
        if set(v) == {"__bytes__"}:
            return bytes.fromhex(v["__bytes__"])
        return {k: from_jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_jsonable(x) for x in v]
    return v


def envelope_of(vec: dict[str, Any]) -> Envelope:
    return Envelope(Kind(vec["kind"]), vec["endpoint"], from_jsonable(vec["body"]), id=vec["id"], ts=vec["ts"], exp=vec["exp"])


def frame_of(vec: dict[str, Any]) -> bytes:
    return bytes.fromhex(vec["frame"])


def fresh_frame(kind: Kind = Kind.FETCH, body: dict[str, Any] | None = None, *, ts: float | None = None,
                exp: float = 0.0, key: bytes = KEY, endpoint: str = EP, msg_id: str | None = None) -> bytes:
    env = Envelope(kind, endpoint, {"want": 3} if body is None else body, ts=time.time() if ts is None else ts, exp=exp)
    if msg_id is not None:
        env = Envelope(env.kind, env.endpoint, env.body, id=msg_id, ts=env.ts, exp=env.exp)
    return encode(env, key)


def ids(vec: dict[str, Any]) -> str:
    return str(vec["name"])


# ---------------------------------------------------------------------------------- golden vectors
def test_vectors_cover_every_kind() -> None:
    assert DATA["protocol_version"] == PROTOCOL_VERSION
    assert {v["kind"] for v in VECTORS} == {k.value for k in Kind}
    assert all(bytes.fromhex(v["key"]) == KEY for v in VECTORS)


@pytest.mark.parametrize("vec", VECTORS, ids=ids)
def test_encode_matches_golden_frame(vec: dict[str, Any]) -> None:
    assert encode(envelope_of(vec), bytes.fromhex(vec["key"])) == frame_of(vec)


@pytest.mark.parametrize("vec", VECTORS, ids=ids)
def test_golden_frame_matches_documented_layout(vec: dict[str, Any]) -> None:
    """Rebuild each frame from docs/protocol.md alone, without calling encode()."""
    ep = vec["endpoint"].encode("ascii")
    prefix = b"CM" + bytes([PROTOCOL_VERSION, len(ep)]) + ep
    payload = msgpack.packb(
        {"k": vec["kind"], "id": vec["id"], "ts": vec["ts"], "exp": vec["exp"], "b": from_jsonable(vec["body"])},
        use_bin_type=True,
    )
    mac = hmac.new(bytes.fromhex(vec["key"]), prefix + payload, hashlib.sha256).digest()
    frame = frame_of(vec)
    assert frame == prefix + mac + payload
    assert frame[:2] == b"CM" and frame[2] == 1 and frame[3] == len(ep) == 15
    assert frame[4 : 4 + len(ep)] == ep
    assert frame[4 + len(ep) : 4 + len(ep) + 32] == mac
    assert peek_endpoint(frame) == vec["endpoint"]


@pytest.mark.parametrize("vec", VECTORS, ids=ids)
def test_decode_golden_frame(vec: dict[str, Any]) -> None:
    env = decode(frame_of(vec), KEY, now=vec["ts"])
    assert env == envelope_of(vec)
    assert env.body == from_jsonable(vec["body"])
    assert env.kind is Kind(vec["kind"])
    # Valid up to and including its expiry instant, and a receiver may be behind by up to max_skew.
    assert decode(frame_of(vec), KEY, now=vec["exp"]) == env
    assert decode(frame_of(vec), KEY, now=vec["ts"] - 29.0) == env


def test_bytes_stay_bytes_and_floats_stay_floats() -> None:
    vec = next(v for v in VECTORS if v["kind"] == "tasks")
    body = decode(frame_of(vec), KEY, now=vec["ts"]).body
    fn_id, fn_body = next(iter(body["functions"].items()))
    assert isinstance(fn_body, bytes) and hashlib.sha256(fn_body).hexdigest() == fn_id
    assert all(isinstance(t["args"], bytes) and t["args"].startswith(b"json\n") for t in body["tasks"])
    assert body["tasks"][0]["timeout"] is None and body["tasks"][1]["timeout"] == 30.0


def test_default_expiry_is_ts_plus_ttl() -> None:
    env = Envelope(Kind.FETCH, EP, {"want": 1}, id="x", ts=1000.0)
    assert decode(encode(env, KEY), KEY, check_fresh=False).exp == 1120.0
    assert decode(encode(env, KEY, ttl=5.0), KEY, check_fresh=False).exp == 1005.0


# ---------------------------------------------------------------------------------- tampering
@pytest.mark.parametrize("vec", VECTORS, ids=ids)
def test_every_single_byte_flip_is_refused(vec: dict[str, Any]) -> None:
    """Every position, one random non-zero XOR each (seeded): only BadFrame or BadSignature."""
    frame = frame_of(vec)
    rng = random.Random(vec["name"])
    for pos in range(len(frame)):
        bad = bytearray(frame)
        bad[pos] ^= rng.randrange(1, 256)
        with pytest.raises(ProtocolError) as info:
            decode(bytes(bad), KEY, now=vec["ts"])
        assert type(info.value) in (BadFrame, BadSignature), (pos, info.value)
        if pos < 3:  # magic and version are checked before any MAC
            assert type(info.value) is BadFrame


def test_random_multi_byte_corruption_is_refused() -> None:
    rng = random.Random(7)
    frames = [frame_of(v) for v in VECTORS]
    for _ in range(200):
        bad = bytearray(rng.choice(frames))
        for pos in rng.sample(range(len(bad)), rng.randint(2, 8)):
            bad[pos] ^= rng.randrange(1, 256)
        with pytest.raises((BadFrame, BadSignature)):
            decode(bytes(bad), KEY, check_fresh=False)


def test_wrong_key_is_bad_signature() -> None:
    vec = VECTORS[0]
    for key in (bytes(32), bytes([1]) + KEY[1:], KEY[:-1], KEY[:-1] + b"\x00", KEY + b"\x01", b""):
        with pytest.raises(BadSignature):
            decode(frame_of(vec), key, now=vec["ts"])


def test_frame_moved_to_another_endpoint_is_bad_signature() -> None:
    """The endpoint id is inside the MAC: relabelling a frame for another endpoint fails."""
    frame = frame_of(VECTORS[0])
    relabelled = frame[:4] + b"ep-0123456789ac" + frame[4 + 15 :]
    assert peek_endpoint(relabelled) == "ep-0123456789ac"
    with pytest.raises(BadSignature):
        decode(relabelled, KEY, check_fresh=False)


# ---------------------------------------------------------------------------------- malformed
def test_unsupported_version_is_bad_frame() -> None:
    frame = bytearray(frame_of(VECTORS[0]))
    for v in (0, 2, 255):
        frame[2] = v
        with pytest.raises(BadFrame, match="unsupported protocol version"):
            decode(bytes(frame), KEY, check_fresh=False)
        with pytest.raises(BadFrame):
            peek_endpoint(bytes(frame))


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, 10, 18, 19, 30, 50, 51, -1])
def test_truncated_frame_is_bad_frame_or_signature(cut: int) -> None:
    frame = frame_of(VECTORS[0])
    with pytest.raises((BadFrame, BadSignature)):
        decode(frame[:cut], KEY, check_fresh=False)


def test_truncated_header_is_bad_frame() -> None:
    frame = frame_of(VECTORS[0])
    header_and_mac = 4 + 15 + 32
    for n in range(header_and_mac):
        with pytest.raises(BadFrame):
            decode(frame[:n], KEY, check_fresh=False)
    # Header and MAC complete, payload gone: the MAC no longer matches.
    with pytest.raises(BadSignature):
        decode(frame[:header_and_mac], KEY, check_fresh=False)


def test_zero_length_endpoint_and_bad_magic_are_bad_frame() -> None:
    frame = bytearray(frame_of(VECTORS[0]))
    frame[3] = 0
    with pytest.raises(BadFrame):
        decode(bytes(frame), KEY, check_fresh=False)
    with pytest.raises(BadFrame, match="not a Continuum Mesh frame"):
        decode(b"XX" + frame_of(VECTORS[0])[2:], KEY, check_fresh=False)


def test_non_ascii_endpoint_in_header_is_bad_frame() -> None:
    frame = bytearray(frame_of(VECTORS[0]))
    frame[4] = 0xE9
    with pytest.raises(BadFrame, match="ascii"):
        peek_endpoint(bytes(frame))


def test_oversize_frame_is_bad_frame_before_any_work() -> None:
    frame = frame_of(VECTORS[0])
    huge = frame + bytes(MAX_FRAME_BYTES + 1 - len(frame))
    assert len(huge) == MAX_FRAME_BYTES + 1
    with pytest.raises(BadFrame, match="exceeds"):
        decode(huge, KEY, check_fresh=False)


def test_frame_at_the_size_limit_is_accepted() -> None:
    env = Envelope(Kind.RESULTS, EP, {"results": []}, id="big", ts=1.0, exp=2.0)
    overhead = len(encode(Envelope(env.kind, EP, {"results": [], "pad": b""}, id="big", ts=1.0, exp=2.0), KEY))
    # bin32 header is 5 bytes, bin8 (used for b"") is 2: 3 more bytes of framing for a large blob.
    pad = MAX_FRAME_BYTES - overhead - 3
    frame = encode(Envelope(env.kind, EP, {"results": [], "pad": bytes(pad)}, id="big", ts=1.0, exp=2.0), KEY)
    assert len(frame) == MAX_FRAME_BYTES
    assert len(decode(frame, KEY, check_fresh=False).body["pad"]) == pad


def _signed(payload: bytes, key: bytes = KEY, endpoint: str = EP) -> bytes:
    prefix = b"CM" + bytes([PROTOCOL_VERSION, len(endpoint)]) + endpoint.encode()
    return prefix + hmac.new(key, prefix + payload, hashlib.sha256).digest() + payload


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        msgpack.packb("hello"),
        msgpack.packb({"k": "hello", "id": "x", "ts": 1.0, "exp": 2.0}),  # no body
        msgpack.packb({"k": "nope", "id": "x", "ts": 1.0, "exp": 2.0, "b": {}}),  # unknown kind
        msgpack.packb({"k": "fetch", "id": "x", "ts": 1.0, "exp": 2.0, "b": [1]}),  # body not a map
        msgpack.packb({"k": "fetch", "id": "x", "ts": "soon", "exp": 2.0, "b": {}}),
        msgpack.packb({"k": "fetch", "id": "x", "ts": [1], "exp": 2.0, "b": {}}),
        msgpack.packb({"k": "fetch", "id": "x", "ts": 1.0, "exp": 2.0, "b": {1: 2}}),  # non-str map key
        msgpack.packb({"k": "fetch", "id": "x", "ts": 1.0, "exp": 2.0, "b": {}}) + b"\x00",  # trailing bytes
        msgpack.packb({"k": "fetch", "id": "x", "ts": 1.0, "exp": 2.0, "b": {"s": b"\xff"}}, use_bin_type=False),  # bad utf-8
        b"\x91" * 5000,  # nesting deeper than the unpacker's stack
    ],
)
def test_signed_but_malformed_payload_is_bad_frame(payload: bytes) -> None:
    with pytest.raises(BadFrame, match="malformed"):
        decode(_signed(payload), KEY, check_fresh=False)


# ---------------------------------------------------------------------------------- freshness
def test_expired_is_stale() -> None:
    vec = VECTORS[0]
    with pytest.raises(Stale, match="expired"):
        decode(frame_of(vec), KEY, now=vec["exp"] + 0.001)
    # Real time: the golden vectors are from 2023 and long expired.
    with pytest.raises(Stale):
        decode(frame_of(vec), KEY)
    # The freshness check can be deferred (the hub does so for hello), not the MAC.
    assert decode(frame_of(vec), KEY, check_fresh=False).id == vec["id"]


def test_future_beyond_skew_is_stale() -> None:
    now = 5_000.0
    ahead = encode(Envelope(Kind.FETCH, EP, {"want": 1}, id="f", ts=now + 31.0, exp=now + 200.0), KEY)
    with pytest.raises(Stale, match="future"):
        decode(ahead, KEY, now=now)
    assert decode(ahead, KEY, now=now, max_skew=31.0).ts == now + 31.0
    slightly = encode(Envelope(Kind.FETCH, EP, {"want": 1}, id="g", ts=now + 29.0, exp=now + 200.0), KEY)
    assert decode(slightly, KEY, now=now).id == "g"


def test_check_freshness_alone() -> None:
    env = Envelope(Kind.ACK, EP, {"ids": []}, id="a", ts=100.0, exp=220.0)
    check_freshness(env, now=100.0)
    check_freshness(env, now=220.0)
    with pytest.raises(Stale):
        check_freshness(env, now=220.5)
    with pytest.raises(Stale):
        check_freshness(env, now=69.0)


# ---------------------------------------------------------------------------------- replay
def test_replay_is_refused() -> None:
    guard = ReplayGuard()
    frame = fresh_frame(msg_id="once")
    assert decode(frame, KEY, replay=guard).id == "once"
    with pytest.raises(Replayed):
        decode(frame, KEY, replay=guard)
    # Another message (new id) is fine; the same id re-signed with a new timestamp is not.
    decode(fresh_frame(msg_id="twice"), KEY, replay=guard)
    with pytest.raises(Replayed):
        decode(fresh_frame(msg_id="once"), KEY, replay=guard)


def test_bad_frames_do_not_poison_the_replay_guard() -> None:
    """An id is remembered only after MAC and freshness passed: a forged frame cannot block a real one."""
    guard = ReplayGuard()
    forged = fresh_frame(msg_id="m1", key=bytes(32))
    with pytest.raises(BadSignature):
        decode(forged, KEY, replay=guard)
    stale = fresh_frame(msg_id="m2", ts=time.time() - 1000)
    with pytest.raises(Stale):
        decode(stale, KEY, replay=guard)
    decode(fresh_frame(msg_id="m1"), KEY, replay=guard)
    decode(fresh_frame(msg_id="m2"), KEY, replay=guard)


def test_replay_guard_is_bounded() -> None:
    guard = ReplayGuard(max_ids=3)
    exp = time.time() + 100
    for i in range(5):
        guard.check(Envelope(Kind.ACK, EP, {}, id=f"id{i}", ts=exp - 100, exp=exp))
    assert len(guard._seen) == 3
    guard.check(Envelope(Kind.ACK, EP, {}, id="id0", ts=exp - 100, exp=exp))  # evicted, so accepted again
    with pytest.raises(Replayed):
        guard.check(Envelope(Kind.ACK, EP, {}, id="id4", ts=exp - 100, exp=exp))


# ---------------------------------------------------------------------------------- encode side
def test_encode_refuses_bad_endpoint_ids() -> None:
    with pytest.raises(BadFrame):
        encode(Envelope(Kind.FETCH, "", {}), KEY)
    with pytest.raises(BadFrame):
        encode(Envelope(Kind.FETCH, "e" * 256, {}), KEY)
    assert peek_endpoint(encode(Envelope(Kind.FETCH, "e" * 255, {}), KEY)) == "e" * 255


# ---------------------------------------------------------------------------------- properties
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data, KEY)


_PREFIX = b"CM" + bytes([PROTOCOL_VERSION, len(EP)]) + EP.encode()


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_well_formed_header_with_arbitrary_rest_only_raises_protocol_error(rest: bytes) -> None:
    with pytest.raises((BadFrame, BadSignature)):
        decode(_PREFIX + rest, KEY)


_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=4)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {"k": st.sampled_from([k.value for k in Kind]), "id": st.text(max_size=8) | _leaf, "ts": st.floats() | _leaf,
         "exp": st.floats() | _leaf, "b": st.dictionaries(st.text(max_size=4), _value, max_size=3)},
    )
    | st.dictionaries(st.sampled_from(["k", "id", "ts", "exp", "b", "x"]), _leaf, max_size=6)
)
def test_correctly_signed_arbitrary_payload_decodes_or_raises_protocol_error(payload: dict[str, Any]) -> None:
    """Even a holder of the key cannot make decode() raise anything but ProtocolError."""
    frame = _signed(msgpack.packb(payload, use_bin_type=True))
    try:
        env = decode(frame, KEY, check_fresh=False)
    except ProtocolError:
        return
    assert isinstance(env.body, dict) and isinstance(env.kind, Kind)


@settings(max_examples=100, deadline=None, database=None)
@given(
    kind=st.sampled_from(list(Kind)),
    body=st.dictionaries(st.text(max_size=6), _value, max_size=4),
    ts=st.floats(0, 4e9),
    msg_id=st.text(max_size=30),
)
def test_encode_decode_round_trip(kind: Kind, body: dict[str, Any], ts: float, msg_id: str) -> None:
    env = Envelope(kind, EP, body, id=msg_id, ts=ts, exp=ts + 60)
    out = decode(encode(env, KEY), KEY, now=ts)
    assert (out.kind, out.endpoint, out.id, out.ts, out.exp) == (kind, EP, msg_id, ts, ts + 60)
    assert msgpack.packb(out.body, use_bin_type=True) == msgpack.packb(body, use_bin_type=True)  # NaN-safe equality


# ---------------------------------------------------------------------------------- known library bugs
# Each xfail pins a defect reported to the maintainers (see the final report / docs/protocol.md,
# "Known gaps"). strict=True: when the library is fixed, the XPASS fails, so the marker gets removed.
def test_signed_deeply_nested_id_is_bad_frame() -> None:
    nested: Any = []
    for _ in range(1020):
        nested = [nested]
    payload = msgpack.packb({"k": "fetch", "id": nested, "ts": 1.0, "exp": 2.0, "b": {}})
    with pytest.raises(BadFrame):
        decode(_signed(payload), KEY, check_fresh=False)


def test_nan_timestamps_are_refused() -> None:
    frame = encode(Envelope(Kind.FETCH, EP, {"want": 1}, id="n", ts=1.0, exp=math.nan), KEY)
    with pytest.raises(ProtocolError):
        decode(frame, KEY)


def test_encode_non_ascii_endpoint_is_bad_frame() -> None:
    with pytest.raises(BadFrame):
        encode(Envelope(Kind.FETCH, "ép", {}), KEY)


def test_replay_guard_follows_the_freshness_clock() -> None:
    """The agent checks freshness on the hub's clock (now=time.time()+offset) but the guard prunes
    entries by its own time.time(): with the local clock > ~12 min ahead of the hub, every id is
    forgotten on insertion and a replayed frame is accepted while still fresh."""
    hub_now = time.time() - 3600  # agent's clock is an hour ahead of the hub's
    guard = ReplayGuard()
    frame = encode(Envelope(Kind.TASKS, EP, {"tasks": [], "functions": {}}, id="t", ts=hub_now), KEY)
    decode(frame, KEY, now=hub_now, replay=guard)
    with pytest.raises(Replayed):
        decode(frame, KEY, now=hub_now, replay=guard)
