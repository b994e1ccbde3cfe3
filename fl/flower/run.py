"""Run a Flower App directory (or FAB) on mesh endpoints, the way ``flwr run`` runs it on a
SuperLink: ``mesh-fl run APP_DIR --endpoints ... | --tags ... | --auto --run-config 'k=v'``.

1. The app: ``[tool.flwr.app.components]`` (``serverapp``, ``clientapp``) and
   ``[tool.flwr.app.config]`` from its ``pyproject.toml``, with ``--run-config`` overrides (an
   unknown key is an error, as in Flower); the ``run_config`` every ``Context`` gets.
   ``--auto`` ranks the online endpoints by what the hub's scheduler predicts for the ClientApp
   runner and takes the ``--clients`` best (:func:`select_auto`, recorded with its reasons).
2. Delivery (:mod:`fl.flower.delivery`): each endpoint is probed for the app's hash and its
   dependencies; the FAB goes only to those that lack it. Dependencies its agent's Python does
   not provide are built into an execution environment the endpoint's ClientApp runs in.
3. Warm-up: each endpoint loads the ``ClientApp`` once and builds its ``Context``; one that
   cannot (a missing module, no dataset declaration) is left out with its first error and is
   never called ready.
4. The ``ServerApp`` runs here, unchanged, with a :class:`fl.flower.grid.MeshGrid` and a real
   ``Context``; each round is recorded in the hub as an FL run (console FL page): who trained,
   who failed and why, the clients' training metrics and the federated evaluation (weighted by
   ``num-examples``), bytes of messages each way.
5. The run ends ``failed`` (and the CLI exits non-zero) when no round trained, when every client
   failed ``max_failed_rounds`` rounds in a row with the same error, or when the ServerApp raised.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from cloud_hub.client import Client
from fl.flower.delivery import PROTOCOL as DELIVERY_PROTOCOL
from fl.flower.delivery import AppError, AppInstaller, AppPackage
from fl.flower.grid import MeshGrid, RoundLog, RunFailed

__all__ = ["run_app", "FlowerRun", "RunFailed", "AppError", "rank_endpoints", "select_auto"]

log = logging.getLogger("fl.flower.run")


@dataclass
class FlowerRun:
    """What a run did: its hub record, the endpoints, the rounds the grid saw, bytes."""

    run_id: Optional[str]
    status: str
    app: Dict[str, Any]
    run_config: Dict[str, Any]
    ready: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    failed: Dict[str, str] = field(default_factory=dict)
    rounds: List[Dict[str, Any]] = field(default_factory=list)
    delivery: Dict[str, Any] = field(default_factory=dict)
    bytes_out: int = 0
    bytes_in: int = 0
    late_replies: int = 0
    error: Optional[str] = None
    time_s: float = 0.0
    selection: Optional[Dict[str, Any]] = None  # --auto: what the scheduler predicted and which were taken


    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _weighted(metrics: Mapping[str, Mapping[str, Any]]) -> Dict[str, float]:
    """Clients' metrics averaged weighted by ``num-examples`` (Flower's default key)."""
    total = sum(float(m.get("num-examples", 1) or 0) for m in metrics.values())
    if not metrics or total <= 0:
        return {}
    keys = {k for m in metrics.values() for k in m if k != "num-examples"}
    out = {}
    for k in sorted(keys):
        num = [(float(m[k]), float(m.get("num-examples", 1) or 0)) for m in metrics.values() if k in m]
        w = sum(n for _, n in num)
        if w > 0:
            out[k] = sum(v * n for v, n in num) / w
    out["num-examples"] = total
    return out


def _pick(m: Mapping[str, float], exact: str, part: str) -> Optional[float]:
    if exact in m:
        return float(m[exact])
    for k in sorted(m):
        if part in k:
            return float(m[k])
    return None


def _resolve(client: Client, endpoints: Optional[Sequence[str]], tags: Optional[Sequence[str]], auto: bool) -> Dict[str, Dict[str, Any]]:
    if sum(bool(x) for x in (endpoints, tags, auto)) != 1:
        raise ValueError("give exactly one of --endpoints, --tags or --auto")
    rows = {e["id"]: e for e in client.list_endpoints()}
    if endpoints:
        unknown = [e for e in endpoints if e not in rows and not any(r.get("name") == e for r in rows.values())]
        if unknown:
            raise ValueError(f"unknown endpoint(s): {', '.join(unknown)}")
        byname = {r.get("name"): i for i, r in rows.items()}
        ids = [e if e in rows else byname[e] for e in endpoints]
        return {i: rows[i] for i in dict.fromkeys(ids)}
    if tags:
        want = set(tags)
        out = {i: r for i, r in rows.items() if want <= set(r.get("tags") or (r.get("info") or {}).get("tags") or [])}
        if not out:
            raise ValueError(f"no endpoint carries tags {sorted(want)}")
        return out
    out = {i: r for i, r in rows.items() if r.get("online")}
    if not out:
        raise ValueError("--auto: no endpoint is online")
    return out


def rank_endpoints(predictions: Mapping[str, Mapping[str, Any]], rows: Mapping[str, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The online endpoints best first, from the scheduler's predictions for the ClientApp runner
    (``POST /v1/scheduler/predict``): by expected seconds per reply, ``predicted_s / p_online``
    (no prediction: last; no outage history: p_online 1), then by name, then by id, so equal
    predictions always rank the same way. Each row says why: ``endpoint``, ``name``, ``rank``,
    ``predicted_s``, ``p_online``, ``source`` (where the runtime came from: ``prior`` = no
    measurement of this function there yet), ``score``."""
    import math

    out = []
    for e, r in rows.items():
        p = predictions.get(e) or {}
        pred = p.get("predicted_s")
        p_on = p.get("p_online")
        p_use = 1.0 if p_on is None else max(float(p_on), 0.01)
        score = float(pred) / p_use if isinstance(pred, (int, float)) and math.isfinite(pred) else math.inf
        out.append({"endpoint": e, "name": str(r.get("name") or ""), "predicted_s": pred, "p_online": p_on,
                    "source": p.get("source"), "score": score})
    out.sort(key=lambda x: (round(x["score"], 6) if math.isfinite(x["score"]) else math.inf, x["name"], x["endpoint"]))
    for i, x in enumerate(out, 1):
        x["rank"] = i
        if not math.isfinite(x["score"]):
            x["score"] = None
    return out


def select_auto(client: Client, fid: str, online: Mapping[str, Mapping[str, Any]], clients: Optional[int]) -> Dict[str, Any]:
    """``--auto``: ask the scheduler what it predicts for the ClientApp runner on each online
    endpoint and take the ``clients`` best (default: all, still ranked). Returns the selection
    record (``policy``, ``chosen``, ``left_out``, ``ranking``, ``error`` when the scheduler could
    not be asked: then the ranking is by name and id)."""
    error = None
    try:
        pred = client.scheduler_predict(fid, sorted(online))
    except Exception as exc:  # the route refused or the hub is old: rank by name, say so
        pred, error = {}, f"{type(exc).__name__}: {exc}"[:300]
        log.warning("--auto: the scheduler could not be asked (%s); taking endpoints by name", error)
    ranking = rank_endpoints(pred, online)
    n = len(ranking) if clients is None else min(int(clients), len(ranking))
    chosen = [x["endpoint"] for x in ranking[:n]]
    rec: Dict[str, Any] = {"policy": "scheduler" if error is None else "by-name", "function_id": fid, "asked_for": clients,
                           "online": len(ranking), "chosen": chosen, "left_out": [x["endpoint"] for x in ranking[n:]],
                           "ranking": ranking}
    if error:
        rec["error"] = error

    def say(x: Mapping[str, Any]) -> str:
        pred_s = "no prediction" if x["predicted_s"] is None else f"predicted {float(x['predicted_s']):.3f}s ({x['source']})"
        p_on = "" if x["p_online"] is None else f", p_online {float(x['p_online']):.2f}"
        return f"{x['name'] or x['endpoint']} [{x['endpoint']}] {pred_s}{p_on}"

    log.info("--auto: took %d of %d online endpoint(s): %s", n, len(ranking), "; ".join(say(x) for x in ranking[:n]))
    if ranking[n:]:
        log.info("--auto: left out: %s", "; ".join(say(x) for x in ranking[n:]))
    return rec


def _gather(client: Client, pending: Dict[str, str], timeout_s: float) -> Dict[str, Any]:
    """task id -> (ok, value) for tasks back within ``timeout_s`` (bounded long polls)."""

    from cloud_hub.client._results import decode_row

    out: Dict[str, Any] = {}
    end = time.monotonic() + timeout_s
    while len(out) < len(pending) and time.monotonic() < end:
        left = [t for t in pending if t not in out]
        for row in client.wait_results(left, min(10.0, max(0.1, end - time.monotonic()))):
            try:
                out[row["task_id"]] = decode_row(row, client.trusted_endpoints)  # untrusted endpoints: data only (numpy arrays included)
            except Exception as exc:
                out[row["task_id"]] = (False, exc)
    return out


def _with_env(spec: Dict[str, Any], env: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """A task spec that runs in ``env`` (a normalized spec, docs/environments.md)."""
    if env:
        spec["environment"] = dict(env)
    return spec


def _err(value: Any) -> str:
    remote = getattr(value, "remote_type", None)
    text = f"{remote or type(value).__name__}: {getattr(value, 'remote_message', None) or value}"
    return text.strip().splitlines()[-1][:500] if text.strip() else type(value).__name__


def deliver(client: Client, pkg: AppPackage, endpoints: Sequence[str], *, timeout_s: float = 120.0) -> Dict[str, Any]:
    """Probe, then install where missing. Returns ``{"installed": [...], "already": [...],
    "failed": {endpoint: first error}, "not_back": [...], "fab_bytes_sent": n, "environments":
    {endpoint: {"pip": [...]}}}``: ``environments`` holds, per endpoint that needs one, the
    execution environment its ClientApp runs in (the app's dependencies its agent's Python does
    not provide, :func:`fl.flower.delivery.plan_dependencies`)."""
    fid = client.register_function(AppInstaller(), "flower-app-installer")
    base = {"v": DELIVERY_PROTOCOL, "sha256": pkg.sha256, "name": pkg.name, "dependencies": pkg.dependencies}
    ttl = timeout_s + 30
    probes = client.submit_batch([Client.task_spec(e, fid, ({**base, "kind": "probe"},), None, ttl_s=ttl) for e in endpoints])
    pmap = dict(zip(probes, endpoints))
    got = _gather(client, pmap, timeout_s)
    report: Dict[str, Any] = {"installed": [], "already": [], "failed": {}, "not_back": [], "fab_bytes_sent": 0,
                              "sha256": pkg.sha256, "environments": {}}

    def note_env(e: str, value: Mapping[str, Any]) -> None:
        env = value.get("environment")
        if isinstance(env, Mapping) and env.get("pip"):
            report["environments"][e] = {"pip": [str(r) for r in env["pip"]]}

    need = []
    for tid, e in pmap.items():
        if tid not in got:
            report["not_back"].append(e)
            continue
        ok, value = got[tid]
        if not ok:
            report["failed"][e] = _err(value)
        elif value.get("installed"):
            report["already"].append(e)
            note_env(e, value)
        else:
            need.append(e)
    if need:
        inst = client.submit_batch([Client.task_spec(e, fid, ({**base, "kind": "install", "fab": pkg.fab},), None, ttl_s=ttl)
                                    for e in need])
        imap = dict(zip(inst, need))
        report["fab_bytes_sent"] = len(pkg.fab) * len(need)
        got = _gather(client, imap, timeout_s)
        for tid, e in imap.items():
            if tid not in got:
                report["not_back"].append(e)
            elif not got[tid][0]:
                report["failed"][e] = _err(got[tid][1])
            else:
                report["installed"].append(e)
                note_env(e, got[tid][1])
    return report


@contextlib.contextmanager
def _app_on_path(folder: Path, ref: str):
    """Import the ServerApp from ``folder`` (modules of the same name imported before are
    dropped first, so a second run of another app version loads its own code)."""
    top = ref.partition(":")[0].split(".")[0]
    for mod in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        del sys.modules[mod]
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))


def _record_no_one_ready(client: Client, result: FlowerRun, failed: Dict[str, str]) -> None:
    """Round 1 of a run in which no endpoint passed the warm-up: skipped, each endpoint's first
    error in ``dropped``, as a native run records it."""
    import numpy as np

    from fl.federation import _json_safe
    from fl.wire import encode_weights

    rec = {"round": 1, "loss": None, "accuracy": None, "participants": [], "stragglers": [], "dropped": dict(failed),
           "round_time_s": 0.0, "extra": {"flower": True, "asked": [], "skipped": True, "reason": "every client failed its warm-up",
                                          "warmup_failed": dict(failed), "weights_note": "no model: nothing trained"}}
    try:
        client.fl_put_round(result.run_id, 1, _json_safe(rec), encode_weights([np.zeros(1, dtype=np.float32)]), {}, "running")
    except Exception as exc:  # the status below still says why
        log.warning("could not record the failed warm-up: %s", exc)
        return
    result.rounds.append(rec)


def run_app(app: "str | os.PathLike[str] | AppPackage", client: Client, *, endpoints: Optional[Sequence[str]] = None,
            tags: Optional[Sequence[str]] = None, auto: bool = False, run_config: Optional[Dict[str, Any]] = None,
            dataset: str = "flower", warmup_s: float = 120.0, max_failed_rounds: int = 2, name: Optional[str] = None,
            workdir: "str | os.PathLike[str] | None" = None, poll_s: float = 5.0,
            on_round: Optional[Any] = None, clients: Optional[int] = None) -> FlowerRun:
    """Run a Flower App on the mesh (see the module doc). Raises :class:`RunFailed` (after
    recording the run as failed) when the run produced nothing; ``AppError``/``ValueError`` for
    bad input before anything is stored. ``auto``: the ``clients`` endpoints (default: every
    online one) the scheduler predicts best for the ClientApp (:func:`select_auto`; recorded in
    ``FlowerRun.selection`` and the run record's ``config.selection``)."""
    t_start = time.monotonic()
    if clients is not None and (not auto or int(clients) < 1):
        raise ValueError("--clients N takes N >= 1, with --auto")
    pkg = app if isinstance(app, AppPackage) else AppPackage.load(app)
    rc = pkg.run_config(run_config)
    chosen = _resolve(client, endpoints, tags, auto)
    from fl.flower.clientapp import ClientAppRunner

    fid = client.register_function(ClientAppRunner(), "flower-clientapp")
    selection = None
    if auto:
        selection = select_auto(client, fid, chosen, clients)
        chosen = {e: chosen[e] for e in selection["chosen"]}
    result = FlowerRun(run_id=None, status="running", app=pkg.describe(), run_config=rc, selection=selection)
    # delivery and warm-up
    result.delivery = deliver(client, pkg, list(chosen), timeout_s=warmup_s)
    result.failed.update(result.delivery["failed"])
    result.failed.update({e: f"no answer to the app delivery within {warmup_s:.0f}s" for e in result.delivery["not_back"]
                          if e not in result.failed})
    candidates = [e for e in chosen if e in set(result.delivery["installed"]) | set(result.delivery["already"])]
    run_int = zlib.crc32(f"{pkg.sha256}:{time.time_ns()}".encode()) or 1
    appref = {"sha256": pkg.sha256, "clientapp": pkg.clientapp, "name": pkg.name}
    # the hub's run record first: its id keys the clients' durable Context.state
    rounds_planned = int(rc.get("num-server-rounds", 1) or 1) if isinstance(rc.get("num-server-rounds", 1), int) else 1
    created = client.fl_create_run(name or f"flower-{pkg.name}", strategy=f"flower-app:{pkg.name}", rounds_planned=max(1, rounds_planned),
                                   mode="sync", clients=list(chosen), client_names={e: str(r.get("name")) for e, r in chosen.items()},
                                   config={"flower_app": pkg.describe(), "run_config": rc, "dataset": dataset,
                                           "delivery": {k: v for k, v in result.delivery.items() if k != "sha256"},
                                           **({"selection": selection} if selection is not None else {})})
    result.run_id = str(created["id"])
    task = {"app": appref, "run": result.run_id, "run_id": run_int, "dataset": dataset, "run_config": rc}
    from mesh_agent.protocol.environment import normalize

    envs: Dict[str, Dict[str, Any]] = {e: normalize(dict(env)) for e, env in (result.delivery.get("environments") or {}).items()}
    for e, env in envs.items():
        log.info("endpoint %s runs the ClientApp in an environment with %s (the rest from its agent's Python)",
                 e, ", ".join(env["pip"]))
    warm = client.submit_batch([_with_env(Client.task_spec(e, fid, ({**task, "v": 1, "kind": "flower-warmup"},), None,
                                                           ttl_s=warmup_s + 30), envs.get(e))
                                for e in candidates]) if candidates else []
    wmap = dict(zip(warm, candidates))
    got = _gather(client, wmap, warmup_s)
    for tid, e in wmap.items():
        if tid not in got:
            result.failed[e] = f"no answer to the warm-up within {warmup_s:.0f}s"
        elif not got[tid][0]:
            result.failed[e] = _err(got[tid][1])
        else:
            result.ready[e] = {k: v for k, v in got[tid][1].items() if k in ("node_id", "node_config", "warmup_time_s")}
    for e, why in result.failed.items():
        log.warning("endpoint %s left out: %s", e, why)
    # where a native run writes its warm-up failures: each left-out endpoint with its first error
    # in round 1's ``dropped`` (and ``extra.warmup_failed``); with nobody ready, round 1 is a
    # skipped record saying so (fl.drivers.sync: "every client failed its warm-up")
    warm_failed = dict(result.failed)

    recorded: Dict[int, bool] = {}

    def record(rl: RoundLog, grid: MeshGrid, last: bool = False) -> None:
        if rl.round < 1 or recorded.get(rl.round):
            return
        import numpy as np

        from fl.wire import encode_weights

        train_m, eval_m = _weighted(rl.train_ok), _weighted(rl.eval_ok)
        loss = _pick(eval_m, "loss", "loss") if eval_m else _pick(train_m, "loss", "loss")
        acc = _pick(eval_m, "accuracy", "acc") if eval_m else _pick(train_m, "accuracy", "acc")
        arrays = grid.arrays_after.get(rl.round)
        weights = arrays.to_numpy_ndarrays() if arrays is not None else [np.zeros(1, dtype=np.float32)]
        not_back = [e for e in rl.asked if e not in rl.train_ok and e not in rl.train_failed]
        dropped = {**(warm_failed if rl.round == 1 else {}), **rl.train_failed}
        rec = {"round": rl.round, "loss": loss, "accuracy": acc, "participants": sorted(rl.train_ok),
               "stragglers": not_back, "dropped": dropped,
               "round_time_s": (rl.ended or time.time()) - rl.started,
               "extra": {"flower": True, "train_metrics": train_m, "client_metrics": rl.train_ok,
                         "federated_eval": {"metrics": eval_m, "clients": sorted(rl.eval_ok), "failed": rl.eval_failed} if (rl.eval_ok or rl.eval_failed) else None,
                         "bytes_out": rl.bytes_out, "bytes_in": rl.bytes_in, "asked": rl.asked,
                         "client_app_s": {"train": rl.train_app_s, "evaluate": rl.eval_app_s},
                         "skipped": not rl.train_ok, **({"reason": "no training reply"} if not rl.train_ok else {}),
                         **({} if arrays is not None else {"weights_note": "the grid saw no model after this round"}),
                         **({"warmup_failed": warm_failed} if rl.round == 1 and warm_failed else {})}}
        from fl.federation import _json_safe

        try:
            client.fl_put_round(result.run_id, rl.round, _json_safe(rec), encode_weights(weights), {},
                                "finished" if last else "running")
        except Exception as exc:  # the run goes on; its record is best effort
            log.warning("could not record round %d: %s", rl.round, exc)
        recorded[rl.round] = True
        result.rounds.append(rec)
        if on_round is not None:
            on_round(rec)

    grid_box: List[MeshGrid] = []

    def on_train_done(rl: RoundLog) -> None:
        prev = grid_box[0].rounds.get(rl.round - 1)
        if prev is not None:
            record(prev, grid_box[0])

    grid = MeshGrid(client, list(result.ready), fid=fid, task=task, run_id=run_int, poll_s=poll_s,
                    max_failed_rounds=max_failed_rounds, on_round=on_train_done,
                    environments={e: env for e, env in envs.items() if e in result.ready})
    grid_box.append(grid)
    error: Optional[str] = None
    cwd = os.getcwd()
    try:
        if not result.ready:
            first = next(iter(result.failed.values()), "no endpoint answered")
            raise RunFailed(f"no endpoint can run the app ({len(result.failed)} failed): {first}")
        from flwr.app import Context, RecordDict
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.serverapp import ServerApp
        from flwr.supercore.object_ref import load_app
        from flwr.supercore.task_identity import TaskIdentity

        with tempfile.TemporaryDirectory(prefix="mesh-flower-app-") as tmp:
            folder = pkg.extract_to(Path(tmp))
            with _app_on_path(folder, pkg.serverapp):
                try:
                    server_app = load_app(pkg.serverapp, AppError, folder)
                except AppError:
                    raise
                except Exception as exc:
                    raise AppError(f"cannot load ServerApp {pkg.serverapp!r}: {type(exc).__name__}: {exc}") from exc
                if not isinstance(server_app, ServerApp):
                    raise AppError(f"{pkg.serverapp!r} is a {type(server_app).__name__}, not a flwr.serverapp.ServerApp")
                TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_int, SUPERLINK_NODE_ID, 1
                ctx = Context(run_id=run_int, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config=dict(rc))
                if workdir is not None:
                    Path(workdir).mkdir(parents=True, exist_ok=True)
                    os.chdir(workdir)
                server_app(grid, ctx)
        if grid.trained_rounds == 0:
            why = "; ".join(f"{e}: {r}" for e, r in list(grid.last_errors.items())[:3]) or "no client was asked to train"
            raise RunFailed(f"no round trained ({why})")
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunFailed) else str(exc)
        result.status, result.error = "failed", error[:1000]
        raise
    finally:
        os.chdir(cwd)
        for r in sorted(grid.rounds):
            record(grid.rounds[r], grid, last=(error is None and r == max(grid.rounds)))
        if not result.ready and warm_failed and not recorded:
            _record_no_one_ready(client, result, warm_failed)
        result.bytes_out, result.bytes_in, result.late_replies = grid.bytes_out, grid.bytes_in, len(grid.late_replies)
        result.time_s = time.monotonic() - t_start
        if error is None:
            result.status = "finished"
        with contextlib.suppress(Exception):
            client.fl_set_status(result.run_id, result.status, error[:1000] if error else None)
    return result
