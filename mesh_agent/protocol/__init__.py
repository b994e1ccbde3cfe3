"""The wire protocol shared by agent, hub and SDK: envelope, message kinds, serializer facade.

Kept free of I/O and of heavy imports so the agent stays light. See docs/protocol.md. Names are
loaded on first use (PEP 562): an engine worker imports only ``mesh_agent.protocol.serialize``
and should not pay for msgpack, hmac and the envelope code it never touches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager, and light: the function ``serialize`` shares its name with this submodule, which would
# otherwise shadow it as a package attribute once imported.
from mesh_agent.protocol.serialize import (
    SerializationError,
    deserialize,
    deserialize_function,
    function_id,
    method_of,
    serialize,
    serialize_function,
)

if TYPE_CHECKING:
    from mesh_agent.protocol.bodies import TASK_CANCELLED, cancelled_error, validate_body
    from mesh_agent.protocol.envelope import (
        DOWN_KINDS,
        KIND_CODES,
        MAX_FRAME_BYTES,
        PROTOCOL_VERSION,
        UP_KINDS,
        BadFrame,
        BadSignature,
        Envelope,
        Kind,
        ProtocolError,
        Replayed,
        ReplayGuard,
        Sealed,
        Stale,
        check_freshness,
        decode,
        encode,
        new_key,
        open_frame,
        peek_endpoint,
    )

_WHERE = {
    "validate_body": "bodies",
    "TASK_CANCELLED": "bodies",
    "cancelled_error": "bodies",
    **{n: "envelope" for n in (
        "DOWN_KINDS", "KIND_CODES", "UP_KINDS", "Sealed", "open_frame", "MAX_FRAME_BYTES", "PROTOCOL_VERSION",
        "BadFrame", "BadSignature", "Envelope", "Kind", "ProtocolError", "Replayed", "ReplayGuard", "Stale",
        "check_freshness", "decode", "encode", "new_key", "peek_endpoint",
    )},
}

__all__ = sorted([*_WHERE, "SerializationError", "deserialize", "deserialize_function", "function_id", "method_of",
                  "serialize", "serialize_function"])


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mesh_agent.protocol.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
