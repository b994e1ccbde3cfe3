"""Secure aggregation (SecAgg+ style) for federated rounds: the driver and the hub see only
masked vectors and the unmasked sum.

* :mod:`fl.secagg.field` -- fixed-point encoding into Z_{2^32}, the shared quantization grid
  (q8/fp16 into Z_{2^16}/Z_{2^24}) and the AES-CTR mask generator;
* :mod:`fl.secagg.shamir` -- Shamir shares of 32-byte secrets (PyCryptodome's, two 16-byte halves);
* :mod:`fl.secagg.protocol` -- the four client steps and the server session (pure);
* :mod:`fl.secagg.rounds` -- the mesh side: the client app steps on the device (key material in
  the device's state directory) and the driver's orchestration over any ``ask`` function.
"""

from .field import FieldCodec, QuantCodec, prg
from .protocol import SecAggAbort, SecAggConfig, SecAggError, ServerSession, neighbor_graph

__all__ = ["FieldCodec", "QuantCodec", "prg", "SecAggAbort", "SecAggConfig", "SecAggError", "ServerSession", "neighbor_graph"]
