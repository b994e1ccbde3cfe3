"""The wire protocol shared by agent, hub and SDK: envelope, message kinds, serializer facade.

Kept free of I/O and of heavy imports so the agent stays light. See docs/protocol.md.
"""

from mesh_agent.protocol.envelope import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    BadFrame,
    BadSignature,
    Envelope,
    Kind,
    ProtocolError,
    Replayed,
    ReplayGuard,
    Stale,
    check_freshness,
    decode,
    encode,
    new_key,
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
