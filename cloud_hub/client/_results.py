"""Turning result blobs back into values or exceptions, with the remote traceback attached.

Like ``ProcessPoolExecutor``: when the remote exception unpickles, the user catches the very
type they raised, and its ``__cause__`` is a :class:`RemoteTraceback` whose text is the
traceback from the endpoint. When it does not unpickle (a class the caller lacks), they get a
:class:`RemoteExecutionError` carrying the type name, message and traceback.
"""

from __future__ import annotations

import pickle
from typing import Any

from mesh_agent.protocol import deserialize

__all__ = ["RemoteTraceback", "RemoteExecutionError", "decode_result"]


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


def to_exception(err: Any) -> BaseException:
    if not isinstance(err, dict):
        return RemoteExecutionError("unknown", repr(err))
    tb = str(err.get("traceback") or "")
    raw = err.get("exception")
    if isinstance(raw, (bytes, bytearray)):
        try:
            exc = pickle.loads(raw)
            if isinstance(exc, BaseException):
                exc.__cause__ = RemoteTraceback(tb)
                return exc
        except Exception:
            pass
    return RemoteExecutionError(str(err.get("type", "unknown")), str(err.get("message", "")), tb)


def decode_result(ok: bool, data: bytes) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, exception)``."""
    value = deserialize(data)
    return (True, value) if ok else (False, to_exception(value))
