"""The SDK stream's frames on the hot path: a submit decoded and checked in one msgspec call, from
JSON text or from msgpack binary (docs/protocol.md, "SDK stream").

Why (issue 30, item 4): checking a streamed batch with ``BatchIn.model_validate`` builds one
pydantic model per task, and its base64 arguments are decoded in a second pass; on the hub's hot
path that was the biggest stage of the event loop. msgspec decodes and checks the frame into
plain structs in one C pass, and a client that asked for msgpack sends arguments and function
bodies as raw bytes, so there is no base64 at all.

The rules are the REST schema's (``TaskIn`` in cloud_hub/service/schemas.py, ``BatchIn`` in
cloud_hub/api/schemas.py), for the fields a plain task uses: an endpoint id, a function id, the
arguments, a timeout, a time to live, a cache key, ``start``. A task using anything else (a list or
tag selector, constraints, an environment, input locations) or anything these structs refuse
returns ``None`` here, and the caller checks the frame the pydantic way, so every answer, a
refusal's wording included, is exactly what REST would give. These structs must never accept what
the pydantic models refuse: tests/unit/test_stream_wire.py checks that on both encodings.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, TypeVar

import msgpack
import msgspec
from msgspec import Meta
from pydantic import BaseModel

from cloud_hub.api.schemas import BatchFunction, BatchIn
from cloud_hub.service.schemas import TaskIn

__all__ = ["ENCODINGS", "fast_submit", "parse_msgpack", "b64_batch", "encode"]

#: What a client may ask for in its hello (``"enc"``); JSON text is what every client speaks.
ENCODINGS = ("json", "msgpack")

_Id64 = Annotated[str, Meta(min_length=64, max_length=64)]
# Patterns end in ``\Z``: Python's ``$`` also matches before a final newline, pydantic's does not.
_Hex64 = Annotated[str, Meta(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}\Z")]
_Positive = Annotated[float, Meta(gt=0)]


class _Task(msgspec.Struct, forbid_unknown_fields=True):
    endpoint_id: Annotated[str, Meta(min_length=1, max_length=100)]
    function_id: _Id64
    args: bytes
    timeout_s: _Positive | None = None
    ttl_s: _Positive | None = None
    cache_key: _Hex64 | None = None
    start: Literal["now"] | None = None


class _Function(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=200)]
    body: bytes


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    tasks: Annotated[list[_Task], Meta(min_length=1)]
    functions: Annotated[dict[str, _Function], Meta(max_length=1000)] | None = None
    task_group_id: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+\Z")] | None = None
    idempotency_key: Annotated[str, Meta(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+\Z")] | None = None


class _Submit(msgspec.Struct):  # other keys of the frame are ignored, as before
    op: Literal["submit"]
    ref: int
    batch: _Batch


_DECODERS = {"json": msgspec.json.Decoder(_Submit), "msgpack": msgspec.msgpack.Decoder(_Submit)}


def fast_submit(data: str | bytes, enc: str) -> tuple[int, BatchIn] | None:
    """``(ref, batch)`` of a plain submit frame, checked, or None: not a submit, or not plain, or
    refused here (the caller then goes the pydantic way, which answers with REST's words)."""
    try:
        frame = _DECODERS[enc].decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    b = frame.batch
    tasks = [_checked(TaskIn, {"endpoint_id": t.endpoint_id, "constraints": None, "function_id": t.function_id, "args": t.args,
                               "timeout_s": t.timeout_s, "ttl_s": t.ttl_s, "idempotency_key": None, "cache_key": t.cache_key,
                               "environment": None, "start": t.start, "inputs": None}) for t in b.tasks]
    functions = None if b.functions is None else {
        fid: _checked(BatchFunction, {"name": f.name, "body": f.body}) for fid, f in b.functions.items()}
    return frame.ref, _checked(BatchIn, {"tasks": tasks, "functions": functions, "task_group_id": b.task_group_id,
                                         "idempotency_key": b.idempotency_key})


_M = TypeVar("_M", bound=BaseModel)


def _checked(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` from values checked already, every field given in declaration order:
    what ``model_construct`` makes (the same four attributes), without its per-field loop, which
    cost 7 us a task, more than decoding and checking the whole task. tests/unit/test_stream_wire.py
    compares the result with a validated model, dump and request hash alike, so a pydantic release
    that changes its model layout fails there, not on the wire."""
    m = cls.__new__(cls)
    object.__setattr__(m, "__dict__", values)
    object.__setattr__(m, "__pydantic_fields_set__", set(values))
    object.__setattr__(m, "__pydantic_extra__", None)
    object.__setattr__(m, "__pydantic_private__", None)
    return m


def parse_msgpack(data: bytes) -> Any:
    """A binary frame as plain values (the slow path and every frame that is not a submit). Map
    keys must be strings, as in JSON (``strict_map_key`` alone lets bytes keys through, which the
    REST schema would then read as strings): anything else is a ValueError."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=_str_keys)


def _str_keys(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    for k, _ in pairs:
        if type(k) is not str:
            raise ValueError(f"map keys must be strings, got {type(k).__name__}")
    return dict(pairs)


def b64_batch(batch: Any) -> Any:
    """A msgpack batch with its raw bytes (arguments, function bodies) as the base64 text the
    pydantic schema reads; anything else is left for that schema to refuse."""
    if not isinstance(batch, dict):
        return batch
    out = dict(batch)
    if isinstance(out.get("tasks"), list):
        out["tasks"] = [{**t, "args": base64.b64encode(t["args"]).decode()} if isinstance(t, dict) and isinstance(t.get("args"), bytes)
                        else t for t in out["tasks"]]
    if isinstance(out.get("functions"), dict):
        out["functions"] = {k: {**f, "body": base64.b64encode(f["body"]).decode()}
                            if isinstance(f, dict) and isinstance(f.get("body"), bytes) else f for k, f in out["functions"].items()}
    return out


_PACK = msgpack.Packer(use_bin_type=True)


def encode(msg: dict[str, Any], enc: str) -> str | bytes:
    """A frame to send: JSON text, or msgpack (raw bytes stay bytes)."""
    if enc == "msgpack":
        return _PACK.pack(msg)
    return msgspec.json.encode(msg).decode()
