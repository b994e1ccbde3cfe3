"""``Federation``: the driver of a federated run on the mesh (Flox-style rounds as functions).

Each client is an endpoint. A round sends each selected client one task (the client app plus
the round's global weights) through the SDK, waits until all are back or the deadline passes,
and aggregates what arrived:

* **sync** (FedAvg, FedProx, Flower strategies): at the deadline, aggregate if at least
  ``min_clients`` valid updates arrived; otherwise extend the deadline (``on_insufficient=
  "extend"``, up to ``max_extensions`` times) or skip the round, keeping the global model, with
  the reason in the round record. An update that arrives after its round ended is discarded and
  recorded (``late_discarded``) in the round during which it arrived.
* **async** (FedAsync, FedBuff): every client always has a task; each arriving update goes to
  the strategy at once (staleness-weighted), even one that was late; one record per new global
  model.
* **hierarchical** (``Hierarchical`` strategy + ``gateways=``): each gateway endpoint first
  aggregates its group's updates with the inner strategy (``fl.client.GatewayAggregator`` runs
  on the gateway); the driver aggregates the gateways' results with the outer strategy. A
  gateway that does not answer by the deadline is replaced by the driver aggregating its group.

After every round the record and the global weights are checkpointed to the hub
(``PUT /v1/fl/runs/{id}/rounds/{n}``), so ``fit(..., resume=run_id)`` continues a run after a
driver or hub restart; while the hub is unreachable the driver waits for it (``hub_wait_s``)
and the round's deadline moves by the outage, since an outage of the coordinator is not the
clients' fault.

Tasks expire on the hub and on the device shortly after their round can still use them, so a
device that comes back after a long outage does not train for a round that is long over.

This module is the public entry point: it checks ``fit``'s arguments and hands the run to the
round driver of its mode (``fl.drivers``: ``sync.py``, ``asynchronous.py``, ``hierarchical.py``;
what they share, from submitting tasks to the checkpoint, is in ``fl/drivers/_base.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Type

from cloud_hub.client import Client
from fl.client import ClientApp, TorchClientApp, TrainerConfig
from fl.compression import check_downlink
from fl.compression import parse as parse_compression
from fl.drivers import RoundDriver, RunParams, SyncDriver, driver_for, mode_of
from fl.drivers.features import FeatureSyncDriver, Features
from fl.drivers._base import FederationError, to_update
from fl.drivers._base import json_safe
from fl.history import History, RoundRecord
from fl.strategies import ClientUpdate, FedAvg, Hierarchical, Strategy, Weights

__all__ = ["Federation", "FederationError"]

# (kept for code that imported them from here)
_RunParams = RunParams
_json_safe = json_safe


class Federation:
    """A federation of endpoints (the clients) driven through a hub.

    ``endpoints``: fixed client endpoint ids; ``tags``: every endpoint of yours carrying all
    these tags (resolved each round, so new devices join); ``gateways``: ``{gateway_endpoint:
    [client endpoints]}`` for hierarchical runs (its clients join the federation).

    Synchronous runs can add (``fl.drivers.features``; checked here, so a bad value is a
    ``ValueError`` before anything reaches the hub):

    * ``selection``: ``"strategy"`` (default: the strategy's own ``configure_round``),
      ``"predicted"`` (the hub's scheduler predicts each client's round time and availability;
      clients likely to report before the deadline are picked, with a fairness floor of
      ``fairness_rounds``) or ``"random"``; ``clients_per_round`` seats for the latter two;
    * ``secagg``: secure aggregation, an ``fl.secagg.SecAggConfig`` (or ``{"threshold": t}``);
    * ``dp``: client-level differential privacy, an ``fl.privacy.DPConfig`` (or its fields as
      a dict), with epsilon from the RDP accountant in every round's record.
    """

    def __init__(
        self,
        client: Client,
        endpoints: Optional[Sequence[str]] = None,
        *,
        tags: Optional[Sequence[str]] = None,
        gateways: Optional[Mapping[str, Sequence[str]]] = None,
        hub_wait_s: float = 300.0,
        poll_s: float = 5.0,
        selection: str = "strategy",
        clients_per_round: Optional[int] = None,
        fairness_rounds: int = 5,
        secagg: Any = None,
        dp: Any = None,
    ) -> None:
        if endpoints is None and tags is None and not gateways:
            raise ValueError("give endpoints=[...], tags=[...] or gateways={...}")
        self.features = Features(secagg=secagg, dp=dp, selection=selection, clients_per_round=clients_per_round,
                                 fairness_rounds=fairness_rounds)
        self.client = client
        self.endpoints = list(dict.fromkeys(endpoints or []))
        self.tags = set(tags or [])
        self.gateways = {str(g): list(dict.fromkeys(cs)) for g, cs in (gateways or {}).items()}
        self._gateway_of = {c: g for g, cs in self.gateways.items() for c in cs}
        if set(self.gateways) & set(self._gateway_of):
            raise ValueError("an endpoint cannot be both a gateway and one of the gateways' clients")
        self.hub_wait_s = float(hub_wait_s)
        self.poll_s = float(poll_s)
        self._late: Dict[str, Tuple[str, int]] = {}  # task id -> (client, round) of rounds already over
        self.run_id: Optional[str] = None
        self.final_weights: Optional[Weights] = None
        self.driver: Optional[RoundDriver] = None  # the last run's round driver

    # ================================================================ membership
    @staticmethod
    def _tags_of(row: Mapping[str, Any]) -> set:
        tags = row.get("tags") or (row.get("info") or {}).get("tags") or []
        return set(tags)

    def _clients(self, rows: Mapping[str, Mapping[str, Any]]) -> list:
        """All client endpoints of this federation (online or not)."""
        out = list(self.endpoints)
        out += [c for cs in self.gateways.values() for c in cs]
        if self.tags:
            out += [eid for eid, row in rows.items() if self.tags <= self._tags_of(row)]
        gws = set(self.gateways)
        return [c for c in dict.fromkeys(out) if c not in gws]

    @staticmethod
    def _to_update(client: str, value: Any, base_version: int) -> Tuple[Optional[ClientUpdate], Optional[str], Dict[str, Any]]:
        """Turn a client's result dict into a ClientUpdate, or a reason it cannot be one."""
        return to_update(client, value, base_version)

    # ================================================================ public API
    def fit(
        self,
        model: Any,
        data: str,
        rounds: int = 10,
        strategy: Optional[Strategy] = None,
        local_epochs: int = 1,
        deadline_s: float = 60.0,
        min_clients: Optional[int] = None,
        *,
        trainer: "TrainerConfig | Dict[str, Any] | None" = None,
        dataset_kwargs: Optional[Dict[str, Any]] = None,
        eval_data: Any = None,
        on_insufficient: str = "extend",
        max_extensions: int = 2,
        extension_s: Optional[float] = None,
        warmup_s: Optional[float] = None,
        name: Optional[str] = None,
        resume: Optional[str] = None,
        seed: int = 0,
        initial_weights: Optional[Weights] = None,
        include_offline: bool = False,
        on_round: Optional[Callable[[RoundRecord, Weights], Any]] = None,
        on_round_start: Optional[Callable[[int, Dict[str, str]], Any]] = None,
        driver: "Optional[str | Type[RoundDriver]]" = None,
        compression: Any = None,
        downlink: Any = None,
        fed_eval_every: int = 0,
        fed_eval_fraction: float = 1.0,
        fed_eval_holdout: float = 0.2,
        max_failed_rounds: int = 2,
        late_updates: str = "discard",
        site_models: bool = True,
    ) -> History:
        """Train ``model`` for ``rounds`` rounds on each client's local dataset ``data``.

        ``model``: a torch ``nn.Module`` (trained by ``TorchClientApp`` with ``trainer``
        settings) or any ``fl.client.ClientApp`` (e.g. ``fl.flower.FlowerClientApp``).
        ``data``: the dataset name the endpoints declare. ``eval_data``: held-out data the
        driver evaluates each new global model on (``(X, y)`` for torch models).
        ``on_round(record, weights)`` runs after each checkpoint; returning ``False`` stops the
        run (status ``aborted``, resumable). ``on_round_start(round, {client: task_id})`` runs
        once a synchronous round's tasks are accepted by the hub (monitoring, tests). Returns the run's :class:`History` (all rounds,
        including those done before a resume); ``self.run_id`` names the run in the hub.
        ``driver``: a round driver (mode name or class, ``fl.drivers``) instead of the one the
        strategy's mode picks. ``compression``: lossy uplink compression, opt-in
        (``"fp16"``, ``"q8"``, ``"topk:0.01"``, ``"topk:0.25+q8"`` or ``fl.compression`` objects;
        top-k keeps its error-feedback residual in each device's durable store). ``downlink``:
        ``"fp16"`` sends the global model down as float16 (the driver keeps float32).

        Federated evaluation (``fed_eval_every=k``, off by default): every k rounds (and after
        the last) a ``fed_eval_fraction`` of the ready clients evaluate the global model on their
        own held-out ``fed_eval_holdout`` part of their data (which they then never train on);
        each record gets ``fed_loss``/``fed_accuracy``/``fed_examples``, weighted by examples.
        Failing loudly: after ``max_failed_rounds`` rounds in a row in which every client failed
        with the same error, and at the end of a run in which no round trained, the run is
        ``failed`` in the hub and this raises :class:`FederationError`.

        ``late_updates`` (synchronous rounds): ``"discard"`` (default, Flower's semantics) lists
        an update that comes back after its round in ``late_discarded``; ``"use"`` lets it join
        the round it arrives in, its weight discounted by its staleness (``late_used``). Async
        strategies (FedAsync, FedBuff) always use late updates, staleness-weighted.

        ``site_models`` (synchronous rounds, on by default): when two or more of a round's
        clients sit behind one site gateway with a site store (docs/sites.md), the global model
        goes down that site's uplink once (a ``stage`` task to the gateway) and each client
        fetches it on the LAN, checked against the key in its hub-signed task; ``False`` sends
        every client its own copy through the hub.
        """
        if rounds < 1:
            raise ValueError("rounds must be >= 1")
        if deadline_s <= 0:
            raise ValueError("deadline_s must be > 0")
        if on_insufficient not in ("extend", "skip"):
            raise ValueError("on_insufficient must be 'extend' or 'skip'")
        if max_extensions < 0:
            raise ValueError("max_extensions must be >= 0")
        if local_epochs < 1:
            raise ValueError("local_epochs must be >= 1")
        if fed_eval_every < 0:
            raise ValueError("fed_eval_every must be >= 0 (0: no federated evaluation)")
        if not 0.0 < fed_eval_fraction <= 1.0:
            raise ValueError("fed_eval_fraction must be in (0, 1]")
        if not 0.0 < fed_eval_holdout < 1.0:
            raise ValueError("fed_eval_holdout must be in (0, 1)")
        if max_failed_rounds < 1:
            raise ValueError("max_failed_rounds must be >= 1")
        if late_updates not in ("discard", "use"):
            raise ValueError(f"late_updates must be 'discard' or 'use', not {late_updates!r}")
        if getattr(model, "evaluate_fn", None) is not None and eval_data is None:
            # central evaluation would be skipped every round without a word (unless the app's
            # evaluate function also runs on the devices and federated evaluation is on)
            ships = bool(getattr(model, "ships_evaluate_fn", False))
            if not (ships and fed_eval_every):
                raise ValueError("the client app has an evaluate function but fit() got no eval_data: pass "
                                 "eval_data=... (the data it evaluates on)"
                                 + (", or use fed_eval_every=k to run it on the devices" if ships else
                                    f" ({type(model).__name__}'s evaluate_fn runs on the driver only)"))
        if fed_eval_every and isinstance(model, ClientApp) and not model.evaluates_on_device():
            raise ValueError(f"fed_eval_every needs a client app that evaluates on the devices; this "
                             f"{type(model).__name__} has no evaluate (e.g. FunctionClientApp(train, evaluate))")
        comp = parse_compression(compression)
        down = check_downlink(downlink)
        strategy = strategy if strategy is not None else FedAvg()
        if min_clients is not None:
            if min_clients < 1:
                raise ValueError("min_clients must be >= 1")
            target = strategy.inner if isinstance(strategy, Hierarchical) else strategy
            target.min_clients = int(min_clients)
            target.min_available_clients = int(min_clients)
        if isinstance(strategy, Hierarchical) and not self.gateways:
            raise ValueError("a Hierarchical strategy needs Federation(gateways={gateway: [clients]})")
        if self.gateways and not isinstance(strategy, Hierarchical):
            raise ValueError("Federation(gateways=...) needs strategy=Hierarchical(...)")
        app = model if isinstance(model, ClientApp) else TorchClientApp(model, trainer)
        driver_cls = driver_for(driver if driver is not None else mode_of(strategy))
        options: Dict[str, Any] = {"late_updates": late_updates, "site_models": bool(site_models)}
        if self.features.active:
            # selection, secure aggregation and DP are layered on synchronous rounds
            if driver_cls.mode != "sync":
                raise ValueError(f"Federation(selection=/secagg=/dp=) needs synchronous rounds; this run's mode is "
                                 f"{driver_cls.mode!r} (strategy {strategy.name})")
            if issubclass(driver_cls, FeatureSyncDriver) and driver_cls.features is not None:
                raise ValueError("give selection/secagg/dp either to Federation(...) or in fit(driver=sync_with(...)), not both")
            if not issubclass(driver_cls, FeatureSyncDriver):
                if driver_cls is not SyncDriver:
                    raise ValueError(f"Federation(selection=/secagg=/dp=) runs on the built-in sync driver, not {driver_cls.__name__}")
                driver_cls = FeatureSyncDriver
            options["features"] = self.features
        mode = driver_cls.mode
        ext_s = float(extension_s if extension_s is not None else deadline_s)
        run = RunParams(
            app=app, dataset=str(data), dataset_kwargs=dict(dataset_kwargs or {}), strategy=strategy, mode=mode,
            rounds=int(rounds), local_epochs=int(local_epochs), deadline_s=float(deadline_s),
            min_clients=int(min_clients if min_clients is not None else getattr(strategy, "min_clients", 1)),
            on_insufficient=on_insufficient, max_extensions=int(max_extensions), extension_s=ext_s,
            eval_data=eval_data, seed=int(seed), include_offline=include_offline, on_round=on_round,
            on_round_start=on_round_start,
            ttl_s=float(deadline_s) + int(max_extensions) * ext_s + 10.0,
            warmup_s=float(warmup_s if warmup_s is not None else max(60.0, deadline_s)),
            compression=comp, downlink=down, fed_eval_every=int(fed_eval_every),
            fed_eval_fraction=float(fed_eval_fraction), fed_eval_holdout=float(fed_eval_holdout),
            max_failed_rounds=int(max_failed_rounds), options=options,
        )
        self.driver = driver_cls(self, run)
        history, weights = self.driver.fit(name, resume, initial_weights)
        self.final_weights = weights
        return history
