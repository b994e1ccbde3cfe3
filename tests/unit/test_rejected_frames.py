"""The hub's rejected-frame counter (``mesh_frames_rejected_total{endpoint,reason}``, issue 25 item 8):
each refusal gets one of a fixed set of reasons, and the endpoint label cannot grow without bound
or be chosen by a sender. The real frames and the real /metrics are in
tests/integration/test_stolen_device.py."""

from __future__ import annotations

from collections import Counter

from cloud_hub.dispatcher import (
    REJECT_LABELS_MAX,
    REJECT_REASONS,
    Dispatcher,
    _refused,
    reject_reason,
)
from mesh_agent.protocol import (
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    Replayed,
    Stale,
    encode,
    new_key,
    open_frame,
)


def test_each_refusal_has_one_reason_of_the_fixed_set() -> None:
    cases = {
        BadSignature("mac mismatch"): "bad_mac",
        Stale("expired 30 s ago"): "stale",
        Replayed("seen"): "replay",
        BadFrame("truncated frame header"): "malformed",
        BadFrame("frame of 70000000 bytes exceeds 67108864"): "oversize",
        BadFrame("compressed body inflates past 67108864 bytes"): "oversize",
        ValueError("result 1 has no 'data' (bytes)"): "malformed",
        _refused(BadFrame("a tasks frame cannot come from an agent (reflected?)"), "wrong_direction"): "wrong_direction",
        _refused(ProtocolError("frame for ep-b arrived on ep-a's channel"), "wrong_channel"): "wrong_channel",
        _refused(ProtocolError("unknown endpoint ep-x"), "unknown_endpoint"): "unknown_endpoint",
        _refused(BadFrame("inner frame for ep-y, which is not a device of this gateway"), "foreign_device"): "foreign_device",
    }
    for exc, reason in cases.items():
        assert reject_reason(exc) == reason, exc
    assert set(cases.values()) == set(REJECT_REASONS)
    key = new_key()
    frame = bytearray(encode(Envelope(Kind.HEARTBEAT, "ep-a", {}), key))
    frame[-1] ^= 1
    try:
        open_frame(bytes(frame), key)
    except ProtocolError as exc:
        assert reject_reason(exc) == "bad_mac"
    else:
        raise AssertionError("a tampered frame was accepted")


def _dispatcher(enrolled: list[str]) -> Dispatcher:
    d = Dispatcher.__new__(Dispatcher)
    d._keys = {e: b"k" * 32 for e in enrolled}
    d.rejected = Counter()
    d.stats = {"rejected_frames": 0}
    return d


def test_endpoint_labels_are_enrolled_ids_capped_and_unknown_otherwise() -> None:
    n = REJECT_LABELS_MAX + 20
    d = _dispatcher([f"ep-{i:04d}" for i in range(n)])
    for i in range(n):
        d._count_rejected(f"ep-{i:04d}", BadSignature("x"))
    d._count_rejected("ep-0000", Stale("x"))  # a known label keeps its own series for every reason
    for i in range(50):
        d._count_rejected(f"ep-forged-{i}", BadFrame("x"))  # channels of no enrolled endpoint
    labels = {e for e, _ in d.rejected}
    assert len(labels - {"other", "unknown"}) == REJECT_LABELS_MAX
    assert d.rejected[("other", "bad_mac")] == 20 and d.rejected[("unknown", "malformed")] == 50
    assert d.rejected[("ep-0000", "stale")] == 1
    assert d.stats["rejected_frames"] == n + 51
