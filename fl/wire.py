"""Model weights on the wire: a list of numpy arrays as one compressed, self-describing blob.

The format lives in ``mesh_agent.protocol.weights`` (the wire layer the hub, the SDK and the agent
share: the hub checks uploaded checkpoints without importing ``fl``). This module is the name FL
code and the docs use (``fl.wire``); it re-exports the format unchanged.
"""

from __future__ import annotations

from mesh_agent.protocol.weights import MAGIC, MAX_DECODED_BYTES, WireError, decode_weights, encode_weights

__all__ = ["WireError", "encode_weights", "decode_weights", "MAX_DECODED_BYTES", "MAGIC"]
