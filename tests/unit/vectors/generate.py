"""Regenerate the golden vectors in this folder: ``python tests/unit/vectors/generate.py``.

Only do this on purpose (a protocol change that bumps ``PROTOCOL_VERSION``, or a new vector):
the point of golden vectors is that the bytes on the wire never change by accident. Everything
here is fixed (key, ids, timestamps, bodies), so the output is byte-for-byte reproducible.

Bytes inside bodies are written as ``{"__bytes__": "<hex>"}`` so the files stay plain JSON.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mesh_agent.protocol import PROTOCOL_VERSION, Envelope, Kind, encode, serialize

HERE = Path(__file__).resolve().parent
KEY = bytes(range(32))
EP = "ep-0123456789ab"
TS = 1_700_000_000.25  # exactly representable, so JSON and msgpack agree on it
EXP = TS + 120.0

# A function body in the ``source`` form: unlike dill output it is the same on every Python.
FN_BODY = b"source\nadd\ndef add(a, b):\n    return a + b\n"
FN_ID = hashlib.sha256(FN_BODY).hexdigest()
ARGS = serialize([[2, 3], {}])  # json: b'json\n[[2,3],{}]'
RESULT = serialize(5)  # b'json\n5'
ERROR = serialize(
    {"type": "builtins.ZeroDivisionError", "message": "division by zero",
     "traceback": "Traceback (most recent call last):\nZeroDivisionError: division by zero\n", "exception": None}
)

# Site frames (docs/sites.md, "Site frames"): the gateway is EP with KEY; its devices' inner frames
# are signed with their own keys and carried unchanged.
DEV_A, DEV_B = "ep-aaaaaaaaaaaa", "ep-bbbbbbbbbbbb"
DEV_C = "pi-barn-3"  # an endpoint id not of the hub's own form: it stays a string in a binary table
DEV_KEY = bytes(range(32, 64))
INNER_BEAT_A = encode(Envelope(Kind.HEARTBEAT, DEV_A, {"running": 1, "want": 2}, id="0000000000000000000000a1", ts=TS, exp=EXP), DEV_KEY)
INNER_BEAT_B = encode(Envelope(Kind.HEARTBEAT, DEV_B, {"running": 0, "want": 4}, id="0000000000000000000000b1", ts=TS, exp=EXP), DEV_KEY)
INNER_ACK_A = encode(Envelope(Kind.ACK, DEV_A, {"ids": ["a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1"]}, id="0000000000000000000000a2", ts=TS, exp=EXP), DEV_KEY)
INNER_RACK_B = encode(Envelope(Kind.RESULT_ACK, DEV_B, {"ids": ["b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2"]}, id="0000000000000000000000b2",
                               ts=TS, exp=EXP), DEV_KEY)

MESSAGES: list[tuple[str, Kind, str, dict[str, Any]]] = [
    ("hello", Kind.HELLO, "000000000000000000000001", {
        "nonce": "00112233aabbccdd", "capacity": 4, "prefetch": 8,
        "have": ["6f1c0d9a2b3e4f5061728394a5b6c7d8"], "engine": "local", "host": "pi-01",
        "version": "0.1.0", "pid": 4242,
    }),
    # A welcome's message id is the nonce of the hello it answers (docs/protocol.md, section 5).
    ("welcome", Kind.WELCOME, "00112233aabbccdd", {
        "reply_to": "00112233aabbccdd", "hub_time": TS + 0.5, "heartbeat_s": 5.0,
    }),
    ("fetch", Kind.FETCH, "000000000000000000000003", {"want": 12}),
    ("tasks", Kind.TASKS, "000000000000000000000004", {
        "tasks": [
            {"id": "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", "fn": FN_ID, "args": ARGS, "timeout": None, "exp": TS + 86400.0},
            {"id": "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2", "fn": FN_ID, "args": ARGS, "timeout": 30.0, "exp": TS + 86400.0},
        ],
        "functions": {FN_ID: FN_BODY},
    }),
    ("ack", Kind.ACK, "000000000000000000000005", {
        "ids": ["a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2"],
    }),
    ("results", Kind.RESULTS, "000000000000000000000006", {
        "results": [
            {"id": "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", "ok": True, "data": RESULT, "started": TS + 1.0, "finished": TS + 1.125, "pid": 101},
            {"id": "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2", "ok": False, "data": ERROR, "started": TS + 1.0, "finished": TS + 1.5, "pid": 102},
        ],
    }),
    ("result_ack", Kind.RESULT_ACK, "000000000000000000000007", {
        "ids": ["a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1", "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2"],
    }),
    ("heartbeat", Kind.HEARTBEAT, "000000000000000000000008", {
        "capacity": 4, "running": 2, "queued": 1, "stored": 3, "outbox": 0, "want": 9,
        "warm": [FN_ID], "cpu": 12.5, "mem_used": 41.25, "mem_avail_mb": 3072,
    }),
    ("error", Kind.ERROR, "000000000000000000000009", {"code": "hello_required", "message": "no session; say hello"}),
    # The agent's MQTT will (docs/protocol.md, "Liveness"): ends the session whose hello carried this conn.
    ("gone", Kind.GONE, "00000000000000000000000a", {"conn": "0011223344556677"}),
    # A gateway's batch of its devices' frames: a device table, then [index, frame] in order.
    ("site_up", Kind.SITE_UP, "00000000000000000000000b", {
        "d": [DEV_A, DEV_B], "f": [[0, INNER_BEAT_A], [1, INNER_BEAT_B], [0, INNER_ACK_A]],
        # the site's own section: a liveness row of DEV_B, its changed heartbeat fields, "stored up to 7"
        "s": {"l": [[1, 1, 3, 1, 0, 0, 0, 0, 2]], "x": [[1, {"cpu": 12, "df": 1024}]], "c": ["0a0b0c0d", 7]},
    }),
    # The hub's batch for a gateway's devices, numbered ("n") per gateway session.
    ("site_down", Kind.SITE_DOWN, "00000000000000000000000c", {"d": [DEV_B], "f": [[0, INNER_RACK_B]], "n": 1, "e": "0a0b0c0d"}),
    # Compact ids (only to a peer that said "bin: 1"): an id "ep-" + 12 lowercase hex digits is its
    # 6 bytes in the device table, any other id its string (DEV_C); the inner frames are unchanged.
    ("site_up_bin", Kind.SITE_UP, "00000000000000000000000d", {
        "d": [bytes.fromhex(DEV_A[3:]), bytes.fromhex(DEV_B[3:]), DEV_C], "f": [[0, INNER_BEAT_A], [1, INNER_BEAT_B], [0, INNER_ACK_A]],
        "s": {"l": [[1, 1, 3, 1, 0, 0, 0, 0, 2], [2, 0, 1, 1, 0, 0, 0, 0, 0]], "c": ["0a0b0c0d", 7]},
    }),
    ("site_down_bin", Kind.SITE_DOWN, "00000000000000000000000e", {
        "d": [bytes.fromhex(DEV_B[3:])], "f": [[0, INNER_RACK_B]], "n": 2, "e": "0a0b0c0d", "b": 2,
    }),
]


def to_jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"__bytes__": v.hex()}
    if isinstance(v, dict):
        return {k: to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    return v


def envelopes() -> dict[str, Any]:
    vectors = []
    for name, kind, mid, body in MESSAGES:
        env = Envelope(kind, EP, body, id=mid, ts=TS, exp=EXP)
        vectors.append({
            "name": name, "kind": kind.value, "endpoint": EP, "id": mid, "ts": TS, "exp": EXP,
            "body": to_jsonable(body), "key": KEY.hex(), "frame": encode(env, KEY).hex(),
        })
    return {"protocol_version": PROTOCOL_VERSION, "bytes_convention": {"__bytes__": "hex"}, "vectors": vectors}


JSON_VALUES: list[tuple[str, Any]] = [
    ("null", None), ("true", True), ("false", False), ("zero", 0), ("negative", -7),
    ("int64_max", 2**63 - 1), ("int64_min", -(2**63)), ("float", 1.5), ("negative_zero", -0.0),
    ("tiny_float", 5e-324), ("ascii", "hello"), ("unicode", "h\u00e9llo \u2603 \U0001f600"),
    ("escapes", "quote\" backslash\\ newline\n tab\t nul\x00"), ("empty_list", []), ("empty_dict", {}),
    ("list", [1, "a", None, 2.25, True]), ("dict", {"b": 1, "a": [1, 2], "c": {"d": None}}),
    ("args_kwargs", [[2, 3], {"scale": 0.5}]),
    ("error_dict", {"type": "builtins.ValueError", "message": "bad", "traceback": "", "exception": None}),
]

# Values JSON would not give back exactly: they must take the pickle path. Written as Python
# literals (ast.literal_eval); only the header is checked, pickle bytes may vary across versions.
PICKLE_LITERALS = [
    "(1, 2)", "[(1, 2), {}]", "((2, 3), {})", "b'\\x00\\x01'", "{1: 'a'}", "{'a': (1,)}",
    "{1, 2}", "9223372036854775808", "-9223372036854775809", "[b'']", "1j",
]


def serializer() -> dict[str, Any]:
    return {
        "json": [{"name": n, "value": v, "blob": serialize(v).hex()} for n, v in JSON_VALUES],
        "pickle": [{"literal": lit, "header": "pickle\n".encode().hex()} for lit in PICKLE_LITERALS],
        "function_id": [{"body": FN_BODY.hex(), "function_id": FN_ID}],
    }


if __name__ == "__main__":
    for fname, data in (("envelopes.json", envelopes()), ("serialize.json", serializer())):
        (HERE / fname).write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n")
        print("wrote", HERE / fname)
