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

A task with ``"uplink": <fl.compression spec>`` gets its update back compressed: ``weights`` is
then the compressed delta against the task's weights and ``"encoding"`` says how (see
``fl.compression``; the top-k residual stays on the device, in its durable store).

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
from fl.sites import SiteError, lan_update, task_weights_blob
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
    "local_split",
]

PROTOCOL = 1


class TaskError(ValueError):
    """A round task is malformed or was sent to the wrong endpoint."""


def client_seed(seed: int, round: int, client_id: str) -> int:
    """Deterministic per (run seed, round, client) so reruns train identically."""
    return (int(seed) * 1_000_003 + int(round) * 7919 + zlib.crc32(client_id.encode())) % (2**31 - 1)


def local_split(data: Any, holdout: float, client_id: str) -> Tuple[Any, Any]:
    """``(train, test)`` parts of a device's own data for federated evaluation.

    A dict ``{"train": ..., "test": ...}`` from the device's loader is its own split (the device
    owner decides); an ``(X, y)`` pair is split here, the ``holdout`` fraction held out. The
    permutation is seeded by the client id only, so every round (and the training task, which
    trains on the other part) sees the same split, and the test part is never trained on."""
    if isinstance(data, dict) and "train" in data and "test" in data:
        return data["train"], data["test"]
    if not (isinstance(data, tuple) and len(data) == 2):
        raise TaskError(f"federated evaluation needs (X, y) or {{'train', 'test'}} data, got {type(data).__name__}")
    X, y = data
    n = len(y)
    n_test = min(n - 1, max(1, int(round(float(holdout) * n)))) if n >= 2 else 0
    perm = np.random.default_rng(zlib.crc32(str(client_id).encode())).permutation(n)
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    return (X[train], y[train]), (X[test], y[test])


def _check_task(task: Any, kind: str) -> Dict[str, Any]:
    if not isinstance(task, dict) or task.get("v") != PROTOCOL or task.get("kind") != kind:
        raise TaskError(f"expected an fl {kind!r} task of protocol v{PROTOCOL}, got {type(task).__name__}"
                        f" {task.get('kind') if isinstance(task, dict) else ''!r}")
    here = _datasets.endpoint_id()
    cid = task.get("client_id")
    if kind in ("train", "warmup", "evaluate") and here is not None and cid != here:
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
    #: the app's ``evaluate_fn`` (if any) also runs on the devices under ``fit(fed_eval_every=k)``;
    #: False: it runs on the driver only (then ``fit`` needs ``eval_data`` for it)
    ships_evaluate_fn = False

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        if isinstance(task, dict) and task.get("kind") == "warmup":
            return self._warmup(task)
        if isinstance(task, dict) and task.get("kind") == "evaluate":
            return self._evaluate(task)
        t0 = time.perf_counter()
        task = _check_task(task, "train")
        weights = decode_weights(task_weights_blob(task))  # inline, or by key from the site's LAN store (fl.sites)
        if task.get("downlink") == "fp16":  # the global model came down as float16: train in float32
            weights = [w.astype(np.float32) if w.dtype == np.float16 else w for w in weights]
        t_data = time.perf_counter()
        data = self._load(task)
        if task.get("holdout") and self.loads_data:  # federated evaluation is on: never train on the local test part
            # (an app that loads its own data, a Flower client, keeps its own train/test split)
            data = local_split(data, float(task["holdout"]), str(task["client_id"]))[0]
        data_time = time.perf_counter() - t_data
        cfg = dict(task.get("config") or {})
        cfg.setdefault("round", task["round"])
        cfg["dataset"] = task["dataset"]
        cfg["seed"] = client_seed(int(cfg.get("seed", 0)), int(task["round"]), str(task["client_id"]))
        t_fit = time.perf_counter()
        new, n, metrics, device = self.fit(weights, data, cfg)
        train_time = time.perf_counter() - t_fit
        if cfg.get("dp_local"):  # local DP (fl.privacy): clip the delta and noise it before it leaves the device
            new = _local_dp(weights, new, dict(cfg["dp_local"]), int(cfg["seed"]))
        encoding = None
        if task.get("uplink"):  # lossy compression the run asked for (fl.compression): a delta leaves
            blob, encoding = _compress(task, weights, new, int(cfg["seed"]))
        else:
            blob = encode_weights(new)
        out = {
            "v": PROTOCOL, "kind": "update", "client_id": task["client_id"], "round": int(task["round"]),
            "base_version": int(task.get("base_version", 0)), "weights": blob, "num_samples": int(n),
            "metrics": {k: _plain(v) for k, v in (metrics or {}).items()},
            "train_time_s": train_time, "data_time_s": data_time, "task_time_s": time.perf_counter() - t0,
            "device": device,
        }
        if encoding is not None:
            out["encoding"] = encoding
        if task.get("update_to_site"):  # hierarchical through a gateway: the update stays on the site's LAN
            out = lan_update(task, out)
        return out

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

    def _evaluate(self, task: Dict[str, Any]) -> Dict[str, Any]:
        """Federated evaluation: the global model on this device's local test part (the data
        stays here; only the loss, metrics and example count leave)."""
        t0 = time.perf_counter()
        task = _check_task(task, "evaluate")
        weights = decode_weights(task["weights"])
        loss, n, metrics = self.evaluate_on_device(weights, task)
        return {"v": PROTOCOL, "kind": "evaluation", "client_id": task["client_id"], "round": int(task["round"]),
                "loss": float(loss), "metrics": {k: _plain(v) for k, v in (metrics or {}).items()},
                "num_examples": int(n), "eval_time_s": time.perf_counter() - t0}

    def evaluate_on_device(self, weights: Weights, task: Dict[str, Any]) -> Tuple[float, int, Dict[str, Any]]:
        """Federated evaluation on the endpoint: ``(loss, num_examples, metrics)`` of ``weights``
        on this device's local test part (:func:`local_split` of its dataset, ``task["holdout"]``).
        An app whose client evaluates on its own data (a Flower client) overrides this."""
        _, test = local_split(self._load(task), float(task.get("holdout") or 0.2), str(task["client_id"]))
        res = self.evaluate(weights, test)
        if res is None:
            raise TaskError(f"client app {self.name!r} has no evaluate(): it cannot take part in federated evaluation")
        loss, metrics = res
        n = len(test[1]) if isinstance(test, tuple) and len(test) == 2 else len(test)
        return float(loss), int(n), dict(metrics or {})

    def evaluates_on_device(self) -> bool:
        """Whether this app can take part in federated evaluation (``fit(fed_eval_every=k)``)."""
        cls = type(self)
        return cls.evaluate is not ClientApp.evaluate or cls.evaluate_on_device is not ClientApp.evaluate_on_device

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
        """``(loss, {"accuracy": ...})`` or None if unsupported: central evaluation on the driver
        (``eval_data``), and federated evaluation on the device (its local test part)."""
        return None

    def describe(self) -> Dict[str, Any]:
        return {"app": self.name}


def _compress(task: Dict[str, Any], base: Weights, new: Weights, seed: int) -> Tuple[bytes, Dict[str, Any]]:
    """Compress this update as the task's ``uplink`` spec says; with error feedback, the
    residual is read from and written to the device's durable store before the result leaves
    (fl.compression.ResidualStore: a reboot keeps it, a re-run task reuses its input)."""
    from fl import compression as fc

    comp = fc.from_spec(task["uplink"])
    run_id, cid, rnd = str(task.get("run_id")), str(task["client_id"]), int(task["round"])
    residual, ef = None, None
    store = fc.residual_store() if comp.error_feedback else None
    if store is not None:
        residual, ef = store.load(run_id, cid, rnd)
    blob, enc, res_out = fc.encode_update(new, base, comp, seed=seed, residual=residual)
    if store is not None and res_out is not None and not (ef or {}).get("stale"):
        store.save(run_id, cid, rnd, residual, res_out)
    if ef is not None:
        enc["ef"] = ef
    return blob, enc


def _local_dp(base: Weights, new: Weights, spec: Dict[str, Any], seed: int) -> Weights:
    from fl.privacy import clip_weights_delta

    delta, _ = clip_weights_delta(new, base, float(spec["clip_norm"]))
    rng = np.random.default_rng(seed)
    std = float(spec.get("noise_std", 0.0))
    return [(np.asarray(b, np.float64) + d + (rng.normal(0.0, std, d.shape) if std > 0 else 0.0)).astype(np.asarray(b).dtype)
            for b, d in zip(base, delta)]


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
    data) -> (loss, metrics)`` runs on the driver on ``eval_data`` (central evaluation) and, with
    ``fit(fed_eval_every=k)``, on the devices on their local test part (it is shipped with
    ``train``)."""

    name = "function"
    #: ``evaluate_fn`` runs on the devices too (federated evaluation), not only on the driver
    ships_evaluate_fn = True

    def __init__(self, train: Callable[..., Any], evaluate: Optional[Callable[..., Any]] = None,
                 initial_weights: Optional[Weights] = None) -> None:
        from mesh_agent.protocol.serialize import _by_value

        if not callable(train):
            raise TypeError(f"train must be a function train(weights, data, config), not {type(train).__name__}")
        if evaluate is not None and not callable(evaluate):
            raise TypeError(f"evaluate must be a function evaluate(weights, data), not {type(evaluate).__name__}")
        self.train = _by_value(train)
        self.evaluate_fn = None if evaluate is None else _by_value(evaluate)
        self._initial = None if initial_weights is None else [np.asarray(w).copy() for w in initial_weights]

    def __getstate__(self) -> Dict[str, Any]:
        return {"train": self.train, "evaluate": self.evaluate_fn}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.train = state["train"]
        self.evaluate_fn = state.get("evaluate")
        self._initial = None

    def evaluates_on_device(self) -> bool:
        return self.evaluate_fn is not None

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
        out = self.evaluate_fn(weights, data)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("evaluate() must return (loss, metrics)")
        loss, metrics = out
        return float(loss), dict(metrics or {})


def _group_blob(task: Dict[str, Any], new: Weights, current: Weights) -> Tuple[bytes, Optional[Dict[str, Any]]]:
    """The site's one update as it goes up, compressed against the staged model as the run asks
    (the driver decodes it against the same model). Top-k keeps its error-feedback residual as a
    device does, in the gateway's own durable store (``fl-state`` in its data directory), under
    the gateway's id: what one round leaves out of the site's update goes up in a later one."""
    spec = task.get("uplink")
    if not spec or task.get("current_ref") is None:
        return encode_weights(new), None
    seed = zlib.crc32(f"{task.get('gateway_id')}:{task.get('round')}".encode())
    return _compress({**task, "client_id": str(task.get("gateway_id"))}, current, new, seed)


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
        if isinstance(task, dict) and task.get("kind") == "stage":
            return self._stage(task)
        task = _check_task(task, "aggregate")
        addr = task.get("site_store")
        if task.get("current_ref") is not None:  # the model staged this round, from the site store (fl.sites)
            current = decode_weights(task_weights_blob({"weights_ref": task["current_ref"], "site_store": addr}))
            # the children trained from the float32 of an fp16 downlink: their deltas are against that
            current = [w.astype(np.float32) if w.dtype == np.float16 else w for w in current]
        else:
            current = decode_weights(task["current"])
        updates: List[ClientUpdate] = []
        rejected: List[Tuple[str, str]] = []
        lan_bytes = 0
        for u in task.get("updates") or []:
            try:
                if u.get("ref") is not None:  # the child's update, on the LAN; its key is in the child's signed result
                    blob = task_weights_blob({"weights_ref": u["ref"], "site_store": addr})
                    lan_bytes += len(blob)
                else:
                    blob = u["weights"]
                if u.get("encoding") is not None:  # compressed (fl.compression): a delta against this round's model
                    from fl.compression import decode_update

                    w = decode_update(blob, u["encoding"], current)
                else:
                    w = decode_weights(blob)
            except Exception as exc:  # one bad, missing or tampered blob rejects that update only
                rejected.append((str(u.get("client_id")), f"undecodable weights: {exc}"))
                continue
            updates.append(ClientUpdate(str(u["client_id"]), w, int(u["num_samples"]), metrics=dict(u.get("metrics") or {})))
        new = self.strategy.aggregate(int(task["round"]), updates, current)
        rep = self.strategy.last_report
        assert rep is not None
        blob, enc = (None, None) if new is None else _group_blob(task, new, current)
        out = {
            "v": PROTOCOL, "kind": "group", "gateway_id": task.get("gateway_id"), "round": int(task["round"]),
            "weights": blob, "num_samples": int(rep.num_samples),
            "accepted": list(rep.accepted), "rejected": rejected + [list(r) for r in rep.rejected],
            "reason": rep.reason, "metrics": self.strategy.aggregate_metrics([u for u in updates if u.client_id in set(rep.accepted)]),
            "aggregate_time_s": time.perf_counter() - t0, "bytes_lan": lan_bytes,
        }
        if enc is not None:
            out["encoding"] = enc
        return out

    def _stage(self, task: Dict[str, Any]) -> Dict[str, Any]:
        """Put this round's global model in the site store (it came down the uplink once, in
        this task) and answer its key: the site's children fetch it on the LAN."""
        from mesh_agent.site_store import put_blob

        if task.get("v") != PROTOCOL or not isinstance(task.get("weights"), (bytes, bytearray)):
            raise TaskError("a stage task needs v and the weights blob")
        addr = task.get("site_store")
        if not isinstance(addr, str):
            raise SiteError("a stage task needs site_store (host:port)")
        decode_weights(task["weights"])  # a blob that is no model is refused here, not by ten children
        return {"v": PROTOCOL, "kind": "staged", "round": int(task.get("round", 0)), "ref": put_blob(addr, bytes(task["weights"])),
                "bytes": len(task["weights"])}
