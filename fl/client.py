"""What runs on an endpoint in a federated round: client apps and the gateway aggregator.

A *client app* is the function the driver submits to each client's endpoint through the SDK.
It is a callable object: the mesh ships it once per worker (the agent caches function bodies
by content hash), so the model's architecture and the trainer settings travel once, and each
round's task carries only the round's small payload:

    task = {"v": 1, "kind": "train", "run_id", "round", "client_id", "base_version",
            "weights": <fl.wire blob>, "dataset": "digits", "dataset_kwargs": {...},
            "config": {"local_epochs": 2, "proximal_mu": 0.0, "seed": 0, ...}}

and returns

    {"v": 1, "kind": "update", "client_id", "round", "base_version", "weights": <fl.wire blob>,
     "num_samples": n, "metrics": {...}, "train_time_s", "data_time_s", "device"}

Apps here: :class:`TorchClientApp` (a torch ``nn.Module`` trained with cross-entropy; torch is
imported only when it runs), :class:`FunctionClientApp` (any framework: your
``train(weights, data, config)``), and ``fl.flower.FlowerClientApp`` (a Flower NumPyClient,
unchanged). :class:`GatewayAggregator` is the function an edge gateway runs in hierarchical
runs: it aggregates its group's updates with the inner strategy (numpy only).

The data comes from ``fl.datasets.load(task["dataset"])``: the endpoint's own declaration.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fl import datasets as _datasets
from fl.strategies import ClientUpdate, FedAvg, Strategy, Weights
from fl.wire import decode_weights, encode_weights

__all__ = [
    "PROTOCOL",
    "TrainerConfig",
    "ClientApp",
    "TorchClientApp",
    "FunctionClientApp",
    "GatewayAggregator",
    "TaskError",
    "client_seed",
]

PROTOCOL = 1


class TaskError(ValueError):
    """A round task is malformed or was sent to the wrong endpoint."""


def client_seed(seed: int, round: int, client_id: str) -> int:
    """Deterministic per (run seed, round, client) so reruns train identically."""
    return (int(seed) * 1_000_003 + int(round) * 7919 + zlib.crc32(client_id.encode())) % (2**31 - 1)


def _check_task(task: Any, kind: str) -> Dict[str, Any]:
    if not isinstance(task, dict) or task.get("v") != PROTOCOL or task.get("kind") != kind:
        raise TaskError(f"expected an fl {kind!r} task of protocol v{PROTOCOL}, got {type(task).__name__}"
                        f" {task.get('kind') if isinstance(task, dict) else ''!r}")
    here = _datasets.endpoint_id()
    cid = task.get("client_id")
    if kind in ("train", "warmup") and here is not None and cid != here:
        raise TaskError(f"task for client {cid!r} arrived at endpoint {here!r}")
    return task


@dataclass
class TrainerConfig:
    """Local training settings, the same for every client (round-varying settings come from the
    strategy's client config). ``device="auto"`` uses CUDA where the endpoint has it.
    ``threads``: torch intra-op threads per worker (None = torch's default, one per core)."""

    lr: float = 0.05
    batch_size: int = 32
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    device: str = "auto"
    threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.batch_size < 1 or self.momentum < 0 or self.weight_decay < 0:
            raise ValueError("lr > 0, batch_size >= 1, momentum >= 0 and weight_decay >= 0 are required")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r} (use 'sgd' or 'adam')")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")

    @classmethod
    def of(cls, value: "TrainerConfig | Dict[str, Any] | None") -> "TrainerConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**dict(value))


class ClientApp:
    """Base class. Subclasses implement :meth:`fit` (on the endpoint); the driver may call
    :meth:`initial_weights` and :meth:`evaluate` (central evaluation)."""

    name = "client"
    #: ``fit`` gets the endpoint's dataset (loaded by name); False: the app loads its own data
    loads_data = True

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        if isinstance(task, dict) and task.get("kind") == "warmup":
            return self._warmup(task)
        t0 = time.perf_counter()
        task = _check_task(task, "train")
        weights = decode_weights(task["weights"])
        t_data = time.perf_counter()
        data = self._load(task)
        data_time = time.perf_counter() - t_data
        cfg = dict(task.get("config") or {})
        cfg.setdefault("round", task["round"])
        cfg["dataset"] = task["dataset"]
        cfg["seed"] = client_seed(int(cfg.get("seed", 0)), int(task["round"]), str(task["client_id"]))
        t_fit = time.perf_counter()
        new, n, metrics, device = self.fit(weights, data, cfg)
        train_time = time.perf_counter() - t_fit
        blob = encode_weights(new)
        return {
            "v": PROTOCOL, "kind": "update", "client_id": task["client_id"], "round": int(task["round"]),
            "base_version": int(task.get("base_version", 0)), "weights": blob, "num_samples": int(n),
            "metrics": {k: _plain(v) for k, v in (metrics or {}).items()},
            "train_time_s": train_time, "data_time_s": data_time, "task_time_s": time.perf_counter() - t0,
            "device": device,
        }

    def _warmup(self, task: Dict[str, Any]) -> Dict[str, Any]:
        """Before round 1: load the dataset and build the model in this warm worker, so the first
        round's deadline measures training, not imports; and a device that lacks the dataset
        says so before any round counts on it."""
        t0 = time.perf_counter()
        task = _check_task(task, "warmup")
        data = self._load(task)
        device = self.prepare(data)
        try:
            n = None if data is None else (len(data[1]) if isinstance(data, tuple) and len(data) == 2 else len(data))
        except TypeError:
            n = None
        return {"v": PROTOCOL, "kind": "ready", "client_id": task["client_id"], "num_samples": n, "device": device,
                "warmup_time_s": time.perf_counter() - t0}

    def _load(self, task: Dict[str, Any]) -> Any:
        if self.loads_data:
            return _datasets.load(task["dataset"], **dict(task.get("dataset_kwargs") or {}))
        if task["dataset"] not in _datasets.declared() and _datasets.endpoint_id() is not None:
            raise _datasets.DatasetNotFound(f"dataset {task['dataset']!r} is not declared on {_datasets.endpoint_name()}")
        return None

    def prepare(self, data: Any) -> str:
        """Build what ``fit`` needs (model, device) and pay one-time costs; return the device."""
        return "cpu"

    def fit(self, weights: Weights, data: Any, config: Dict[str, Any]) -> Tuple[Weights, int, Dict[str, Any], str]:
        """Train from ``weights`` on the local ``data``; return (weights, num_samples, metrics, device)."""
        raise NotImplementedError

    def initial_weights(self) -> Optional[Weights]:
        return None

    def evaluate(self, weights: Weights, data: Any) -> Optional[Tuple[float, Dict[str, float]]]:
        """Central evaluation on the driver: ``(loss, {"accuracy": ...})`` or None if unsupported."""
        return None

    def describe(self) -> Dict[str, Any]:
        return {"app": self.name}


def _plain(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


class TorchClientApp(ClientApp):
    """Supervised classification with a torch model: cross-entropy, SGD or Adam, FedProx's
    proximal term when the strategy sends ``proximal_mu``. ``data`` on the endpoint is ``(X, y)``.

    Pickles to the model's architecture (no weights) and the trainer settings; the model built
    on the endpoint is kept in the warm worker and reused across rounds.
    """

    name = "torch"

    def __init__(self, model: Any, trainer: "TrainerConfig | Dict[str, Any] | None" = None) -> None:
        from fl import torch_support as ts

        self.trainer = TrainerConfig.of(trainer)
        self.arch = ts.architecture_blob(model)
        self.arch_id = hashlib.sha256(self.arch).hexdigest()[:16]
        self._initial: Optional[Weights] = ts.get_weights(model)
        self._model: Any = None
        self._device: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"trainer": asdict(self.trainer), "arch": self.arch, "arch_id": self.arch_id}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.trainer = TrainerConfig(**state["trainer"])
        self.arch = state["arch"]
        self.arch_id = state["arch_id"]
        self._initial = None
        self._model = None
        self._device = None

    def initial_weights(self) -> Optional[Weights]:
        return None if self._initial is None else [w.copy() for w in self._initial]

    def _build(self, weights: Optional[Sequence[np.ndarray]]) -> Any:
        import torch

        from fl import torch_support as ts

        if self.trainer.threads:
            torch.set_num_threads(int(self.trainer.threads))
        dev = ts.select_device(self.trainer.device)
        if self._model is None or self._device != dev:
            self._model = ts.model_from_blob(self.arch, None, dev)
            self._device = dev
        if weights is not None:
            ts.set_weights(self._model, weights)
        return self._model

    def prepare(self, data: Any) -> str:
        """Build the model and run one forward/backward pass on a few samples with a zero step
        (no weight changes): torch initialises autograd and the optimizer lazily, which costs
        seconds on a busy or small device, and that must not count against round 1's deadline."""
        from fl import torch_support as ts

        model = self._build(None)
        X, y = data
        if len(y):
            t = self.trainer
            before = ts.get_weights(model)
            ts.train_supervised(model, X[:8], y[:8], epochs=1, batch_size=8, lr=0.0, momentum=t.momentum,
                                weight_decay=0.0, optimizer=t.optimizer, device=self._device)
            ts.set_weights(model, before)  # (lr=0 moves nothing, but a model must never drift here)
        return str(self._device)

    def fit(self, weights: Weights, data: Any, config: Dict[str, Any]) -> Tuple[Weights, int, Dict[str, Any], str]:
        from fl import torch_support as ts

        X, y = data
        model = self._build(weights)
        t = self.trainer
        metrics = ts.train_supervised(
            model, X, y, epochs=int(config.get("local_epochs", 1)), batch_size=t.batch_size,
            lr=float(config.get("lr", t.lr)), momentum=t.momentum, weight_decay=t.weight_decay,
            optimizer=t.optimizer, proximal_mu=float(config.get("proximal_mu", 0.0)),
            seed=int(config.get("seed", 0)), device=self._device,
        )
        return ts.get_weights(model), len(y), metrics, str(self._device)

    def evaluate(self, weights: Weights, data: Any) -> Optional[Tuple[float, Dict[str, float]]]:
        from fl import torch_support as ts

        X, y = data
        model = self._build(weights)
        loss, acc = ts.evaluate_supervised(model, X, y, device=self._device)
        return loss, {"accuracy": acc}

    def describe(self) -> Dict[str, Any]:
        return {"app": self.name, "arch_id": self.arch_id, **asdict(self.trainer)}


class FunctionClientApp(ClientApp):
    """Any framework: ``train(weights, data, config) -> (weights, num_samples, metrics)`` runs
    on the endpoint (shipped by value like any mesh function); optional ``evaluate(weights,
    data) -> (loss, metrics)`` runs on the driver."""

    name = "function"

    def __init__(self, train: Callable[..., Any], evaluate: Optional[Callable[..., Any]] = None,
                 initial_weights: Optional[Weights] = None) -> None:
        from mesh_agent.protocol.serialize import _by_value

        self.train = _by_value(train)
        self.evaluate_fn = evaluate
        self._initial = None if initial_weights is None else [np.asarray(w).copy() for w in initial_weights]

    def __getstate__(self) -> Dict[str, Any]:
        return {"train": self.train}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.train = state["train"]
        self.evaluate_fn = None
        self._initial = None

    def fit(self, weights: Weights, data: Any, config: Dict[str, Any]) -> Tuple[Weights, int, Dict[str, Any], str]:
        out = self.train(weights, data, config)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("train() must return (weights, num_samples, metrics)")
        w, n, m = out
        return [np.asarray(a) for a in w], int(n), dict(m or {}), "cpu"

    def initial_weights(self) -> Optional[Weights]:
        return None if self._initial is None else [w.copy() for w in self._initial]

    def evaluate(self, weights: Weights, data: Any) -> Optional[Tuple[float, Dict[str, float]]]:
        if self.evaluate_fn is None:
            return None
        loss, metrics = self.evaluate_fn(weights, data)
        return float(loss), dict(metrics or {})


@dataclass
class GatewayAggregator:
    """Runs on an edge gateway: aggregate the group's updates with the inner strategy first.

    Task: ``{"v", "kind": "aggregate", "round", "gateway_id", "current": <blob>, "updates":
    [{"client_id", "weights": <blob>, "num_samples", "metrics"}]}``; returns the group's new
    weights as one pseudo-update (its ``num_samples`` is the group's accepted total) with the
    accepted/rejected lists, or ``weights=None`` and the reason.
    """

    strategy: Strategy = field(default_factory=FedAvg)
    name: str = "gateway"

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        t0 = time.perf_counter()
        task = _check_task(task, "aggregate")
        current = decode_weights(task["current"])
        updates: List[ClientUpdate] = []
        rejected: List[Tuple[str, str]] = []
        for u in task.get("updates") or []:
            try:
                w = decode_weights(u["weights"])
            except Exception as exc:  # one bad blob rejects that update only
                rejected.append((str(u.get("client_id")), f"undecodable weights: {exc}"))
                continue
            updates.append(ClientUpdate(str(u["client_id"]), w, int(u["num_samples"]), metrics=dict(u.get("metrics") or {})))
        new = self.strategy.aggregate(int(task["round"]), updates, current)
        rep = self.strategy.last_report
        assert rep is not None
        return {
            "v": PROTOCOL, "kind": "group", "gateway_id": task.get("gateway_id"), "round": int(task["round"]),
            "weights": None if new is None else encode_weights(new), "num_samples": int(rep.num_samples),
            "accepted": list(rep.accepted), "rejected": rejected + [list(r) for r in rep.rejected],
            "reason": rep.reason, "metrics": self.strategy.aggregate_metrics([u for u in updates if u.client_id in set(rep.accepted)]),
            "aggregate_time_s": time.perf_counter() - t0,
        }
