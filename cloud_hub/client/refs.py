"""Intermediate data by reference (Pocket-style): ``put`` a value into a data store, pass the
small ``MeshRef`` to later tasks, and the agent's worker fetches the value itself.

    from cloud_hub.client import refs
    store = refs.Store()                       # MESH_REDIS_URL, else the hub's embedded store
    parts = ex.map(map_words, chunks, [store] * n)   # each task: return store.put(counts)
    total = ex.submit(reduce_counts, list(parts))    # refs in, resolved on the agent
    print(refs.get(total.result()))            # only here do the bytes reach this program

Why a ref: without it every byte between two stages goes agent -> hub -> SDK -> hub -> agent.
With it, only a ~150-byte ref travels through the hub and this program.

Tiers (``put(..., tier=)``, docs/data.md):

* ``local``: the producing agent's own store (memory plus refs.sqlite3 in its data directory).
  A consumer on the same endpoint reads it there: no link crossed. A consumer elsewhere (or
  ``refs.get`` in the program) has it staged through the shared store by the producing
  endpoint (the stager of mesh_agent.refstore; the keys: mesh_agent.protocol.refs). Survives the
  agent's restart.
* ``shared``: the shared store, reached by every endpoint: a Redis (``MESH_REDIS_URL``) or, when
  none is configured, the hub's embedded store (``GET /v1/kv``).
* ``auto`` (default): ``local`` in a task on an agent, ``shared`` in the program.

A ref carries the SHA-256 of its bytes (``meta["sha256"]``). A device behind a site gateway
(docs/sites.md) reads it from its site's LAN store first, and leaves a copy there after fetching
it (from the shared store, or staged from the endpoint that holds a local ref): the bytes cross
the site's uplink once, not once per device. The digest
is in the ref, inside the hub-signed task, and every read is checked against it, so neither the
gateway nor the shared store can hand a task other bytes.

A ``Future`` of the Executor may also be an argument of a later task (:class:`TaskOutput`): the
consumer's agent reads the producer's result from the hub, not through this program.

Each ref has a TTL (``ttl_s``, default 1 h, at most 7 days) and a size limit (``max_bytes``,
default 64 MiB, ``MESH_REF_MAX_BYTES``). A missing or expired ref is a ``RefError`` naming the
task that produced it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mesh_agent import refstore
from mesh_agent.protocol.refs import READY, STAGE_LOST, STAGED, new_ref_key, owner_of, stage_list

__all__ = ["MeshRef", "RefError", "Store", "TaskOutput", "TIERS", "put", "get", "delete", "resolve"]

MAX_TTL_S = 7 * 86400.0
DEFAULT_TTL_S = 3600.0
TIERS = ("auto", "local", "shared")


class RefError(LookupError):
    """A ref whose data is gone (expired, deleted, or the store was flushed)."""


def _max_bytes() -> int:
    return int(os.environ.get("MESH_REF_MAX_BYTES", str(64 << 20)))


def _producer() -> str:
    """Which task is putting: the agent's worker records the running task id; elsewhere, the host."""
    w = sys.modules.get("mesh_agent.engine._worker")
    task = getattr(w, "CURRENT_TASK_ID", None) if w is not None else None
    return f"task {task}" if task else f"program {socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class MeshRef:
    """A reference to a value in the data store: small, picklable, safe to pass to any task."""

    key: str
    url: str
    size: int
    producer: str
    expires: float
    tier: str = "shared"  # "local": meta["endpoint"] holds it (docs/data.md, "Tiers")
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def get(self) -> Any:
        return Store(self.url).get(self)

    def __repr__(self) -> str:
        return f"MeshRef({self.key}, {self.size} B, from {self.producer}, tier={self.tier})"


class Store:
    """The store refs live in (a Redis URL), passed by the program to the tasks that ``put``."""

    def __init__(self, url: str | None = None) -> None:
        if url is None:
            from cloud_hub.client.multiprocessing._state import redis_url

            url = redis_url()
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        return (Store, (self.url,))

    def _r(self) -> Any:
        return refstore.connection(self.url)

    def put(self, value: Any, ttl_s: float = DEFAULT_TTL_S, max_bytes: int | None = None, tier: str = "auto") -> MeshRef:
        """Store ``value``; returns its ref. Refused (nothing stored) past the size limit, with
        a TTL outside (0, 7 days], or an unknown tier. ``tier``: ``auto``, ``local`` (this
        agent's own store; only in a task) or ``shared``."""
        from cloud_hub.client.multiprocessing._resource import dumps, retrying

        if tier not in TIERS and tier != "redis":
            raise ValueError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}] seconds, not {ttl_s!r}")
        local = refstore.local_store() if tier in ("auto", "local") else None
        if tier == "local" and local is None:
            raise ValueError("tier='local' is the producing agent's own store: use it in a task on an agent "
                             "(here, use tier='shared' or 'auto')")
        blob = dumps(value)
        limit = _max_bytes() if max_bytes is None else max_bytes
        if len(blob) > limit:
            raise ValueError(f"value is {len(blob)} bytes serialized, over the ref size limit of {limit} bytes "
                             "(max_bytes= or MESH_REF_MAX_BYTES); split it or move it as a file")
        key = new_ref_key()
        producer = _producer()
        expires = time.time() + ttl_s
        if local is not None:
            try:
                local.put(key, blob, producer, expires, owner_of(self.url), self.url)
            except refstore.LocalFull:
                if tier == "local":
                    raise
            else:
                refstore.ensure_stager(self.url)
                return MeshRef(key, self.url, len(blob), producer, expires, "local",
                               {"endpoint": refstore.endpoint_id(), "sha256": hashlib.sha256(blob).hexdigest()})
        r = self._r()
        pipe = r.pipeline()
        pipe.set(key, blob, px=int(ttl_s * 1000))
        pipe.set(key + ":by", producer, px=int(ttl_s * 1000))
        retrying(self.url, pipe.execute)
        return MeshRef(key, self.url, len(blob), producer, expires, "shared", {"sha256": hashlib.sha256(blob).hexdigest()})

    def get(self, ref: MeshRef) -> Any:
        from cloud_hub.client.multiprocessing._resource import loads, retrying

        if ref.tier == "local":
            return loads(_local_blob(ref))

        def fetch() -> bytes:
            blob = retrying(self.url, lambda: self._r().get(ref.key))
            if blob is None:
                raise _gone(ref, f"its data is no longer in {_safe(self.url)}")
            return blob

        return loads(_via_site(ref, fetch))

    def delete(self, ref: MeshRef) -> None:
        """Delete the value (a local ref: on its own endpoint; elsewhere only its staged copy,
        and the producer's copy goes at its TTL)."""
        from cloud_hub.client.multiprocessing._resource import retrying

        if ref.tier == "local":
            local = refstore.local_store()
            if local is not None and ref.meta.get("endpoint") == refstore.endpoint_id():
                local.delete(ref.key, owner_of(ref.url))
            retrying(self.url, lambda: self._r().delete(ref.key + STAGED))
            return
        retrying(self.url, lambda: self._r().delete(ref.key, ref.key + ":by"))


def _site_store() -> str | None:
    """The LAN blob store of this worker's site (``host:port``), when its agent sits behind a site
    gateway that runs one: the agent writes what the hub's signed welcome says to a file in its
    data directory (mesh_agent.agent), read here at each shared-ref read (one small file)."""
    root = os.environ.get("MESH_ENDPOINT_DATA_DIR")
    if not root:
        return None
    from mesh_agent.site_store import SITE_STORE_FILE

    try:
        with open(os.path.join(root, SITE_STORE_FILE)) as f:
            addr = f.read(300).strip()
    except OSError:
        return None
    return addr if addr.count(":") == 1 else None


def _safe(url: str) -> str:
    from cloud_hub.client.multiprocessing._resource import _safe as safe

    return safe(url)


def _gone(ref: MeshRef, where: str) -> RefError:
    when = "expired" if time.time() >= ref.expires else "was deleted or lost"
    return RefError(f"{ref.key} ({ref.size} B, put by {ref.producer}) {when}: {where}")


def _via_site(ref: MeshRef, fetch: Any) -> bytes:
    """A ref's bytes through this device's site store (docs/sites.md, "Data refs, once per site"):
    from the site's LAN when a reader there left them, else ``fetch()`` (over the uplink), checked
    against the ref's digest and left at the site for the next reader. Without a digest or a site
    store, just ``fetch()``."""
    digest = ref.meta.get("sha256")
    site = _site_store() if isinstance(digest, str) else None
    if site is not None:
        from mesh_agent.site_store import SiteStoreError, get_blob

        try:
            return get_blob(site, digest)  # checked against the digest: the gateway cannot swap it
        except SiteStoreError:
            pass  # not there yet (or the store is down): fetched, then left at the site
    blob = fetch()
    if isinstance(digest, str) and hashlib.sha256(blob).hexdigest() != digest:
        raise RefError(f"{ref.key} ({ref.size} B, put by {ref.producer}): the bytes read are not the ones put "
                       "(SHA-256 differs); refusing them")
    if site is not None:
        from mesh_agent.site_store import SiteStoreError, put_blob

        try:
            put_blob(site, blob)
        except SiteStoreError:
            pass  # the next device of the site fetches it over the uplink too
    return blob


def _local_blob(ref: MeshRef) -> bytes:
    """A local-tier ref's bytes: from this endpoint's own store, or staged through the shared one."""
    ep = ref.meta.get("endpoint")
    if ep is not None and ep == refstore.endpoint_id():
        local = refstore.local_store()
        hit = local.get(ref.key, owner_of(ref.url)) if local is not None else None
        if hit is None:
            raise _gone(ref, f"not in the local store of endpoint {ep}")
        refstore.ensure_stager(ref.url)  # this endpoint holds local refs: serve them to others too
        return hit[0]
    if time.time() >= ref.expires:
        raise _gone(ref, f"its TTL ran out (it was in the local store of endpoint {ep})")

    def staged() -> bytes:
        blob, why = _stage_in(ref.url, ref.key, str(ep), float(os.environ.get("MESH_REF_STAGE_S", "30")))
        if blob is None:
            raise RefError(f"{ref.key} ({ref.size} B, put by {ref.producer}) is in the local store of endpoint {ep} and could not "
                           f"be staged: {why}")
        return blob

    return _via_site(ref, staged)


def _stage_in(url: str, key: str, producer_ep: str, timeout_s: float) -> tuple[bytes | None, str]:
    """From another endpoint or the program: the value of a local ref on ``producer_ep``, copied
    through the shared store by that endpoint's stager (mesh_agent.refstore). Returns (blob, "")
    or (None, why)."""
    from cloud_hub.client.multiprocessing._resource import retrying

    r = refstore.connection(url)
    blob = retrying(url, lambda: r.get(key + STAGED))
    if blob is not None:
        return blob, ""
    retrying(url, lambda: r.rpush(stage_list(producer_ep), key))
    got = retrying(url, lambda: r.blpop([key + READY], timeout=timeout_s))
    if got is None:
        return None, (f"endpoint {producer_ep} did not stage it within {timeout_s:g} s (it is offline, or no worker "
                      "that used refs is alive there; MESH_REF_STAGE_S)")
    if got[1] == STAGE_LOST.encode():
        return None, f"endpoint {producer_ep} no longer has it (expired, deleted, or its data directory was wiped)"
    blob = retrying(url, lambda: r.get(key + STAGED))
    return (blob, "") if blob is not None else (None, "its staged copy expired before it was read")


@dataclass(frozen=True)
class TaskOutput:
    """A ``Future`` passed as an argument of a later task: the producing task's id and the hub's
    store, where the consumer's worker reads the result (``MESH.RESULT``; the hub answers only
    for the same user's tasks). Made by the Executor, never by hand."""

    task_id: str
    url: str

    def fetch(self) -> Any:
        from cloud_hub.client.multiprocessing._resource import retrying
        from mesh_agent.protocol.serialize import deserialize

        got = retrying(self.url, lambda: refstore.connection(self.url).execute_command("MESH.RESULT", self.task_id))
        if not got:
            raise RefError(f"the result of task {self.task_id} (an argument of this task) is not in the hub: "
                           "it expired (result_ttl_s), or the task is not yours")
        ok, data = int(got[0]), got[1]
        if not ok:
            err = deserialize(data)
            what = f"{err.get('type')}: {err.get('message')}" if isinstance(err, dict) else repr(err)
            raise RefError(f"task {self.task_id}, whose result is an argument of this task, failed: {what}")
        value = deserialize(data)
        return Store(value.url).get(value) if isinstance(value, MeshRef) else value


def put(value: Any, ttl_s: float = DEFAULT_TTL_S, max_bytes: int | None = None, tier: str = "auto") -> MeshRef:
    """``Store().put``: the store from ``MESH_REDIS_URL`` / ``multiprocessing.config``, else the hub's."""
    return Store().put(value, ttl_s, max_bytes, tier)


def get(ref: MeshRef) -> Any:
    """The value behind ``ref`` (the one call that brings data into this program)."""
    if not isinstance(ref, MeshRef):
        raise TypeError(f"refs.get wants a MeshRef, not {type(ref).__name__}")
    return Store(ref.url).get(ref)


def delete(ref: MeshRef) -> None:
    Store(ref.url).delete(ref)


def _resolve_one(v: Any, depth: int) -> Any:
    if isinstance(v, MeshRef):
        return Store(v.url).get(v)
    if isinstance(v, TaskOutput):
        return v.fetch()
    if depth >= 2:
        return v
    if type(v) in (list, tuple):
        if any(isinstance(x, (MeshRef, TaskOutput, list, tuple, dict)) for x in v):
            return type(v)(_resolve_one(x, depth + 1) for x in v)
        return v
    if type(v) is dict:
        if any(isinstance(x, (MeshRef, TaskOutput, list, tuple, dict)) for x in v.values()):
            return {k: _resolve_one(x, depth + 1) for k, x in v.items()}
    return v


def _locate(v: Any, depth: int, out: dict[str, int]) -> None:
    if isinstance(v, MeshRef):
        if v.tier == "local" and v.meta.get("endpoint"):
            out[v.meta["endpoint"]] = out.get(v.meta["endpoint"], 0) + v.size
    elif depth < 2 and type(v) in (list, tuple):
        for x in v:
            _locate(x, depth + 1, out)
    elif depth < 2 and type(v) is dict:
        for x in v.values():
            _locate(x, depth + 1, out)


def locations(args: Any, kwargs: dict[str, Any]) -> list[list[Any]]:
    """``[[endpoint_id, bytes], ...]``: where a task's local-tier ref arguments lie, for the
    scheduler's data locality (the SDK sends it with the task; shared-tier refs are as far from
    every endpoint and are left out)."""
    out: dict[str, int] = {}
    for a in args:
        _locate(a, 0, out)
    for a in kwargs.values():
        _locate(a, 0, out)
    return [[e, n] for e, n in out.items()]


def resolve(args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """On the agent's worker, before the function runs: every ``MeshRef`` or ``TaskOutput``
    argument (also inside a list, tuple or dict argument, two levels deep) becomes its value,
    fetched by this worker. The program never sees the bytes."""
    return [_resolve_one(a, 0) for a in args], {k: _resolve_one(v, 0) for k, v in kwargs.items()}


def _unpickle_blob(blob: bytes) -> Any:  # kept for symmetry with multiprocessing._resource.loads
    return pickle.loads(blob)
