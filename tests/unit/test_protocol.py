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
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from mesh_agent.protocol import (
    DOWN_KINDS,
    KIND_CODES,
    UP_KINDS,
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
    open_frame,
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


KIND_CODE = {"hello": 1, "welcome": 2, "fetch": 3, "tasks": 4, "ack": 5, "results": 6, "result_ack": 7, "heartbeat": 8, "error": 9, "gone": 10,
             "site_up": 11, "site_down": 12}


def documented_header(endpoint: str, kind: str, msg_id: str, ts: float, exp: float) -> bytes:
    """The v2 header exactly as docs/protocol.md section 1 describes it (no library code)."""
    ep, mid = endpoint.encode("ascii"), msg_id.encode("ascii")
    return b"CM" + bytes([2, len(ep)]) + ep + bytes([KIND_CODE[kind], len(mid)]) + mid + struct.pack(">dd", ts, exp)


@pytest.mark.parametrize("vec", VECTORS, ids=ids)
def test_golden_frame_matches_documented_layout(vec: dict[str, Any]) -> None:
    """Rebuild each frame from docs/protocol.md alone, without calling encode()."""
    header = documented_header(vec["endpoint"], vec["kind"], vec["id"], vec["ts"], vec["exp"])
    body = msgpack.packb(from_jsonable(vec["body"]), use_bin_type=True)
    mac = hmac.new(bytes.fromhex(vec["key"]), header + body, hashlib.sha256).digest()
    frame = frame_of(vec)
    assert frame == header + mac + body
    ep = vec["endpoint"].encode()
    assert frame[:2] == b"CM" and frame[2] == 2 and frame[3] == len(ep) == 15
    assert frame[4 : 4 + len(ep)] == ep
    assert frame[4 + len(ep)] == KIND_CODE[vec["kind"]]
    assert frame[len(header) : len(header) + 32] == mac
    assert peek_endpoint(frame) == vec["endpoint"]


def test_welcome_vector_is_bound_to_the_hello_nonce() -> None:
    hello = next(v for v in VECTORS if v["kind"] == "hello")
    welcome = next(v for v in VECTORS if v["kind"] == "welcome")
    assert welcome["id"] == welcome["body"]["reply_to"] == hello["body"]["nonce"]


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
    for v in (0, 1, 3, 255):
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
    header_and_mac = 4 + 15 + 2 + len(VECTORS[0]["id"]) + 16 + 32
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


def _signed(body: bytes, key: bytes = KEY, endpoint: str = EP, kind: str = "fetch", msg_id: str = "x",
            ts: float = 1.0, exp: float = 2.0) -> bytes:
    """A correctly signed v2 frame around arbitrary body bytes."""
    header = documented_header(endpoint, kind, msg_id, ts, exp)
    return header + hmac.new(key, header + body, hashlib.sha256).digest() + body


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x93\x01\x02\x03",  # an array, not a map
        msgpack.packb("hello"),
        msgpack.packb({1: 2}),  # non-str map key
        msgpack.packb({"want": 1}) + b"\x00",  # trailing bytes
        msgpack.packb({"s": b"\xff"}, use_bin_type=False),  # bad utf-8
        b"\x91" * 5000,  # nesting deeper than the unpacker's stack
    ],
)
def test_signed_but_malformed_body_is_bad_frame(body: bytes) -> None:
    with pytest.raises(BadFrame, match="malformed"):
        decode(_signed(body), KEY, check_fresh=False)


@pytest.mark.parametrize(
    "kind, body, message",
    [
        ("fetch", {}, "missing 'want'"),
        ("fetch", {"want": -1}, "want must be an int >= 0"),
        ("fetch", {"want": "3"}, "want must be an int >= 0, got str"),
        ("tasks", {"tasks": [{"id": "t", "fn": "f"}], "functions": {}}, "tasks[0] has no 'args'"),
        ("tasks", {"tasks": [{"id": "t", "fn": "f", "args": "x"}]}, "tasks[0].args must be bytes, got str"),
        ("tasks", {"tasks": [{"id": "t", "fn": "f", "args": b"x", "timeout": -1}]}, "tasks[0].timeout"),
        ("tasks", {"tasks": [], "functions": {"f": "not bytes"}}, "functions"),
        ("results", {"results": [{"id": "t", "ok": 1, "data": b""}]}, "results[0].ok must be a bool"),
        ("results", {"results": [{"id": "", "ok": True, "data": b""}]}, "results[0].id"),
        ("results", {"results": [{"id": "t", "ok": True, "data": b"", "started": float("nan")}]}, "results[0].started"),
        ("ack", {"ids": ["a", 3]}, "ids[1] must be a non-empty string id, got int"),
        ("result_ack", {"ids": "abc"}, "ids must be a list"),
        ("hello", {"nonce": "n", "capacity": -2}, "capacity"),
        ("hello", {"nonce": "n", "capacity": 1, "have": [None]}, "have[0]"),
        ("welcome", {"reply_to": "n"}, "missing 'hub_time'"),
        ("heartbeat", {"cpu": "hot"}, "cpu"),
        ("error", {"code": 5}, "code must be a short string"),
    ],
)
def test_signed_body_of_the_wrong_shape_is_bad_frame_naming_the_field(kind: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadFrame) as info:
        decode(_signed(msgpack.packb(body, use_bin_type=True), kind=kind), KEY, check_fresh=False)
    assert message in str(info.value) and str(info.value).startswith(f"{kind} body")


def test_unknown_body_keys_are_ignored() -> None:
    env = decode(_signed(msgpack.packb({"want": 2, "future_field": [1, 2]}), kind="fetch"), KEY, check_fresh=False)
    assert env.body["want"] == 2


def test_unknown_kind_code_and_empty_message_id_are_bad_frame() -> None:
    good = _signed(msgpack.packb({"want": 1}))
    pos = 4 + len(EP)
    for code in (0, 13, 127, 128, 255):  # 0x80 is the compression flag: 128 is kind 0, 255 kind 127
        bad = bytearray(good)
        bad[pos] = code
        with pytest.raises(BadFrame, match="unknown message kind"):
            decode(bytes(bad), KEY, check_fresh=False)
    with pytest.raises(BadFrame, match="message id"):
        encode(Envelope(Kind.FETCH, EP, {"want": 1}, id=""), KEY)
    with pytest.raises(BadFrame, match="message id"):
        encode(Envelope(Kind.FETCH, EP, {"want": 1}, id="ä"), KEY)


def test_freshness_and_replay_are_checked_before_the_body_is_parsed() -> None:
    """A stale or replayed frame with a body msgpack cannot even parse is Stale/Replayed, not BadFrame:
    proof that nothing of the body was touched before those checks."""
    garbage = b"\xc1\xc1\xc1"
    with pytest.raises(Stale):
        decode(_signed(garbage, ts=1.0, exp=2.0), KEY, now=1000.0)
    now = time.time()
    guard = ReplayGuard()
    guard.check(Envelope(Kind.FETCH, EP, {}, id="seen", ts=now, exp=now + 60), now=now)
    with pytest.raises(Replayed):
        decode(_signed(garbage, msg_id="seen", ts=now, exp=now + 60), KEY, now=now, replay=guard)
    with pytest.raises(BadFrame):  # and with a fresh, unseen id the same body is refused as malformed
        decode(_signed(garbage, msg_id="new", ts=now, exp=now + 60), KEY, now=now, replay=guard)


def test_open_frame_leaves_the_body_unparsed() -> None:
    sealed = open_frame(_signed(b"\xc1 not msgpack", kind="tasks", msg_id="abc", ts=5.0, exp=6.0), KEY)
    assert (sealed.kind, sealed.endpoint, sealed.id, sealed.ts, sealed.exp) == (Kind.TASKS, EP, "abc", 5.0, 6.0)
    assert sealed.payload == b"\xc1 not msgpack"
    with pytest.raises(BadFrame, match="malformed"):
        sealed.open()


def test_replay_guard_is_per_endpoint() -> None:
    guard = ReplayGuard()
    now = time.time()
    guard.check(Envelope(Kind.ACK, "ep-a", {}, id="same", ts=now, exp=now + 60), now=now)
    guard.check(Envelope(Kind.ACK, "ep-b", {}, id="same", ts=now, exp=now + 60), now=now)
    with pytest.raises(Replayed):
        guard.check(Envelope(Kind.ACK, "ep-a", {}, id="same", ts=now, exp=now + 60), now=now)


def test_directions_partition_the_kinds() -> None:
    assert UP_KINDS | DOWN_KINDS == set(Kind) and not UP_KINDS & DOWN_KINDS
    assert sorted(KIND_CODES.values()) == list(range(1, 13))


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


# Property-based fuzzing of the decoder lives in test_protocol_fuzz.py.


# ---------------------------------------------------------------------------------- regressions
def test_signed_deeply_nested_body_is_bad_frame() -> None:
    nested: Any = []
    for _ in range(1020):
        nested = [nested]
    with pytest.raises(BadFrame):
        decode(_signed(msgpack.packb({"want": nested})), KEY, check_fresh=False)


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
