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
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import httpx
import numpy as np

from cloud_hub.client import Client, HubError
from cloud_hub.client._results import decode_result
from fl.client import PROTOCOL, ClientApp, GatewayAggregator, TorchClientApp, TrainerConfig
from fl.history import History, RoundRecord
from fl.strategies import ClientInstruction, ClientUpdate, FedAvg, Hierarchical, Strategy, Weights
from fl.wire import WireError, decode_weights, encode_weights

__all__ = ["Federation", "FederationError"]

log = logging.getLogger("fl.federation")


class FederationError(RuntimeError):
    """The run cannot go on (no clients, the hub refused it, the hub stayed unreachable)."""


_RECORD_BUDGET = 900 * 1024
_MAX_LATE = 2000  # late tasks still watched for


def _json_safe(v: Any) -> Any:
    """JSON the hub accepts: NaN/inf (a diverged client's loss) become null, numpy scalars plain."""
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def _short_error(exc: BaseException) -> str:
    remote = getattr(exc, "remote_type", None)
    text = f"{remote or type(exc).__name__}: {getattr(exc, 'remote_message', None) or exc}"
    return text if len(text) <= 500 else text[:497] + "..."


@dataclass
class _Arrival:
    """One task result that came back, decoded."""

    ok: bool
    value: Any = None
    error: Optional[str] = None
    started: Optional[float] = None
    finished: Optional[float] = None


@dataclass
class _Collected:
    updates: List[ClientUpdate] = field(default_factory=list)
    info: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # client -> result dict (minus weights)
    failed: Dict[str, str] = field(default_factory=dict)
    late: List[Dict[str, Any]] = field(default_factory=list)
    extensions: int = 0
    deadline_reached: bool = False
    outage_s: float = 0.0


class Federation:
    """A federation of endpoints (the clients) driven through a hub.

    ``endpoints``: fixed client endpoint ids; ``tags``: every endpoint of yours carrying all
    these tags (resolved each round, so new devices join); ``gateways``: ``{gateway_endpoint:
    [client endpoints]}`` for hierarchical runs (its clients join the federation).
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
    ) -> None:
        if endpoints is None and tags is None and not gateways:
            raise ValueError("give endpoints=[...], tags=[...] or gateways={...}")
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
        self._outage_s = 0.0
        self._excluded: Dict[str, str] = {}  # clients that failed the warm-up -> why
        self._late_seen: List[Dict[str, Any]] = []  # late updates noticed, until recorded in a round
        # Warming-aware selection: a client that is new, or was offline (its worker may have died
        # with it), gets a warm-up task first and is asked to train only once that is back, so
        # its cold start (importing torch, loading data) never costs a round its deadline.
        self._cold: set = set()
        self._warming: Dict[str, str] = {}  # warm-up task id -> client
        self._warm_sent: Dict[str, float] = {}  # warm-up task id -> when it was sent
        self._warm_info: Dict[str, Dict[str, Any]] = {}
        self.run_id: Optional[str] = None
        self.final_weights: Optional[Weights] = None

    # ================================================================ hub access with retries
    def _hub(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Call the hub; while it is unreachable (restarting, link down) wait and retry, up to
        ``hub_wait_s``. Refusals (4xx) are raised at once. Time spent waiting is added to
        ``self._outage_s`` so deadlines can move by it."""
        start = time.monotonic()
        delay = 0.2
        while True:
            try:
                return fn(*args, **kw)
            except HubError as exc:
                if exc.status < 500:
                    raise
                err: BaseException = exc
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                err = exc
            waited = time.monotonic() - start
            if waited > self.hub_wait_s:
                raise FederationError(f"hub unreachable for {waited:.0f}s (last error: {err})") from err
            log.warning("hub unreachable (%s); retrying in %.1fs", err, delay)
            time.sleep(delay)
            self._outage_s += delay
            delay = min(delay * 2, 2.0)

    def _endpoint_rows(self) -> Dict[str, Dict[str, Any]]:
        return {e["id"]: e for e in self._hub(self.client.list_endpoints)}

    @staticmethod
    def _tags_of(row: Mapping[str, Any]) -> set:
        tags = row.get("tags") or (row.get("info") or {}).get("tags") or []
        return set(tags)

    def _clients(self, rows: Mapping[str, Mapping[str, Any]]) -> List[str]:
        """All client endpoints of this federation (online or not)."""
        out = list(self.endpoints)
        out += [c for cs in self.gateways.values() for c in cs]
        if self.tags:
            out += [eid for eid, row in rows.items() if self.tags <= self._tags_of(row)]
        gws = set(self.gateways)
        return [c for c in dict.fromkeys(out) if c not in gws]

    def _available(self, rows: Mapping[str, Mapping[str, Any]], include_offline: bool) -> List[str]:
        return [c for c in self._clients(rows) if c in rows and (include_offline or rows[c].get("online"))]

    # ================================================================ task plumbing
    def _submit(self, fid: str, items: Sequence[Tuple[str, Dict[str, Any]]], ttl_s: float) -> Dict[str, str]:
        """Submit one task per (endpoint, payload); returns task id -> endpoint."""
        if not items:
            return {}
        specs = [Client.task_spec(ep, fid, (payload,), None, ttl_s=ttl_s) for ep, payload in items]
        ids = self._hub(self.client.submit_batch, specs)
        return {tid: ep for tid, (ep, _) in zip(ids, items)}

    def _wait(self, task_ids: Sequence[str], timeout_s: float) -> List[Tuple[str, _Arrival]]:
        """Results among ``task_ids`` (waits up to ``timeout_s`` for the first). Warm-up answers
        and late updates of finished rounds are picked up on the way and handled here."""
        wanted = set(task_ids)
        ids = list(task_ids) + [t for t in list(self._warming) + list(self._late) if t not in wanted]
        if not ids:
            time.sleep(max(0.0, timeout_s))
            return []
        rows = self._hub(self.client.wait_results, ids, min(max(0.0, timeout_s), 30.0))
        out = []
        for row in rows:
            try:
                ok, value = decode_result(row["ok"], base64.b64decode(row["data"]))
            except Exception as exc:  # a result that does not deserialize here
                ok, value = False, exc
            arr = _Arrival(ok=ok, started=row.get("started"), finished=row.get("finished"))
            if ok:
                arr.value = value
            else:
                arr.error = _short_error(value)
            tid = row["task_id"]
            if tid in wanted:
                out.append((tid, arr))
            elif tid in self._warming:
                self._warm_sent.pop(tid, None)
                self._on_warm(self._warming.pop(tid), arr)
            elif tid in self._late:
                client, rnd = self._late.pop(tid)
                self._late_seen.append({"client": client, "round": rnd})
        return out

    def _drain_late(self) -> List[Dict[str, Any]]:
        out, self._late_seen = self._late_seen, []
        return out

    # ================================================================ warming-aware selection
    def _on_warm(self, client: str, arr: _Arrival) -> None:
        if arr.ok and isinstance(arr.value, dict) and arr.value.get("kind") == "ready":
            self._cold.discard(client)
            self._warm_info[client] = {"num_samples": arr.value.get("num_samples"), "device": arr.value.get("device"),
                                       "warmup_time_s": arr.value.get("warmup_time_s")}
            return
        err = arr.error or f"unexpected warm-up answer {type(arr.value).__name__}"
        if any(t in err for t in ("TaskExpired", "WorkerDied", "TaskTimeout", "expired")):
            return  # transient (the device went away again): it stays cold and is warmed next time
        self._cold.discard(client)
        self._excluded[client] = err  # e.g. the device does not hold the dataset
        log.warning("client %s excluded from the run: %s", client, err)

    def _refresh(self, run: "_RunParams", rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Mark clients that are offline as cold; send warm-ups to cold clients that are online."""
        clients = self._clients(rows)
        if not run.include_offline:
            for c in clients:
                if c not in rows or not rows[c].get("online"):
                    self._cold.add(c)
        warming = set(self._warming.values())
        todo = [c for c in clients if c in self._cold and c not in warming and c not in self._excluded
                and c in rows and (run.include_offline or rows[c].get("online"))]
        if todo:
            payloads = [(c, {"v": PROTOCOL, "kind": "warmup", "client_id": c, "dataset": run.dataset,
                             "dataset_kwargs": run.dataset_kwargs}) for c in todo]
            for tid, c in self._submit(run.fid, payloads, ttl_s=run.warmup_s + 30).items():
                self._warming[tid] = c
                self._warm_sent[tid] = time.monotonic()

    def _ready(self, run: "_RunParams", rows: Mapping[str, Mapping[str, Any]]) -> List[str]:
        """Clients that may be asked to train now: available, warm, not excluded."""
        return [c for c in self._available(rows, run.include_offline) if c not in self._cold and c not in self._excluded]

    def _retire(self, pending: Mapping[str, str], round: int) -> None:
        for tid, client in pending.items():
            self._late[tid] = (client, round)
        if len(self._late) > _MAX_LATE:  # bounded (a wait names at most 10,000 tasks); the oldest are expired anyway
            for tid in list(self._late)[: len(self._late) - _MAX_LATE]:
                del self._late[tid]

    @staticmethod
    def _to_update(client: str, value: Any, base_version: int) -> Tuple[Optional[ClientUpdate], Optional[str], Dict[str, Any]]:
        """Turn a client's result dict into a ClientUpdate, or a reason it cannot be one."""
        if not isinstance(value, dict) or value.get("v") != PROTOCOL or value.get("kind") != "update":
            return None, f"not an fl update (got {type(value).__name__})", {}
        if value.get("client_id") != client:
            return None, f"update claims client {value.get('client_id')!r}", {}
        info = {k: v for k, v in value.items() if k not in ("weights", "v", "kind")}
        try:
            weights = decode_weights(value["weights"])
        except (WireError, KeyError) as exc:
            return None, f"undecodable weights: {exc}", info
        try:
            n = int(value.get("num_samples", 0))
        except (TypeError, ValueError):
            return None, f"num_samples is not an integer: {value.get('num_samples')!r}", info
        metrics = dict(value.get("metrics") or {})
        return ClientUpdate(client, weights, n, base_version=int(value.get("base_version", base_version)),
                            metrics=metrics), None, info

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
        mode = "async" if strategy.is_async else ("hierarchical" if isinstance(strategy, Hierarchical) else "sync")
        ext_s = float(extension_s if extension_s is not None else deadline_s)
        run = _RunParams(
            app=app, dataset=str(data), dataset_kwargs=dict(dataset_kwargs or {}), strategy=strategy, mode=mode,
            rounds=int(rounds), local_epochs=int(local_epochs), deadline_s=float(deadline_s),
            min_clients=int(min_clients if min_clients is not None else getattr(strategy, "min_clients", 1)),
            on_insufficient=on_insufficient, max_extensions=int(max_extensions), extension_s=ext_s,
            eval_data=eval_data, seed=int(seed), include_offline=include_offline, on_round=on_round,
            on_round_start=on_round_start,
            ttl_s=float(deadline_s) + int(max_extensions) * ext_s + 10.0,
            warmup_s=float(warmup_s if warmup_s is not None else max(60.0, deadline_s)),
        )
        self._excluded, self._warm_info, self._late_seen = {}, {}, []
        rows = self._endpoint_rows()
        clients = self._clients(rows)
        if not clients:
            raise FederationError("no client endpoints match this federation")
        # functions first: a model that cannot be shipped must fail before a run is created
        run.fid = self._hub(self.client.register_function, app, "fl-client-" + app.name)
        if mode == "hierarchical":
            run.gateway_fid = self._hub(self.client.register_function, GatewayAggregator(strategy.inner), "fl-gateway")
        history, weights, start_round, state = self._open_run(run, rows, clients, name, resume, initial_weights)
        try:
            if start_round <= rounds:
                if eval_data is not None and "initial_eval" not in history.metadata:
                    # the model before training (round 0, as Flower reports it); it also pays the
                    # driver's own one-time torch start-up before round 1 rather than in it
                    res = app.evaluate(weights, eval_data)
                    if res is not None:
                        history.metadata["initial_eval"] = {"loss": float(res[0]), **{k: float(v) for k, v in res[1].items()}}
                self._warmup(run, rows, history)
            if mode == "async":
                weights = self._run_async(run, history, weights, start_round, state)
            else:
                weights = self._run_sync(run, history, weights, start_round)
        except KeyboardInterrupt:
            self._set_status("aborted", "interrupted by the user")
            raise
        except BaseException as exc:  # the run stays resumable: fit(..., resume=run_id)
            self._set_status("failed", _short_error(exc))
            raise
        self.final_weights = weights
        return history

    # ================================================================ run bookkeeping
    def _set_status(self, status: str, error: Optional[str] = None) -> None:
        if self.run_id is None:
            return
        try:
            self.client.fl_set_status(self.run_id, status, error)
        except Exception as exc:  # best effort: the run stays resumable either way
            log.warning("could not mark run %s %s: %s", self.run_id, status, exc)

    def _open_run(self, run: "_RunParams", rows: Mapping[str, Mapping[str, Any]], clients: List[str], name: Optional[str],
                  resume: Optional[str], initial: Optional[Weights]) -> Tuple[History, Weights, int, Dict[str, Any]]:
        meta = {"strategy": run.strategy.name, "mode": run.mode, "dataset": run.dataset, "rounds": run.rounds}
        if resume:
            info = self._hub(self.client.fl_run, resume)
            if info["status"] == "finished":
                raise FederationError(f"run {resume} is already finished")
            self.run_id = resume
            history = History([RoundRecord.from_dict(r) for r in info["rounds"]], {**meta, "run_id": resume, "resumed_from": info["rounds_done"]})
            if info["rounds_done"] > 0:
                ck = self._hub(self.client.fl_checkpoint, resume)
                weights, state = decode_weights(ck["weights"]), dict(ck.get("state") or {})
            else:
                weights, state = self._initial(run, initial), {}
            if info["status"] != "running":
                self._hub(self.client.fl_set_status, resume, "running")
            return history, weights, int(info["rounds_done"]) + 1, state
        weights = self._initial(run, initial)
        config = {
            "dataset": run.dataset, "dataset_kwargs": run.dataset_kwargs, "local_epochs": run.local_epochs,
            "deadline_s": run.deadline_s, "min_clients": run.min_clients, "on_insufficient": run.on_insufficient,
            "max_extensions": run.max_extensions, "extension_s": run.extension_s, "seed": run.seed,
            "client_app": run.app.describe(), "gateways": self.gateways, "tags": sorted(self.tags),
        }
        names = {c: str(rows[c]["name"]) for c in clients if c in rows}
        names.update({g: str(rows[g]["name"]) for g in self.gateways if g in rows})
        created = self._hub(self.client.fl_create_run, name or f"{run.dataset}-{run.strategy.name}", strategy=run.strategy.name,
                            rounds_planned=run.rounds, mode=run.mode, clients=clients, client_names=names, config=config)
        self.run_id = created["id"]
        return History([], {**meta, "run_id": self.run_id}), weights, 1, {}

    @staticmethod
    def _initial(run: "_RunParams", initial: Optional[Weights]) -> Weights:
        w = initial if initial is not None else run.app.initial_weights()
        if w is None:
            raise ValueError("this client app has no initial weights: pass initial_weights=[...]")
        return [np.asarray(a).copy() for a in w]

    def _checkpoint(self, run: "_RunParams", rec: RoundRecord, weights: Weights, state: Dict[str, Any], last: bool) -> None:
        from dataclasses import asdict

        assert self.run_id is not None
        body = _json_safe(asdict(rec))
        # the hub keeps a round's extras under 1 MiB: with thousands of clients drop the
        # per-client detail first (the record says what was left out)
        for key in ("client_metrics", "train_time_s", "asked"):
            if len(json.dumps(body)) <= _RECORD_BUDGET:
                break
            if key in body["extra"]:
                del body["extra"][key]
                body["extra"].setdefault("trimmed", []).append(key)
        self._hub(self.client.fl_put_round, self.run_id, rec.round, body, encode_weights(weights), state,
                  "finished" if last else "running")

    def _evaluate(self, run: "_RunParams", weights: Weights, updates: Sequence[ClientUpdate]) -> Tuple[Optional[float], Optional[float]]:
        if run.eval_data is not None:
            res = run.app.evaluate(weights, run.eval_data)
            if res is not None:
                loss, metrics = res
                return float(loss), (float(metrics["accuracy"]) if "accuracy" in metrics else None)
        m = run.strategy.aggregate_metrics(updates) if updates else {}
        return m.get("loss"), m.get("accuracy")

    def _finish_round(self, run: "_RunParams", history: History, rec: RoundRecord, weights: Weights,
                      state: Dict[str, Any]) -> bool:
        """Checkpoint, record, call ``on_round``; False when the user asked to stop."""
        history.append(rec)
        last = rec.round >= run.rounds
        self._checkpoint(run, rec, weights, state, last)
        if run.on_round is not None and run.on_round(rec, weights) is False:
            self._set_status("aborted", f"stopped by on_round after round {rec.round}")
            return False
        return True

    # ================================================================ warm-up
    def _warmup(self, run: "_RunParams", rows: Mapping[str, Mapping[str, Any]], history: History) -> None:
        """Warm every online client before round 1 (up to ``warmup_s``); late ones are warmed
        when they show up, and join the rounds after that."""
        t0 = time.monotonic()
        self._cold = set(self._clients(rows))
        self._refresh(run, rows)
        deadline = t0 + run.warmup_s
        while self._warming and time.monotonic() < deadline:
            self._wait([], min(self.poll_s, deadline - time.monotonic()))
        history.metadata["warmup"] = {"time_s": round(time.monotonic() - t0, 3), "ready": dict(self._warm_info),
                                      "failed": dict(self._excluded), "not_back": sorted(set(self._warming.values()))}

    # ================================================================ synchronous rounds
    def _run_sync(self, run: "_RunParams", history: History, weights: Weights, start_round: int) -> Weights:
        version = int(history.rounds[-1].extra.get("version", len(history))) if history.rounds else 0
        # a skipped round keeps the model, so it reports the model's last known loss/accuracy
        init = history.metadata.get("initial_eval") or {}
        last: Tuple[Optional[float], Optional[float]] = (init.get("loss"), init.get("accuracy"))
        for rec_ in history.rounds:
            if rec_.accuracy is not None or rec_.loss is not None:
                last = (rec_.loss, rec_.accuracy)
        for r in range(start_round, run.rounds + 1):
            t0 = time.monotonic()
            self._outage_s = 0.0
            instructions, _ = self._wait_for_clients(run, t0, r)
            asked = [i.client_id for i in instructions]
            extra: Dict[str, Any] = {"asked": asked}
            if not instructions:
                reason = run.strategy.last_selection_reason or "no client available"
                late = self._drain_late()
                rec = RoundRecord(r, last[0], last[1], [], [], {}, time.monotonic() - t0,
                                  {**extra, "skipped": True, "reason": reason, "version": version,
                                   **({"late_discarded": late} if late else {})})
                if not self._finish_round(run, history, rec, weights, {"version": version}):
                    break
                continue
            base = encode_weights(weights)
            payloads = []
            for ins in instructions:
                cfg = {**ins.config, "local_epochs": run.local_epochs, "seed": run.seed}
                payloads.append((ins.client_id, {
                    "v": PROTOCOL, "kind": "train", "run_id": self.run_id, "round": r, "client_id": ins.client_id,
                    "base_version": version, "weights": base, "dataset": run.dataset,
                    "dataset_kwargs": run.dataset_kwargs, "config": cfg,
                }))
            t_sent = time.monotonic()
            if t_sent - t0 > 0.05:
                extra["selection_wait_s"] = round(t_sent - t0, 3)  # waiting for clients to (re)join
            pending = self._submit(run.fid, payloads, run.ttl_s)
            if run.on_round_start is not None:
                run.on_round_start(r, {c: tid for tid, c in pending.items()})
            col = _Collected()
            self._collect(run, pending, col, t_sent, r)
            col.late += self._drain_late()
            back = set(col.info) | set(col.failed)
            stragglers = [c for c in asked if c not in back]
            if run.mode == "hierarchical":
                new, accepted, rejected, reason, hx = self._aggregate_hierarchical(run, r, col.updates, weights)
                extra.update(hx)
            else:
                new = run.strategy.aggregate(r, col.updates, weights)
                rep = run.strategy.last_report
                accepted = list(rep.accepted) if rep else []
                rejected = dict(rep.rejected) if rep else {}
                reason = rep.reason if rep else None
            dropped = {**col.failed, **rejected}
            used = [u for u in col.updates if u.client_id in set(accepted)]
            if new is not None:
                weights = new
                version += 1
                extra["num_samples"] = int(sum(u.num_samples for u in used))
            else:
                extra.update({"skipped": True, "reason": reason or "no new model"})
                accepted = []
            loss, acc = self._evaluate(run, weights, used) if new is not None else last
            last = (loss, acc)
            round_time = time.monotonic() - t0
            train_times = {c: float(i["train_time_s"]) for c, i in col.info.items() if c in set(accepted) and "train_time_s" in i}
            extra.update(self._col_extra(col))
            if self._outage_s:  # the whole round's, including waiting to select clients
                extra["hub_outage_s"] = round(self._outage_s, 3)
            extra.update({"version": version, "train_time_s": train_times,
                          "client_metrics": {c: col.info[c].get("metrics", {}) for c in accepted if c in col.info}})
            if train_times:
                extra["max_train_time_s"] = max(train_times.values())
                extra["overhead_s"] = round_time - extra["max_train_time_s"]
            rec = RoundRecord(r, loss, acc, list(accepted), stragglers, dropped, round_time, extra)
            if not self._finish_round(run, history, rec, weights, {"version": version}):
                break
        return weights

    @staticmethod
    def _col_extra(col: _Collected) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if col.extensions:
            out["extensions"] = col.extensions
        if col.deadline_reached:
            out["deadline_reached"] = True
        if col.late:
            out["late_discarded"] = col.late
        if col.outage_s:
            out["hub_outage_s"] = round(col.outage_s, 3)
        return out

    def _collect(self, run: "_RunParams", pending: Dict[str, str], col: _Collected, t0: float, round: int) -> None:
        """Gather results until all are back or the (possibly extended) deadline passes."""
        pending = dict(pending)
        deadline = t0 + run.deadline_s
        while pending:
            now = time.monotonic()
            if now >= deadline:
                if len(col.updates) < run.min_clients and run.on_insufficient == "extend" and col.extensions < run.max_extensions:
                    col.extensions += 1
                    deadline += run.extension_s
                    continue
                col.deadline_reached = True
                break
            before = self._outage_s
            rows = self._wait(list(pending) + list(self._late), min(self.poll_s, deadline - now))
            outage = self._outage_s - before
            if outage > 0:  # the coordinator was away: the clients get that time back
                deadline += outage
                col.outage_s += outage
            for tid, arr in rows:
                client = pending.pop(tid, None)
                if client is None:
                    continue
                if not arr.ok:
                    col.failed[client] = arr.error or "failed on the endpoint"
                    continue
                upd, why, info = self._to_update(client, arr.value, 0)
                if upd is None:
                    col.failed[client] = why or "invalid update"
                    continue
                col.updates.append(upd)
                col.info[client] = info
        self._retire(pending, round)

    def _wait_for_clients(self, run: "_RunParams", t0: float, r: int) -> Tuple[List[ClientInstruction], Dict[str, Mapping[str, Any]]]:
        """Selection for round ``r``.

        A client coming back (new, or online again after an outage) is being warmed: the round
        waits for its warm-up up to ``deadline_s`` (never for one older than ``warmup_s``), so it
        rejoins now instead of straggling. With too few clients the round keeps looking until
        its (extended) deadline, then gives up."""
        deadline = t0 + run.deadline_s * (1 + (run.max_extensions if run.on_insufficient == "extend" else 0))
        warm_deadline = t0 + run.deadline_s
        while True:
            rows = self._endpoint_rows()
            self._refresh(run, rows)
            now = time.monotonic()
            fresh = [t for t, sent in self._warm_sent.items() if t in self._warming and now - sent < run.warmup_s]
            if fresh and now < warm_deadline:
                self._wait([], min(self.poll_s, 1.0, warm_deadline - now))
                continue
            instructions = run.strategy.configure_round(r, self._ready(run, rows))
            if instructions or time.monotonic() >= deadline:
                return instructions, rows
            self._wait([], min(self.poll_s, 1.0, max(0.0, deadline - time.monotonic())))

    # ================================================================ hierarchical
    def _aggregate_hierarchical(self, run: "_RunParams", r: int, updates: List[ClientUpdate], weights: Weights):
        strat = run.strategy
        assert isinstance(strat, Hierarchical)
        groups: Dict[str, List[ClientUpdate]] = {}
        for u in updates:
            groups.setdefault(self._gateway_of.get(u.client_id, f"direct:{u.client_id}"), []).append(u)
        current = encode_weights(weights)
        payloads = []
        for gw, us in groups.items():
            if gw.startswith("direct:"):
                continue
            payloads.append((gw, {"v": PROTOCOL, "kind": "aggregate", "round": r, "gateway_id": gw, "current": current,
                                  "updates": [{"client_id": u.client_id, "weights": encode_weights(u.weights),
                                               "num_samples": u.num_samples, "metrics": u.metrics} for u in us]}))
        t0 = time.monotonic()
        pending = self._submit(run.gateway_fid, payloads, run.ttl_s)
        answers: Dict[str, Any] = {}
        deadline = t0 + run.deadline_s
        while pending and time.monotonic() < deadline:
            for tid, arr in self._wait(list(pending), min(self.poll_s, deadline - time.monotonic())):
                gw = pending.pop(tid, None)
                if gw is not None and arr.ok and isinstance(arr.value, dict) and arr.value.get("kind") == "group":
                    answers[gw] = arr.value
        self._retire(pending, r)
        pseudo: List[ClientUpdate] = []
        accepted: List[str] = []
        rejected: Dict[str, str] = {}
        fallback: List[str] = []
        for gw in sorted(groups):
            ans = answers.get(gw)
            if ans is not None and ans.get("weights") is not None:
                try:
                    gw_w = decode_weights(ans["weights"])
                except WireError as exc:
                    ans = None
                    log.warning("gateway %s sent undecodable weights: %s", gw, exc)
                else:
                    for cid, why in ans.get("rejected") or []:
                        rejected[str(cid)] = str(why)
                    accepted += [str(c) for c in ans.get("accepted") or []]
                    pseudo.append(ClientUpdate(gw, gw_w, int(ans["num_samples"])))
                    continue
            if ans is not None:  # the gateway answered: its group had nothing usable
                for cid, why in ans.get("rejected") or []:
                    rejected[str(cid)] = str(why)
                for u in groups[gw]:
                    rejected.setdefault(u.client_id, f"gateway {gw}: {ans.get('reason')}")
                continue
            if not gw.startswith("direct:"):
                fallback.append(gw)
            gw_w2 = strat.inner.aggregate(r, groups[gw], weights)
            rep = strat.inner.last_report
            assert rep is not None
            rejected.update(dict(rep.rejected))
            if gw_w2 is None:
                for u in groups[gw]:
                    rejected.setdefault(u.client_id, f"group {gw}: {rep.reason}")
                continue
            accepted += rep.accepted
            pseudo.append(ClientUpdate(gw, gw_w2, rep.num_samples))
        new = strat.outer.aggregate(r, pseudo, weights)
        reason = None if new is not None else f"outer aggregation over {len(pseudo)} group(s): {strat.outer.last_report.reason}"
        extra = {"gateways": {g: list(cs) for g, cs in self.gateways.items()}}
        if fallback:
            extra["gateway_fallback"] = fallback
        return new, accepted, rejected, reason, extra

    # ================================================================ asynchronous
    def _run_async(self, run: "_RunParams", history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        """Keep every available client busy; feed each update to the strategy as it arrives.

        A task not back within ``deadline_s`` makes its client a straggler and frees it for a
        new task; if the old task's update still arrives it is used, weighted by its staleness
        (and refused past the strategy's ``max_staleness``). One record per new global model;
        if none appears within ``deadline_s * (1 + max_extensions)`` a skipped record is written
        so a run with no live clients still ends.
        """
        strat = run.strategy
        version = int(state.get("version", 0))
        if hasattr(strat, "register_version"):
            strat.register_version(version, weights)  # FedBuff needs the base weights of this version
        in_flight: Dict[str, Tuple[str, int, float]] = {}  # task id -> (client, base version, asked at)
        overdue_seen: set = set()
        give_up = run.deadline_s * (1 + run.max_extensions)
        r = start_round
        last_t = time.monotonic()
        stragglers: List[str] = []
        dropped: Dict[str, str] = {}
        staleness: Dict[str, int] = {}
        infos: Dict[str, Dict[str, Any]] = {}
        while r <= run.rounds:
            now = time.monotonic()
            for tid, (c, _, at) in in_flight.items():
                if now - at >= run.deadline_s and tid not in overdue_seen:
                    overdue_seen.add(tid)
                    stragglers.append(c)
            busy = {c for c, _, at in in_flight.values() if now - at < run.deadline_s}
            rows = self._endpoint_rows()
            self._refresh(run, rows)
            idle = [c for c in self._ready(run, rows) if c not in busy]
            if idle:
                base = encode_weights(weights)
                cfg = {**strat.client_round_config(r), "local_epochs": run.local_epochs, "seed": run.seed}
                payloads = [(c, {"v": PROTOCOL, "kind": "train", "run_id": self.run_id, "round": r, "client_id": c,
                                 "base_version": version, "weights": base, "dataset": run.dataset,
                                 "dataset_kwargs": run.dataset_kwargs, "config": cfg}) for c in idle]
                for tid, c in self._submit(run.fid, payloads, run.ttl_s).items():
                    in_flight[tid] = (c, version, time.monotonic())
            accepted: Optional[List[str]] = None
            for tid, arr in self._wait(list(in_flight), min(self.poll_s, run.deadline_s)):
                if tid not in in_flight:
                    continue
                client, base_v, _ = in_flight.pop(tid)
                overdue_seen.discard(tid)
                if not arr.ok:
                    dropped[client] = arr.error or "failed on the endpoint"
                    continue
                upd, why, info = self._to_update(client, arr.value, base_v)
                if upd is None:
                    dropped[client] = why or "invalid update"
                    continue
                infos[client] = info
                staleness[client] = version - upd.base_version
                out = strat.on_update(upd, weights, version)
                rep = strat.last_report
                if rep is not None and rep.rejected:
                    dropped.update(dict(rep.rejected))
                if out is not None:
                    weights, version = out, version + 1
                    accepted = list(rep.accepted) if rep is not None else [client]
                    break  # one record per model; the other results stay at the hub for the next pass
            now = time.monotonic()
            if accepted is None and now - last_t < give_up:
                continue
            extra: Dict[str, Any] = {"version": version, "buffered": int(getattr(strat, "buffered", 0))}
            if accepted is None:
                extra.update({"skipped": True, "reason": f"no new global model within {give_up:.0f}s",
                              "staleness": dict(staleness)})
                rec = RoundRecord(r, None, None, [], list(stragglers), dict(dropped), now - last_t, extra)
            else:
                used = [ClientUpdate(c, [], max(1, int(infos.get(c, {}).get("num_samples", 1))),
                                     metrics=infos.get(c, {}).get("metrics", {})) for c in accepted]
                if run.eval_data is not None:
                    loss, acc = self._evaluate(run, weights, [])
                else:
                    m = strat.aggregate_metrics(used)
                    loss, acc = m.get("loss"), m.get("accuracy")
                tt = {c: float(infos[c]["train_time_s"]) for c in accepted if "train_time_s" in infos.get(c, {})}
                extra.update({"staleness": {c: staleness[c] for c in accepted if c in staleness}, "train_time_s": tt,
                              "num_samples": int(sum(u.num_samples for u in used))})
                rec = RoundRecord(r, loss, acc, list(accepted), list(stragglers), dict(dropped), now - last_t, extra)
            last_t = now
            stragglers, dropped, staleness, infos = [], {}, {}, {}
            if not self._finish_round(run, history, rec, weights, {"version": version}):
                break
            r += 1
        self._retire({tid: c for tid, (c, _, _) in in_flight.items()}, r)
        return weights


@dataclass
class _RunParams:
    app: ClientApp
    dataset: str
    dataset_kwargs: Dict[str, Any]
    strategy: Strategy
    mode: str
    rounds: int
    local_epochs: int
    deadline_s: float
    min_clients: int
    on_insufficient: str
    max_extensions: int
    extension_s: float
    eval_data: Any
    seed: int
    include_offline: bool
    on_round: Optional[Callable[[RoundRecord, Weights], Any]]
    on_round_start: Optional[Callable[[int, Dict[str, str]], Any]]
    ttl_s: float
    warmup_s: float = 60.0
    fid: str = ""
    gateway_fid: str = ""

