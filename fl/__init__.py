"""Flox-style federated learning on the Continuum Mesh.

Each client's local training round is a remote function run on the client's own endpoint;
the server side (this package's pure-logic core) selects clients, validates and aggregates the
updates that arrive, and records a per-round history. Data stays on devices.

Public surface (numpy only; torch is never imported here):

* strategies: ``FedAvg``, ``FedProx``, ``FedAdam`` / ``FedYogi`` / ``FedAdagrad`` (server
  optimizers), ``TrimmedMean`` / ``Krum`` (robust), ``FedAsync``, ``FedBuff``, ``Hierarchical`` with the hooks
  ``configure_round`` / ``aggregate`` / ``on_update`` (async) / ``aggregate_metrics``;
  data types ``ClientUpdate``, ``ClientInstruction``, ``AggregationReport``; ``Weights`` is a
  list of numpy arrays, one per tensor.
* data: ``load_federated_digits`` / ``load_client_data`` / ``partition_indices`` (IID or
  Dirichlet non-IID partitions of scikit-learn's bundled digits).
* history: ``History`` / ``RoundRecord`` (JSON, CSV, PNG plot).
* on the mesh (loaded on first use, so an endpoint importing ``fl`` pays only for what it runs):
  ``Federation`` (the driver), ``TorchClientApp`` / ``FunctionClientApp`` / ``TrainerConfig``
  (what runs on the endpoints), ``FlowerClientApp`` / ``FlowerStrategy`` (Flower interop), and
  ``fl.datasets`` (datasets the endpoint declares, by name).
"""

from .history import History, RoundRecord
from .strategies import (
    AggregationReport,
    ClientInstruction,
    ClientUpdate,
    FedAdagrad,
    FedAdam,
    FedAsync,
    FedAvg,
    FedBuff,
    FedOpt,
    FedProx,
    FedYogi,
    Hierarchical,
    Krum,
    Strategy,
    TrimmedMean,
    Weights,
    polynomial_staleness,
    proximal_term,
    validate_update,
    weighted_average,
)

# fl.data imports scikit-learn lazily (only when digits are loaded), so importing it is cheap.
from .data import (  # noqa: E402
    ClientData,
    FederatedData,
    load_client_data,
    load_federated_digits,
    load_test_data,
    partition_indices,
)

__all__ = [
    "AggregationReport", "ClientInstruction", "ClientUpdate", "FedAsync", "FedAvg", "FedBuff",
    "FedProx", "FedOpt", "FedAdam", "FedYogi", "FedAdagrad", "TrimmedMean", "Krum", "Hierarchical", "Strategy", "Weights", "polynomial_staleness", "proximal_term",
    "validate_update", "weighted_average",
    "ClientData", "FederatedData", "load_client_data", "load_federated_digits", "load_test_data",
    "partition_indices",
    "History", "RoundRecord",
]

_LAZY = {
    "Federation": "fl.federation",
    "FederationError": "fl.federation",
    "TorchClientApp": "fl.client",
    "FunctionClientApp": "fl.client",
    "ClientApp": "fl.client",
    "TrainerConfig": "fl.client",
    "FlowerClientApp": "fl.flower",
    "FlowerStrategy": "fl.flower",
    "DPConfig": "fl.privacy",
    "SecAggConfig": "fl.secagg",
}
__all__ += list(_LAZY)


def __getattr__(name: str):  # PEP 562: heavy parts load on first use
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
