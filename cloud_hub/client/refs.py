"""Intermediate data by reference (Pocket-style): ``put`` a value into the data store, pass the
small ``MeshRef`` to later tasks, and the agent's worker fetches the value itself.

    from cloud_hub.client import refs
    store = refs.Store()                       # MESH_REDIS_URL / multiprocessing.config(redis_url=)
    parts = ex.map(map_words, chunks, [store] * n)   # each task: return store.put(counts)
    total = ex.submit(reduce_counts, list(parts))    # refs in, resolved on the agent
    print(refs.get(total.result()))            # only here do the bytes reach this program

Why a ref: without it every byte between two stages goes agent -> hub -> SDK -> hub -> agent.
With it, the producing task writes once to a store both agents reach, and only a ~150-byte ref
travels through the hub and this program.

Tier in this version: ``redis`` (a Redis both the program and the endpoints reach; the
"hub's store or Redis" tier of the issue). The producing agent's own store and staging through
the hub are not built yet (docs/data.md).

Each ref has a TTL (``ttl_s``, default 1 h, at most 7 days) and a size limit (``max_bytes``,
default 64 MiB, ``MESH_REF_MAX_BYTES``). A missing or expired ref is a ``RefError`` naming the
task that produced it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MeshRef", "RefError", "Store", "put", "get", "delete", "resolve"]

MAX_TTL_S = 7 * 86400.0
DEFAULT_TTL_S = 3600.0


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
    tier: str = "redis"
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
        from cloud_hub.client.multiprocessing._resource import connection

        return connection(self.url)

    def put(self, value: Any, ttl_s: float = DEFAULT_TTL_S, max_bytes: int | None = None) -> MeshRef:
        """Store ``value``; returns its ref. Refused (nothing stored) past the size limit or with
        a TTL outside (0, 7 days]."""
        from cloud_hub.client.multiprocessing._resource import dumps, retrying

        if not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:g}] seconds, not {ttl_s!r}")
        blob = dumps(value)
        limit = _max_bytes() if max_bytes is None else max_bytes
        if len(blob) > limit:
            raise ValueError(f"value is {len(blob)} bytes serialized, over the ref size limit of {limit} bytes "
                             "(max_bytes= or MESH_REF_MAX_BYTES); split it or move it as a file")
        key = f"mesh:ref:{uuid.uuid4().hex}"
        producer = _producer()
        r = self._r()
        pipe = r.pipeline()
        pipe.set(key, blob, px=int(ttl_s * 1000))
        pipe.set(key + ":by", producer, px=int(ttl_s * 1000))
        retrying(self.url, pipe.execute)
        return MeshRef(key, self.url, len(blob), producer, time.time() + ttl_s)

    def get(self, ref: MeshRef) -> Any:
        from cloud_hub.client.multiprocessing._resource import loads, retrying

        blob = retrying(self.url, lambda: self._r().get(ref.key))
        if blob is None:
            when = "expired" if time.time() >= ref.expires else "was deleted or lost"
            raise RefError(f"{ref.key} ({ref.size} B, put by {ref.producer}) {when}: its data is no longer in {self.url}")
        return loads(blob)

    def delete(self, ref: MeshRef) -> None:
        from cloud_hub.client.multiprocessing._resource import retrying

        retrying(self.url, lambda: self._r().delete(ref.key, ref.key + ":by"))


def put(value: Any, ttl_s: float = DEFAULT_TTL_S, max_bytes: int | None = None) -> MeshRef:
    """``Store().put``: the store from ``MESH_REDIS_URL`` / ``multiprocessing.config``."""
    return Store().put(value, ttl_s, max_bytes)


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
    if depth >= 2:
        return v
    if type(v) in (list, tuple):
        if any(isinstance(x, (MeshRef, list, tuple, dict)) for x in v):
            return type(v)(_resolve_one(x, depth + 1) for x in v)
        return v
    if type(v) is dict:
        if any(isinstance(x, (MeshRef, list, tuple, dict)) for x in v.values()):
            return {k: _resolve_one(x, depth + 1) for k, x in v.items()}
    return v


def resolve(args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """On the agent's worker, before the function runs: every ``MeshRef`` argument (also inside
    a list, tuple or dict argument, two levels deep) becomes its value, fetched from the store
    by this worker. The program never sees the bytes."""
    return [_resolve_one(a, 0) for a in args], {k: _resolve_one(v, 0) for k, v in kwargs.items()}


def _unpickle_blob(blob: bytes) -> Any:  # kept for symmetry with multiprocessing._resource.loads
    return pickle.loads(blob)
