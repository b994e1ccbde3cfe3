"""Secure aggregation on the mesh: the device steps as a client app, and the driver's four
rounds over any ``ask`` function (the round driver supplies it: submit one task per client
through the hub, wait until the deadline, return what came back).

Device side (:class:`SecureClientApp`, wraps any :class:`fl.client.ClientApp`): task
``{"v": 1, "kind": "secagg", "stage": "advertise"|"share"|"train"|"unmask", "tag", "client_id", ...}``.
The private keys, the self-mask seed and the shares addressed to this device are kept in the
device's state directory (``$MESH_ENDPOINT_DATA_DIR/fl-secagg``, files 0600, written atomically),
so a worker that restarts between steps still finishes the protocol; they are deleted after
unmasking. The ``train`` step trains with the inner app, turns the result into a *delta* from
the global model, clips it (L2, ``clip_norm``: the server cannot clip what it cannot see),
optionally adds local DP noise, multiplies by the client's weight (``min(n, weight_cap) /
weight_cap``, appended as one more coordinate so the server can divide), encodes it into the
field and masks it. With a quantizing uplink compression in the train task (``uplink``: q8 or
fp16), the encoding is that quantization on the grid the driver names (``secagg.quant``:
:class:`fl.secagg.field.QuantCodec`), in a 16- or 24-bit field, so the masked vector is 2 or 3
bytes a coordinate instead of 4; top-k is refused (a masked vector is dense, or it would show
which coordinates the client sent).

Driver side (:func:`secure_round`): advertise -> share -> train+mask -> unmask, each a mesh
task per client; the hub only relays public keys, AES-GCM ciphertexts, masked vectors and
shares. The result is the mean delta of the survivors, or :class:`SecAggAbort` (round skipped).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from fl.client import PROTOCOL, ClientApp, TaskError, client_seed
from fl.sites import task_weights_blob
from fl.wire import decode_weights

from .field import FieldCodec, QuantCodec, flatten, unflatten
from .protocol import (SecAggAbort, SecAggConfig, SecAggError, ServerSession, client_advertise, client_mask,
                       client_share, client_unmask)

__all__ = ["SecureClientApp", "StateStore", "SecureRoundResult", "secure_round", "Ask"]

ENV_DATA_DIR = "MESH_ENDPOINT_DATA_DIR"


# ---------------------------------------------------------------- device state
def _enc(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"$b": bytes(v).hex()}
    if isinstance(v, dict):
        return {k: _enc(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_enc(x) for x in v]
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$b"}:
            return bytes.fromhex(v["$b"])
        return {k: _dec(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


class StateStore:
    """Per-aggregation device state in files under ``root`` (mode 0600, atomic replace).

    Why files and not the worker's memory: a worker may be recycled between the four steps,
    and the key material must never leave the device."""

    def __init__(self, root: "str | Path | None" = None) -> None:
        if root is None:
            base = os.environ.get(ENV_DATA_DIR)
            if not base:
                raise TaskError("secure aggregation needs the endpoint's data directory ($MESH_ENDPOINT_DATA_DIR); "
                                "this worker was not started by a mesh agent")
            root = Path(base) / "fl-secagg"
        self.root = Path(root)

    def _path(self, tag: str, me: str) -> Path:
        return self.root / (hashlib.sha256(f"{tag}|{me}".encode()).hexdigest()[:32] + ".json")

    def put(self, tag: str, me: str, state: Mapping[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(_enc(dict(state)), fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._path(tag, me))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, tag: str, me: str) -> Dict[str, Any]:
        p = self._path(tag, me)
        if not p.exists():
            raise SecAggError(f"no secure-aggregation state for {tag!r} on this device (earlier step missing or expired)")
        return _dec(json.loads(p.read_text()))

    def delete(self, tag: str, me: str) -> None:
        self._path(tag, me).unlink(missing_ok=True)

    def prune(self, max_age_s: float = 86400.0) -> int:
        """Remove state of aggregations abandoned long ago (the driver skipped the round)."""
        n = 0
        if self.root.is_dir():
            for p in self.root.glob("*.json"):
                if time.time() - p.stat().st_mtime > max_age_s:
                    p.unlink(missing_ok=True)
                    n += 1
        return n


# ---------------------------------------------------------------- device side
def quant_code_bits(uplink: Any) -> Optional[int]:
    """The code width a train task's ``uplink`` compression spec asks of a secure update: 8
    (q8), 16 (fp16) or None (no compression). Top-k is refused: a masked vector is dense."""
    if uplink is None:
        return None
    from fl.compression import FP16, Q8, CompressionError, from_spec

    try:
        comp = from_spec(uplink)
    except CompressionError as exc:
        raise TaskError(str(exc)) from None
    if comp.sparsify is not None:
        raise TaskError(f"secure aggregation cannot send a sparse update ({comp.describe()}): the masked vector "
                        "would show which coordinates the client kept; use compression='q8' or 'fp16'")
    return 8 if isinstance(comp.quantize, Q8) else 16 if isinstance(comp.quantize, FP16) else None


def make_codec(sa: Mapping[str, Any], code_bits: Optional[int]) -> "FieldCodec | QuantCodec":
    """The field encoding of a secure train task: 32-bit fixed point, or (``sa["quant"]`` set)
    the shared quantization grid of the run's compression."""
    q = sa.get("quant")
    if q is None:
        return FieldCodec(float(sa["field_clip"]), int(sa["max_clients"]))
    if code_bits is None or int(q.get("code_bits", -1)) != code_bits:
        raise TaskError(f"secure train task asks for {q.get('code_bits')}-bit quantization, its uplink spec for {code_bits}")
    return QuantCodec(code_bits, float(q["range"]), int(sa["max_clients"]))


def encode_delta(delta: np.ndarray, num_samples: int, *, clip_norm: float, weight_cap: int, codec: "FieldCodec | QuantCodec",
                 rng: np.random.Generator, noise_std: float = 0.0) -> Tuple[np.ndarray, float]:
    """Clip the delta to L2 ``clip_norm``, add local noise, weight it, append the weight,
    encode into the field. Returns (field vector, the delta's norm before clipping)."""
    from fl.privacy import clip_by_norm

    clipped, norm = clip_by_norm(delta, clip_norm)
    if noise_std > 0:
        clipped = clipped + rng.normal(0.0, noise_std, clipped.shape)
    w = min(int(num_samples), weight_cap) / float(weight_cap)
    return codec.encode(np.concatenate([clipped * w, [w]]), rng), norm


class SecureClientApp(ClientApp):
    """Runs an inner client app inside the SecAgg+ steps (see the module docstring)."""

    name = "secagg"

    def __init__(self, inner: ClientApp, state_dir: "str | Path | None" = None) -> None:
        self.inner = inner
        self.state_dir = None if state_dir is None else str(state_dir)

    @property
    def loads_data(self) -> bool:  # type: ignore[override]
        return self.inner.loads_data

    def _store(self) -> StateStore:
        return StateStore(self.state_dir)

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        if not (isinstance(task, dict) and task.get("kind") == "secagg"):
            return self.inner(task)  # warm-ups
        if task.get("v") != PROTOCOL:
            raise TaskError(f"expected an fl secagg task of protocol v{PROTOCOL}")
        from fl import datasets as _datasets

        me, tag, stage = str(task["client_id"]), str(task["tag"]), task.get("stage")
        here = _datasets.endpoint_id()
        if here is not None and here != me:
            raise TaskError(f"task for client {me!r} arrived at endpoint {here!r}")
        store = self._store()
        base = {"v": PROTOCOL, "kind": "secagg", "stage": stage, "client_id": me, "tag": tag}
        if stage == "advertise":
            store.prune()
            msg, state = client_advertise(tag, me)
            store.put(tag, me, state)
            return {**base, "msg": msg}
        if stage == "share":
            msg, state = client_share(store.get(tag, me), task["request"])
            store.put(tag, me, state)
            return {**base, "msg": msg}
        if stage == "train":
            return {**base, **self._train(store, me, tag, task)}
        if stage == "unmask":
            out = client_unmask(store.get(tag, me), task["survivors"], task["dropped"])
            store.delete(tag, me)  # keys are single-use: gone once the shares are out
            return {**base, "msg": out}
        raise TaskError(f"unknown secagg stage {stage!r}")

    def _train(self, store: StateStore, me: str, tag: str, task: Dict[str, Any]) -> Dict[str, Any]:
        state = store.get(tag, me)  # fail before training if the earlier steps are missing
        t0 = time.perf_counter()
        tt = task["train"]
        weights = decode_weights(task_weights_blob(tt))  # inline, or by key from the site's store (fl.sites)
        data = self.inner._load(tt)
        cfg = dict(tt.get("config") or {})
        cfg.setdefault("round", tt["round"])
        cfg["dataset"] = tt["dataset"]
        seed = client_seed(int(cfg.get("seed", 0)), int(tt["round"]), me)
        cfg["seed"] = seed
        t_fit = time.perf_counter()
        new, n, metrics, device = self.inner.fit(weights, data, cfg)
        train_time = time.perf_counter() - t_fit
        g, _ = flatten(weights)
        l, _ = flatten(new)
        sa = task["secagg"]
        try:
            codec = make_codec(sa, quant_code_bits(tt.get("uplink")))
        except ValueError as exc:
            raise TaskError(f"bad secure-aggregation settings: {exc}") from None
        rng = np.random.default_rng(seed)
        enc, norm = encode_delta(l - g, n, clip_norm=float(sa["clip_norm"]), weight_cap=int(sa["weight_cap"]),
                                 codec=codec, rng=rng, noise_std=float(sa.get("local_noise_std", 0.0)))
        y, state = client_mask(state, enc, task["request"]["inbox"], task["request"]["shared"], codec.field_bits)
        store.put(tag, me, state)
        return {"y": y, "num_samples": int(n), "metrics": {k: float(v) for k, v in (metrics or {}).items()
                                                            if isinstance(v, (int, float))},
                "update_norm": float(norm), "train_time_s": train_time, "task_time_s": time.perf_counter() - t0,
                "device": device}

    def prepare(self, data: Any) -> str:
        return self.inner.prepare(data)

    def _warmup(self, task: Dict[str, Any]) -> Dict[str, Any]:
        return self.inner._warmup(task)

    def initial_weights(self):  # type: ignore[override]
        return self.inner.initial_weights()

    def evaluate(self, weights, data):  # type: ignore[override]
        return self.inner.evaluate(weights, data)

    def describe(self) -> Dict[str, Any]:
        return {**self.inner.describe(), "secure_aggregation": True}


# ---------------------------------------------------------------- driver side
#: ``ask(stage, {client: task}) -> {client: result}``: one mesh task per client, results that
#: came back by the stage's deadline (failed or missing clients are simply absent).
Ask = Callable[[str, Dict[str, Dict[str, Any]]], Dict[str, Any]]


@dataclass
class SecureRoundResult:
    weights: Optional[List[np.ndarray]]
    survivors: List[str]
    dropped_after_masking: List[str]
    not_back: Dict[str, str]
    infos: Dict[str, Dict[str, Any]]
    reason: Optional[str] = None
    stages_s: Optional[Dict[str, float]] = None
    #: bytes of model data per client: the masked vector up, the global weights down
    bytes_up: Dict[str, int] = field(default_factory=dict)
    bytes_down: Dict[str, int] = field(default_factory=dict)
    #: protocol bytes besides the model (keys, encrypted shares, revealed shares), all clients
    overhead_bytes: Dict[str, int] = field(default_factory=dict)
    #: the field of the masked vectors (32; 16/24 with a quantizing compression) and the grid's range
    field_bits: int = 32
    quant_range: Optional[float] = None


def _nbytes(obj: Any) -> int:
    """Rough payload size of a protocol message: its bytes and strings (keys, ciphertexts, hex shares)."""
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(_nbytes(k) + _nbytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 8 if isinstance(obj, (int, float)) else 0


def secure_round(ask: Ask, tag: str, clients: Sequence[str], current: Sequence[np.ndarray],
                 train_task: Callable[[str], Dict[str, Any]], *, config: SecAggConfig, clip_norm: float,
                 field_clip: Optional[float] = None, weight_cap: int = 1000, max_clients: int = 1000,
                 local_noise_std: float = 0.0, central_noise_std: float = 0.0,
                 rng: Optional[np.random.Generator] = None, quant_range: Optional[float] = None) -> SecureRoundResult:
    """One securely aggregated round. ``train_task(client)`` is the ordinary train task body.

    ``quant_range``: with a quantizing ``uplink`` compression in the train tasks (q8, fp16), the
    per-coordinate range of the shared grid (:class:`QuantCodec`); None keeps the 32-bit
    fixed-point field. Returns the new global weights (current + mean survivor delta, plus
    central noise), or ``weights=None`` with the reason when too few clients remain (never a
    partial sum)."""
    rng = rng or np.random.default_rng()
    field_clip = float(field_clip if field_clip is not None else max(clip_norm, 1.0) * 4)
    srv = ServerSession(tag, config)
    codec: "FieldCodec | QuantCodec" = FieldCodec(field_clip, max_clients)
    quant: Optional[Dict[str, Any]] = None
    if quant_range is not None:
        bits = quant_code_bits((train_task(clients[0]) if clients else {}).get("uplink")) if clients else None
        if bits is None:
            raise ValueError("quant_range needs train tasks with a q8 or fp16 uplink compression")
        codec = QuantCodec(bits, float(quant_range), max_clients)
        quant = {"code_bits": bits, "range": float(quant_range)}
    srv.bits = codec.field_bits
    overhead = {"up": 0, "down": 0}
    bytes_up: Dict[str, int] = {}
    bytes_down: Dict[str, int] = {}
    base = {"v": PROTOCOL, "kind": "secagg", "tag": tag}
    not_back: Dict[str, str] = {}
    times: Dict[str, float] = {}

    def stage(name: str, reqs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
        t0 = time.monotonic()
        got = ask(name, {c: {**base, "stage": name, "client_id": c, **r} for c, r in reqs.items()})
        times[name] = round(time.monotonic() - t0, 3)
        ok = {}
        for c in reqs:
            v = got.get(c)
            if isinstance(v, dict) and v.get("kind") == "secagg" and v.get("stage") == name and v.get("client_id") == c:
                ok[c] = v
                if name == "train":
                    bytes_up[c] = len(v.get("y") or b"")
                else:
                    overhead["up"] += _nbytes(v.get("msg"))
            else:
                not_back.setdefault(c, f"{name}: {v if isinstance(v, str) else 'no answer by the deadline'}")
        return ok

    survivors: List[str] = []
    dropped: List[str] = []
    infos: Dict[str, Dict[str, Any]] = {}
    try:
        adv = stage("advertise", {c: {} for c in clients})
        share_req = srv.share_requests([a["msg"] for a in adv.values()])
        overhead["down"] += _nbytes(share_req)
        shr = stage("share", {c: {"request": r} for c, r in share_req.items()})
        mask_req = srv.mask_requests([s["msg"] for s in shr.values()])
        overhead["down"] += _nbytes(mask_req)
        sa: Dict[str, Any] = {"clip_norm": clip_norm, "field_clip": field_clip, "weight_cap": weight_cap,
                              "max_clients": max_clients, "local_noise_std": local_noise_std}
        if quant is not None:
            sa["quant"] = quant
        train_reqs = {c: {"request": r, "train": train_task(c), "secagg": sa} for c, r in mask_req.items()}
        for c, r in train_reqs.items():
            w = r["train"].get("weights")
            if isinstance(w, (bytes, bytearray)):
                bytes_down[c] = len(w)
        tr = stage("train", train_reqs)
        for c, v in tr.items():
            try:
                srv.add_masked(c, v["y"])
            except SecAggError as exc:
                not_back[c] = f"train: {exc}"
                continue
            infos[c] = {k: v[k] for k in ("num_samples", "metrics", "update_norm", "train_time_s", "device") if k in v}
        unmask_req = srv.unmask_requests()
        survivors = sorted(srv.masked)
        dropped = [c for c in srv.shared if c not in srv.masked]
        overhead["down"] += _nbytes(unmask_req)
        rev = stage("unmask", unmask_req)
        total, survivors = srv.finish([r["msg"] for r in rev.values()])
    except SecAggAbort as exc:
        return SecureRoundResult(None, [], dropped, not_back, infos, str(exc), times, bytes_up, bytes_down, overhead,
                                 codec.field_bits, quant_range)
    s = codec.decode(total, len(survivors))
    wsum = s[-1]
    if not wsum > 0:
        return SecureRoundResult(None, [], dropped, not_back, infos, "secure sum has no weight", times, bytes_up,
                                 bytes_down, overhead, codec.field_bits, quant_range)
    g, spec = flatten(current)
    noise = rng.normal(0.0, central_noise_std, len(g)) if central_noise_std > 0 else 0.0
    # central DP: noise on the sum of clipped, weighted deltas, before the division
    mean_delta = (s[:-1] + noise) / wsum
    return SecureRoundResult(unflatten(g + mean_delta, spec), survivors, dropped, not_back, infos, None, times,
                             bytes_up, bytes_down, overhead, codec.field_bits, quant_range)
