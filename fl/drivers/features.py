"""Secure aggregation, client-level DP and scheduler-predicted selection on synchronous rounds.

:class:`Features` holds a run's settings for these (validated when made, so a bad value is a
``ValueError`` before anything reaches the hub); ``Federation(..., selection=..., secagg=...,
dp=...)`` builds one and runs its synchronous rounds with :class:`FeatureSyncDriver`:

* ``secagg`` (:class:`fl.secagg.SecAggConfig`): each round is the four SecAgg+ stages
  (advertise keys, share keys, train + masked input, unmask) as mesh tasks; the hub relays only
  public keys, AES-GCM ciphertexts, masked vectors and shares; the driver sees the unmasked sum.
  Too many dropouts skip the round (reason in its record), never a wrong model. With
  ``fit(compression="q8"|"fp16")`` the device quantizes on a grid shared by all clients into a
  16- or 24-bit field (2 or 3 bytes a coordinate instead of 4); the grid's range is
  ``SecAggConfig.quant_range`` or adapted each round: ``QUANT_HEADROOM`` x the largest
  coordinate of the last mean update (capped at the DP clip norm), the first round at the DP clip
  norm, or at the full 32-bit width without DP (no scale known yet). Top-k is refused in fit().
* ``dp`` (:class:`fl.privacy.DPConfig`): deltas clipped to ``clip_norm`` (on the device with
  secure aggregation, else at the driver), Gaussian noise at the driver (``central``) or on
  each device (``local``); the record gets ``dp: {epsilon, delta, noise_multiplier,
  sample_rate, clip_norm, mode}`` from the RDP accountant, cumulative, and the accountant is
  checkpointed with the run so a resume goes on counting.
* ``selection="predicted"``: clients picked by :func:`fl.selection.select_predicted` from the
  hub's ``POST /v1/scheduler/predict`` (training function's predicted seconds and P(online)
  per endpoint), with a fairness floor; ``"random"``: uniform. ``clients_per_round`` seats.

:func:`sync_with` (the older spelling, ``fit(driver=sync_with(...))``) makes the same driver.
The round itself is :class:`SyncDriver`'s; only the secure round has its own loop (four stages
per round instead of one task).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

import numpy as np

from fl.history import History, RoundRecord
from fl.strategies import ClientInstruction, ClientUpdate, Weights

from ._base import Aggregate, RoundDriver
from .sync import SyncDriver

__all__ = ["Features", "SELECTIONS", "sync_with", "FeatureSyncDriver"]

#: client selection policies: the strategy's own, the scheduler's predictions, uniform
SELECTIONS = ("strategy", "predicted", "random")
#: adapted range of the shared quantization grid (secure aggregation with q8/fp16): this many
#: times the largest coordinate of the last round's mean update; individual updates of non-IID
#: clients are larger than their mean, and a coordinate past the range is clipped
QUANT_HEADROOM = 8.0


def _config(value: Any, cls: type, what: str) -> Any:
    """``value`` as a ``cls`` (an instance, or a mapping of its fields), or a clear ValueError."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**dict(value))
        except TypeError as exc:  # an unknown or missing field
            raise ValueError(f"{what}: {exc}") from None
    raise ValueError(f"{what} must be a {cls.__module__}.{cls.__name__} or a mapping of its fields, not {type(value).__name__}")


@dataclass(frozen=True)
class Features:
    """What a synchronous run adds to plain rounds; checked when made (``ValueError``).

    ``secagg``: :class:`fl.secagg.SecAggConfig` (or its fields as a dict); ``dp``:
    :class:`fl.privacy.DPConfig` (or a dict); ``selection``: one of :data:`SELECTIONS`;
    ``clients_per_round``: seats per round for ``predicted``/``random`` (default: every ready
    client); ``fairness_rounds``: a client not asked for this many rounds is asked (predicted);
    ``weight_cap``: sample-count cap of a client's weight under secure aggregation."""

    secagg: Any = None
    dp: Any = None
    selection: str = "strategy"
    clients_per_round: Optional[int] = None
    fairness_rounds: int = 5
    weight_cap: int = 1000

    def __post_init__(self) -> None:
        from fl.privacy import DPConfig
        from fl.secagg import SecAggConfig

        object.__setattr__(self, "secagg", _config(self.secagg, SecAggConfig, "secagg"))
        object.__setattr__(self, "dp", _config(self.dp, DPConfig, "dp"))
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(repr(s) for s in SELECTIONS)}, not {self.selection!r}")
        if self.clients_per_round is not None:
            if isinstance(self.clients_per_round, bool) or not isinstance(self.clients_per_round, int) or self.clients_per_round < 1:
                raise ValueError(f"clients_per_round must be an integer >= 1, not {self.clients_per_round!r}")
            if self.selection == "strategy":
                raise ValueError("clients_per_round needs selection='predicted' or 'random' "
                                 "(with selection='strategy' the strategy picks, e.g. FedAvg(fraction_fit=...))")
        if isinstance(self.fairness_rounds, bool) or not isinstance(self.fairness_rounds, int) or self.fairness_rounds < 1:
            raise ValueError(f"fairness_rounds must be an integer >= 1, not {self.fairness_rounds!r}")
        if isinstance(self.weight_cap, bool) or not isinstance(self.weight_cap, int) or self.weight_cap < 1:
            raise ValueError(f"weight_cap must be an integer >= 1, not {self.weight_cap!r}")
        if self.dp is not None and self.dp.sample_rate is not None and self.dp.sample_rate < 1 and self.selection != "random":
            raise ValueError(f"dp sample_rate={self.dp.sample_rate} claims amplification by subsampling, which holds only "
                             f"when clients are drawn uniformly at random (selection='random'), not with "
                             f"selection={self.selection!r}; leave sample_rate unset (accounted as q = 1)")

    def dp_sample_rate(self, asked: int, population: int) -> float:
        """The q the accountant composes a round with. Amplification by subsampling assumes
        each client is in the round with probability q independently of the data and of the
        driver's state; only ``selection="random"`` (uniform draws) comes close, and it is
        accounted as Poisson sampling with q = asked / population (or the configured
        ``sample_rate``), the usual approximation for fixed-size uniform sampling. The strategy's
        or the scheduler's choice (``"predicted"``: deterministic from predictions and history)
        gets q = 1, no amplification; so does local DP (each device's noise stands alone)."""
        if self.dp is None or self.dp.mode == "local" or self.selection != "random":
            return 1.0
        return float(self.dp.sample_rate or min(1.0, asked / max(1, population)))

    @property
    def active(self) -> bool:
        """Anything beyond plain synchronous rounds."""
        return self.secagg is not None or self.dp is not None or self.selection != "strategy"

    def describe(self) -> Dict[str, Any]:
        """For the run's config in the hub."""
        out: Dict[str, Any] = {"selection": self.selection}
        if self.selection != "strategy":
            out.update(clients_per_round=self.clients_per_round, fairness_rounds=self.fairness_rounds)
        if self.secagg is not None:
            out["secagg"] = {"threshold": self.secagg.threshold, "neighbors": self.secagg.neighbors}
        if self.dp is not None:
            out["dp"] = {"noise_multiplier": self.dp.noise_multiplier, "clip_norm": self.dp.clip_norm,
                         "mode": self.dp.mode, "delta": self.dp.delta, "sample_rate": self.dp.sample_rate}
        return out


class FeatureSyncDriver(SyncDriver):
    """Sync rounds plus a run's :class:`Features` (``run.options["features"]``, else the
    class's ``features``, which :func:`sync_with` sets)."""

    mode = "sync"
    features: Optional[Features] = None

    def __init__(self, federation: Any, run: Any) -> None:
        super().__init__(federation, run)
        from fl.privacy import PrivacyAccountant

        f = run.options.get("features") or self.features or Features()
        self.features = f
        self.secagg, self.dp, self.selection = f.secagg, f.dp, f.selection
        self.clients_per_round, self.fairness_rounds, self.weight_cap = f.clients_per_round, f.fairness_rounds, f.weight_cap
        self.accountant = None if self.dp is None else PrivacyAccountant(self.dp.noise_multiplier, self.dp.delta)
        comp = run.compression
        if self.secagg is not None and comp is not None and comp.sparsify is not None:
            raise ValueError(f"secure aggregation cannot carry a sparse update (compression={comp.describe()!r}): a masked "
                             "vector must be dense, or it shows which coordinates each client sent; use compression='q8' "
                             "or 'fp16', which are quantized on a shared grid into a narrower field")
        self._quant_range: Optional[float] = None
        self._last_asked: Dict[str, int] = {}
        self._rng = np.random.default_rng(run.seed + 7)
        self._sel_info: Dict[str, Any] = {}

    def run_config(self) -> Dict[str, Any]:
        return {**super().run_config(), "features": self.features.describe()}

    # ------------------------------------------------------------------ app and selection
    def prepare(self) -> None:
        if self.secagg is not None:
            from fl.secagg.rounds import SecureClientApp

            if not isinstance(self.run.app, SecureClientApp):
                self.run.app = SecureClientApp(self.run.app)
        super().prepare()

    def select(self, round: int, ready: Sequence[str]) -> List[ClientInstruction]:
        if self.selection == "strategy":
            return super().select(round, ready)
        from fl.selection import Candidate, select_predicted, select_random

        k = int(self.clients_per_round or max(1, len(ready)))
        k = max(k, self.run.min_clients)
        if self.selection == "random":
            chosen = select_random(ready, k, round, self.run.seed)
            self._sel_info = {"policy": "random"}
        else:
            try:
                pred = self.hub(self.client.scheduler_predict, self.run.fid, list(ready), horizon_s=self.run.deadline_s)
            except Exception as exc:  # the route refused: say so, fall back to random
                pred = {}
                self._sel_info = {"policy": "predicted", "error": str(exc)[:200]}
            cands = [Candidate(c, (pred.get(c) or {}).get("predicted_s") if (pred.get(c) or {}).get("source") != "prior" else None,
                               float((pred.get(c) or {}).get("p_online") or 1.0), 1, self._last_asked.get(c))
                     for c in ready]
            sel = select_predicted(cands, k, round, self.run.deadline_s, fairness_rounds=self.fairness_rounds,
                                   seed=self.run.seed)
            chosen = sel.chosen
            self._sel_info = {"policy": "predicted", "forced": sel.forced, "explored": sel.explored,
                              "p_report": {c: round_(sel.scores.get(c)) for c in chosen}}
        for c in chosen:
            self._last_asked[c] = round
        cfg = self.run.strategy.client_round_config(round) if hasattr(self.run.strategy, "client_round_config") else {}
        return [ClientInstruction(c, round, dict(cfg)) for c in chosen]

    # ------------------------------------------------------------------ DP without secure aggregation
    def aggregate(self, round: int, updates: List[ClientUpdate], current: Weights) -> Aggregate:
        if self.dp is None:
            return super().aggregate(round, updates, current)
        from fl.privacy import privatize_mean
        from fl.secagg.field import flatten, unflatten
        from fl.strategies import validate_update

        g, spec = flatten(current)
        deltas, accepted, rejected = [], [], {}
        for u in updates:
            why = validate_update(u, current) if callable(validate_update) else None
            if why:
                rejected[u.client_id] = str(why)
                continue
            deltas.append(flatten(u.weights)[0] - g)
            accepted.append(u.client_id)
        if len(deltas) < self.run.min_clients:
            return Aggregate(None, [], rejected, f"{len(deltas)} valid update(s), {self.run.min_clients} needed")
        # local mode: the device already clipped and noised; the driver only averages
        mean, norms = privatize_mean(deltas, self.dp, self._rng, already_clipped=False) if self.dp.mode == "central" \
            else (np.mean(deltas, axis=0), [float(np.linalg.norm(d)) for d in deltas])
        return Aggregate(unflatten(g + mean, spec), accepted, rejected, None,
                         {"dp_update_norms": {c: round_(n) for c, n in zip(accepted, norms)}})

    def client_config(self, ins: ClientInstruction) -> Dict[str, Any]:
        cfg = super().client_config(ins)
        if self.dp is not None and self.dp.mode == "local" and self.secagg is None:
            cfg["dp_local"] = {"clip_norm": self.dp.clip_norm, "noise_std": self.dp.noise_std}
        return cfg

    def _dp_extra(self, participants: int, population: int, asked: Optional[int] = None) -> Dict[str, Any]:
        if self.dp is None or self.accountant is None or participants == 0:
            return {}
        q = self.features.dp_sample_rate(max(participants, asked or 0), population)
        self.accountant.step(q)
        return {"dp": {"epsilon": round_(self.accountant.epsilon(), 4), "delta": self.dp.delta,
                       "noise_multiplier": self.dp.noise_multiplier, "clip_norm": self.dp.clip_norm,
                       "sample_rate": round_(q), "mode": self.dp.mode, "rounds": self.accountant.rounds}}

    # ------------------------------------------------------------------ rounds
    def run_rounds(self, history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        if state.get("dp_accountant") and self.accountant is not None:
            from fl.privacy import PrivacyAccountant

            self.accountant = PrivacyAccountant.from_state(state["dp_accountant"])
        for rec in history.rounds:
            for c in rec.extra.get("asked", []) or []:
                self._last_asked[str(c)] = rec.round
        if self.secagg is None:
            return super().run_rounds(history, weights, start_round, state)
        return self._run_secure(history, weights, start_round, state)

    def finish_round(self, history: History, rec: RoundRecord, weights: Weights, state: Dict[str, Any]) -> bool:
        if self._sel_info:
            rec.extra["selection"] = self._sel_info
            self._sel_info = {}
        if self.dp is not None and self.secagg is None and not rec.extra.get("skipped"):
            rec.extra.update(self._dp_extra(len(rec.participants), len(self.fed._clients(self.endpoint_rows())),
                                            len(rec.extra.get("asked") or [])))
        if self.accountant is not None:
            state = {**state, "dp_accountant": self.accountant.to_state()}
        return super().finish_round(history, rec, weights, state)

    def _ask(self, round: int):
        """One SecAgg+ stage: a task per client, answers (value or error text) by the deadline."""
        def ask(stage: str, tasks: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
            pending = self.submit(self.run.fid, list(tasks.items()), self.run.ttl_s)
            got, missing = self.gather(pending, self.run.deadline_s)
            self.retire(missing, round)
            return {c: arr.value if arr.ok else (arr.error or "failed") for c, arr in got.items()}
        return ask

    def _run_secure(self, history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        from fl.secagg.rounds import secure_round

        run = self.run
        version, last = self.resume_point(history)
        quantized = run.compression is not None and run.compression.quantize is not None
        if quantized:
            self._quant_range = self.secagg.quant_range or state.get("secagg_quant_range") or (
                self.dp.clip_norm if self.dp is not None else None)
        for r in range(start_round, run.rounds + 1):
            t0 = time.monotonic()
            self.outage_s = 0.0
            instructions, _ = self.wait_for_clients(t0, r)
            asked = [i.client_id for i in instructions]
            extra: Dict[str, Any] = {"asked": asked, "secure_aggregation": True}
            blob = self.encode_global(r, weights, version)
            by_c = {i.client_id: i for i in instructions}

            def train_task(c: str) -> Dict[str, Any]:
                return self.train_payload(by_c[c], r, blob, version)

            dp = self.dp
            res = None
            if len(asked) >= self.secagg.threshold:
                res = secure_round(self._ask(r), f"{self.run_id}:{r}", asked, weights, train_task, config=self.secagg,
                                   clip_norm=dp.clip_norm if dp else 1e3, weight_cap=1 if dp else self.weight_cap,
                                   max_clients=max(len(asked), 2),
                                   local_noise_std=(dp.noise_std if dp and dp.mode == "local" else 0.0),
                                   central_noise_std=(dp.noise_std if dp and dp.mode == "central" else 0.0), rng=self._rng,
                                   quant_range=self._quant_range if quantized else None)
                extra.update(self._secure_traffic(res))
            if res is None or res.weights is None:
                reason = res.reason if res is not None else f"{len(asked)} client(s) asked, secure aggregation needs {self.secagg.threshold}"
                extra.update({"skipped": True, "reason": reason, "version": version})
                if res is not None:
                    extra["secagg_stage_s"] = res.stages_s
                rec = RoundRecord(r, last[0], last[1], [], [c for c in asked if res is None or c in res.not_back],
                                  dict(res.not_back) if res else {}, time.monotonic() - t0, extra)
            else:
                if quantized and not self.secagg.quant_range:
                    self._quant_range = self._next_quant_range(weights, res.weights)
                weights = res.weights
                version += 1
                ev = self.evaluate(r, weights, [])
                last = (ev.loss, ev.accuracy)
                extra.update(ev.extra)
                extra.update({"version": version, "dropped_after_masking": res.dropped_after_masking,
                              "secagg_stage_s": res.stages_s, "num_samples": int(sum(i.get("num_samples", 0) for i in res.infos.values())),
                              "train_time_s": {c: i.get("train_time_s") for c, i in res.infos.items()}})
                extra.update(self._dp_extra(len(res.survivors), len(self.fed._clients(self.endpoint_rows())), len(asked)))
                rec = RoundRecord(r, last[0], last[1], list(res.survivors),
                                  [c for c in asked if c in res.not_back and c not in res.survivors],
                                  {c: why for c, why in res.not_back.items() if c not in res.survivors},
                                  time.monotonic() - t0, extra)
            ck: Dict[str, Any] = {"version": version}
            if quantized and self._quant_range is not None:
                ck["secagg_quant_range"] = self._quant_range
            if not self.finish_round(history, rec, weights, ck):
                break
        return weights

    @staticmethod
    def _secure_traffic(res: Any) -> Dict[str, Any]:
        """Bytes of a secure round for its record: the masked vectors up and the global model
        down per client (as plain rounds record them), the protocol's own messages, the field."""
        out: Dict[str, Any] = {"bytes_up": dict(res.bytes_up), "bytes_down": dict(res.bytes_down),
                               "bytes_up_total": int(sum(res.bytes_up.values())),
                               "bytes_down_total": int(sum(res.bytes_down.values())),
                               "secagg_overhead_bytes": dict(res.overhead_bytes), "secagg_field_bits": res.field_bits}
        if res.quant_range is not None:
            out["secagg_quant_range"] = round_(res.quant_range, 9)
        return out

    def _next_quant_range(self, old: Weights, new: Weights) -> Optional[float]:
        """The grid range for the next round from this round's mean update (public: the driver
        holds the unmasked mean anyway); capped at the DP clip norm, which bounds a coordinate."""
        from fl.secagg.field import flatten

        top = float(np.max(np.abs(flatten(new)[0] - flatten(old)[0]), initial=0.0))
        if not (top > 0 and np.isfinite(top)):
            return self._quant_range
        r = QUANT_HEADROOM * top
        if self.dp is not None:
            r = min(r, float(self.dp.clip_norm))
        return r


def round_(x: Any, nd: int = 6) -> Any:
    return None if x is None else round(float(x), nd)


def sync_with(*, secagg: Any = None, dp: Any = None, selection: str = "strategy", clients_per_round: Optional[int] = None,
              fairness_rounds: int = 5, weight_cap: int = 1000) -> Type[RoundDriver]:
    """A synchronous round driver class with the given features (pass it as ``fit(driver=...)``;
    ``Federation(selection=..., secagg=..., dp=...)`` is the same without a driver class)."""
    f = Features(secagg=secagg, dp=dp, selection=selection, clients_per_round=clients_per_round,
                 fairness_rounds=fairness_rounds, weight_cap=weight_cap)
    return type("FeatureSyncDriver", (FeatureSyncDriver,), {"features": f})
