"""SecAgg+-style secure aggregation: the client steps (run on each device) and the server
session (run by the driver), as pure functions over plain state; no I/O here.

Rounds of one secure aggregation, ``tag`` naming it (run id and round):

1. **advertise** (client): two fresh X25519 key pairs, ``c`` (to encrypt shares to peers) and
   ``s`` (to agree pairwise mask seeds); the public halves go to the server.
2. **share** (client): the server sends each client its neighbours' public keys (SecAgg+: a
   sparse random graph of ``neighbors`` peers instead of everyone; ``None`` = all). The client
   draws a self-mask seed ``b``, Shamir-splits ``b`` and its ``s`` private key (PyCryptodome,
   :mod:`fl.secagg.shamir`) among its
   neighbours and itself (threshold ``t``), and encrypts each neighbour's pair of shares with
   AES-GCM under a key agreed with that neighbour's ``c`` key (HKDF-SHA256). The server only
   relays ciphertexts.
3. **masked input** (client): ``y = encode(x) + PRG(b) + sum_v sign(u, v) * PRG(s_uv)`` over
   Z_{2^bits} (32 bits; 16 or 24 with a quantizing compression, :mod:`fl.secagg.field`) for each neighbour ``v`` that took part in step 2; the server sees only ``y``.
4. **unmask** (client): told who sent ``y`` (survivors) and who dropped after step 2, a client
   reveals its share of ``b_u`` for each survivor and of ``s_u``'s private key for each dropped
   neighbour, never both for the same peer (that would unmask an individual input). The server
   removes survivors' self-masks and the dropped clients' pairwise masks, and keeps the sum.

Threat model (as in SecAgg's honest-but-curious setting): the driver and the hub follow the
protocol but may read everything they relay; they learn only the sum of at least ``t``
clients' inputs. Keys are fresh per aggregation and live only in the device's state. Not
covered: a malicious server that lies about who dropped to different clients (SecAgg's
consistency-check round with signatures) and Sybil clients.
"""

from __future__ import annotations

import json
import os
import random
import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import shamir
from .field import field_mask, pack, prg, unpack

__all__ = [
    "SecAggConfig", "SecAggError", "SecAggAbort", "ServerSession",
    "client_advertise", "client_share", "client_mask", "client_unmask", "neighbor_graph",
]


class SecAggError(ValueError):
    """A protocol message is malformed or inconsistent (a client refuses to go on)."""


class SecAggAbort(RuntimeError):
    """Too few clients are left to finish the aggregation safely: the round must be skipped.

    Never a partial or wrong sum: the server cannot unmask without ``threshold`` answers."""


@dataclass(frozen=True)
class SecAggConfig:
    """``threshold``: shares needed to rebuild a secret, so at most ``holders - threshold``
    clients may drop after masking (holders = neighbours + self). ``neighbors``: SecAgg+
    graph degree (None: every client shares with every other). ``quant_range``: with a q8/fp16
    ``compression``, the per-coordinate range ``[-r, r]`` of the shared quantization grid (None:
    the driver adapts it each round, :mod:`fl.drivers.features`)."""

    threshold: int
    neighbors: Optional[int] = None
    quant_range: Optional[float] = None

    def __post_init__(self) -> None:
        if self.quant_range is not None and (isinstance(self.quant_range, bool) or not isinstance(self.quant_range, (int, float))
                                             or not (0 < float(self.quant_range) < float("inf"))):
            raise ValueError(f"quant_range must be a positive finite number, not {self.quant_range!r}")
        if self.threshold < 2:
            raise ValueError("threshold must be >= 2 (one share would reveal the secret)")
        if self.neighbors is not None and self.neighbors < self.threshold - 1:
            raise ValueError(f"neighbors ({self.neighbors}) must be >= threshold - 1 ({self.threshold - 1})")


# ---------------------------------------------------------------- primitives (all from cryptography)
def _raw_pub(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_priv(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _agree(priv: bytes, pub: bytes, info: bytes) -> bytes:
    shared = X25519PrivateKey.from_private_bytes(priv).exchange(X25519PublicKey.from_public_bytes(pub))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _pair_info(kind: str, tag: str, a: str, b: str) -> bytes:
    lo, hi = sorted((a, b))
    return f"continuum-secagg/{kind}/{tag}/{lo}/{hi}".encode()


def _self_seed(b: bytes, tag: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"continuum-secagg/self/{tag}".encode()).derive(b)


def neighbor_graph(clients: Sequence[str], degree: Optional[int], seed: bytes) -> Dict[str, List[str]]:
    """SecAgg+ communication graph: a ring over a seeded shuffle, each client joined to
    ``degree`` others (half on each side); complete when ``degree`` is None or >= n - 1.

    Deterministic from ``seed`` so the server can state it and every client can check it."""
    ids = sorted(clients)
    n = len(ids)
    if degree is None or degree >= n - 1:
        return {c: [v for v in ids if v != c] for c in ids}
    order = ids[:]
    random.Random(seed).shuffle(order)
    pos = {c: i for i, c in enumerate(order)}
    out: Dict[str, Set[str]] = {c: set() for c in ids}
    half_lo, half_hi = degree // 2, degree - degree // 2
    for c in ids:
        i = pos[c]
        for d in range(1, half_hi + 1):
            out[c].add(order[(i + d) % n])
        for d in range(1, half_lo + 1):
            out[c].add(order[(i - d) % n])
    for c in ids:  # make it symmetric
        for v in out[c]:
            out[v].add(c)
    return {c: sorted(vs) for c, vs in out.items()}


# ---------------------------------------------------------------- client side (on the device)
def client_advertise(tag: str, me: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Step 1. Returns (message to the server, private state to keep on the device)."""
    c, s = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    msg = {"client": me, "c_pk": _raw_pub(c), "s_pk": _raw_pub(s)}
    return msg, {"tag": tag, "me": me, "c_sk": _raw_priv(c), "s_sk": _raw_priv(s), "stage": "advertised", **msg}


def client_share(state: Dict[str, Any], msg: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Step 2. ``msg``: ``{"tag", "threshold", "keys": {peer: {"c_pk", "s_pk"}}, "index": {peer: x}}``
    for this client's neighbours and itself. Returns (ciphertexts per holder, new state)."""
    me = state["me"]
    if state.get("stage") != "advertised" or msg.get("tag") != state["tag"]:
        raise SecAggError(f"share step for {msg.get('tag')!r} does not follow this device's advertise step")
    keys = {str(k): dict(v) for k, v in dict(msg["keys"]).items()}
    index = {str(k): int(v) for k, v in dict(msg["index"]).items()}
    t = int(msg["threshold"])
    mine = keys.get(me)
    if mine is None or mine["c_pk"] != state["c_pk"] or mine["s_pk"] != state["s_pk"]:
        raise SecAggError("the server relayed other public keys for this client than it advertised")
    if set(keys) != set(index) or len(set(index.values())) != len(index):
        raise SecAggError("keys and share indices do not name the same distinct peers")
    if not 2 <= t <= len(keys):
        raise SecAggError(f"threshold {t} does not fit {len(keys)} share holders")
    b = secrets.token_bytes(32)
    pos = shamir.positions(keys)  # share points 1..n: this client's holders in sorted order
    b_sh = shamir.split(b, len(pos), t)
    sk_sh = shamir.split(state["s_sk"], len(pos), t)
    out: Dict[str, bytes] = {}
    for peer in sorted(keys):
        key = _agree(state["c_sk"], keys[peer]["c_pk"], _pair_info("enc", state["tag"], me, peer))
        plain = json.dumps({"from": me, "to": peer, "x": pos[peer], "b": b_sh[pos[peer]].hex(),
                            "sk": sk_sh[pos[peer]].hex()}).encode()
        nonce = os.urandom(12)
        out[peer] = nonce + AESGCM(key).encrypt(nonce, plain, f"{state['tag']}|{me}|{peer}".encode())
    new = {**state, "stage": "shared", "b": b, "t": t, "peers": keys, "index": index}
    return {"client": me, "shares": out}, new


def client_mask(state: Dict[str, Any], encoded: np.ndarray, inbox: Mapping[str, bytes],
                shared: Sequence[str], bits: int = 32) -> Tuple[bytes, Dict[str, Any]]:
    """Step 3. ``encoded``: this client's input already in the field Z_{2^bits} (uint32);
    ``inbox``: the ciphertexts other clients addressed to it (kept for step 4); ``shared``: the
    clients that finished step 2. Returns (masked vector, ``bits/8`` little-endian bytes per
    element, and the new state)."""
    me, tag = state["me"], state["tag"]
    if state.get("stage") != "shared":
        raise SecAggError("masking step does not follow this device's share step")
    live = [p for p in shared if p in state["peers"] and p != me]
    if me not in shared:
        raise SecAggError("the server says this client did not share its keys")
    mask = field_mask(bits)
    x = np.asarray(encoded, dtype=np.uint32)
    if np.any(x > mask):
        raise SecAggError(f"encoded input does not lie in the {bits}-bit field")
    y = x + prg(_self_seed(state["b"], tag), len(x))
    for p in live:
        seed = _agree(state["s_sk"], state["peers"][p]["s_pk"], _pair_info("mask", tag, me, p))
        m = prg(seed, len(x))
        y = y + m if me < p else y - m
    kept = {str(k): bytes(v) for k, v in inbox.items() if str(k) in state["peers"]}
    return pack(y & mask, bits), {**state, "stage": "masked", "inbox": kept, "live": list(live), "dim": len(x)}


def client_unmask(state: Dict[str, Any], survivors: Sequence[str], dropped: Sequence[str]) -> Dict[str, Any]:
    """Step 4: reveal ``b`` shares of survivors and private-key shares of dropped peers."""
    me, tag = state["me"], state["tag"]
    if state.get("stage") != "masked":
        raise SecAggError("unmasking step does not follow this device's masking step")
    surv, drop = set(survivors), set(dropped)
    if surv & drop:
        raise SecAggError("the server names clients both as survivors and as dropped: refusing to unmask")
    if len(surv) < int(state["t"]):
        raise SecAggError(f"only {len(surv)} survivors, fewer than the threshold {state['t']}: refusing to unmask")
    if me not in surv:
        raise SecAggError("the server says this client dropped")
    b_shares: Dict[str, str] = {}
    sk_shares: Dict[str, str] = {}
    for sender, ct in state.get("inbox", {}).items():
        if sender not in surv and sender not in drop:
            continue
        key = _agree(state["c_sk"], state["peers"][sender]["c_pk"], _pair_info("enc", tag, sender, me))
        try:
            plain = json.loads(AESGCM(key).decrypt(ct[:12], ct[12:], f"{tag}|{sender}|{me}".encode()))
        except (InvalidTag, ValueError) as exc:
            raise SecAggError(f"share from {sender} does not decrypt: {type(exc).__name__}") from None
        if plain.get("from") != sender or plain.get("to") != me:
            raise SecAggError(f"share from {sender} names other parties")
        if sender in surv:
            b_shares[sender] = plain["b"]
        else:
            sk_shares[sender] = plain["sk"]
    return {"client": me, "x": int(state["index"][me]), "b": b_shares, "sk": sk_shares}


# ---------------------------------------------------------------- server side (the driver)
@dataclass
class ServerSession:
    """Driver side of one secure aggregation; it holds only public keys, relayed ciphertexts,
    masked vectors and the revealed shares it needs."""

    tag: str
    config: SecAggConfig
    graph_seed: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    keys: Dict[str, Dict[str, bytes]] = field(default_factory=dict)
    graph: Dict[str, List[str]] = field(default_factory=dict)
    index: Dict[str, int] = field(default_factory=dict)
    shared: List[str] = field(default_factory=list)
    masked: Dict[str, np.ndarray] = field(default_factory=dict)
    dim: Optional[int] = None
    #: the field of the masked vectors: Z_{2^bits} (set before the masked inputs arrive)
    bits: int = 32

    def _need(self, have: int, stage: str) -> None:
        if have < self.config.threshold:
            raise SecAggAbort(f"secure aggregation {self.tag}: {have} client(s) left after {stage}, "
                              f"{self.config.threshold} needed; round skipped")

    def share_requests(self, adverts: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """After step 1: what each advertising client gets for step 2."""
        for a in adverts:
            c = str(a["client"])
            if len(a["c_pk"]) != 32 or len(a["s_pk"]) != 32 or c in self.keys:
                raise SecAggError(f"bad or duplicate advertisement from {c!r}")
            self.keys[c] = {"c_pk": bytes(a["c_pk"]), "s_pk": bytes(a["s_pk"])}
        self._need(len(self.keys), "advertising keys")
        ids = sorted(self.keys)
        self.index = {c: i + 1 for i, c in enumerate(ids)}
        self.graph = neighbor_graph(ids, self.config.neighbors, self.graph_seed)
        holders_min = min(len(v) + 1 for v in self.graph.values())
        if holders_min < self.config.threshold:
            raise SecAggAbort(f"secure aggregation {self.tag}: a client has {holders_min} share holders, "
                              f"threshold {self.config.threshold}; round skipped")
        out = {}
        for c in ids:
            group = self.graph[c] + [c]
            out[c] = {"tag": self.tag, "threshold": self.config.threshold,
                      "keys": {p: self.keys[p] for p in group}, "index": {p: self.index[p] for p in group}}
        return out

    def mask_requests(self, shares: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """After step 2: each client's inbox of ciphertexts and the list of who shared."""
        got = {str(s["client"]): dict(s["shares"]) for s in shares if str(s["client"]) in self.keys}
        self.shared = sorted(got)
        self._need(len(self.shared), "sharing keys")
        inbox: Dict[str, Dict[str, bytes]] = {c: {} for c in self.shared}
        for sender, cts in got.items():
            for holder, ct in cts.items():
                if holder in inbox and (holder == sender or holder in self.graph.get(sender, [])):
                    inbox[holder][sender] = bytes(ct)
        return {c: {"tag": self.tag, "inbox": inbox[c], "shared": self.shared} for c in self.shared}

    def add_masked(self, client: str, y: bytes) -> None:
        """Step 3 answer: one masked vector."""
        if client not in self.shared:
            raise SecAggError(f"masked input from {client!r}, which did not share keys")
        try:
            v = unpack(bytes(y), self.bits)
        except ValueError as exc:
            raise SecAggError(f"masked input from {client!r}: {exc}") from None
        if self.dim is None:
            self.dim = len(v)
        if len(v) != self.dim:
            raise SecAggError(f"masked input from {client!r} has {len(v)} values, expected {self.dim}")
        self.masked[client] = v

    def unmask_requests(self) -> Dict[str, Dict[str, Any]]:
        """Step 4 requests: survivors and dropped, the same list to everyone."""
        self._need(len(self.masked), "masked input")
        surv = sorted(self.masked)
        dropped = [c for c in self.shared if c not in self.masked]
        return {c: {"tag": self.tag, "survivors": surv, "dropped": dropped} for c in surv}

    def finish(self, reveals: Sequence[Mapping[str, Any]]) -> Tuple[np.ndarray, List[str]]:
        """The unmasked sum (uint32 elements of Z_{2^bits}) of the survivors' inputs, and who they are.

        Raises :class:`SecAggAbort` when a secret lacks ``threshold`` shares."""
        assert self.dim is not None
        surv = sorted(self.masked)
        dropped = [c for c in self.shared if c not in self.masked]
        b_sh: Dict[str, Dict[int, bytes]] = {c: {} for c in surv}
        sk_sh: Dict[str, Dict[int, bytes]] = {c: {} for c in dropped}
        for r in reveals:
            holder = str(r["client"])
            if holder not in self.masked:
                continue
            # the holder's share point for each owner: its place among the owner's holders
            for owner, hx in dict(r.get("b") or {}).items():
                if owner in b_sh and holder in self.graph[owner] + [owner]:
                    b_sh[owner][shamir.positions(self.graph[owner] + [owner])[holder]] = bytes.fromhex(hx)
            for owner, hx in dict(r.get("sk") or {}).items():
                if owner in sk_sh and holder in self.graph[owner]:
                    sk_sh[owner][shamir.positions(self.graph[owner] + [owner])[holder]] = bytes.fromhex(hx)
        t = self.config.threshold
        short = [c for c, s in list(b_sh.items()) + list(sk_sh.items()) if len(s) < t]
        if short:
            raise SecAggAbort(f"secure aggregation {self.tag}: too few unmasking answers to rebuild the secrets "
                              f"of {len(short)} client(s) (threshold {t}); round skipped")
        total = np.zeros(self.dim, dtype=np.uint32)
        for c in surv:
            total += self.masked[c]
            total -= prg(_self_seed(shamir.combine(b_sh[c], t), self.tag), self.dim)
        for v in dropped:
            sk = shamir.combine(sk_sh[v], t)
            for w in self.graph[v]:
                if w in self.masked:
                    seed = _agree(sk, self.keys[w]["s_pk"], _pair_info("mask", self.tag, v, w))
                    m = prg(seed, self.dim)
                    total = total - m if w < v else total + m  # w added +m if w < v; undo it
        return total & field_mask(self.bits), surv
