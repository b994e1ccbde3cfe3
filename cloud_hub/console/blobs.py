"""Reading result blobs at the hub without running anything an endpoint sent.

Results and error reports are serialized on the device, mostly with pickle (an error report is a
dict holding the pickled exception). Unpickling device data at the hub would let one compromised
device run code on the hub, so the console reads blobs with an unpickler that refuses every
global: only plain containers, strings, bytes and numbers come out. Anything else is shown as
"not decoded" with its method and size. The nested pickled exception is left as bytes.
"""

from __future__ import annotations

import io
import json
import pickle
import reprlib
from typing import Any

from mesh_agent.protocol import SerializationError, method_of

__all__ = ["safe_load", "describe_result"]

MAX_DECODE_BYTES = 4 * 2**20
_PREVIEW_CHARS = 4000


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not plain data")


class NotPlainData(ValueError):
    """The blob holds something other than plain data (or is too large, or is not a blob)."""


def safe_load(blob: bytes | None) -> Any:
    """Decode a ``json`` or ``pickle`` blob that holds only plain data; raise ``NotPlainData`` otherwise."""
    if not blob:
        raise NotPlainData("empty")
    if len(blob) > MAX_DECODE_BYTES:
        raise NotPlainData(f"{len(blob)} bytes, over the {MAX_DECODE_BYTES}-byte preview limit")
    try:
        method = method_of(blob)
    except SerializationError as exc:
        raise NotPlainData(str(exc)) from None
    body = bytes(blob[len(method) + 1 :])
    try:
        if method == "json":
            return json.loads(body)
        if method == "pickle":
            return _PlainUnpickler(io.BytesIO(body)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, KeyError, RecursionError) as exc:
        raise NotPlainData(f"{method}: {exc}") from None
    raise NotPlainData(f"{method} payloads are code, not data")


def _method(blob: bytes | None) -> str:
    try:
        return method_of(blob or b"")
    except SerializationError:
        return "unknown"


def describe_result(ok: bool | None, blob: bytes | None) -> dict[str, Any]:
    """What the task page shows about a result: a value preview, or the remote error."""
    out: dict[str, Any] = {"method": _method(blob), "size": len(blob or b""), "preview": None, "note": None}
    if ok is None:
        return out
    try:
        value = safe_load(blob)
    except NotPlainData as exc:
        out["note"] = f"not decoded at the hub ({exc})"
        if not ok:
            out.update(error_type="unknown", error_message="the error report could not be read", traceback="")
        return out
    if ok:
        r = reprlib.Repr()
        r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxlevel = 2000, 200, 50, 50, 6
        out["preview"] = r.repr(value)[:_PREVIEW_CHARS]
        return out
    if isinstance(value, dict):
        out["error_type"] = str(value.get("type") or "unknown").removeprefix("builtins.")
        out["error_message"] = str(value.get("message") or "")
        out["traceback"] = str(value.get("traceback") or "")
    else:
        out.update(error_type="unknown", error_message=repr(value)[:_PREVIEW_CHARS], traceback="")
    return out
