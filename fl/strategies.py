"""Aggregation strategies for the Flox-style FL library (pure logic: numpy only, no I/O).

The interface follows Flower's strategy hooks, reduced to what a function-mesh round needs:

``configure_round(round, available_clients) -> list[ClientInstruction]``
    Client selection for a round (``fraction_fit`` / ``min_clients`` / ``min_available_clients``),
    deterministic for ``(seed, round)``, plus the config each client's trainer receives.
``aggregate(round, updates, current) -> Weights | None``
    Synchronous aggregation of what arrived before the deadline. ``None`` means "no new global
    model": not enough valid updates (``min_clients``); the reason is in ``last_report.reason``.
``on_update(update, current, server_version) -> Weights | None``
    Asynchronous strategies only (``is_async = True``): called once per arriving update.
``aggregate_metrics(updates) -> dict``
    Sample-weighted average of numeric client metrics (loss, accuracy, ...).

``Weights`` is a list of numpy arrays, one per model tensor, in a fixed order.

Synchronous strategies: ``FedAvg``, ``FedProx``; server optimizers ``FedAdam``, ``FedYogi``,
``FedAdagrad`` (FedOpt, Reddi et al. 2021); robust aggregation ``TrimmedMean`` (Yin et al. 2018),
``Krum`` and multi-Krum (Blanchard et al. 2017); ``Hierarchical``. Asynchronous: ``FedAsync``,
``FedBuff``.

Every update is validated against the current global weights before it is used: wrong number
of tensors, wrong shapes, non-finite values or a non-positive sample count reject *that* update
with a reason (kept in ``last_report.rejected`` and in ``strategy.rejections``); aggregation never
crashes because of one bad client ("accept_failures" semantics as in Flower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

Weights = List[np.ndarray]

__all__ = [
    "Weights",
    "ClientUpdate",
    "ClientInstruction",
    "AggregationReport",
    "Strategy",
    "FedAvg",
    "FedProx",
    "FedOpt",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "TrimmedMean",
    "Krum",
    "FedAsync",
    "FedBuff",
    "Hierarchical",
    "validate_update",
    "weighted_average",
    "polynomial_staleness",
    "proximal_term",
]


# --------------------------------------------------------------------------------------------
# data types
# --------------------------------------------------------------------------------------------
@dataclass
class ClientUpdate:
    """What one client's local-training function returns.

    ``base_version`` is the global-model version the client trained from (async strategies use
    it for staleness). ``gateway_id`` (optional) names the edge gateway the client sits behind;
    ``Hierarchical`` groups by it.
    """

    client_id: str
    weights: Weights
    num_samples: int
    base_version: int = 0
    metrics: Dict[str, Any] = field(default_factory=dict)
    gateway_id: Optional[str] = None


@dataclass
class ClientInstruction:
    """A selected client for a round and the config its trainer receives."""

    client_id: str
    round: int
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class AggregationReport:
    """What happened in the last ``aggregate`` / ``on_update`` call."""

    round: int
    accepted: List[str] = field(default_factory=list)
    rejected: List[Tuple[str, str]] = field(default_factory=list)  # (client_id, reason)
    num_samples: int = 0  # total samples of accepted updates
    aggregated: bool = False
    reason: Optional[str] = None  # why no new model was produced (None when aggregated)

    @property
    def dropped_reasons(self) -> Dict[str, str]:
        return {cid: why for cid, why in self.rejected}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def validate_update(update: ClientUpdate, reference: Sequence[np.ndarray]) -> Optional[str]:
    """Return ``None`` if ``update`` is usable against ``reference`` weights, else a reason."""
    try:
        n = int(update.num_samples)
    except (TypeError, ValueError):
        return f"num_samples is not an integer: {update.num_samples!r}"
    if n <= 0:
        return f"num_samples must be > 0, got {n}"
    w = update.weights
    if w is None or not isinstance(w, (list, tuple)):
        return f"weights must be a list of arrays, got {type(w).__name__}"
    if len(w) != len(reference):
        return f"expected {len(reference)} tensors, got {len(w)}"
    for i, (a, ref) in enumerate(zip(w, reference)):
        try:
            arr = np.asarray(a)
        except Exception as exc:  # pragma: no cover - exotic objects
            return f"tensor {i} is not array-like: {exc}"
        if arr.shape != np.shape(ref):
            return f"tensor {i} has shape {arr.shape}, expected {np.shape(ref)}"
        if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
            return f"tensor {i} has non-real dtype {arr.dtype}"
        if not np.all(np.isfinite(arr)):
            return f"tensor {i} contains non-finite values (NaN/inf)"
    return None


def _out_dtype(ref: np.ndarray) -> np.dtype:
    dt = np.asarray(ref).dtype
    return dt if np.issubdtype(dt, np.floating) else np.dtype(np.float64)


def weighted_average(
    weight_lists: Sequence[Sequence[np.ndarray]],
    coefficients: Sequence[float],
    reference: Sequence[np.ndarray],
) -> Weights:
    """Σ c_k w_k / Σ c_k per tensor, computed in float64 and cast to the reference dtype."""
    coef = np.asarray(coefficients, dtype=np.float64)
    total = float(coef.sum())
    if total <= 0:
        raise ValueError("sum of aggregation coefficients must be > 0")
    out: Weights = []
    for t, ref in enumerate(reference):
        acc = np.zeros(np.shape(ref), dtype=np.float64)
        for c, wl in zip(coef, weight_lists):
            acc += c * np.asarray(wl[t], dtype=np.float64)
        out.append((acc / total).astype(_out_dtype(ref)))
    return out


def polynomial_staleness(staleness: float, a: float = 0.5) -> float:
    """s(t) = (1 + t)^-a  (Xie et al., FedAsync; also used by FedBuff)."""
    return float((1.0 + max(0.0, float(staleness))) ** (-a))


def proximal_term(weights: Sequence[np.ndarray], global_weights: Sequence[np.ndarray], mu: float):
    """FedProx proximal term for numpy trainers: returns ``(value, grads)`` of
    ``mu/2 * ||w - w_global||^2``; add ``value`` to the loss and ``grads[i]`` to tensor i's grad."""
    value = 0.0
    grads = []
    for w, g in zip(weights, global_weights):
        d = np.asarray(w, dtype=np.float64) - np.asarray(g, dtype=np.float64)
        value += float(np.sum(d * d))
        grads.append((mu * d).astype(_out_dtype(np.asarray(w))))
    return 0.5 * mu * value, grads


def _copy(weights: Sequence[np.ndarray]) -> Weights:
    return [np.array(w, copy=True) for w in weights]


# --------------------------------------------------------------------------------------------
# base strategy
# --------------------------------------------------------------------------------------------
class Strategy:
    """Base class: client selection + bookkeeping of rejected updates.

    Parameters
    ----------
    fraction_fit: fraction of available clients asked per round (rounded up).
    min_clients: minimum number of valid updates needed to aggregate (and minimum asked).
    min_available_clients: below this many available clients the round is not started.
    seed: client selection is deterministic for ``(seed, round)``.
    client_config: extra config sent to every selected client's trainer.
    """

    is_async = False
    name = "strategy"
    #: the round driver's mode (``fl.drivers``); None: sync, async or hierarchical as the
    #: strategy's kind says
    driver: Optional[str] = None

    def __init__(
        self,
        *,
        fraction_fit: float = 1.0,
        min_clients: int = 1,
        min_available_clients: Optional[int] = None,
        seed: int = 0,
        client_config: Optional[Mapping[str, Any]] = None,
    ) -> None:
        if not 0.0 < fraction_fit <= 1.0:
            raise ValueError("fraction_fit must be in (0, 1]")
        if min_clients < 1:
            raise ValueError("min_clients must be >= 1")
        self.fraction_fit = float(fraction_fit)
        self.min_clients = int(min_clients)
        self.min_available_clients = int(
            min_available_clients if min_available_clients is not None else min_clients
        )
        self.seed = int(seed)
        self.client_config: Dict[str, Any] = dict(client_config or {})
        self.last_report: Optional[AggregationReport] = None
        self.last_selection_reason: Optional[str] = None
        self.rejections: List[Tuple[int, str, str]] = []  # (round/version, client_id, reason)

    # ---- hooks ---------------------------------------------------------------------------
    def client_round_config(self, round: int) -> Dict[str, Any]:
        """Config dict sent to each selected client (override to add e.g. learning rate)."""
        cfg = dict(self.client_config)
        cfg.setdefault("round", round)
        cfg.setdefault("strategy", self.name)
        return cfg

    def configure_round(self, round: int, available_clients: Sequence[str]) -> List[ClientInstruction]:
        """Select clients for ``round``. Returns ``[]`` (reason in ``last_selection_reason``)
        when fewer than ``min_available_clients`` are available."""
        clients = sorted(dict.fromkeys(str(c) for c in available_clients))
        self.last_selection_reason = None
        if len(clients) < self.min_available_clients:
            self.last_selection_reason = (
                f"only {len(clients)} clients available, need {self.min_available_clients}"
            )
            return []
        n = max(self.min_clients, int(math.ceil(self.fraction_fit * len(clients))))
        n = min(n, len(clients))
        rng = np.random.default_rng([self.seed, int(round)])
        idx = sorted(rng.choice(len(clients), size=n, replace=False).tolist())
        cfg = self.client_round_config(round)
        return [ClientInstruction(clients[i], int(round), dict(cfg)) for i in idx]

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        raise NotImplementedError

    def on_update(self, update: ClientUpdate, current: Weights, server_version: int) -> Optional[Weights]:
        raise NotImplementedError(
            f"{type(self).__name__} is synchronous: collect updates and call aggregate()"
        )

    def aggregate_metrics(self, updates: Sequence[ClientUpdate]) -> Dict[str, float]:
        """Sample-weighted mean of each numeric metric reported by the updates."""
        sums: Dict[str, float] = {}
        counts: Dict[str, float] = {}
        for u in updates:
            for k, v in (u.metrics or {}).items():
                if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(float(v)):
                    sums[k] = sums.get(k, 0.0) + float(v) * u.num_samples
                    counts[k] = counts.get(k, 0.0) + u.num_samples
        return {k: sums[k] / counts[k] for k in sums if counts[k] > 0}

    # ---- shared machinery ----------------------------------------------------------------
    def _split_valid(self, round: int, updates: Sequence[ClientUpdate], current: Weights, report: AggregationReport):
        valid: List[ClientUpdate] = []
        seen = set()
        for u in updates:
            reason = validate_update(u, current)
            if reason is None and u.client_id in seen:
                reason = "duplicate update from the same client in this round"
            if reason is not None:
                report.rejected.append((u.client_id, reason))
                self.rejections.append((round, u.client_id, reason))
                continue
            seen.add(u.client_id)
            valid.append(u)
        return valid


# --------------------------------------------------------------------------------------------
# synchronous strategies
# --------------------------------------------------------------------------------------------
class FedAvg(Strategy):
    """Sample-weighted federated averaging (McMahan et al.): w = Σ n_k w_k / Σ n_k.

    accept_failures: aggregate whatever valid updates arrived if there are at least
    ``min_clients`` of them; otherwise return ``None`` (``last_report.reason`` says why).
    With ``accept_failures=False`` any rejected update also makes the round return ``None``.
    """

    name = "fedavg"

    def __init__(self, *, accept_failures: bool = True, **kw: Any) -> None:
        super().__init__(**kw)
        self.accept_failures = bool(accept_failures)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        report = AggregationReport(round=int(round))
        self.last_report = report
        valid = self._split_valid(round, updates, current, report)
        report.accepted = [u.client_id for u in valid]
        report.num_samples = int(sum(int(u.num_samples) for u in valid))
        if report.rejected and not self.accept_failures:
            report.reason = f"{len(report.rejected)} update(s) rejected and accept_failures=False"
            return None
        if len(valid) < self.min_clients:
            report.reason = f"only {len(valid)} valid update(s), need min_clients={self.min_clients}"
            return None
        new = weighted_average([u.weights for u in valid], [u.num_samples for u in valid], current)
        report.aggregated = True
        return new


class FedProx(FedAvg):
    """FedProx (Li et al.): the server side is FedAvg; ``proximal_mu`` goes to every client's
    config and the trainer adds ``mu/2 ||w - w_global||^2`` to its loss (see ``proximal_term``)."""

    name = "fedprox"

    def __init__(self, *, proximal_mu: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        if proximal_mu < 0:
            raise ValueError("proximal_mu must be >= 0")
        self.proximal_mu = float(proximal_mu)

    def client_round_config(self, round: int) -> Dict[str, Any]:
        cfg = super().client_round_config(round)
        cfg["proximal_mu"] = self.proximal_mu
        return cfg


# --------------------------------------------------------------------------------------------
# server optimizers (FedOpt)
# --------------------------------------------------------------------------------------------
class FedOpt(FedAvg):
    """FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): the sample-weighted
    mean of the clients' deltas is a pseudo-gradient ``Δ = Σ n_k (w_k - w) / Σ n_k`` that a
    server optimizer applies:

        m <- β1 m + (1 - β1) Δ
        v <- (subclass: Adagrad, Yogi or Adam's second-moment rule)
        w <- w + η m / (sqrt(v) + τ)

    ``eta`` is the server learning rate, ``tau`` the adaptivity (how far from sign-SGD);
    ``bias_correction`` scales η by sqrt(1 - β2^t) / (1 - β1^t) as Adam does (Flower's FedAdam
    does too). Moments start at zero (``v`` at ``tau²`` for Yogi, as in the paper); they are
    kept in the strategy, so a resumed run starts them again. Integer tensors (e.g. BatchNorm's
    ``num_batches_tracked``) are averaged as FedAvg does, not optimized.
    """

    name = "fedopt"

    def __init__(self, *, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 bias_correction: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        if eta <= 0 or tau <= 0:
            raise ValueError("eta and tau must be > 0")
        if not (0.0 <= beta_1 < 1.0 and 0.0 <= beta_2 < 1.0):
            raise ValueError("beta_1 and beta_2 must be in [0, 1)")
        self.eta, self.beta_1, self.beta_2, self.tau = float(eta), float(beta_1), float(beta_2), float(tau)
        self.bias_correction = bool(bias_correction)
        self.m: Optional[List[np.ndarray]] = None
        self.v: Optional[List[np.ndarray]] = None
        self.steps = 0

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _v0(self, shape: Tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float64)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        avg = super().aggregate(round, updates, current)
        if avg is None:
            return None
        floats = [np.issubdtype(np.asarray(c).dtype, np.floating) for c in current]
        delta = [np.asarray(a, np.float64) - np.asarray(c, np.float64) for a, c in zip(avg, current)]
        if self.m is None or len(self.m) != len(delta) or any(m.shape != d.shape for m, d in zip(self.m, delta)):
            self.m = [np.zeros(d.shape) for d in delta]
            self.v = [self._v0(d.shape) for d in delta]
            self.steps = 0
        assert self.v is not None
        self.steps += 1
        eta = self.eta
        if self.bias_correction:
            eta *= math.sqrt(1.0 - self.beta_2 ** self.steps) / (1.0 - self.beta_1 ** self.steps)
        out: Weights = []
        for t, (c, d) in enumerate(zip(current, delta)):
            if not floats[t]:
                out.append(avg[t])
                continue
            self.m[t] = self.beta_1 * self.m[t] + (1.0 - self.beta_1) * d
            self.v[t] = self._second_moment(self.v[t], d * d)
            w = np.asarray(c, np.float64) + eta * self.m[t] / (np.sqrt(self.v[t]) + self.tau)
            out.append(w.astype(_out_dtype(c)))
        return out


class FedAdagrad(FedOpt):
    """FedOpt with Adagrad's second moment: ``v <- v + Δ²``."""

    name = "fedadagrad"

    def __init__(self, *, eta: float = 0.1, tau: float = 1e-3, beta_1: float = 0.0, **kw: Any) -> None:
        super().__init__(eta=eta, tau=tau, beta_1=beta_1, **kw)

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v + d2


class FedYogi(FedOpt):
    """FedOpt with Yogi's second moment: ``v <- v - (1 - β2) Δ² sign(v - Δ²)`` (v starts at τ²)."""

    name = "fedyogi"

    def _v0(self, shape: Tuple[int, ...]) -> np.ndarray:
        return np.full(shape, self.tau ** 2, dtype=np.float64)

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v - (1.0 - self.beta_2) * d2 * np.sign(v - d2)


class FedAdam(FedOpt):
    """FedOpt with Adam's second moment: ``v <- β2 v + (1 - β2) Δ²``."""

    name = "fedadam"

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return self.beta_2 * v + (1.0 - self.beta_2) * d2


# --------------------------------------------------------------------------------------------
# robust aggregation
# --------------------------------------------------------------------------------------------
def _flat(weights: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).reshape(-1) for w in weights]) if len(weights) else np.zeros(0)


class TrimmedMean(FedAvg):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): for every coordinate drop the
    ``k = floor(beta * n)`` largest and ``k`` smallest of the ``n`` valid client values and
    average the rest (unweighted: a client cannot buy influence with a large sample count).
    Tolerates up to ``k`` Byzantine clients per coordinate. ``n - 2k`` must be at least 1;
    with ``beta=0`` it is the plain (unweighted) mean."""

    name = "trimmedmean"

    def __init__(self, *, beta: float = 0.2, **kw: Any) -> None:
        super().__init__(**kw)
        if not 0.0 <= beta < 0.5:
            raise ValueError("beta must be in [0, 0.5)")
        self.beta = float(beta)
        self.last_trimmed = 0  # clients trimmed from each side per coordinate, last round

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        report = AggregationReport(round=int(round))
        self.last_report = report
        valid = self._split_valid(round, updates, current, report)
        if report.rejected and not self.accept_failures:
            report.reason = f"{len(report.rejected)} update(s) rejected and accept_failures=False"
            return None
        if len(valid) < self.min_clients:
            report.reason = f"only {len(valid)} valid update(s), need min_clients={self.min_clients}"
            return None
        n = len(valid)
        k = int(math.floor(self.beta * n))
        if n - 2 * k < 1:  # (cannot happen for beta < 0.5; kept as a guard)
            report.reason = f"trimming {k} from each side of {n} leaves nothing"
            return None
        out: Weights = []
        for t, ref in enumerate(current):
            stack = np.sort(np.stack([np.asarray(u.weights[t], np.float64) for u in valid]), axis=0)
            out.append(stack[k : n - k].mean(axis=0).astype(_out_dtype(ref)))
        report.accepted = [u.client_id for u in valid]
        report.num_samples = int(sum(int(u.num_samples) for u in valid))
        report.aggregated = True
        self.last_trimmed = k
        return out


class Krum(FedAvg):
    """Krum and multi-Krum (Blanchard et al., NeurIPS 2017).

    With ``n`` valid updates of which at most ``f`` (``num_byzantine``) are Byzantine, each
    update's score is the sum of squared distances to its ``n - f - 2`` nearest other updates;
    Krum keeps the update with the lowest score, multi-Krum (``num_selected = m > 1``) the ``m``
    lowest and averages them by sample count. Needs ``n >= 2f + 3``; below that the round has no
    new model (reason in the report). Updates not kept are reported as rejected ("not selected
    by Krum") so the round record names them. ``num_selected=None``: ``n - f`` (multi-Krum).
    """

    name = "krum"

    def __init__(self, *, num_byzantine: int = 1, num_selected: Optional[int] = 1, **kw: Any) -> None:
        super().__init__(**kw)
        if num_byzantine < 0:
            raise ValueError("num_byzantine must be >= 0")
        if num_selected is not None and num_selected < 1:
            raise ValueError("num_selected must be >= 1 (or None for n - f)")
        self.num_byzantine = int(num_byzantine)
        self.num_selected = None if num_selected is None else int(num_selected)
        self.last_scores: Dict[str, float] = {}

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        report = AggregationReport(round=int(round))
        self.last_report = report
        valid = self._split_valid(round, updates, current, report)
        if report.rejected and not self.accept_failures:
            report.reason = f"{len(report.rejected)} update(s) rejected and accept_failures=False"
            return None
        n, f = len(valid), self.num_byzantine
        need = max(self.min_clients, 2 * f + 3)
        if n < need:
            report.reason = f"only {len(valid)} valid update(s), Krum with num_byzantine={f} needs {need}"
            return None
        X = np.stack([_flat(u.weights) for u in valid])
        sq = np.sum(X * X, axis=1)
        d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (X @ X.T), 0.0)
        np.fill_diagonal(d2, np.inf)
        closest = n - f - 2
        scores = np.sort(d2, axis=1)[:, :closest].sum(axis=1)
        m = min(n, self.num_selected if self.num_selected is not None else n - f)
        order = np.argsort(scores, kind="stable")
        keep = sorted(order[:m].tolist())
        self.last_scores = {u.client_id: float(s) for u, s in zip(valid, scores)}
        chosen = [valid[i] for i in keep]
        for i in order[m:].tolist():
            why = f"not selected by Krum (score {scores[i]:.4g}, kept {m} of {n})"
            report.rejected.append((valid[i].client_id, why))
            self.rejections.append((round, valid[i].client_id, why))
        report.accepted = [u.client_id for u in chosen]
        report.num_samples = int(sum(int(u.num_samples) for u in chosen))
        report.aggregated = True
        return weighted_average([u.weights for u in chosen], [u.num_samples for u in chosen], current)


class Hierarchical(Strategy):
    """Two-level aggregation: edge gateways first, then across gateways.

    Updates are grouped by ``update.gateway_id`` (or ``gateway_of(client_id)`` when given; a
    client with no gateway forms its own group). Each group is aggregated by ``inner``; each
    group result becomes one pseudo-update whose ``num_samples`` is the group's accepted sample
    total, and these are aggregated by ``outer`` (``min_clients`` of ``outer`` counts groups).

    With FedAvg inside and outside the result equals flat FedAvg over all clients:
    Σ_g (N_g/N) Σ_{k∈g} (n_k/N_g) w_k = Σ_k n_k w_k / N  (up to floating-point rounding).
    A group whose inner aggregation returns ``None`` is dropped with its reason.
    Client selection and client config are delegated to ``inner``.
    """

    name = "hierarchical"

    def __init__(
        self,
        inner: Optional[Strategy] = None,
        outer: Optional[Strategy] = None,
        *,
        gateway_of: Union[None, Mapping[str, str], Callable[[str], Optional[str]]] = None,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.inner = inner if inner is not None else FedAvg()
        self.outer = outer if outer is not None else FedAvg()
        if self.inner.is_async or self.outer.is_async:
            raise ValueError("Hierarchical needs synchronous inner/outer strategies")
        self.gateway_of = gateway_of
        self.group_reports: Dict[str, AggregationReport] = {}

    def configure_round(self, round: int, available_clients: Sequence[str]) -> List[ClientInstruction]:
        out = self.inner.configure_round(round, available_clients)
        self.last_selection_reason = self.inner.last_selection_reason
        return out

    def _gateway(self, u: ClientUpdate) -> str:
        gw: Optional[str] = None
        if self.gateway_of is not None:
            gw = self.gateway_of(u.client_id) if callable(self.gateway_of) else self.gateway_of.get(u.client_id)
        if gw is None:
            gw = u.gateway_id
        return str(gw) if gw is not None else f"direct:{u.client_id}"

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        report = AggregationReport(round=int(round))
        self.last_report = report
        self.group_reports = {}
        groups: Dict[str, List[ClientUpdate]] = {}
        for u in updates:
            groups.setdefault(self._gateway(u), []).append(u)
        pseudo: List[ClientUpdate] = []
        for gw in sorted(groups):
            gw_weights = self.inner.aggregate(round, groups[gw], current)
            rep = self.inner.last_report
            assert rep is not None
            self.group_reports[gw] = rep
            for cid, why in rep.rejected:
                report.rejected.append((cid, why))
                self.rejections.append((round, cid, why))
            if gw_weights is None:
                why = f"gateway {gw} dropped: {rep.reason}"
                for cid in rep.accepted:
                    report.rejected.append((cid, why))
                    self.rejections.append((round, cid, why))
                continue
            report.accepted.extend(rep.accepted)
            pseudo.append(ClientUpdate(gw, gw_weights, rep.num_samples, metrics={}))
        report.num_samples = int(sum(p.num_samples for p in pseudo))
        new = self.outer.aggregate(round, pseudo, current)
        if new is None:
            report.reason = f"outer aggregation over {len(pseudo)} gateway(s): {self.outer.last_report.reason}"
            return None
        report.aggregated = True
        return new


# --------------------------------------------------------------------------------------------
# asynchronous strategies
# --------------------------------------------------------------------------------------------
def _staleness_fn(staleness: Union[str, Callable[[float], float]], a: float) -> Callable[[float], float]:
    if callable(staleness):
        return staleness
    if staleness == "polynomial":
        return lambda t: polynomial_staleness(t, a)
    if staleness == "constant":
        return lambda t: 1.0
    raise ValueError(f"unknown staleness function {staleness!r} (use 'polynomial', 'constant' or a callable)")


class _AsyncStrategy(Strategy):
    is_async = True

    def __init__(self, *, staleness: Union[str, Callable[[float], float]] = "polynomial",
                 a: float = 0.5, max_staleness: Optional[int] = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.a = float(a)
        self.staleness_fn = _staleness_fn(staleness, self.a)
        self.max_staleness = max_staleness

    def aggregate(self, round: int, updates: Sequence[ClientUpdate], current: Weights) -> Optional[Weights]:
        raise NotImplementedError(
            f"{type(self).__name__} is asynchronous: call on_update() for each arriving update"
        )

    def _check(self, update: ClientUpdate, current: Weights, server_version: int, report: AggregationReport) -> Optional[int]:
        """Validate and return staleness, or None (rejection recorded)."""
        reason = validate_update(update, current)
        staleness = int(server_version) - int(update.base_version)
        if reason is None and staleness < 0:
            reason = f"base_version {update.base_version} is newer than server version {server_version}"
        if reason is None and self.max_staleness is not None and staleness > self.max_staleness:
            reason = f"staleness {staleness} exceeds max_staleness={self.max_staleness}"
        if reason is not None:
            report.rejected.append((update.client_id, reason))
            self.rejections.append((int(server_version), update.client_id, reason))
            report.reason = reason
            return None
        return staleness


class FedAsync(_AsyncStrategy):
    """FedAsync (Xie et al. 2019): mix every update as it arrives,
    ``w <- (1 - a_t) w + a_t w_client`` with ``a_t = alpha * s(staleness)``,
    staleness = ``server_version - update.base_version``, ``s(t) = (1 + t)^-a`` by default.

    ``on_update`` returns the new global weights (the caller bumps its version), or ``None``
    when the update is rejected (reason in ``last_report``). ``last_mixing`` holds a_t.
    """

    name = "fedasync"

    def __init__(self, *, alpha: float = 0.6, **kw: Any) -> None:
        super().__init__(**kw)
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = float(alpha)
        self.last_mixing: Optional[float] = None

    def on_update(self, update: ClientUpdate, current: Weights, server_version: int) -> Optional[Weights]:
        report = AggregationReport(round=int(server_version))
        self.last_report = report
        staleness = self._check(update, current, server_version, report)
        if staleness is None:
            return None
        a_t = self.alpha * float(self.staleness_fn(staleness))
        self.last_mixing = a_t
        out = []
        for w, c in zip(current, update.weights):
            mixed = (1.0 - a_t) * np.asarray(w, dtype=np.float64) + a_t * np.asarray(c, dtype=np.float64)
            out.append(mixed.astype(_out_dtype(w)))
        report.accepted = [update.client_id]
        report.num_samples = int(update.num_samples)
        report.aggregated = True
        return out


class FedBuff(_AsyncStrategy):
    """FedBuff (Nguyen et al. 2022): buffered asynchronous aggregation.

    Each arriving update contributes the delta ``w_client - w_base`` relative to the global
    weights of its ``base_version``, weighted by ``s(staleness)`` at arrival. When ``buffer_size``
    (K) updates are buffered: ``w <- w + server_lr * Σ s_i Δ_i / K`` (the paper's normalisation;
    ``normalize="weights"`` divides by Σ s_i instead), the buffer is cleared and the new weights
    are returned; until then ``on_update`` returns ``None`` (``last_report.reason`` = "buffering").

    Base weights: the strategy snapshots ``current`` under ``server_version`` on each call and
    keeps the last ``keep_versions`` versions; after a flush it also records the returned
    weights as ``server_version + 1`` (the caller is expected to bump its version by one per
    new global model). ``register_version`` adds one explicitly (e.g. after a restart). An
    update whose base version is unknown is rejected with a reason.
    """

    name = "fedbuff"

    def __init__(self, *, buffer_size: int = 10, server_lr: float = 1.0, normalize: str = "k",
                 keep_versions: int = 64, **kw: Any) -> None:
        super().__init__(**kw)
        if buffer_size < 1:
            raise ValueError("buffer_size must be >= 1")
        if normalize not in ("k", "weights"):
            raise ValueError("normalize must be 'k' or 'weights'")
        self.buffer_size = int(buffer_size)
        self.server_lr = float(server_lr)
        self.normalize = normalize
        self.keep_versions = max(1, int(keep_versions))
        self._versions: Dict[int, Weights] = {}
        self._buffer: List[Tuple[ClientUpdate, float, Weights]] = []  # (update, s_i, delta)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def register_version(self, version: int, weights: Weights) -> None:
        self._versions[int(version)] = _copy(weights)
        if len(self._versions) > self.keep_versions:
            for v in sorted(self._versions)[: len(self._versions) - self.keep_versions]:
                del self._versions[v]

    def on_update(self, update: ClientUpdate, current: Weights, server_version: int) -> Optional[Weights]:
        report = AggregationReport(round=int(server_version))
        self.last_report = report
        if int(server_version) not in self._versions:
            self.register_version(server_version, current)
        staleness = self._check(update, current, server_version, report)
        if staleness is None:
            return None
        base = self._versions.get(int(update.base_version))
        if base is None:
            reason = f"base weights for version {update.base_version} unknown (not kept)"
            report.rejected.append((update.client_id, reason))
            self.rejections.append((int(server_version), update.client_id, reason))
            report.reason = reason
            return None
        s = float(self.staleness_fn(staleness))
        delta = [np.asarray(c, dtype=np.float64) - np.asarray(b, dtype=np.float64)
                 for c, b in zip(update.weights, base)]
        self._buffer.append((update, s, delta))
        if len(self._buffer) < self.buffer_size:
            report.reason = f"buffering ({len(self._buffer)}/{self.buffer_size})"
            return None
        denom = float(self.buffer_size) if self.normalize == "k" else sum(si for _, si, _ in self._buffer)
        out = []
        for t, w in enumerate(current):
            step = sum(si * d[t] for _, si, d in self._buffer) / denom
            out.append((np.asarray(w, dtype=np.float64) + self.server_lr * step).astype(_out_dtype(w)))
        report.accepted = [u.client_id for u, _, _ in self._buffer]
        report.num_samples = int(sum(int(u.num_samples) for u, _, _ in self._buffer))
        report.aggregated = True
        self._buffer = []
        self.register_version(int(server_version) + 1, out)
        return out
