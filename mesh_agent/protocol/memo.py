"""Memoization keys: which calls count as "the same call" (docs/sdk.md, "Memoization").

Pure logic, no I/O; part of the wire protocol (``mesh_agent/protocol``), as the SDK computes a key
that the hub stores and matches. The SDK computes the key where the arguments are (the hub only sees them
pickled, and ``ignore_for_cache`` names need the call's signature); the hub keeps, per user, a
map from key to the task whose successful result answers it. A client can only poison its own
cache: the scope is per user, so a wrong key cannot reach another user's results.

The key hashes, as in Parsl's app cache and funcX (HPDC'20, section 5.3):
* the function id (the SHA-256 of its serialized body: a changed body is another function),
* the arguments, bound to the function's parameter names, minus the ``ignore_for_cache`` names,
* the task's environment spec, when it has one (the same call in another environment may differ).

Arguments are encoded canonically, not pickled: ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}``, or
two equal sets, give one key whatever their insertion order. Numbers keep their type (``1`` and
``1.0`` are different calls). NumPy arrays hash by dtype, shape and bytes. Anything else falls back
to its pickle (a stable encoding for plain objects); what cannot be pickled is refused with
:class:`MemoKeyError` before anything is sent or stored.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import pickle
import struct
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["MemoKeyError", "memo_key", "bound_arguments", "canonical"]

_VERSION = b"cm-memo-1\0"
_MAX_DEPTH = 64


class MemoKeyError(TypeError):
    """An argument cannot be part of a cache key; the message names it and the way out."""


def bound_arguments(fn: Callable[..., Any] | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The call's arguments as (name, value) pairs: bound to ``fn``'s parameters when its signature
    is known (so ``f(1)`` and ``f(x=1)`` are one call, and a positional argument can be ignored by
    name), else positions as ``"#0"``, ``"#1"``, ... and keywords by name."""
    if fn is not None:
        try:
            ba = inspect.signature(fn).bind(*args, **kwargs)
        except (TypeError, ValueError):
            ba = None
        if ba is not None:
            ba.apply_defaults()
            out: list[tuple[str, Any]] = []
            for name, value in ba.arguments.items():
                kind = ba.signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    out.extend(sorted(value.items()))
                elif kind is inspect.Parameter.VAR_POSITIONAL:
                    out.extend((f"*{name}#{i}", v) for i, v in enumerate(value))
                else:
                    out.append((name, value))
            return out
    return [(f"#{i}", v) for i, v in enumerate(args)] + sorted(kwargs.items())


def memo_key(function_id: str, arguments: Iterable[tuple[str, Any]], ignore_for_cache: Iterable[str] = (),
             environment: Any = None) -> str:
    """The cache key (64 hex characters) of a call."""
    ignore = set(ignore_for_cache)
    h = hashlib.sha256(_VERSION)
    h.update(function_id.encode())
    kept = sorted(((name, value) for name, value in arguments if name not in ignore), key=lambda nv: nv[0])
    for name, value in kept:
        h.update(b"\1" + name.encode() + b"\0")
        try:
            h.update(canonical(value))
        except MemoKeyError as exc:
            raise MemoKeyError(f"cache=True: argument {name!r} cannot be part of a cache key: {exc}. Leave it out with "
                               f"ignore_for_cache=[{name!r}], or submit without cache=True") from None
    if environment is not None:
        h.update(b"\2env\0")
        try:
            h.update(canonical(environment))
        except MemoKeyError as exc:
            raise MemoKeyError(f"cache=True: the environment spec cannot be part of a cache key: {exc}") from None
    return h.hexdigest()


def canonical(value: Any, _depth: int = 0) -> bytes:
    """A deterministic byte encoding of ``value`` (equal plain values give equal bytes)."""
    if _depth > _MAX_DEPTH:
        raise MemoKeyError(f"nested deeper than {_MAX_DEPTH} levels (a cycle?)")
    t = type(value)
    if value is None:
        return b"N"
    if t is bool:
        return b"T" if value else b"F"
    if t is int:
        s = str(value).encode()
        return b"i" + struct.pack(">I", len(s)) + s
    if t is float:
        if math.isnan(value):
            return b"fnan"
        return b"f" + struct.pack(">d", value)
    if t is complex:
        return b"c" + struct.pack(">dd", value.real, value.imag)
    if t is str:
        s = value.encode("utf-8", "surrogatepass")
        return b"s" + struct.pack(">Q", len(s)) + s
    if t in (bytes, bytearray, memoryview):
        b = bytes(value)
        return b"b" + struct.pack(">Q", len(b)) + b
    if t in (list, tuple):
        parts = [canonical(v, _depth + 1) for v in value]
        return (b"l" if t is list else b"t") + struct.pack(">Q", len(parts)) + b"".join(parts)
    if t in (dict,):
        items = sorted((canonical(k, _depth + 1), canonical(v, _depth + 1)) for k, v in value.items())
        return b"d" + struct.pack(">Q", len(items)) + b"".join(k + v for k, v in items)
    if t in (set, frozenset):
        parts = sorted(canonical(v, _depth + 1) for v in value)
        return b"S" + struct.pack(">Q", len(parts)) + b"".join(parts)
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        if value.dtype.hasobject:
            return b"a" + canonical(value.tolist(), _depth + 1)
        data = value.tobytes()  # C order, whatever the layout in memory
        head = f"{value.dtype.str}|{value.shape}".encode()
        return b"A" + struct.pack(">I", len(head)) + head + struct.pack(">Q", len(data)) + data
    if t.__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "item"):  # a numpy scalar
        return b"n" + value.dtype.str.encode() + b"|" + canonical(value.item(), _depth + 1)
    if inspect.isgenerator(value) or inspect.isasyncgen(value) or inspect.iscoroutine(value):
        raise MemoKeyError(f"a {t.__name__} is consumed by the call and has no stable value")
    try:
        blob = pickle.dumps(value, protocol=4)
    except Exception as exc:  # sockets, locks, open files, lambdas (pickle refuses them by reference)
        raise MemoKeyError(f"a {t.__module__}.{t.__qualname__} cannot be pickled ({type(exc).__name__}: {exc})") from None
    name = f"{t.__module__}.{t.__qualname__}".encode()
    return b"p" + struct.pack(">I", len(name)) + name + struct.pack(">Q", len(blob)) + blob
