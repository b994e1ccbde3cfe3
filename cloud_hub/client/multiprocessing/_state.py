"""Where the mesh ``multiprocessing`` runs: endpoint selector, Redis address, the shared Executor.

Why one module-level configuration: the point of the module is that a stdlib program runs with
only its import line changed, so nothing can be passed to ``Pool()`` or ``Queue()`` that the
standard library does not take. ``config()`` (or ``MESH_MP_ENDPOINT`` / ``MESH_REDIS_URL``) says
where work runs and where shared state lives, once, before the program's own code.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

__all__ = ["config", "settings", "executor", "redis_url", "shutdown_executor"]

_lock = threading.Lock()
_settings: dict[str, Any] = {
    "endpoint": None,        # "auto" unless MESH_MP_ENDPOINT or config() says otherwise
    "redis_url": None,       # MESH_REDIS_URL, else the hub's embedded store (GET /v1/kv)
    "ttl_s": 3600.0,         # expiry of every shared resource, refreshed on writes
    "client": None,
    "task_timeout_s": None,
    "start_timeout_s": 60.0,  # Process.start() raises when the target has not started within this
}
_executor: Any = None


def config(*, endpoint: Any = None, redis_url: str | None = None, ttl_s: float | None = None, client: Any = None,
           task_timeout_s: float | None = None, start_timeout_s: float | None = None) -> dict[str, Any]:
    """Set where Pools and Processes run (``endpoint``: ``"auto"``, an id, a list of ids or
    ``{"tags": [...]}``), the Redis that holds Queues, Locks, Values... (``redis_url``, reachable
    from the endpoints too), the expiry of shared resources, and how long ``Process.start()``
    waits for its target to start (``start_timeout_s``). Returns the settings in force."""
    global _executor
    with _lock:
        given = [(k, v) for k, v in (("endpoint", endpoint), ("redis_url", redis_url), ("ttl_s", ttl_s), ("client", client),
                                     ("task_timeout_s", task_timeout_s), ("start_timeout_s", start_timeout_s)) if v is not None]
        for k, v in given:  # all checked before any is set: a bad value changes nothing
            if k in ("ttl_s", "start_timeout_s") and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{k} must be a positive number of seconds, not {v!r}")
        _settings.update(given)
        if _executor is not None and (endpoint is not None or client is not None or task_timeout_s is not None):
            old, _executor = _executor, None
            old.shutdown(wait=False)
    return settings()


def settings() -> dict[str, Any]:
    out = dict(_settings)
    if out["endpoint"] is None:
        env = os.environ.get("MESH_MP_ENDPOINT")
        out["endpoint"] = ([e for e in env.split(",") if e] if env and "," in env else env) or "auto"
    if out["redis_url"] is None:
        out["redis_url"] = os.environ.get("MESH_REDIS_URL")  # None: the hub's store, asked for by redis_url()
    return out


_hub_urls: dict[int, str] = {}


def _hub_store(client: Any) -> str:
    """No Redis configured: the hub's embedded store (a Redis subset, per user; docs/data.md),
    asked once per client. A hub without one (``kv_host: ''``) leaves the local Redis default."""
    key = id(client)
    url = _hub_urls.get(key)
    if url is None:
        from cloud_hub.client._client import Client, HubError

        c = client if client is not None else Client()
        try:
            url = str(c.request("GET", "/v1/kv")["url"])
        except HubError as exc:
            if getattr(exc, "status", None) != 404:
                raise
            url = "redis://127.0.0.1:6379/0"
        _hub_urls[key] = url
    return url


def redis_url() -> str:
    """The shared store: ``config(redis_url=)``, ``MESH_REDIS_URL``, else the hub's embedded store."""
    s = settings()
    return str(s["redis_url"] or _hub_store(s["client"]))


def executor() -> Any:
    """The one Executor every Pool and Process of this program submits through (batching,
    retries, code by value come from it)."""
    global _executor
    with _lock:
        if _executor is None:
            from cloud_hub.client._executor import Executor

            s = settings()
            _executor = Executor(client=s["client"], endpoint=s["endpoint"], task_timeout_s=s["task_timeout_s"])
        return _executor


def shutdown_executor() -> None:
    global _executor
    with _lock:
        ex, _executor = _executor, None
    if ex is not None:
        ex.shutdown(wait=False, cancel_futures=True)


atexit.register(shutdown_executor)


def cancel(future: Any) -> bool:
    """Cancel a task of this program: the future at once, and the task wherever it is when the
    Executor can say so to the hub (``Executor.cancel``); True when the future is cancelled."""
    ex = _executor
    fn = getattr(ex, "cancel", None) if ex is not None else None
    if fn is not None:
        try:
            return bool(fn(future))
        except Exception:  # the hub unreachable: the future is still cancelled here
            pass
    return bool(future.cancel())
