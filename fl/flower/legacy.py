"""Flower interop: run an existing Flower client unchanged on the mesh, and aggregate with a
Flower strategy.

Client side -- :class:`FlowerClientApp` wraps a Flower ``client_fn(context)`` (the function a
Flower ``ClientApp`` is built from; it returns a ``NumPyClient``, or a ``Client`` via
``.to_client()``). On each endpoint it builds a real ``flwr.app.Context`` whose ``node_config``
carries the endpoint's partition, taken from the dataset the endpoint declares
(``index`` -> ``partition-id``, ``num_clients`` -> ``num-partitions``, plus the declaration's
other keyword arguments), and whose ``run_config`` is what you pass. Then it calls the client's
``fit(parameters, config)`` with the round's global weights and a Flower-style config
(``server-round``, ``local-epochs``, ...). The client's code is not modified. The warm-up
builds the client through ``client_fn`` once (a ``client_fn`` that fails there fails the
warm-up: the driver leaves that endpoint out with the error); federated evaluation
(``fit(fed_eval_every=k)``) calls the client's ``evaluate(parameters, config)`` on the device.
A Message-API ``flwr.clientapp.ClientApp`` is refused here: it runs unchanged through
``mesh-fl run`` / :func:`fl.flower.run.run_app`.

Server side -- :class:`FlowerStrategy` wraps a Flower strategy so that ``Federation`` uses it
to aggregate: the legacy API (``flwr.server.strategy.*``: ``aggregate_fit(round, results,
failures)``) or the Message API (``flwr.serverapp.strategy.*``: ``aggregate_train(round,
replies)``). Updates are validated first (shapes, NaN, sample counts) like with every strategy,
so a broken client is dropped with a reason instead of crashing Flower's arithmetic. Client
selection stays ours (deadline-based, dropout tolerant); Flower's ``configure_fit`` is not used.

flwr is imported only when these run.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fl import datasets as _datasets
from fl.client import PROTOCOL, ClientApp, TaskError, _check_task
from fl.strategies import AggregationReport, ClientUpdate, Strategy, Weights

__all__ = ["FlowerClientApp", "FlowerStrategy", "node_config_for"]

_SCALAR = (bool, int, float, str, bytes)


def _scalars(d: Dict[str, Any]) -> Dict[str, Any]:
    """Flower configs and metrics hold scalars only."""
    out: Dict[str, Any] = {}
    for k, v in (d or {}).items():
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, _SCALAR):
            out[str(k)] = v
    return out


def node_config_for(dataset: str) -> Dict[str, Any]:
    """The Flower ``node_config`` of this endpoint, from its declaration of ``dataset``."""
    spec = _datasets.declared().get(dataset)
    if spec is None:
        where = _datasets.endpoint_name() or _datasets.endpoint_id() or "this process"
        raise _datasets.DatasetNotFound(f"dataset {dataset!r} is not declared on {where}")
    cfg = _scalars(spec.kwargs)
    if "index" in spec.kwargs:
        cfg["partition-id"] = int(spec.kwargs["index"])
    if "num_clients" in spec.kwargs:
        cfg["num-partitions"] = int(spec.kwargs["num_clients"])
    cfg["dataset"] = dataset
    return cfg


def _numpy_client(client: Any) -> Any:
    from flwr.client import NumPyClient

    if isinstance(client, NumPyClient):
        return client
    return getattr(client, "numpy_client", None)  # what NumPyClient.to_client() wraps


def _refuse_message_api_app(client_fn: Any) -> None:
    """A Message-API ``flwr.clientapp.ClientApp`` is not a ``client_fn``: calling it with a
    Context alone fails on every device (``__call__() missing ... 'context'``). Refuse it here.
    (flwr is already imported when the caller holds one of its ClientApps.)"""
    if "flwr" not in sys.modules:
        return
    from flwr.clientapp import ClientApp as FlwrClientApp

    if isinstance(client_fn, FlwrClientApp):
        raise TypeError("FlowerClientApp takes a client_fn(context) -> NumPyClient | Client (Flower's legacy API), not a "
                        "flwr.clientapp.ClientApp: run a Message-API ClientApp unchanged, with its ServerApp, through "
                        "`mesh-fl run APP_DIR --endpoints ...` or fl.flower.run_app(APP_DIR, client, ...) (docs/fl.md, Flower)")


def _client_of(client_fn: Callable[[Any], Any], context: Any) -> Any:
    """``client_fn(context)``, checked: a ``NumPyClient`` or a Flower ``Client``."""
    from flwr.client import Client

    client = client_fn(context)
    if _numpy_client(client) is None and not isinstance(client, Client):
        raise TypeError(f"client_fn returned {type(client).__name__}, not a flwr NumPyClient or Client "
                        "(return MyClient(...) or MyClient(...).to_client())")
    return client


class FlowerClientApp(ClientApp):
    """A Flower ``client_fn(context) -> NumPyClient | Client`` as the mesh client function.

    ``initial_weights``: the starting global model (as Flower's ``initial_parameters``);
    ``evaluate_fn(weights) -> (loss, {"accuracy": ...})`` evaluates centrally on the driver.
    With ``fit(fed_eval_every=k)`` the client's own ``evaluate(parameters, config)`` runs on the
    devices, on the data its ``client_fn`` loaded for evaluation.

    The warm-up builds the client once through ``client_fn`` on each endpoint: a ``client_fn``
    that raises there (a missing module, a partition it cannot load) fails the warm-up, and the
    driver leaves that endpoint out with that error.
    """

    name = "flower"
    loads_data = False  # the Flower client loads its own partition (from node_config)

    def __init__(self, client_fn: Callable[[Any], Any], *, initial_weights: Optional[Weights] = None,
                 run_config: Optional[Dict[str, Any]] = None,
                 evaluate_fn: Optional[Callable[[Weights], Tuple[float, Dict[str, Any]]]] = None) -> None:
        from mesh_agent.protocol.serialize import _by_value

        _refuse_message_api_app(client_fn)
        if not callable(client_fn):
            raise TypeError(f"FlowerClientApp needs a client_fn(context) -> NumPyClient | Client, not a "
                            f"{type(client_fn).__name__} (wrap a client instance as: lambda context: client)")
        self.client_fn = _by_value(client_fn)
        self.run_config = _scalars(dict(run_config or {}))
        self.evaluate_fn = evaluate_fn
        self._initial = None if initial_weights is None else [np.asarray(w).copy() for w in initial_weights]

    def __getstate__(self) -> Dict[str, Any]:
        return {"client_fn": self.client_fn, "run_config": self.run_config}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.client_fn = state["client_fn"]
        self.run_config = state["run_config"]
        self.evaluate_fn = None
        self._initial = None

    def _context(self, dataset: str, run_config: Dict[str, Any]) -> Any:
        from flwr.app import Context, RecordDict

        node = _datasets.endpoint_id() or "local"
        return Context(run_id=0, node_id=zlib.crc32(node.encode()), node_config=node_config_for(dataset),
                       state=RecordDict(), run_config={**self.run_config, **_scalars(run_config)})

    def _warmup(self, task: Dict[str, Any]) -> Dict[str, Any]:
        """Build the client through ``client_fn`` with this endpoint's Context (its partition
        loads here, once, before round 1): whatever fails there fails the warm-up."""
        t0 = time.perf_counter()
        task = _check_task(task, "warmup")
        self._load(task)  # the dataset must be declared here
        _client_of(self.client_fn, self._context(str(task["dataset"]), {}))
        return {"v": PROTOCOL, "kind": "ready", "client_id": task["client_id"], "num_samples": None, "device": "cpu",
                "warmup_time_s": time.perf_counter() - t0}

    def fit(self, weights: Weights, data: Any, config: Dict[str, Any]) -> Tuple[Weights, int, Dict[str, Any], str]:
        fcfg = _scalars(config)
        fcfg["server-round"] = int(config.get("round", 0))
        if "local_epochs" in config:
            fcfg["local-epochs"] = int(config["local_epochs"])
        client = _client_of(self.client_fn, self._context(str(config["dataset"]), {"local-epochs": fcfg.get("local-epochs", 1)}))
        nc = _numpy_client(client)
        t0 = time.perf_counter()
        if nc is not None:
            out = nc.fit([np.asarray(w) for w in weights], fcfg)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError("NumPyClient.fit must return (parameters, num_examples, metrics)")
            params, n, metrics = out
        else:
            from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays

            res = client.fit(FitIns(ndarrays_to_parameters(list(weights)), fcfg))
            params, n, metrics = parameters_to_ndarrays(res.parameters), res.num_examples, res.metrics
        metrics = dict(metrics or {})
        metrics.setdefault("train_time_s", time.perf_counter() - t0)
        return [np.asarray(p) for p in params], int(n), metrics, "cpu"

    def evaluate_on_device(self, weights: Weights, task: Dict[str, Any]) -> Tuple[float, int, Dict[str, Any]]:
        """Federated evaluation: the client's own ``evaluate(parameters, config)`` (config:
        ``server-round``), on the evaluation data its ``client_fn`` loaded on this device."""
        from flwr.client import NumPyClient

        self._load(task)
        cfg = {"server-round": int(task["round"])}
        client = _client_of(self.client_fn, self._context(str(task["dataset"]), {}))
        nc = _numpy_client(client)
        params = [np.asarray(w) for w in weights]
        if nc is not None:
            if type(nc).evaluate is NumPyClient.evaluate:
                raise TaskError(f"the Flower client {type(nc).__name__} has no evaluate(): it cannot take part in federated evaluation")
            out = nc.evaluate(params, cfg)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError("NumPyClient.evaluate must return (loss, num_examples, metrics)")
            loss, n, metrics = out
        else:
            from flwr.common import Code, EvaluateIns, ndarrays_to_parameters

            res = client.evaluate(EvaluateIns(ndarrays_to_parameters(params), cfg))
            if res.status.code != Code.OK:
                raise TaskError(f"the Flower client's evaluate failed: {res.status.code.name}: {res.status.message}")
            loss, n, metrics = res.loss, res.num_examples, res.metrics
        return float(loss), int(n), dict(metrics or {})

    def evaluates_on_device(self) -> bool:
        return True  # whether the client implements evaluate is known on the device (else: a clear error there)

    def initial_weights(self) -> Optional[Weights]:
        return None if self._initial is None else [w.copy() for w in self._initial]

    def evaluate(self, weights: Weights, data: Any) -> Optional[Tuple[float, Dict[str, float]]]:
        if self.evaluate_fn is None:
            return None
        loss, metrics = self.evaluate_fn(weights)
        return float(loss), dict(metrics or {})


class FlowerStrategy(Strategy):
    """A Flower strategy (legacy or Message API) as this library's synchronous aggregator."""

    def __init__(self, strategy: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.flower = strategy
        self.legacy = hasattr(strategy, "aggregate_fit")
        if not self.legacy and not hasattr(strategy, "aggregate_train"):
            raise TypeError(f"{type(strategy).__name__} has neither aggregate_fit nor aggregate_train")
        self.name = f"flower:{type(strategy).__name__}"
        self.last_flower_metrics: Dict[str, Any] = {}

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        report = AggregationReport(round=int(round))
        self.last_report = report
        valid = self._split_valid(round, updates, current, report)
        report.accepted = [u.client_id for u in valid]
        report.num_samples = int(sum(int(u.num_samples) for u in valid))
        if len(valid) < self.min_clients:
            report.reason = f"only {len(valid)} valid update(s), need min_clients={self.min_clients}"
            return None
        out = self._aggregate_legacy(round, valid) if self.legacy else self._aggregate_messages(round, valid)
        if out is None:
            report.reason = f"{type(self.flower).__name__} returned no parameters"
            return None
        if len(out) != len(current):
            report.reason = f"{type(self.flower).__name__} returned {len(out)} tensors, expected {len(current)}"
            return None
        report.aggregated = True
        return [np.asarray(o).astype(np.asarray(c).dtype, copy=False).reshape(np.shape(c)) for o, c in zip(out, current)]

    def _aggregate_legacy(self, round: int, valid: List[ClientUpdate]) -> Optional[List[np.ndarray]]:
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
        from flwr.server.client_proxy import ClientProxy

        class _Proxy(ClientProxy):  # Flower strategies only read .cid from it
            def _no(self, *a: Any, **k: Any) -> Any:
                raise RuntimeError("mesh clients are reached through the mesh, not a ClientProxy")

            get_properties = get_parameters = fit = evaluate = reconnect = _no

        results = [
            (_Proxy(u.client_id), FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([np.asarray(w) for w in u.weights]),
                                        int(u.num_samples), _scalars(u.metrics)))
            for u in valid
        ]
        params, metrics = self.flower.aggregate_fit(int(round), results, [])
        self.last_flower_metrics = dict(metrics or {})
        return None if params is None else parameters_to_ndarrays(params)

    def _aggregate_messages(self, round: int, valid: List[ClientUpdate]) -> Optional[List[np.ndarray]]:
        from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

        key = getattr(self.flower, "weighted_by_key", "num-examples")
        replies = []
        for i, u in enumerate(valid):
            metrics = {k: v for k, v in _scalars(u.metrics).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            metrics[key] = int(u.num_samples)
            content = RecordDict({"arrays": ArrayRecord([np.asarray(w) for w in u.weights]), "metrics": MetricRecord(metrics)})
            md = Metadata(run_id=0, message_id=f"{round}-{i}", src_node_id=zlib.crc32(u.client_id.encode()), dst_node_id=0,
                          reply_to_message_id="", group_id=str(round), created_at=time.time(), ttl=3600.0,
                          message_type=MessageType.TRAIN)
            replies.append(Message(content=content, metadata=md))
        arrays, metrics = self.flower.aggregate_train(int(round), replies)
        self.last_flower_metrics = dict(metrics or {})
        return None if arrays is None else arrays.to_numpy_ndarrays()
