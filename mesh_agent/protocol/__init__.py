"""The wire protocol shared by agent, hub and SDK: envelope, message kinds, serializer facade.

Kept free of I/O and of heavy imports so the agent stays light. See docs/protocol.md.
"""

from mesh_agent.protocol.bodies import validate_body
from mesh_agent.protocol.envelope import (
    DOWN_KINDS,
    KIND_CODES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    Replayed,
    ReplayGuard,
    Sealed,
    Stale,
    UP_KINDS,
    check_freshness,
    decode,
    encode,
    new_key,
    open_frame,
    peek_endpoint,
)
from mesh_agent.protocol.serialize import (
    SerializationError,
    deserialize,
    deserialize_function,
    function_id,
    method_of,
    serialize,
    serialize_function,
)

__all__ = [
    "DOWN_KINDS",
    "KIND_CODES",
    "UP_KINDS",
    "Sealed",
    "open_frame",
    "validate_body",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "BadFrame",
    "BadSignature",
    "Envelope",
    "Kind",
    "ProtocolError",
    "Replayed",
    "ReplayGuard",
    "Stale",
    "check_freshness",
    "decode",
    "encode",
    "new_key",
    "peek_endpoint",
    "SerializationError",
    "deserialize",
    "deserialize_function",
    "function_id",
    "method_of",
    "serialize",
    "serialize_function",
]
