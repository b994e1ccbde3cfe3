"""Turning result blobs back into values or exceptions, with the remote traceback attached.

Like ``ProcessPoolExecutor``: when the remote exception unpickles, the user catches the very
type they raised, and its ``__cause__`` is a :class:`RemoteTraceback` whose text is the
traceback from the endpoint. When it does not unpickle (a class the caller lacks), they get a
:class:`RemoteExecutionError` carrying the type name, message and traceback.

Only results from trusted endpoints are unpickled (:func:`row_trusted`; docs/security.md, "What a
stolen device key can and cannot do"). From any other endpoint a value is decoded as data only,
and an exception is rebuilt by name when it is a built-in type, else ``RemoteExecutionError``.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

from mesh_agent.protocol import SerializationError, deserialize

__all__ = ["RemoteExecutionError", "RemoteTraceback", "UntrustedResult", "decode_result", "decode_row", "row_trusted"]


class RemoteTraceback(Exception):
    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\nRemote traceback:\n{self.tb}"""'


class RemoteExecutionError(Exception):
    """A task failed on its endpoint and the original exception could not be rebuilt here."""

    def __init__(self, remote_type: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = traceback

    def __str__(self) -> str:
        s = f"{self.remote_type}: {self.remote_message}"
        return f"{s}\n\nRemote traceback:\n{self.remote_traceback}" if self.remote_traceback else s


class UntrustedResult(Exception):
    """A result from an endpoint the caller has not marked trusted held code or objects other than
    plain data; it was not unpickled. The message names the endpoint and the two ways to trust it."""


def _builtin_exception(remote_type: str, message: str) -> BaseException | None:
    """``builtins.ZeroDivisionError`` and the like, rebuilt by name from type and message, never by
    unpickling: only classes of the ``builtins`` module that subclass ``Exception`` (so never
    ``SystemExit`` or ``KeyboardInterrupt``), and only when they take one message argument."""
    import builtins

    module, _, name = remote_type.rpartition(".")
    if module != "builtins" or not name.isidentifier():
        return None
    cls = vars(builtins).get(name)
    if not isinstance(cls, type) or not issubclass(cls, Exception) or cls.__module__ != "builtins":
        return None
    arg: Any = message
    if issubclass(cls, KeyError) and len(message) < 4096:  # str(KeyError('k')) is "'k'": the key's repr
        import ast

        try:
            arg = ast.literal_eval(message)  # literals only: never runs code
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            arg = message
    try:
        exc = cls(arg)
    except Exception:  # UnicodeDecodeError and the like need more arguments: not rebuilt
        return None
    return exc if type(exc) is cls else None


def to_exception(err: Any, *, trusted: bool = True) -> BaseException:
    """The exception of a failed task's error dict, its ``__cause__`` the remote traceback.
    ``trusted``: unpickled as raised; otherwise only built-in exception types are rebuilt (by
    name), anything else is :class:`RemoteExecutionError`."""
    if not isinstance(err, dict):
        return RemoteExecutionError("unknown", repr(err))
    tb = str(err.get("traceback") or "")
    raw = err.get("exception")
    if trusted and isinstance(raw, (bytes, bytearray)):
        try:
            exc = pickle.loads(raw)
            if isinstance(exc, BaseException):
                exc.__cause__ = RemoteTraceback(tb)
                return exc
        except Exception:
            pass
    remote_type, message = str(err.get("type", "unknown")), str(err.get("message", ""))
    if not trusted:
        rebuilt = _builtin_exception(remote_type, message)
        if rebuilt is not None:
            rebuilt.__cause__ = RemoteTraceback(tb)
            return rebuilt
    return RemoteExecutionError(remote_type, message, tb)


def decode_result(ok: bool, data: bytes, *, trusted: bool = True) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, exception)``. ``trusted=False``: data only (see
    :func:`decode_row`); a remote exception comes back rebuilt by name if it is a built-in
    type, else as :class:`RemoteExecutionError`."""
    value = deserialize(data, trusted=trusted)
    return (True, value) if ok else (False, to_exception(value, trusted=trusted))


def row_trusted(row: dict[str, Any], trusted_endpoints: "frozenset[str] | set[str]" = frozenset()) -> bool:
    """Whether the SDK may unpickle this result: the hub made it (no endpoint), the hub says the
    endpoint is trusted *for this caller* (the caller owns it and marked it trusted:
    ``Client.set_endpoint_trusted``), or the caller listed it in ``trusted_endpoints``. A row from
    a hub that does not send ``trusted`` counts as untrusted."""
    ep = row.get("endpoint_id")
    return ep is None or row.get("trusted") is True or ep in trusted_endpoints


def decode_row(row: dict[str, Any], trusted_endpoints: "frozenset[str] | set[str]" = frozenset()) -> tuple[bool, Any]:
    """Decode a result row from the hub. Results from trusted endpoints (:func:`row_trusted`) are
    unpickled as usual; from any other endpoint only data is decoded (JSON; pickles of plain
    containers, numbers, strings, bytes, complex, numpy arrays of numbers, booleans, strings and
    dates), since unpickling anything else runs the sender's code here: a device that was stolen
    could otherwise send a result that takes over this machine. Raises :class:`UntrustedResult`
    naming the endpoint and the setting that would trust it."""
    ep = row.get("endpoint_id")
    trusted = row_trusted(row, trusted_endpoints)
    try:
        data = row["data"]  # raw bytes from a msgpack stream, base64 text from REST and a JSON stream
        return decode_result(row["ok"], data if isinstance(data, bytes) else base64.b64decode(data), trusted=trusted)
    except SerializationError as exc:
        if trusted:
            raise
        why = str(exc).replace("\n", " ")
        if row.get("own_endpoint"):
            fix = (f"if you trust that device, mark it trusted (client.set_endpoint_trusted({ep!r}, True), "
                   f"or PUT /v1/endpoints/{ep}/trusted) or pass Client(..., trusted_endpoints=[{ep!r}])")
            whose = "your endpoint, not marked trusted"
        else:
            fix = f"if you trust it and its owner, pass Client(..., trusted_endpoints=[{ep!r}])"
            whose = "not yours"
        raise UntrustedResult(f"result of task {row.get('task_id')} from endpoint {ep} ({whose}) was not unpickled: {why}; "
                              f"{fix}") from None
