"""``Manager()``: dict, list, Namespace (and the other shared types) kept in Redis.

No manager process is started: a Redis server already is the server process a
``SyncManager`` would be, so ``start``/``shutdown`` only mark the manager's lifetime. A managed
dict is a Redis hash, a list a Redis list, a Namespace a hash of attribute names; values are
pickled. As with the standard library, ``d[k].append(x)`` changes a copy: assign back.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from cloud_hub.client.multiprocessing import queues, sharedctypes, synchronize
from cloud_hub.client.multiprocessing._resource import Resource, dumps, loads

__all__ = ["DictProxy", "ListProxy", "Namespace", "SyncManager", "Manager"]

_MISSING = object()


class DictProxy(Resource):
    _suffixes = ("data",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        init = dict(*args, **kwargs)
        if init:
            self.update(init)

    def _h(self) -> str:
        return self.key("data")

    def __getitem__(self, k: Any) -> Any:
        raw = self.call(lambda: self._r.hget(self._h(), dumps(k)))
        if raw is None:
            raise KeyError(k)
        return loads(raw)

    def __setitem__(self, k: Any, v: Any) -> None:
        pipe = self._r.pipeline()
        pipe.hset(self._h(), dumps(k), dumps(v))
        self.touch(pipe)
        self.call(pipe.execute)

    def __delitem__(self, k: Any) -> None:
        if not self.call(lambda: self._r.hdel(self._h(), dumps(k))):
            raise KeyError(k)

    def __contains__(self, k: Any) -> bool:
        return bool(self.call(lambda: self._r.hexists(self._h(), dumps(k))))

    def __len__(self) -> int:
        return int(self.call(lambda: self._r.hlen(self._h())))

    def _copy(self) -> dict[Any, Any]:
        return {loads(k): loads(v) for k, v in self.call(lambda: self._r.hgetall(self._h())).items()}

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._copy()))

    def keys(self) -> list[Any]:
        return list(self._copy().keys())

    def values(self) -> list[Any]:
        return list(self._copy().values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._copy().items())

    def copy(self) -> dict[Any, Any]:
        return self._copy()

    def get(self, k: Any, default: Any = None) -> Any:
        try:
            return self[k]
        except KeyError:
            return default

    def setdefault(self, k: Any, default: Any = None) -> Any:
        if self.call(lambda: self._r.hsetnx(self._h(), dumps(k), dumps(default))):
            return default
        return self[k]

    def pop(self, k: Any, default: Any = _MISSING) -> Any:
        pipe = self._r.pipeline()
        pipe.hget(self._h(), dumps(k))
        pipe.hdel(self._h(), dumps(k))
        raw = self.call(pipe.execute)[0]
        if raw is None:
            if default is _MISSING:
                raise KeyError(k)
            return default
        return loads(raw)

    def update(self, *args: Any, **kwargs: Any) -> None:
        d = dict(*args, **kwargs)
        if d:
            pipe = self._r.pipeline()
            pipe.hset(self._h(), mapping={dumps(k): dumps(v) for k, v in d.items()})
            self.touch(pipe)
            self.call(pipe.execute)

    def clear(self) -> None:
        self.call(lambda: self._r.delete(self._h()))

    def __repr__(self) -> str:
        return repr(self._copy())


class ListProxy(Resource):
    _suffixes = ("data",)

    def __init__(self, seq: Iterable[Any] = ()) -> None:
        super().__init__()
        self.extend(seq)

    def _l(self) -> str:
        return self.key("data")

    def _copy(self) -> list[Any]:
        return [loads(v) for v in self.call(lambda: self._r.lrange(self._l(), 0, -1))]

    def __len__(self) -> int:
        return int(self.call(lambda: self._r.llen(self._l())))

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return self._copy()[i]
        raw = self.call(lambda: self._r.lindex(self._l(), i))
        if raw is None:
            raise IndexError("list index out of range")
        return loads(raw)

    def __setitem__(self, i: int, v: Any) -> None:
        import redis

        try:
            self.call(lambda: self._r.lset(self._l(), i, dumps(v)))
        except redis.ResponseError:
            raise IndexError("list assignment index out of range") from None

    def append(self, v: Any) -> None:
        pipe = self._r.pipeline()
        pipe.rpush(self._l(), dumps(v))
        self.touch(pipe)
        self.call(pipe.execute)

    def extend(self, seq: Iterable[Any]) -> None:
        blobs = [dumps(v) for v in seq]
        if blobs:
            pipe = self._r.pipeline()
            pipe.rpush(self._l(), *blobs)
            self.touch(pipe)
            self.call(pipe.execute)

    def pop(self, i: int = -1) -> Any:
        if i not in (0, -1):
            cur = self._copy()
            v = cur.pop(i)
            self._replace(cur)
            return v
        raw = self.call(lambda: (self._r.rpop if i == -1 else self._r.lpop)(self._l()))
        if raw is None:
            raise IndexError("pop from empty list")
        return loads(raw)

    def _replace(self, items: list[Any]) -> None:
        pipe = self._r.pipeline()
        pipe.delete(self._l())
        if items:
            pipe.rpush(self._l(), *(dumps(v) for v in items))
        self.touch(pipe)
        self.call(pipe.execute)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._copy())

    def __contains__(self, v: Any) -> bool:
        return v in self._copy()

    def index(self, v: Any) -> int:
        return self._copy().index(v)

    def count(self, v: Any) -> int:
        return self._copy().count(v)

    def remove(self, v: Any) -> None:
        cur = self._copy()
        cur.remove(v)
        self._replace(cur)

    def insert(self, i: int, v: Any) -> None:
        cur = self._copy()
        cur.insert(i, v)
        self._replace(cur)

    def sort(self, **kw: Any) -> None:
        self._replace(sorted(self._copy(), **kw))

    def reverse(self) -> None:
        self._replace(self._copy()[::-1])

    def __repr__(self) -> str:
        return repr(self._copy())


class Namespace(Resource):
    """Attributes in a Redis hash; names starting with ``_`` stay local, as in the stdlib."""

    _suffixes = ("data",)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raw = self.call(lambda: self._r.hget(self.key("data"), name))
        if raw is None:
            raise AttributeError(f"'Namespace' object has no attribute {name!r}")
        return loads(raw)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        pipe = self._r.pipeline()
        pipe.hset(self.key("data"), name, dumps(value))
        self.touch(pipe)
        self.call(pipe.execute)

    def __delattr__(self, name: str) -> None:
        if name.startswith("_"):
            object.__delattr__(self, name)
        elif not self.call(lambda: self._r.hdel(self.key("data"), name)):
            raise AttributeError(name)

    def __repr__(self) -> str:
        items = {k.decode(): loads(v) for k, v in self.call(lambda: self._r.hgetall(self.key("data"))).items()}
        return "Namespace(" + ", ".join(f"{k}={v!r}" for k, v in sorted(items.items())) + ")"


class SyncManager:
    """What ``multiprocessing.Manager()`` returns; every method makes a Redis-backed object."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._started = False

    def start(self, initializer: Any = None, initargs: tuple[Any, ...] = ()) -> None:
        if initializer is not None:
            initializer(*initargs)
        self._started = True

    def shutdown(self) -> None:
        self._started = False

    def join(self, timeout: float | None = None) -> None:
        pass

    def __enter__(self) -> "SyncManager":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    dict = staticmethod(DictProxy)
    list = staticmethod(ListProxy)
    Namespace = staticmethod(Namespace)
    Queue = staticmethod(queues.Queue)
    JoinableQueue = staticmethod(queues.JoinableQueue)
    Lock = staticmethod(synchronize.Lock)
    RLock = staticmethod(synchronize.RLock)
    Semaphore = staticmethod(synchronize.Semaphore)
    BoundedSemaphore = staticmethod(synchronize.BoundedSemaphore)
    Condition = staticmethod(synchronize.Condition)
    Event = staticmethod(synchronize.Event)
    Barrier = staticmethod(synchronize.Barrier)

    @staticmethod
    def Value(typecode: Any, value: Any, lock: bool = True) -> sharedctypes.Value:
        return sharedctypes.Value(typecode, value, lock=lock)

    @staticmethod
    def Array(typecode: Any, sequence: Any, lock: bool = True) -> sharedctypes.Array:
        return sharedctypes.Array(typecode, sequence, lock=lock)


def Manager() -> SyncManager:
    m = SyncManager()
    m.start()
    return m
