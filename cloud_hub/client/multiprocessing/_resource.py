"""Base of every Redis-backed proxy: a connection per process, a reference count, an expiry.

Why both a reference count and an expiry (as in Lithops): the count deletes a resource's keys as
soon as the last proxy to it is garbage-collected, in the driver or on a worker; the expiry is the
backstop for what the count cannot see (a SIGKILLed driver, a task that never ran, a pickled
copy never loaded), so a crashed program leaks nothing for longer than ``ttl_s``.

Counting rule: a proxy made in the program holds one reference; each copy *unpickled* elsewhere
(on an agent's worker) takes one more and drops it when collected. A copy still in flight holds
none, so dropping the last local proxy while tasks that use it are queued deletes the resource:
keep it referenced until they are done (the stdlib program's natural shape).

Redis goes down: each call retries with exponential backoff for ``MESH_REDIS_RETRY_S`` (10 s),
then raises ``ConnectionError`` naming the address.
"""

from __future__ import annotations

import os
import pickle
import uuid
import weakref
from typing import Any, Callable, TypeVar

from mesh_agent.backoff import Backoff, retry
from mesh_agent.refstore import connection  # one per process and URL, shared with refs and the agent's stagers

__all__ = ["Resource", "connection", "retrying", "dumps", "loads"]

T = TypeVar("T")
#: Redis unreachable (mesh_agent/backoff.py): 50 ms doubling to 1 s, times 0.5-1.5, for
#: ``MESH_REDIS_RETRY_S`` (the deadline, read per call) and at most 1000 tries.
_REDIS_RETRY = Backoff(base=0.05, cap=1.0, jitter=(0.5, 1.5), max_tries=1000)


def retrying(url: str, fn: Callable[[], T]) -> T:
    """``fn()`` with backoff while Redis is unreachable; then one clear ``ConnectionError``."""
    import redis

    budget = float(os.environ.get("MESH_REDIS_RETRY_S", "10"))

    def unreachable(exc: BaseException) -> bool:  # a refused login is a ConnectionError too: retrying cannot help it
        return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and not isinstance(exc, redis.AuthenticationError)

    try:
        return retry(fn, retry_on=unreachable, policy=_REDIS_RETRY.replace(deadline=max(0.0, budget)))
    except redis.AuthenticationError as exc:  # say so at once
        raise ConnectionError(f"the store at {_safe(url)} refused this login ({exc}): a hub's embedded store whose "
                              "credentials changed (a new hub database), or a wrong Redis password") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ConnectionError(f"cannot reach Redis at {_safe(url)} for {budget:g} s ({exc}); is redis-server running there "
                              "and reachable from the endpoints? (MESH_REDIS_URL / multiprocessing.config(redis_url=))") from None


def _safe(url: str) -> str:
    """A store URL without its credential, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.split('@', 1)[1]}"
    return url


def dumps(obj: Any) -> bytes:
    """Items in queues, pipes, managed dicts: pickle, cloudpickle for what pickle refuses
    (lambdas, classes of ``__main__``)."""
    try:
        return pickle.dumps(obj, protocol=5)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=5)


loads = pickle.loads


def _release(url: str, prefix: str, keys: tuple[str, ...], members: tuple[str, str] | None = None) -> None:
    """Finalizer: drop one reference; the last one deletes the keys, and with ``members`` =
    (set suffix, key suffix) the keys named by that set's members too (a Queue's pending lists)."""
    try:
        r = connection(url)
        if r.decr(prefix + ":ref") <= 0:
            extra = []
            if members is not None:
                extra = [f"{prefix}:{members[1]}{m.decode()}" for m in r.smembers(f"{prefix}:{members[0]}")]
            r.delete(prefix + ":ref", *keys, *extra)
    except Exception:
        pass  # Redis gone or interpreter exiting: the expiry cleans up


class Resource:
    """A named set of Redis keys under ``mesh:mp:<uuid>``, with a reference count and expiry."""

    _suffixes: tuple[str, ...] = ()
    #: (suffix of a set, key suffix): keys ``<prefix>:<key suffix><member>`` that the set names
    #: are the resource's too (made as it is used; each carries its own expiry)
    _members: tuple[str, str] | None = None

    def __init__(self, *, _prefix: str | None = None, _url: str | None = None, _ttl: float | None = None,
                 _leased: bool = False) -> None:
        from cloud_hub.client.multiprocessing._state import redis_url, settings

        from cloud_hub.client.multiprocessing._state import in_task, lease

        s = settings()
        self._url = _url or redis_url()  # a copy unpickled on a worker keeps the program's store
        self._ttl = int(_ttl or s["ttl_s"])
        # Made in the program (not a copy, not in a task): its keys live as long as the program's
        # lease, renewed with it, and expire within lease_s once the program is gone (_state.Lease).
        held = lease() if _prefix is None and not in_task() else None
        if held is not None:
            self._ttl = int(min(self._ttl, held.lease_s))
        #: kept alive by the program's lease: a copy in a task never pushes its expiry out (only the
        #: program's renewals do), so its keys go within lease_s of the program's last renewal
        self._leased = held is not None or _leased
        self._prefix = _prefix or f"mesh:mp:{uuid.uuid4().hex}"
        self._r = connection(self._url)
        pipe = self._r.pipeline()
        pipe.incr(self._prefix + ":ref")
        pipe.expire(self._prefix + ":ref", self._ttl, **({"lt": True} if self._leased and in_task() else {}))
        self.call(pipe.execute)
        self._finalizer = weakref.finalize(self, _release, self._url, self._prefix, tuple(self._keys()), self._members)
        if held is not None:
            held.track(self)

    def _keys(self) -> list[str]:
        return [f"{self._prefix}:{s}" for s in self._suffixes]

    def key(self, suffix: str) -> str:
        return f"{self._prefix}:{suffix}"

    def call(self, fn: Callable[[], T]) -> T:
        return retrying(self._url, fn)

    def touch(self, pipe: Any) -> Any:
        """Add expiry refreshes for every key to ``pipe`` (sent with the write, one round trip). A
        leased object's copy in a task only ever shortens an expiry (``EXPIRE ... LT``): a task
        that keeps writing after its program died must not keep the program's state alive."""
        from cloud_hub.client.multiprocessing._state import in_task

        lt = {"lt": True} if self._leased and in_task() else {}
        pipe.expire(self._prefix + ":ref", self._ttl, **lt)
        for k in self._keys():
            pipe.expire(k, self._ttl, **lt)
        return pipe

    def _state(self) -> dict[str, Any]:
        return {}

    def _restore(self, state: dict[str, Any]) -> None:
        pass

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._prefix, self._url, self._ttl, self._state(), self._leased))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._prefix} at {self._url}>"


def _rebuild(cls: type, prefix: str, url: str, ttl: float, state: dict[str, Any], leased: bool = False) -> Any:
    obj = cls.__new__(cls)
    Resource.__init__(obj, _prefix=prefix, _url=url, _ttl=ttl, _leased=leased)
    obj._restore(state)
    return obj
