"""fl.wire: model weights on the wire (exact round trip, compression, refusal of bad blobs)."""

import json
import struct
import zlib

import numpy as np
import pytest

from fl.wire import MAGIC, WireError, decode_weights, encode_weights


def _same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def test_round_trip_keeps_dtype_shape_and_values():
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((64, 64)).astype(np.float32), np.zeros(0, np.float32), np.array(7, np.int64),
          np.array([True, False]), rng.standard_normal((3, 2, 2)), np.arange(6, dtype=np.uint8).reshape(2, 3),
          np.float16([1.5, -2])]
    assert _same(decode_weights(encode_weights(ws)), ws)
    assert _same(decode_weights(encode_weights(ws, shuffle=False, level=0)), ws)
    assert decode_weights(encode_weights([])) == []


def test_big_endian_input_comes_back_native():
    a = np.arange(6, dtype=">f8").reshape(2, 3)
    (b,) = decode_weights(encode_weights([a]))
    assert b.dtype == np.float64 and b.dtype.isnative and np.array_equal(a, b)


def test_byte_shuffle_compresses_trained_like_weights_better():
    rng = np.random.default_rng(1)
    w = [(rng.standard_normal((256, 256)) * 0.05).astype(np.float32)]
    shuffled, plain = len(encode_weights(w)), len(encode_weights(w, shuffle=False))
    assert shuffled < plain < w[0].nbytes * 1.01


def test_unsupported_dtypes_refused_on_encode():
    for bad in (np.array([1 + 2j]), np.array(["x"]), np.array([object()], dtype=object)):
        with pytest.raises(WireError):
            encode_weights([bad])


def _blob(header, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("!I", len(head)) + head + payload


@pytest.mark.parametrize("blob, text", [
    (b"", "bad magic"),
    (b"PK\x03\x04 not ours", "bad magic"),
    (MAGIC + struct.pack("!I", 1000) + b"{}", "truncated"),
    (_blob({"t": [["<f4", [2]]]}, zlib.compress(b"\x00" * 4)), "truncated"),
    (_blob({"t": [["<f4", [1]]]}, zlib.compress(b"\x00" * 8)), "more or other data"),
    (_blob({"t": [["<f4", [1]]]}, zlib.compress(b"\x00" * 4) + b"junk"), "more or other data"),
    (_blob({"t": [["|O", [1]]]}, zlib.compress(b"\x00" * 8)), "header"),
    (_blob({"t": [["<c8", [1]]]}, zlib.compress(b"\x00" * 8)), "header"),
    (_blob({"t": [["<f4", [-1]]]}, b""), "header"),
    (_blob({"nope": 1}, b""), "header"),
    (_blob({"t": [["<f4", [1]]]}, b"not zlib at all"), "corrupt"),
])
def test_malformed_blobs_are_refused_with_a_reason(blob, text):
    with pytest.raises(WireError, match=text):
        decode_weights(blob)


def test_decompression_bomb_refused_before_allocating():
    huge = _blob({"t": [["<f8", [1 << 28]]]}, zlib.compress(b"\x00" * 1024))
    with pytest.raises(WireError, match="over the"):
        decode_weights(huge)
    small = encode_weights([np.zeros(1000, np.float32)])
    with pytest.raises(WireError, match="over the 100-byte limit"):
        decode_weights(small, max_bytes=100)


def test_not_bytes_refused():
    with pytest.raises(WireError, match="must be bytes"):
        decode_weights([np.zeros(1)])  # type: ignore[arg-type]
