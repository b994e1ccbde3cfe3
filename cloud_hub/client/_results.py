"""Turning result blobs back into values or exceptions, with the remote traceback attached.

Like ``ProcessPoolExecutor``: when the remote exception unpickles, the user catches the very
type they raised, and its ``__cause__`` is a :class:`RemoteTraceback` whose text is the
traceback from the endpoint. When it does not unpickle (a class the caller lacks), they get a
:class:`RemoteExecutionError` carrying the type name, message and traceback.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

from mesh_agent.protocol import SerializationError, deserialize

__all__ = ["RemoteTraceback", "RemoteExecutionError", "UntrustedResult", "decode_result", "decode_row"]


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
    """A result from an endpoint the caller does not own held code or objects; it was not unpickled."""


def to_exception(err: Any, *, trusted: bool = True) -> BaseException:
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
    return RemoteExecutionError(str(err.get("type", "unknown")), str(err.get("message", "")), tb)


def decode_result(ok: bool, data: bytes, *, trusted: bool = True) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, exception)``. ``trusted=False``: plain data only (see
    :func:`decode_row`); a remote exception comes back as :class:`RemoteExecutionError`."""
    value = deserialize(data, trusted=trusted)
    return (True, value) if ok else (False, to_exception(value, trusted=trusted))


def decode_row(row: dict[str, Any], trusted_endpoints: "frozenset[str] | set[str]" = frozenset()) -> tuple[bool, Any]:
    """Decode a result row from the hub. Results from the caller's own endpoints (``own_endpoint``)
    or from endpoints the caller trusts are unpickled as usual; from any other endpoint (one shared
    with the caller by another user) only plain data is accepted, since unpickling runs the sender's
    code here. Raises :class:`UntrustedResult` naming the endpoint and the fix."""
    ep = row.get("endpoint_id")
    trusted = bool(row.get("own_endpoint")) or ep in trusted_endpoints
    try:
        return decode_result(row["ok"], base64.b64decode(row["data"]), trusted=trusted)
    except SerializationError as exc:
        if trusted:
            raise
        raise UntrustedResult(f"result of task {row.get('task_id')} from endpoint {ep} (not yours) was not unpickled: {exc}; "
                              f"trust it with Client(..., trusted_endpoints=[{ep!r}]) if you trust its owner") from None
