"""Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event, Barrier over Redis.

Why token lists: a semaphore of value n is a Redis list holding n tokens; ``acquire`` is one
``BLPOP`` (the server blocks, no polling, waiters are served in arrival order) and ``release`` is
one ``RPUSH``. Condition and Event wake waiters through a private list per waiter, so nothing
polls either. Like the standard library's, a Lock may be released by any process.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Any, Callable

from cloud_hub.client.multiprocessing._resource import Resource

__all__ = ["Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event", "Barrier", "BrokenBarrierError"]

BrokenBarrierError = threading.BrokenBarrierError

_RELEASE = """
local n = redis.call('LLEN', KEYS[1])
if tonumber(ARGV[1]) > 0 and n >= tonumber(ARGV[1]) then return -1 end
redis.call('RPUSH', KEYS[1], 't')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return n + 1
"""


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def _blpop_timeout(block: bool, timeout: float | None) -> float | None:
    if not block:
        return None
    if timeout is None:
        return 0.0  # BLPOP 0: wait for ever, as the standard library does
    return max(float(timeout), 0.001)


class Semaphore(Resource):
    """``multiprocessing.Semaphore``; ``get_value()`` is the number of free tokens."""

    _suffixes = ("tok",)
    _bound = 0

    def __init__(self, value: int = 1) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        super().__init__()
        tok = self.key("tok")
        pipe = self._r.pipeline()
        pipe.delete(tok)
        if value:
            pipe.rpush(tok, *(["t"] * value))
        self.touch(pipe)
        self.call(pipe.execute)
        if self._bound:
            self._bound = value

    def _state(self) -> dict[str, Any]:
        return {"bound": self._bound}

    def _restore(self, state: dict[str, Any]) -> None:
        self._bound = state.get("bound", 0)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        tok = self.key("tok")
        t = _blpop_timeout(block, timeout)
        if t is None:
            return self.call(lambda: self._r.lpop(tok)) is not None
        return self.call(lambda: self._r.blpop([tok], timeout=t)) is not None

    def release(self) -> None:
        got = self.call(lambda: self._r.eval(_RELEASE, 1, self.key("tok"), self._bound, self._ttl))
        if got == -1:
            raise ValueError("semaphore or lock released too many times")

    def get_value(self) -> int:
        return int(self.call(lambda: self._r.llen(self.key("tok"))))

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class BoundedSemaphore(Semaphore):
    _bound = -1  # set to the initial value in __init__

    def __init__(self, value: int = 1) -> None:
        self._bound = -1
        super().__init__(value)
        self._bound = value


class Lock(BoundedSemaphore):
    """``multiprocessing.Lock``: a bounded semaphore of one."""

    def __init__(self) -> None:
        super().__init__(1)


class RLock(Resource):
    """Owned by one thread of one process (host, pid, thread); re-entrant for it."""

    _suffixes = ("tok", "owner", "count")

    def __init__(self) -> None:
        super().__init__()
        pipe = self._r.pipeline()
        pipe.delete(self.key("tok"), self.key("owner"), self.key("count"))
        pipe.rpush(self.key("tok"), "t")
        self.touch(pipe)
        self.call(pipe.execute)

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        me = _me()
        if self.call(lambda: self._r.get(self.key("owner"))) == me.encode():
            self.call(lambda: self._r.incr(self.key("count")))
            return True
        t = _blpop_timeout(block, timeout)
        tok = self.key("tok")
        got = self.call(lambda: self._r.lpop(tok)) if t is None else self.call(lambda: self._r.blpop([tok], timeout=t))
        if got is None:
            return False
        pipe = self._r.pipeline()
        pipe.set(self.key("owner"), me, ex=self._ttl)
        pipe.set(self.key("count"), 1, ex=self._ttl)
        self.call(pipe.execute)
        return True

    def release(self) -> None:
        if self.call(lambda: self._r.get(self.key("owner"))) != _me().encode():
            raise AssertionError("attempt to release recursive lock not owned by thread")
        if self.call(lambda: self._r.decr(self.key("count"))) <= 0:
            pipe = self._r.pipeline()
            pipe.delete(self.key("owner"), self.key("count"))
            pipe.rpush(self.key("tok"), "t")
            self.touch(pipe)
            self.call(pipe.execute)

    def _is_owned(self) -> bool:
        return self.call(lambda: self._r.get(self.key("owner"))) == _me().encode()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Condition(Resource):
    """``multiprocessing.Condition(lock=None)``: waiters park on a private list each."""

    _suffixes = ("waiters",)

    def __init__(self, lock: Lock | RLock | None = None) -> None:
        super().__init__()
        self._lock = lock if lock is not None else RLock()

    def _state(self) -> dict[str, Any]:
        return {"lock": self._lock}

    def _restore(self, state: dict[str, Any]) -> None:
        self._lock = state["lock"]

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._lock.acquire(block, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        box = f"{self._prefix}:w:{uuid.uuid4().hex}"
        pipe = self._r.pipeline()
        pipe.rpush(self.key("waiters"), box)
        self.touch(pipe)
        self.call(pipe.execute)
        # release fully (an RLock may be held several times), wait, re-acquire as often
        depth = 1
        if isinstance(self._lock, RLock):
            depth = max(1, int(self.call(lambda: self._r.get(self._lock.key("count"))) or 1))
            for _ in range(depth):
                self._lock.release()
        else:
            self._lock.release()
        try:
            t = _blpop_timeout(True, timeout)
            got = self.call(lambda: self._r.blpop([box], timeout=t))
        finally:
            self.call(lambda: self._r.lrem(self.key("waiters"), 0, box))
            self.call(lambda: self._r.delete(box))
            for _ in range(depth):
                self._lock.acquire()
        return got is not None

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        import time

        end = None if timeout is None else time.monotonic() + timeout
        result = predicate()
        while not result:
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.wait(left)
            else:
                self.wait()
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        for _ in range(max(0, n)):
            box = self.call(lambda: self._r.lpop(self.key("waiters")))
            if box is None:
                return
            pipe = self._r.pipeline()
            pipe.rpush(box, "1")
            pipe.expire(box, self._ttl)
            self.call(pipe.execute)

    def notify_all(self) -> None:
        self.notify(1 << 30)


class Event(Resource):
    """``multiprocessing.Event``: a flag; ``wait`` parks on a private list until ``set``."""

    _suffixes = ("flag", "waiters")

    def __init__(self) -> None:
        super().__init__()
        self.call(lambda: self._r.delete(self.key("flag"), self.key("waiters")))

    def is_set(self) -> bool:
        return bool(self.call(lambda: self._r.exists(self.key("flag"))))

    def set(self) -> None:
        pipe = self._r.pipeline()
        pipe.set(self.key("flag"), 1, ex=self._ttl)
        pipe.smembers(self.key("waiters"))
        pipe.delete(self.key("waiters"))
        boxes = self.call(pipe.execute)[1]
        if boxes:
            pipe = self._r.pipeline()
            for b in boxes:
                pipe.rpush(b, "1")
                pipe.expire(b, self._ttl)
            self.call(pipe.execute)

    def clear(self) -> None:
        self.call(lambda: self._r.delete(self.key("flag")))

    def wait(self, timeout: float | None = None) -> bool:
        if self.is_set():
            return True
        box = f"{self._prefix}:w:{uuid.uuid4().hex}"
        pipe = self._r.pipeline()
        pipe.sadd(self.key("waiters"), box)  # register first, then look: a set() in between still wakes us
        pipe.expire(self.key("waiters"), self._ttl)
        pipe.exists(self.key("flag"))
        if self.call(pipe.execute)[2]:
            self.call(lambda: self._r.srem(self.key("waiters"), box))
            return True
        t = _blpop_timeout(True, timeout)
        try:
            self.call(lambda: self._r.blpop([box], timeout=t))
        finally:
            self.call(lambda: self._r.srem(self.key("waiters"), box))
            self.call(lambda: self._r.delete(box))
        return self.is_set()


_ARRIVE = """
if redis.call('EXISTS', KEYS[3]) == 1 then return {-1, 0} end
local gen = tonumber(redis.call('GET', KEYS[2]) or '0')
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
if n >= tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], 0, 'EX', ARGV[2])
  redis.call('SET', KEYS[2], gen + 1, 'EX', ARGV[2])
  local g = KEYS[4] .. gen
  for i = 1, n - 1 do redis.call('RPUSH', g, 'go') end
  redis.call('EXPIRE', g, ARGV[2])
end
return {n, gen}
"""


class Barrier(Resource):
    """``multiprocessing.Barrier(parties, action=None, timeout=None)``; a timeout breaks it."""

    _suffixes = ("count", "gen", "broken")

    def __init__(self, parties: int, action: Callable[[], Any] | None = None, timeout: float | None = None) -> None:
        if parties <= 0:
            raise ValueError("parties must be > 0")
        super().__init__()
        self._parties, self._action, self._timeout = parties, action, timeout
        pipe = self._r.pipeline()
        pipe.set(self.key("count"), 0, ex=self._ttl)
        pipe.set(self.key("gen"), 0, ex=self._ttl)
        pipe.delete(self.key("broken"))
        self.call(pipe.execute)

    def _state(self) -> dict[str, Any]:
        return {"parties": self._parties, "action": self._action, "timeout": self._timeout}

    def _restore(self, state: dict[str, Any]) -> None:
        self._parties, self._action, self._timeout = state["parties"], state["action"], state["timeout"]

    @property
    def parties(self) -> int:
        return self._parties

    @property
    def n_waiting(self) -> int:
        return int(self.call(lambda: self._r.get(self.key("count"))) or 0)

    @property
    def broken(self) -> bool:
        return bool(self.call(lambda: self._r.exists(self.key("broken"))))

    def wait(self, timeout: float | None = None) -> int:
        timeout = self._timeout if timeout is None else timeout
        keys = [self.key("count"), self.key("gen"), self.key("broken"), self.key("go:")]
        n, gen = self.call(lambda: self._r.eval(_ARRIVE, 4, *keys, self._parties, self._ttl))
        if n == -1:
            raise BrokenBarrierError
        index = self._parties - int(n)
        if n >= self._parties:
            if self._action is not None:
                try:
                    self._action()
                except BaseException:
                    self.abort()
                    raise
            return index
        go = self.key(f"go:{gen}")
        t = _blpop_timeout(True, timeout)
        got = self.call(lambda: self._r.blpop([go, self.key("broken")], timeout=t))
        if got is None or got[0].decode() == self.key("broken"):
            self.abort()
            raise BrokenBarrierError
        return index

    def abort(self) -> None:
        # a list, so that blocked waiters wake from BLPOP; many items, one per possible waiter
        pipe = self._r.pipeline()
        pipe.rpush(self.key("broken"), *(["x"] * self._parties))
        pipe.expire(self.key("broken"), self._ttl)
        self.call(pipe.execute)

    def reset(self) -> None:
        pipe = self._r.pipeline()
        pipe.delete(self.key("broken"))
        pipe.set(self.key("count"), 0, ex=self._ttl)
        self.call(pipe.execute)
