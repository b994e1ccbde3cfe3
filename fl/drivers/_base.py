"""What every round driver shares: hub access with retries, submitting and collecting tasks,
warming-aware client readiness, late results, the run's record and checkpoint in the hub.

A *round driver* runs one mode of federated rounds (sync, async, hierarchical, ...). It is made
by ``Federation.fit`` once per run, from the run's parameters (:class:`RunParams`), and
:meth:`RoundDriver.fit` runs it: open (or resume) the run in the hub, evaluate the initial
model, warm the clients, then :meth:`RoundDriver.run_rounds` (the one method a mode must
write), and mark the run's status. The hooks below are where a mode, or a feature layered on
a mode, changes one step without copying the rest (docs/fl.md, "Writing a round driver"):

``select(round, ready)``
    client selection among the clients ready now (default: the strategy's ``configure_round``).
``encode_global(round, weights, version)`` / ``train_payload(instruction, round, blob, version)``
    the downlink: the global model as the clients get it (``downlink="fp16"``: float16), and
    each client's task.
``decode_update(client, value, base_version)``
    the uplink: one client's result -> a ``ClientUpdate`` (or the reason it is refused);
    compression is undone here (and masking would be).
``aggregate(round, updates, current)``
    the aggregation step -> :class:`Aggregate` (new weights or the reason there are none).
``evaluate(round, weights, used)``
    the evaluation step -> :class:`Evaluation` (central, or the clients' reported metrics).

Shared by every mode, in :meth:`RoundDriver.finish_round`: federated evaluation every
``fed_eval_every`` rounds (:meth:`RoundDriver.federated_evaluate`), and failing loudly (a run
stops after ``max_failed_rounds`` rounds in a row in which every client failed with one error,
and a run in which no round trained ends ``failed``, never ``finished``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

import httpx
import numpy as np

from cloud_hub.client import Client, HubError
from cloud_hub.client._results import decode_row
from fl.client import PROTOCOL, ClientApp
from fl.history import History, RoundRecord
from fl.sites import site_stores
from fl.strategies import ClientInstruction, ClientUpdate, Strategy, Weights
from fl.wire import WireError, decode_weights, encode_weights
from mesh_agent._logs import log_context
from mesh_agent.backoff import Backoff, retry

if TYPE_CHECKING:  # (fl.federation imports this module)
    from fl.compression import Compression
    from fl.federation import Federation

__all__ = ["FederationError", "RunParams", "Arrival", "Collected", "Aggregate", "Evaluation", "RoundDriver",
           "json_safe", "short_error", "to_update"]

log = logging.getLogger("fl.federation")

_RECORD_BUDGET = 900 * 1024
#: Hub calls while the hub is unreachable (mesh_agent/backoff.py): 0.2 s doubling to 2 s, no jitter
#: (one driver), for ``hub_wait_s`` (the deadline, set per driver). Shared with the Flower grid.
HUB_WAIT = Backoff(base=0.2, cap=2.0, jitter=(1.0, 1.0))


def hub_down(exc: BaseException) -> bool:
    """Worth waiting out: the hub unreachable (restarting, link down) or answering 5xx. A 4xx is a
    refusal and raised at once."""
    if isinstance(exc, HubError):
        return exc.status >= 500
    return isinstance(exc, (httpx.TransportError, httpx.TimeoutException, ConnectionError))  # (HubUnreachable)


def wait_out_hub(call: Callable[[], Any], wait_s: float, on_wait: Callable[[float], None] | None = None) -> Any:
    """``call()``; while the hub is down (:func:`hub_down`) wait and retry for up to ``wait_s``,
    logging each wait (``on_wait(delay)`` too). What the FL driver and the Flower grid share;
    the last error is raised as it was, and each caller wraps it in its own run error."""

    def waiting(_n: int, err: BaseException, delay: float) -> None:
        log.warning("hub unreachable (%s); retrying in %.1fs", err, delay)
        if on_wait is not None:
            on_wait(delay)

    return retry(call, retry_on=hub_down, policy=HUB_WAIT.replace(deadline=max(0.0, wait_s)), on_retry=waiting)
_MAX_LATE = 2000  # late tasks still watched for
_KEEP_VERSIONS = 64  # global models kept to decode delta-encoded updates of async clients


class FederationError(RuntimeError):
    """The run cannot go on (no clients, the hub refused it, the hub stayed unreachable)."""


def json_safe(v: Any) -> Any:
    """JSON the hub accepts: NaN/inf (a diverged client's loss) become null, numpy scalars plain."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def short_error(exc: BaseException) -> str:
    remote = getattr(exc, "remote_type", None)
    text = f"{remote or type(exc).__name__}: {getattr(exc, 'remote_message', None) or exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def to_update(client: str, value: Any, base_version: int, base: Optional[Weights] = None,
              compression: "Optional[Compression]" = None) -> Tuple[Optional[ClientUpdate], Optional[str], Dict[str, Any]]:
    """Turn a client's result dict into a ClientUpdate, or a reason it cannot be one.

    ``info`` (third item) is the result without its weights, plus ``bytes_up`` (the weights
    blob's size). A compressed update (``value["encoding"]``) is a delta against ``base`` (the
    global weights of its base version); without ``base`` it cannot be decoded."""
    if not isinstance(value, dict) or value.get("v") != PROTOCOL or value.get("kind") != "update":
        return None, f"not an fl update (got {type(value).__name__})", {}
    if value.get("client_id") != client:
        return None, f"update claims client {value.get('client_id')!r}", {}
    info = {k: v for k, v in value.items() if k not in ("weights", "v", "kind")}
    blob = value.get("weights")
    if isinstance(blob, (bytes, bytearray)):
        info["bytes_up"] = len(blob)
    try:
        bv = int(value.get("base_version", base_version))
    except (TypeError, ValueError):
        return None, f"base_version is not an integer: {value.get('base_version')!r}", info
    enc = value.get("encoding")
    try:
        if enc is not None:
            from fl.compression import CompressionError, decode_update

            if base is None:
                return None, f"compressed update against version {bv}, which the driver no longer holds", info
            try:
                weights = decode_update(blob, enc, base, expected=compression)
            except CompressionError as exc:
                return None, f"undecodable compressed update: {exc}", info
        else:
            if blob is None:
                raise KeyError("weights")
            weights = decode_weights(blob)
    except (WireError, KeyError) as exc:
        return None, f"undecodable weights: {exc}", info
    try:
        n = int(value.get("num_samples", 0))
    except (TypeError, ValueError):
        return None, f"num_samples is not an integer: {value.get('num_samples')!r}", info
    metrics = dict(value.get("metrics") or {})
    return ClientUpdate(client, weights, n, base_version=bv, metrics=metrics), None, info


@dataclass
class RunParams:
    """One ``fit`` call's settings, as every driver sees them."""

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
    compression: "Optional[Compression]" = None
    downlink: Optional[str] = None  # "fp16": the global model goes down as float16
    #: federated evaluation: every k rounds (0: off), on this fraction of the ready clients, on
    #: this held-out fraction of each device's own data (never trained on while it is on)
    fed_eval_every: int = 0
    fed_eval_fraction: float = 1.0
    fed_eval_holdout: float = 0.2
    #: stop after this many rounds in a row in which every client failed with the same error
    max_failed_rounds: int = 2
    #: anything a driver or a feature needs beyond the above (the driver's own settings)
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Arrival:
    """One task result that came back, decoded."""

    ok: bool
    value: Any = None
    error: Optional[str] = None
    started: Optional[float] = None
    finished: Optional[float] = None


@dataclass
class Collected:
    """What came back for one round by its deadline."""

    updates: List[ClientUpdate] = field(default_factory=list)
    info: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # client -> result dict (minus weights)
    failed: Dict[str, str] = field(default_factory=dict)
    late: List[Dict[str, Any]] = field(default_factory=list)
    extensions: int = 0
    deadline_reached: bool = False
    outage_s: float = 0.0


@dataclass
class Aggregate:
    """The aggregation step's outcome: ``weights`` (None: no new model, ``reason`` says why),
    the clients whose updates went in, those refused (client -> why), and record extras."""

    weights: Optional[Weights]
    accepted: List[str] = field(default_factory=list)
    rejected: Dict[str, str] = field(default_factory=dict)
    reason: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Evaluation:
    """The evaluation step's outcome for a new global model; ``extra`` goes into the record."""

    loss: Optional[float] = None
    accuracy: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)


class RoundDriver:
    """Base of the round drivers; subclasses set ``mode`` and write :meth:`run_rounds`."""

    #: the run's ``mode`` in the hub (``sync``, ``async``, ``hierarchical``, ...)
    mode: ClassVar[str] = ""

    def __init__(self, federation: "Federation", run: RunParams) -> None:
        self.fed = federation
        self.client: Client = federation.client
        self.run = run
        self.poll_s = federation.poll_s
        self.hub_wait_s = federation.hub_wait_s
        self.run_id: Optional[str] = None
        self.outage_s = 0.0  # time the current round waited for an unreachable hub
        self._late = federation._late  # task id -> (client, round) of rounds already over (kept across runs)
        self._late_seen: List[Dict[str, Any]] = []  # late updates noticed, until recorded in a round
        self._excluded: Dict[str, str] = {}  # clients that failed the warm-up -> why
        # Warming-aware selection: a client that is new, or was offline (its worker may have died
        # with it), gets a warm-up task first and is asked to train only once that is back, so
        # its cold start (importing torch, loading data) never costs a round its deadline.
        self._cold: set = set()
        self._warming: Dict[str, str] = {}  # warm-up task id -> client
        self._warm_sent: Dict[str, float] = {}  # warm-up task id -> when it was sent
        self._warm_info: Dict[str, Dict[str, Any]] = {}
        self._versions: Dict[int, Weights] = {}  # global model versions (decoding delta updates)
        self._trained_rounds = 0  # rounds (this run, resumed ones included) that produced a model
        self._failed_streak = 0  # rounds in a row in which every client failed with one error
        self._last_failure: Optional[str] = None  # why the last round produced no model
        self._aborted = False  # on_round asked to stop

    # ================================================================ the run
    def prepare(self) -> None:
        """Register the functions the run needs before it is created (a model that cannot be
        shipped fails here, before any run exists). Override to register more."""
        self.run.fid = self.hub(self.client.register_function, self.run.app, "fl-client-" + self.run.app.name)

    def fit(self, name: Optional[str], resume: Optional[str], initial: Optional[Weights]) -> Tuple[History, Weights]:
        """The whole run; returns its history and final global weights."""
        run = self.run
        rows = self.endpoint_rows()
        clients = self.fed._clients(rows)
        if not clients:
            raise FederationError("no client endpoints match this federation")
        self.prepare()
        history, weights, start_round, state = self.open_run(rows, clients, name, resume, initial)
        self.history: History = history  # also when fit raises: what the failed run recorded
        self._trained_rounds = sum(1 for r in history.rounds if self.trained(r))
        ids = log_context(fl_run_id=self.run_id)  # structured logs: every line of this run carries its id
        ids.__enter__()
        try:
            if start_round <= run.rounds:
                if run.eval_data is not None and "initial_eval" not in history.metadata:
                    # the model before training (round 0, as Flower reports it); it also pays the
                    # driver's own one-time torch start-up before round 1 rather than in it
                    res = run.app.evaluate(weights, run.eval_data)
                    if res is not None:
                        history.metadata["initial_eval"] = {"loss": float(res[0]), **{k: float(v) for k, v in res[1].items()}}
                self.warmup(rows, history)
            weights = self.run_rounds(history, weights, start_round, state)
            if self._trained_rounds == 0 and not self._aborted and history.rounds:
                # a run that never produced a model has failed, whatever the rounds' count says
                raise FederationError(f"no round trained in {len(history)} round(s): {self._last_failure or 'no client update was used'}")
        except KeyboardInterrupt:
            self.set_status("aborted", "interrupted by the user")
            if self.run_id is not None:  # what the resume step needs (docs/fl-tutorial.md, section 6)
                log.warning("run %s interrupted; continue it with fit(..., resume=%r)", self.run_id, self.run_id)
            raise
        except BaseException as exc:  # the run stays resumable: fit(..., resume=run_id)
            self.set_status("failed", short_error(exc))
            raise
        finally:
            ids.__exit__(None, None, None)
        return history, weights

    def run_rounds(self, history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        """Rounds ``start_round..run.rounds``: each ends in :meth:`finish_round` (stop when it
        returns False). ``state`` is the last checkpoint's driver state. Returns the final weights."""
        raise NotImplementedError

    # ================================================================ hooks
    def select(self, round: int, ready: Sequence[str]) -> List[ClientInstruction]:
        """Client selection among the clients ready now. Returning ``[]`` skips the round (say
        why in ``strategy.last_selection_reason``)."""
        return self.run.strategy.configure_round(round, ready)

    def encode_global(self, round: int, weights: Weights, version: int) -> bytes:
        """The global model as it goes down to the clients (once per round, shared by all)."""
        self.remember_version(version, weights)
        if self.run.downlink is not None:
            from fl.compression import encode_global

            return encode_global(weights, self.run.downlink)
        return encode_weights(weights)

    def stage_at_sites(self, round: int, blob: bytes, gateways: Mapping[str, Sequence[str]],
                       rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Put this round's global model in the site store of each gateway in ``gateways``
        (gateway -> its clients this round), one ``stage`` task each: the model crosses that
        site's uplink once instead of once per client (docs/sites.md, "Fetched once per site").
        Clients behind a staged site get its key instead of the model (:meth:`train_payload`);
        the key is inside the hub's signature, so the gateway cannot swap the model. A site whose
        stage task is not answered in time gets the round the old way (fl.sites)."""
        self._staged: Dict[str, Tuple[str, str]] = {}
        self._site_of = {c: g for g, cs in gateways.items() for c in cs}
        stores = site_stores(rows, gateways)
        if not stores:
            return
        if not self.run.gateway_fid:  # a flat run: the gateway's worker only puts the model in its store
            from fl.client import GatewayAggregator

            self.run.gateway_fid = self.hub(self.client.register_function, GatewayAggregator(), "fl-gateway")
        payloads = [(gw, {"v": PROTOCOL, "kind": "stage", "round": round, "gateway_id": gw, "weights": blob, "site_store": addr})
                    for gw, addr in stores.items()]
        pending = self.submit(self.run.gateway_fid, payloads, self.run.ttl_s)
        deadline = time.monotonic() + min(self.run.deadline_s, 120.0)
        while pending and time.monotonic() < deadline:
            for tid, arr in self.wait(list(pending), min(self.poll_s, max(0.1, deadline - time.monotonic()))):
                gw = pending.pop(tid, None)
                if gw is None:
                    continue
                if arr.ok and isinstance(arr.value, dict) and arr.value.get("kind") == "staged" and isinstance(arr.value.get("ref"), str):
                    self._staged[gw] = (arr.value["ref"], stores[gw])
                else:
                    log.warning("site %s could not stage round %d's model (%s); its clients get it through the hub",
                                gw, round, arr.error or arr.value)
        self.retire(pending, round)

    def site_of(self, client: str) -> Optional[str]:
        """The gateway whose site store serves ``client`` this round (see stage_at_sites)."""
        return getattr(self, "_site_of", {}).get(client)

    @staticmethod
    def sites_of(clients: Sequence[str], rows: Mapping[str, Mapping[str, Any]]) -> Dict[str, List[str]]:
        """Gateway -> the clients behind it (from their hellos, ``info.gateway``), for gateways with
        two or more of ``clients``: staging one model for a single client would save nothing."""
        out: Dict[str, List[str]] = {}
        for c in clients:
            gw = ((rows.get(c) or {}).get("info") or {}).get("gateway")
            if isinstance(gw, str):
                out.setdefault(gw, []).append(c)
        return {g: cs for g, cs in out.items() if len(cs) >= 2}

    def client_config(self, ins: ClientInstruction) -> Dict[str, Any]:
        return {**ins.config, "local_epochs": self.run.local_epochs, "seed": self.run.seed}

    def train_payload(self, ins: ClientInstruction, round: int, blob: bytes, version: int) -> Dict[str, Any]:
        """One client's training task. Override to add per-client fields (a mask seed, ...)."""
        p = {"v": PROTOCOL, "kind": "train", "run_id": self.run_id, "round": round, "client_id": ins.client_id,
             "base_version": version, "weights": blob, "dataset": self.run.dataset,
             "dataset_kwargs": self.run.dataset_kwargs, "config": self.client_config(ins)}
        if self.run.fed_eval_every:  # train on the part of the device's data that is not its test part
            p["holdout"] = self.run.fed_eval_holdout
        if self.run.compression is not None:
            p["uplink"] = self.run.compression.spec()
        if self.run.downlink is not None:
            p["downlink"] = self.run.downlink
        staged = getattr(self, "_staged", {}).get(self.site_of(ins.client_id) or "")
        if staged is not None:  # the model is in the client's site store (stage_at_sites)
            del p["weights"]
            p.update({"weights_ref": staged[0], "site_store": staged[1]})
        return p

    def decode_update(self, client: str, value: Any, base_version: int) -> Tuple[Optional[ClientUpdate], Optional[str], Dict[str, Any]]:
        """One client's result -> ``(update, None, info)`` or ``(None, why, info)``."""
        try:
            bv = int(value.get("base_version", base_version)) if isinstance(value, dict) else base_version
        except (TypeError, ValueError):
            bv = base_version
        return to_update(client, value, base_version, self._versions.get(bv), self.run.compression)

    def aggregate(self, round: int, updates: List[ClientUpdate], current: Weights) -> Aggregate:
        """The aggregation step (synchronous modes)."""
        new = self.run.strategy.aggregate(round, updates, current)
        rep = self.run.strategy.last_report
        return Aggregate(new, list(rep.accepted) if rep else [], dict(rep.rejected) if rep else {},
                         rep.reason if rep else None)

    def evaluate(self, round: int, weights: Weights, used: Sequence[ClientUpdate]) -> Evaluation:
        """The evaluation step: the new global model on the driver's ``eval_data`` when the run
        has it, else the sample-weighted mean of what the clients reported."""
        run = self.run
        if run.eval_data is not None:
            res = run.app.evaluate(weights, run.eval_data)
            if res is not None:
                loss, metrics = res
                return Evaluation(float(loss), float(metrics["accuracy"]) if "accuracy" in metrics else None)
        m = run.strategy.aggregate_metrics(used) if used else {}
        return Evaluation(m.get("loss"), m.get("accuracy"))

    # ================================================================ hub access with retries
    def hub(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Call the hub; while it is unreachable (restarting, link down) wait and retry, up to
        ``hub_wait_s``. Refusals (4xx) are raised at once. Time spent waiting is added to
        ``self.outage_s`` so deadlines can move by it."""
        start = time.monotonic()

        def waited(delay: float) -> None:
            self.outage_s += delay

        try:
            return wait_out_hub(lambda: fn(*args, **kw), self.hub_wait_s, waited)
        except BaseException as err:
            if not hub_down(err):
                raise
            raise FederationError(f"hub unreachable for {time.monotonic() - start:.0f}s (last error: {err})") from err

    def endpoint_rows(self) -> Dict[str, Dict[str, Any]]:
        return {e["id"]: e for e in self.hub(self.client.list_endpoints)}

    def available(self, rows: Mapping[str, Mapping[str, Any]]) -> List[str]:
        return [c for c in self.fed._clients(rows) if c in rows and (self.run.include_offline or rows[c].get("online"))]

    # ================================================================ task plumbing
    def submit(self, fid: str, items: Sequence[Tuple[str, Dict[str, Any]]], ttl_s: float) -> Dict[str, str]:
        """Submit one task per (endpoint, payload); returns task id -> endpoint."""
        if not items:
            return {}
        specs = [Client.task_spec(ep, fid, (payload,), None, ttl_s=ttl_s) for ep, payload in items]
        ids = self.hub(self.client.submit_batch, specs)
        return {tid: ep for tid, (ep, _) in zip(ids, items)}

    def wait(self, task_ids: Sequence[str], timeout_s: float) -> List[Tuple[str, Arrival]]:
        """Results among ``task_ids`` (waits up to ``timeout_s`` for the first). Warm-up answers
        and late updates of finished rounds are picked up on the way and handled here."""
        wanted = set(task_ids)
        ids = list(task_ids) + [t for t in list(self._warming) + list(self._late) if t not in wanted]
        if not ids:
            time.sleep(max(0.0, timeout_s))
            return []
        rows = self.hub(self.client.wait_results, ids, min(max(0.0, timeout_s), 30.0))
        out = []
        for row in rows:
            try:
                ok, value = decode_row(row, self.client.trusted_endpoints)  # untrusted endpoints: data only (numpy arrays included)
            except Exception as exc:  # a result that does not deserialize here
                ok, value = False, exc
            arr = Arrival(ok=ok, started=row.get("started"), finished=row.get("finished"))
            if ok:
                arr.value = value
            else:
                arr.error = short_error(value)
            tid = row["task_id"]
            if tid in wanted:
                out.append((tid, arr))
            elif tid in self._warming:
                self._warm_sent.pop(tid, None)
                self._on_warm(self._warming.pop(tid), arr)
            elif tid in self._late:
                client, rnd = self._late.pop(tid)
                self.on_late(client, rnd, arr)
        return out

    def on_late(self, client: str, round: int, arr: Arrival) -> None:
        """A result of round ``round``, which is over, came back. Default (Flower's semantics):
        not used, listed in the next record's ``late_discarded``."""
        self._late_seen.append({"client": client, "round": round})

    def gather(self, pending: Mapping[str, str], timeout_s: float) -> Tuple[Dict[str, Arrival], Dict[str, str]]:
        """Answers to ``pending`` (task id -> client) until all are back or ``timeout_s``
        passes: (client -> its arrival, the task id -> client of those not back)."""
        pending = dict(pending)
        got: Dict[str, Arrival] = {}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for tid, arr in self.wait(list(pending), min(self.poll_s, max(0.0, deadline - time.monotonic()))):
                c = pending.pop(tid, None)
                if c is not None:
                    got[c] = arr
        return got, pending

    def drain_late(self) -> List[Dict[str, Any]]:
        out, self._late_seen = self._late_seen, []
        return out

    def retire(self, pending: Mapping[str, str], round: int) -> None:
        """Tasks of a round that is over: their results, if they come, are late."""
        for tid, client in pending.items():
            self._late[tid] = (client, round)
        if len(self._late) > _MAX_LATE:  # bounded (a wait names at most 10,000 tasks); the oldest are expired anyway
            for tid in list(self._late)[: len(self._late) - _MAX_LATE]:
                del self._late[tid]

    def remember_version(self, version: int, weights: Weights) -> None:
        """Keep the global weights of ``version`` (delta-encoded updates are decoded against them)."""
        if version in self._versions:
            return
        self._versions[int(version)] = [np.array(w, copy=True) for w in weights]
        if len(self._versions) > _KEEP_VERSIONS:
            for v in sorted(self._versions)[: len(self._versions) - _KEEP_VERSIONS]:
                del self._versions[v]

    def collect(self, pending: Dict[str, str], col: Collected, t0: float, round: int, base_version: int = 0) -> None:
        """Gather results until all are back or the (possibly extended) deadline passes: the
        shared "wait until the deadline" of synchronous modes."""
        run = self.run
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
            before = self.outage_s
            # (wait() watches late tasks itself: naming them here would return them as this
            # round's and they would never reach on_late)
            rows = self.wait(list(pending), min(self.poll_s, deadline - now))
            outage = self.outage_s - before
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
                upd, why, info = self.decode_update(client, arr.value, base_version)
                if upd is None:
                    col.failed[client] = why or "invalid update"
                    continue
                col.updates.append(upd)
                col.info[client] = info
        self.retire(pending, round)

    # ================================================================ warming-aware selection
    def _on_warm(self, client: str, arr: Arrival) -> None:
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

    def refresh(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Mark clients that are offline as cold; send warm-ups to cold clients that are online."""
        run = self.run
        clients = self.fed._clients(rows)
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
            for tid, c in self.submit(run.fid, payloads, ttl_s=run.warmup_s + 30).items():
                self._warming[tid] = c
                self._warm_sent[tid] = time.monotonic()

    def all_excluded(self, rows: Mapping[str, Mapping[str, Any]]) -> Dict[str, str]:
        """Every client of the federation failed its warm-up (e.g. the app does not load on the
        devices): client -> its first error; empty while any client may still train."""
        clients = self.fed._clients(rows)
        if clients and all(c in self._excluded for c in clients):
            return {c: self._excluded[c] for c in clients}
        return {}

    def ready(self, rows: Mapping[str, Mapping[str, Any]]) -> List[str]:
        """Clients that may be asked to train now: available, warm, not excluded."""
        return [c for c in self.available(rows) if c not in self._cold and c not in self._excluded]

    def warmup(self, rows: Mapping[str, Mapping[str, Any]], history: History) -> None:
        """Warm every online client before round 1 (up to ``warmup_s``); late ones are warmed
        when they show up, and join the rounds after that."""
        t0 = time.monotonic()
        self._cold = set(self.fed._clients(rows))
        self.refresh(rows)
        deadline = t0 + self.run.warmup_s
        while self._warming and time.monotonic() < deadline:
            self.wait([], min(self.poll_s, deadline - time.monotonic()))
        history.metadata["warmup"] = {"time_s": round(time.monotonic() - t0, 3), "ready": dict(self._warm_info),
                                      "failed": dict(self._excluded), "not_back": sorted(set(self._warming.values()))}

    def wait_for_clients(self, t0: float, r: int) -> Tuple[List[ClientInstruction], Dict[str, Mapping[str, Any]]]:
        """Selection for round ``r``.

        A client coming back (new, or online again after an outage) is being warmed: the round
        waits for its warm-up up to ``deadline_s`` (never for one older than ``warmup_s``), so it
        rejoins now instead of straggling. With too few clients the round keeps looking until
        its (extended) deadline, then gives up."""
        run = self.run
        deadline = t0 + run.deadline_s * (1 + (run.max_extensions if run.on_insufficient == "extend" else 0))
        warm_deadline = t0 + run.deadline_s
        while True:
            rows = self.endpoint_rows()
            self.refresh(rows)
            if self.all_excluded(rows):  # nobody can ever train: do not wait out the deadline
                return [], rows
            now = time.monotonic()
            fresh = [t for t, sent in self._warm_sent.items() if t in self._warming and now - sent < run.warmup_s]
            if fresh and now < warm_deadline:
                self.wait([], min(self.poll_s, 1.0, warm_deadline - now))
                continue
            instructions = self.select(r, self.ready(rows))
            if instructions or time.monotonic() >= deadline:
                return instructions, rows
            self.wait([], min(self.poll_s, 1.0, max(0.0, deadline - time.monotonic())))

    # ================================================================ run bookkeeping
    def set_status(self, status: str, error: Optional[str] = None) -> None:
        if self.run_id is None:
            return
        try:
            self.client.fl_set_status(self.run_id, status, error)
        except Exception as exc:  # best effort: the run stays resumable either way
            log.warning("could not mark run %s %s: %s", self.run_id, status, exc)

    def run_config(self) -> Dict[str, Any]:
        """The run's ``config`` as stored in the hub (override to add a mode's settings)."""
        run = self.run
        cfg = {
            "dataset": run.dataset, "dataset_kwargs": run.dataset_kwargs, "local_epochs": run.local_epochs,
            "deadline_s": run.deadline_s, "min_clients": run.min_clients, "on_insufficient": run.on_insufficient,
            "max_extensions": run.max_extensions, "extension_s": run.extension_s, "seed": run.seed,
            "client_app": run.app.describe(), "gateways": self.fed.gateways, "tags": sorted(self.fed.tags),
        }
        if run.compression is not None:
            cfg["compression"] = run.compression.describe()
        if run.downlink is not None:
            cfg["downlink"] = run.downlink
        return cfg

    def open_run(self, rows: Mapping[str, Mapping[str, Any]], clients: List[str], name: Optional[str],
                 resume: Optional[str], initial: Optional[Weights]) -> Tuple[History, Weights, int, Dict[str, Any]]:
        run = self.run
        meta = {"strategy": run.strategy.name, "mode": run.mode, "dataset": run.dataset, "rounds": run.rounds}
        if run.compression is not None:
            meta["compression"] = run.compression.describe()
        if run.downlink is not None:
            meta["downlink"] = run.downlink
        if resume:
            info = self.hub(self.client.fl_run, resume)
            if info["status"] == "finished":
                raise FederationError(f"run {resume} is already finished")
            self.run_id = self.fed.run_id = resume
            history = History([RoundRecord.from_dict(r) for r in info["rounds"]], {**meta, "run_id": resume, "resumed_from": info["rounds_done"]})
            if info["rounds_done"] > 0:
                ck = self.hub(self.client.fl_checkpoint, resume)
                weights, state = decode_weights(ck["weights"]), dict(ck.get("state") or {})
            else:
                weights, state = self.initial(initial), {}
            if info["status"] != "running":
                self.hub(self.client.fl_set_status, resume, "running")
            return history, weights, int(info["rounds_done"]) + 1, state
        weights = self.initial(initial)
        names = {c: str(rows[c]["name"]) for c in clients if c in rows}
        names.update({g: str(rows[g]["name"]) for g in self.fed.gateways if g in rows})
        created = self.hub(self.client.fl_create_run, name or f"{run.dataset}-{run.strategy.name}", strategy=run.strategy.name,
                           rounds_planned=run.rounds, mode=run.mode, clients=clients, client_names=names, config=self.run_config())
        self.run_id = self.fed.run_id = created["id"]
        return History([], {**meta, "run_id": self.run_id}), weights, 1, {}

    def initial(self, initial: Optional[Weights]) -> Weights:
        w = initial if initial is not None else self.run.app.initial_weights()
        if w is None:
            raise ValueError("this client app has no initial weights: pass initial_weights=[...]")
        return [np.asarray(a).copy() for a in w]

    def checkpoint(self, rec: RoundRecord, weights: Weights, state: Dict[str, Any], last: bool) -> None:
        assert self.run_id is not None
        body = json_safe(asdict(rec))
        # the hub keeps a round's extras under 1 MiB: with thousands of clients drop the
        # per-client detail first (the record says what was left out)
        for key in ("client_metrics", "fed_eval", "fed_eval_asked", "train_time_s", "bytes_up", "bytes_down", "asked"):
            if len(json.dumps(body)) <= _RECORD_BUDGET:
                break
            if key in body["extra"]:
                del body["extra"][key]
                body["extra"].setdefault("trimmed", []).append(key)
        # a run with no trained round is never "finished" (the hub cannot make that "failed")
        self.hub(self.client.fl_put_round, self.run_id, rec.round, body, encode_weights(weights), state,
                 "finished" if last and self._trained_rounds > 0 else "running")

    @staticmethod
    def trained(rec: RoundRecord) -> bool:
        """The round produced a new global model from at least one client's update."""
        return bool(rec.participants) and not rec.extra.get("skipped")

    def note_failures(self, rec: RoundRecord) -> None:
        """Count rounds in which every client failed with one error (the app does not load, a
        config key is missing): such a run would fail the same way until its last round."""
        if self.trained(rec):
            self._trained_rounds += 1
            self._failed_streak = 0
            return
        errors = set(rec.dropped.values())
        self._last_failure = (f"every client failed with: {next(iter(errors))}" if len(errors) == 1
                              else rec.extra.get("reason") or self._last_failure)
        if rec.dropped and len(errors) == 1 and not rec.stragglers:
            self._failed_streak += 1
        else:
            self._failed_streak = 0

    def finish_round(self, history: History, rec: RoundRecord, weights: Weights, state: Dict[str, Any]) -> bool:
        """Federated evaluation (when due), checkpoint, record, call ``on_round``; False when the
        user asked to stop. Raises :class:`FederationError` after ``max_failed_rounds`` rounds
        in a row in which every client failed with the same error."""
        run = self.run
        self.note_failures(rec)
        last = rec.round >= run.rounds
        if run.fed_eval_every and self.trained(rec) and (rec.round % run.fed_eval_every == 0 or last):
            rec.extra.update(self.federated_evaluate(rec.round, weights))
        history.append(rec)
        self.checkpoint(rec, weights, state, last)
        if self._failed_streak >= run.max_failed_rounds and not last:
            raise FederationError(f"stopped after {self._failed_streak} round(s) in a row in which "
                                  f"{self._last_failure or 'every client failed'}")
        if run.on_round is not None and run.on_round(rec, weights) is False:
            self._aborted = True
            self.set_status("aborted", f"stopped by on_round after round {rec.round}")
            return False
        return True

    def federated_evaluate(self, round: int, weights: Weights) -> Dict[str, Any]:
        """The global model evaluated on the devices, each on its own local test part: a
        ``fed_eval_fraction`` of the ready clients get an ``evaluate`` task, the driver waits up
        to ``deadline_s`` and averages what came back weighted by examples. Record extras:
        ``fed_loss``, ``fed_accuracy``, ``fed_examples``, ``fed_eval`` (per client), ``fed_eval_asked``
        (the clients that got the task) and
        ``fed_eval_failed`` / ``fed_eval_missing`` (why a client's numbers are not in)."""
        run = self.run
        ready = sorted(self.ready(self.endpoint_rows()))
        if not ready:
            return {"fed_eval_failed": {"*": "no client ready for federated evaluation"}}
        k = max(1, min(len(ready), int(math.ceil(run.fed_eval_fraction * len(ready)))))
        rng = np.random.default_rng([int(run.seed), int(round), 0xE7A1])
        chosen = sorted(rng.choice(ready, size=k, replace=False).tolist()) if k < len(ready) else ready
        blob = encode_weights(weights)
        payloads = [(c, {"v": PROTOCOL, "kind": "evaluate", "run_id": self.run_id, "round": round, "client_id": c,
                         "weights": blob, "dataset": run.dataset, "dataset_kwargs": run.dataset_kwargs,
                         "holdout": run.fed_eval_holdout}) for c in chosen]
        got, pending = self.gather(self.submit(run.fid, payloads, ttl_s=run.deadline_s + 10.0), run.deadline_s)
        per: Dict[str, Dict[str, Any]] = {}
        failed: Dict[str, str] = {}
        for c, arr in got.items():
            v = arr.value
            if not arr.ok or not isinstance(v, dict) or v.get("kind") != "evaluation":
                failed[c] = arr.error or f"not an evaluation ({type(v).__name__})"
                continue
            m = dict(v.get("metrics") or {})
            per[c] = {"loss": v.get("loss"), "accuracy": m.get("accuracy"), "num_examples": int(v.get("num_examples", 0))}
        out: Dict[str, Any] = {"fed_eval": per, "fed_eval_asked": list(chosen)}
        if failed:
            out["fed_eval_failed"] = failed
        if pending:
            out["fed_eval_missing"] = sorted(pending.values())
        n = sum(p["num_examples"] for p in per.values())
        if n > 0:
            out["fed_examples"] = n
            with_loss = [p for p in per.values() if isinstance(p["loss"], (int, float)) and math.isfinite(p["loss"])]
            if with_loss:
                out["fed_loss"] = sum(p["loss"] * p["num_examples"] for p in with_loss) / max(1, sum(p["num_examples"] for p in with_loss))
            with_acc = [p for p in per.values() if isinstance(p["accuracy"], (int, float))]
            if with_acc and sum(p["num_examples"] for p in with_acc) > 0:
                out["fed_accuracy"] = sum(p["accuracy"] * p["num_examples"] for p in with_acc) / sum(p["num_examples"] for p in with_acc)
        return out

    @staticmethod
    def traffic_extra(down: Mapping[str, int], info: Mapping[str, Mapping[str, Any]], clients: Sequence[str]) -> Dict[str, Any]:
        """Bytes of model data per client this round: down (the global weights each client was
        sent) and up (each update that came back, used or not); plus the totals."""
        up = {c: int(info[c]["bytes_up"]) for c in clients if c in info and "bytes_up" in info[c]}
        dn = {c: int(down[c]) for c in clients if c in down}
        out: Dict[str, Any] = {"bytes_up": up, "bytes_down": dn, "bytes_up_total": int(sum(up.values())),
                               "bytes_down_total": int(sum(dn.values()))}
        # compressed updates with error feedback: the round each client's residual came from
        # (None: it started without one, e.g. first round, or its store was lost)
        ef = {c: (info[c].get("encoding") or {}).get("ef") for c in clients if c in info and isinstance(info[c].get("encoding"), dict)}
        ef = {c: e.get("from_round") for c, e in ef.items() if isinstance(e, dict)}
        if ef:
            out["error_feedback"] = ef
        return out

    @staticmethod
    def col_extra(col: Collected) -> Dict[str, Any]:
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
