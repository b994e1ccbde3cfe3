"""Where the mesh ``multiprocessing`` runs: endpoint selector, Redis address, the program's lease.

Why one module-level configuration: the point of the module is that a stdlib program runs with
only its import line changed, so nothing can be passed to ``Pool()`` or ``Queue()`` that the
standard library does not take. ``config()`` (or ``MESH_MP_ENDPOINT`` / ``MESH_REDIS_URL``) says
where work runs and where shared state lives, once, before the program's own code.

The one Executor every Pool and Process submits through is made above this module
(``_runner.py``): the proxies and ``cloud_hub.client.refs`` read the settings here, and the
Executor is built on those refs (a Future passed to a task becomes one), so holding it here
would close an import circle.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any

__all__ = ["config", "settings", "generation", "redis_url", "lease", "take_lease", "in_task"]

log = logging.getLogger("cloud_hub.client.multiprocessing")

_lock = threading.Lock()
_settings: dict[str, Any] = {
    "endpoint": None,        # "auto" unless MESH_MP_ENDPOINT or config() says otherwise
    "redis_url": None,       # MESH_REDIS_URL, else the hub's embedded store (GET /v1/kv)
    "ttl_s": 3600.0,         # expiry of every shared resource, refreshed on writes
    "client": None,
    "task_timeout_s": None,
    "start_timeout_s": 60.0,  # Process.start() raises when the target has not started within this
    "lease_s": None,          # MESH_MP_LEASE_S, else 60: a dead program's tasks and state go within this
}
#: Default of ``lease_s`` (docs/multiprocessing.md, "Lease").
DEFAULT_LEASE_S = 60.0
#: Bumped by ``config()`` when a setting the shared Executor is made from changes (endpoint,
#: client, task_timeout_s): ``_runner.executor()`` then replaces the one it holds.
_generation = 0


def config(*, endpoint: Any = None, redis_url: str | None = None, ttl_s: float | None = None, client: Any = None,
           task_timeout_s: float | None = None, start_timeout_s: float | None = None, lease_s: float | None = None) -> dict[str, Any]:
    """Set where Pools and Processes run (``endpoint``: ``"auto"``, an id, a list of ids or
    ``{"tags": [...]}``), the Redis that holds Queues, Locks, Values... (``redis_url``, reachable
    from the endpoints too), the expiry of shared resources, how long ``Process.start()`` waits
    for its target to start (``start_timeout_s``), and the bound on a dead program's work
    (``lease_s``: its tasks are cancelled and its shared state deleted within it once it stops
    renewing; docs/multiprocessing.md, "Lease"). Returns the settings in force."""
    global _generation
    with _lock:
        given = [(k, v) for k, v in (("endpoint", endpoint), ("redis_url", redis_url), ("ttl_s", ttl_s), ("client", client),
                                     ("task_timeout_s", task_timeout_s), ("start_timeout_s", start_timeout_s),
                                     ("lease_s", lease_s)) if v is not None]
        for k, v in given:  # all checked before any is set: a bad value changes nothing
            if k in ("ttl_s", "start_timeout_s", "lease_s") and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{k} must be a positive number of seconds, not {v!r}")
            if k == "lease_s" and not 4 <= v <= 86_400:
                raise ValueError(f"lease_s must be between 4 and 86400 seconds, not {v!r}")
        _settings.update(given)
        if endpoint is not None or client is not None or task_timeout_s is not None:
            _generation += 1
    return settings()


def generation() -> int:
    """How many times the settings the shared Executor is made from were changed."""
    return _generation


def settings() -> dict[str, Any]:
    out = dict(_settings)
    if out["endpoint"] is None:
        env = os.environ.get("MESH_MP_ENDPOINT")
        out["endpoint"] = ([e for e in env.split(",") if e] if env and "," in env else env) or "auto"
    if out["redis_url"] is None:
        out["redis_url"] = os.environ.get("MESH_REDIS_URL")  # None: the hub's store, asked for by redis_url()
    if out["lease_s"] is None:
        env_lease = os.environ.get("MESH_MP_LEASE_S")
        try:
            out["lease_s"] = min(86_400.0, max(4.0, float(env_lease))) if env_lease else DEFAULT_LEASE_S
        except ValueError:
            log.error("MESH_MP_LEASE_S=%r is not a number of seconds; using %g", env_lease, DEFAULT_LEASE_S)
            out["lease_s"] = DEFAULT_LEASE_S
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


def in_task() -> bool:
    """Whether this code runs inside a task on an agent's worker (not in the driver program)."""
    w = sys.modules.get("mesh_agent.engine._worker")
    return w is not None and getattr(w, "CURRENT_TASK_ID", None) is not None


class Lease:
    """The driver's lease on its work (docs/multiprocessing.md, "Lease"). A daemon thread renews,
    every ``lease_s / 4``: the hub lease of each task group this program submitted to, for
    ``3/4 lease_s`` (the hub cancels a group's unfinished tasks once it runs out: two renewals may
    fail in a row), and the expiry of every shared object made here, ``lease_s`` (later than the
    cancel, so a task waiting on an object is cancelled rather than failing because its object
    vanished). A program that exits drops them at once (:func:`shutdown_executor`); one that dies
    stops renewing, and within ``lease_s`` its tasks are cancelled and its state is gone. Other
    programs are not touched."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = float(lease_s)
        self._groups: dict[str, Any] = {}  # task group id -> its Executor (whose client renews it)
        self._resources: dict[int, "weakref.ref[Any]"] = {}  # id -> the object (proxies may be unhashable)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mesh-mp-lease", daemon=True)
        self._thread.start()
        self.renewals = 0

    @property
    def period_s(self) -> float:
        return self.lease_s / 4

    @property
    def hub_ttl_s(self) -> float:
        return self.lease_s * 3 / 4

    def hold(self, ex: Any) -> None:
        """Lease ``ex``'s task group now (before any of its tasks is submitted), then keep renewing."""
        with self._lock:
            self._groups[ex.task_group_id] = ex
        self._renew_group(ex.task_group_id, ex)

    def track(self, resource: Any) -> float:
        """A shared object made in this program: its keys are renewed with the lease. Returns the
        expiry its keys get (the lease's bound)."""
        key = id(resource)

        def gone(_ref: Any, key: int = key) -> None:
            with self._lock:
                if self._resources.get(key) is _ref:
                    del self._resources[key]

        with self._lock:
            self._resources[key] = weakref.ref(resource, gone)
        return self.lease_s

    def _renew_group(self, group: str, ex: Any) -> None:
        try:
            ex.client.renew_task_group_lease(group, self.hub_ttl_s)
        except Exception as exc:  # the hub unreachable for a while: tried again next period
            log.warning("could not renew the lease of task group %s (%s); retrying in %.0f s", group, exc, self.period_s)

    def renew(self) -> None:
        with self._lock:
            groups = list(self._groups.items())
            resources = [r for ref in self._resources.values() if (r := ref()) is not None]
        for group, ex in groups:
            self._renew_group(group, ex)
        by_url: dict[str, list[Any]] = {}
        for r in resources:
            by_url.setdefault(r._url, []).append(r)
        for url, rs in by_url.items():
            try:
                from mesh_agent.refstore import connection

                pipe = connection(url).pipeline(transaction=False)
                for r in rs:
                    r.touch(pipe)
                pipe.execute()
            except Exception as exc:
                log.warning("could not renew the expiry of %d shared objects at %s (%s)", len(rs), url.split("@")[-1], exc)
        self.renewals += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.renew()
            except Exception:  # never let the renewing thread die
                log.exception("lease renewal failed")

    def end(self) -> None:
        """Stop renewing; cancel every unfinished task of this program's groups and drop their leases."""
        self._stop.set()
        with self._lock:
            groups = list(self._groups.items())
            self._groups.clear()
        for group, ex in groups:
            try:
                ex.cancel_group(group)
                ex.client.release_task_group_lease(group)
            except Exception as exc:  # the hub unreachable: the lease runs out and the hub cancels them then
                log.warning("could not cancel task group %s at exit (%s); the hub does within lease_s", group, exc)


_lease: Lease | None = None


def lease() -> Lease:
    """This program's lease, started on first use."""
    global _lease
    with _lease_lock:
        if _lease is None:
            _lease = Lease(settings()["lease_s"])
        return _lease


_lease_lock = threading.Lock()


def take_lease() -> Lease | None:
    """This program's lease, no longer held (a later ``lease()`` starts a new one); the caller
    ends it (``_runner.shutdown_executor``)."""
    global _lease
    with _lease_lock:
        held, _lease = _lease, None
    return held


def cancel(future: Any) -> bool:
    """Cancel a task of this program wherever it is (``Executor.cancel``: not sent, queued at the
    hub or an agent, or running: its worker is ended); True when the task ends cancelled."""
    return bool(future.cancel())  # a MeshFuture asks its Executor; the hub unreachable: False, logged
