"""Serializer facade: data by the fastest method that round-trips, code by dill with a source fallback.

Every serialized blob starts with a header line naming its method (``b"json\\n"``, ``b"pickle\\n"``,
``b"dill\\n"``, ``b"source\\n"``), so a reader never guesses and a future method can be added
without breaking old agents: an unknown header is a clear error, never a crash.

Why JSON first: most arguments are small plain values; JSON is fast, language-neutral and safe
to inspect in the console. It is used only when it round-trips exactly (no tuples, no non-str
keys, no numpy), otherwise pickle (protocol 5), and dill only for what pickle refuses (lambdas,
closures, interactively defined classes).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import pickle
import sys
import sysconfig
import textwrap
import types
from typing import Any, Callable

__all__ = [
    "SerializationError",
    "serialize",
    "deserialize",
    "serialize_function",
    "deserialize_function",
    "function_id",
    "method_of",
]

_JSON = b"json\n"
_PICKLE = b"pickle\n"
_DILL = b"dill\n"
_SOURCE = b"source\n"
_HEADERS = (_JSON, _PICKLE, _DILL, _SOURCE)


class SerializationError(ValueError):
    """A value could not be serialized, or a blob could not be read back."""


def _json_exact(value: Any, depth: int = 0) -> bool:
    """True when ``json.loads(json.dumps(value)) == value`` with the same types all the way down."""
    if depth > 64:
        return False
    t = type(value)
    if t is str:
        return value.isascii() or _utf8_ok(value)
    if t is bool or value is None:
        return True
    if t is int:
        return -(2**63) <= value < 2**63
    if t is float:
        return value == value and value not in (float("inf"), float("-inf"))
    if t is list:
        return all(_json_exact(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and _json_exact(k) and _json_exact(v, depth + 1) for k, v in value.items())
    return False


def _utf8_ok(s: str) -> bool:
    try:
        s.encode()
        return True
    except UnicodeEncodeError:  # lone surrogates: pickle keeps them, JSON text cannot
        return False


def serialize(value: Any) -> bytes:
    """Serialize data (arguments, results) with the fastest method that round-trips exactly."""
    if _json_exact(value):
        return _JSON + json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    try:
        return _PICKLE + pickle.dumps(value, protocol=5)
    except Exception:  # pickle refuses lambdas, local classes, ...
        pass
    try:
        import dill

        return _DILL + dill.dumps(value, recurse=True)
    except Exception as exc:
        raise SerializationError(f"cannot serialize value of type {type(value).__name__}: {exc}") from exc


def method_of(blob: bytes) -> str:
    """The method named by a blob's header, e.g. ``"json"``."""
    blob = bytes(blob[:8])
    for header in _HEADERS:
        if blob.startswith(header):
            return header[:-1].decode()
    raise SerializationError(f"unknown serialization header {bytes(blob[:12])!r}")


def deserialize(blob: bytes) -> Any:
    """Read back what :func:`serialize` or :func:`serialize_function` wrote."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise SerializationError(f"expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    try:
        if blob.startswith(_JSON):
            return json.loads(blob[len(_JSON) :])
        if blob.startswith(_PICKLE):
            return pickle.loads(blob[len(_PICKLE) :])
        if blob.startswith(_DILL):
            import dill

            return dill.loads(blob[len(_DILL) :])
        if blob.startswith(_SOURCE):
            return _load_source(blob[len(_SOURCE) :].decode())
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(f"cannot deserialize {method_of(blob)} payload: {exc}") from exc
    raise SerializationError(f"unknown serialization header {blob[:12]!r}")


def serialize_function(fn: Callable[..., Any]) -> bytes:
    """Serialize code: dill by value first (closures, lambdas), source text when dill fails."""
    if not callable(fn):
        raise SerializationError(f"expected a callable, got {type(fn).__name__}")
    try:
        import dill

        return _DILL + dill.dumps(_by_value(fn), recurse=True)
    except Exception:
        pass
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise SerializationError(f"cannot serialize function {getattr(fn, '__name__', fn)!r}: {exc}") from exc
    return _SOURCE + f"{fn.__name__}\n{src}".encode()


def _installed(path: str) -> bool:
    roots = {sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]}
    return any(path.startswith(r) for r in roots if r)


def _by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's own module (a script, a notebook helper, a test file) does not exist on the
    endpoint, so a function from it must travel by value; dill does that only for ``__main__``.
    Functions from installed packages stay by reference (the endpoint has the package)."""
    if not isinstance(fn, types.FunctionType) or fn.__module__ in ("__main__", None):
        return fn
    mod = sys.modules.get(fn.__module__)
    path = getattr(mod, "__file__", None) or ""
    if not path or _installed(path):
        return fn
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    clone.__doc__ = fn.__doc__
    clone.__module__ = "__main__"
    return clone


def _load_source(text: str) -> Callable[..., Any]:
    name, _, src = text.partition("\n")
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<mesh function {name}>", "exec"), namespace)  # noqa: S102 - signed code
    try:
        return namespace[name]
    except KeyError:
        raise SerializationError(f"source payload does not define {name!r}") from None


def deserialize_function(blob: bytes) -> Callable[..., Any]:
    fn = deserialize(blob)
    if not callable(fn):
        raise SerializationError(f"function payload holds a {type(fn).__name__}, not a callable")
    return fn


def function_id(body: bytes) -> str:
    """Content address of a serialized function: the same body always gets the same id."""
    return hashlib.sha256(body).hexdigest()
