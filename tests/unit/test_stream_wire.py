"""The stream's fast submit check (cloud_hub/api/_stream_wire.py) against the REST schema.

Its promise: it never accepts a batch the pydantic schema (``BatchIn``) refuses, and what it
accepts is the same batch, field for field, on JSON text and on msgpack. Anything it does not
take goes the pydantic way, so refusing more is allowed; accepting more is a hole. Hypothesis
draws tasks from good and bad values of every field, and unknown fields.
"""

from __future__ import annotations

import base64
import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cloud_hub.api import _stream_wire as wire
from cloud_hub.api.schemas import BatchIn
from cloud_hub.service.schemas import TaskIn
from cloud_hub.service.submit import _request_hash

_FID = "a" * 64
_KEY = "0123456789abcdef" * 4

#: Per field: values REST accepts, then values it refuses (or that only the slow way takes).
_values = {
    "endpoint_id": (["ep-0123456789ab", "auto", "x" * 100], ["", "x" * 101, ["ep-1"], {"tags": ["gpu"]}, 5, None]),
    "function_id": ([_FID], ["a" * 63, "a" * 65, _FID[:-1] + "\n", 7, None]),
    "args": ([b"\x01payload", b""], ["not base64 %%%", 3]),
    "timeout_s": ([None, 1, 2.5, float("inf")], [0, -1, "5", True, float("nan")]),
    "ttl_s": ([None, 60], [0.0, -0.5, "x"]),
    "cache_key": ([None, _KEY], [_KEY.upper(), _KEY[:-1] + "\n", _KEY[:-1], 1]),
    "start": ([None, "now"], ["later", 1]),
    "idempotency_key": ([], ["abcdefgh"]),  # belongs on the batch: REST refuses it on a task
    "constraints": ([], [{"gpu": True}]),  # fine for REST, but only the slow way takes it
    "surprise": ([], [1]),
}
_required = ("endpoint_id", "function_id", "args")


@st.composite
def _task(draw: st.DrawFn) -> dict:
    t = {}
    for k, (good, bad) in _values.items():
        if draw(st.integers(0, 9)) == 0 and bad:  # one field in ten is bad
            t[k] = draw(st.sampled_from(bad))
        elif good and (k in _required or draw(st.booleans())):
            t[k] = draw(st.sampled_from(good))
        elif k in _required and draw(st.integers(0, 9)) == 0:
            continue  # missing
    return t


@st.composite
def _batch(draw: st.DrawFn) -> dict:
    b: dict = {"tasks": draw(st.lists(_task(), min_size=0, max_size=3))}
    if draw(st.booleans()):
        b["idempotency_key"] = draw(st.sampled_from(["abcdefgh", "k" * 128, "short", "abcdefgh\n", "a b c d e f", "k" * 129]))
    if draw(st.booleans()):
        b["task_group_id"] = draw(st.sampled_from(["g1", "g" * 64, "", "g" * 65, "g1\n", "g/1"]))
    if draw(st.booleans()):
        b["functions"] = {_FID: draw(st.sampled_from([{"name": "f", "body": b"\x00code"}, {"name": "", "body": b"x"},
                                                      {"name": "f", "body": b"x", "extra": 1}, {"name": "f"}]))}
    return b


def _as_json(batch: dict) -> dict:
    """The batch as a JSON client sends it: bytes as base64 text."""
    def conv(v: object) -> object:
        return base64.b64encode(v).decode() if isinstance(v, bytes) else v
    out = {**batch, "tasks": [{k: conv(v) for k, v in t.items()} for t in batch["tasks"]]}
    if "functions" in batch:
        out["functions"] = {k: {kk: conv(vv) for kk, vv in f.items()} for k, f in batch["functions"].items()}
    return out


def _pydantic(batch_json: dict) -> BatchIn | None:
    try:
        return BatchIn.model_validate(batch_json)
    except ValidationError:
        return None


_seen = {"fast": 0}


@settings(max_examples=400, deadline=None)
@given(_batch())
def test_fast_path_accepts_only_what_the_rest_schema_accepts(batch: dict) -> None:
    as_json = _as_json(batch)
    try:
        json_text = json.dumps({"op": "submit", "ref": 3, "batch": as_json}, allow_nan=True)
    except ValueError:
        return
    slow = _pydantic(json.loads(json_text)["batch"])
    frames = [(json_text, "json"), (msgpack.packb({"op": "submit", "ref": 3, "batch": batch}, use_bin_type=True), "msgpack")]
    for data, enc in frames:
        fast = wire.fast_submit(data, enc)
        if fast is None:
            continue  # the pydantic way decides
        _seen["fast"] += 1
        assert slow is not None, f"{enc} fast path accepted what REST refuses: {batch!r}"
        ref, got = fast
        assert ref == 3
        assert got.model_dump() == slow.model_dump()
        assert got.model_dump_json() == slow.model_dump_json()
        assert _request_hash(got.tasks) == _request_hash(slow.tasks)  # an idempotency key means the same request either way
        assert list(got.tasks[0].__dict__) == list(TaskIn.model_fields) if got.tasks else True


def test_the_property_above_met_plain_batches() -> None:
    """Guards the test itself: it must have compared accepted batches, not only refusals."""
    if _seen["fast"] == 0:
        test_fast_path_accepts_only_what_the_rest_schema_accepts()
    assert _seen["fast"] >= 20


def test_plain_batches_take_the_fast_path_on_both_encodings() -> None:
    batch = {"tasks": [{"endpoint_id": "ep-0123456789ab", "function_id": _FID, "args": b"\x01", "timeout_s": 5, "start": "now"}],
             "functions": {_FID: {"name": "f", "body": b"\x00code"}}, "idempotency_key": "abcdefgh", "task_group_id": "g1"}
    for data, enc in [(json.dumps({"op": "submit", "ref": 1, "batch": _as_json(batch)}), "json"),
                      (msgpack.packb({"op": "submit", "ref": 1, "batch": batch, "later": "ignored"}, use_bin_type=True), "msgpack")]:
        fast = wire.fast_submit(data, enc)
        assert fast is not None
        assert fast[1].tasks[0].args == b"\x01" and fast[1].functions[_FID].body == b"\x00code"  # type: ignore[index]


@pytest.mark.parametrize("frame", [
    {"op": "hello", "ref": 1, "batch": {}},
    {"op": "submit", "ref": True, "batch": {"tasks": [{"endpoint_id": "e", "function_id": _FID, "args": b""}]}},
    {"op": "submit", "batch": {"tasks": [{"endpoint_id": "e", "function_id": _FID, "args": b""}]}},
])
def test_what_is_not_a_plain_submit_goes_the_slow_way(frame: dict) -> None:
    assert wire.fast_submit(msgpack.packb(frame, use_bin_type=True), "msgpack") is None
    assert wire.fast_submit(b"\xc1 not msgpack", "msgpack") is None
    assert wire.fast_submit("{not json", "json") is None


def test_b64_batch_gives_the_rest_shape() -> None:
    raw = {"tasks": [{"endpoint_id": "e", "function_id": _FID, "args": b"\x01\x02"}, "junk"],
           "functions": {_FID: {"name": "f", "body": b"\x00"}}}
    out = wire.b64_batch(raw)
    assert out["tasks"][0]["args"] == "AQI=" and out["tasks"][1] == "junk" and out["functions"][_FID]["body"] == "AA=="
    assert raw["tasks"][0]["args"] == b"\x01\x02"  # the frame's own value is left as it was
    assert wire.b64_batch("a string") == "a string"

