"""Queue, SimpleQueue, JoinableQueue and Pipe over Redis lists.

Delivery, for a consumer inside a mesh task (a ``Process`` target, a ``Pool`` function): **at
least once** (the reliable-queue pattern). Its ``get`` moves the item, in one atomic step, from
the queue's list to a pending list of its own, ``<queue>:pending:<task id>`` (``LMOVE``, or
``BLMOVE`` to wait), and in that same step drops the item it got before: an item counts as
consumed when its consumer asks for the next one, or when its task ends (the Process and Pool
wrappers clear the task's pending lists; so does the next task of the same worker process). A
consumer SIGKILLed with its agent leaves its item in the pending list; the mesh runs the task
again with the same task id, and that run's first ``get`` hands out what the killed run held
before anything new. So nothing a killed consumer held is lost, and only that item may be
processed again (once more per kill), when the run that died got as far as doing its work. A
task that fails without a re-run (its worker died under a live agent, a timeout) leaves its item
pending until the queue's reference count or expiry deletes it.

Outside a task (the driver program) ``get`` is ``BLPOP``: the item leaves Redis in the command
that returns it, so a driver killed after ``get`` loses it (**at most once**, the standard
library's semantics: an item read from its pipe is gone too).

Cost, per ``get`` in a task with an item waiting: still one round trip, as one transaction
(``MULTI DEL RPUSH LMOVE EXPIRE EXEC``, against one ``BLPOP``): 426 request bytes against 77,
measured on redis-server (docs/multiprocessing.md), the same reply; and one extra list per
consumer task and queue, holding the one item in hand (plus an empty marker that keeps the list, and its expiry,
alive while ``BLMOVE`` waits). An empty queue costs one more round trip before the wait, not
after the item arrives; the first ``get`` of each task and queue, one more (reading what a
killed run held).
"""

from __future__ import annotations

import queue as _queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cloud_hub.client.multiprocessing._resource import Resource, connection, dumps, loads, retrying

__all__ = ["Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Connection"]

#: first element of every pending list: keeps the list (and its expiry) alive while BLMOVE waits;
#: never an item (items are pickles, never empty)
_MARK = b""


def _task_id() -> str | None:
    """The mesh task running in this process (set by the agent's worker), or None in a driver."""
    w = sys.modules.get("mesh_agent.engine._worker")
    return getattr(w, "CURRENT_TASK_ID", None) if w is not None else None


@dataclass
class _Held:
    """What this process's consumer holds of one queue in the current task."""

    url: str
    redeliver: list[bytes] = field(default_factory=list)  # left by a killed run, still to hand out
    current: bytes | None = None  # a re-delivered item in hand (the next get drops it with LREM)


_held_lock = threading.Lock()
_held_task: str | None = None
_held: dict[str, _Held] = {}  # pending list key -> state, for the task _held_task


def _holding(task: str) -> dict[str, _Held]:
    """This task's pending lists; a new task in this process means the previous one ended (its
    worker lives on), so its items are consumed: their lists are cleared first."""
    global _held_task
    with _held_lock:
        if _held_task == task:
            return _held
        old, _held_task = dict(_held), task
        _held.clear()
    _clear(old)
    return _held


def _clear(held: dict[str, _Held]) -> None:
    by_url: dict[str, list[str]] = {}
    for key, h in held.items():
        by_url.setdefault(h.url, []).append(key)
    for url, keys in by_url.items():
        try:
            r = connection(url)
            pipe = r.pipeline(transaction=False)
            for k in keys:
                prefix, task = k.rsplit(":pending:", 1)
                pipe.delete(k)
                pipe.srem(prefix + ":consumers", task)
            retrying(url, pipe.execute)
        except Exception:
            pass  # the store gone: the lists' expiry deletes them


def task_ended() -> None:
    """Called by the Process and Pool wrappers when their task returns (or raises): the items its
    consumers got are consumed, and their pending lists go."""
    global _held_task
    with _held_lock:
        old, _held_task = dict(_held), None
        _held.clear()
    if old:
        _clear(old)


class Queue(Resource):
    """``multiprocessing.Queue(maxsize=0)``; ``get`` raises ``queue.Empty`` on timeout, ``put``
    ``queue.Full`` when ``maxsize`` stays reached."""

    _suffixes = ("items", "unfinished", "consumers")  # consumers: task ids with a pending list
    _members = ("consumers", "pending:")  # the count's release deletes those lists too

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__()
        self._maxsize = max(0, int(maxsize))
        self._closed = False

    def _state(self) -> dict[str, Any]:
        return {"maxsize": self._maxsize}

    def _restore(self, state: dict[str, Any]) -> None:
        self._maxsize, self._closed = state["maxsize"], False

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        blob = dumps(obj)
        if self._maxsize:
            end = None if timeout is None else time.monotonic() + timeout
            delay = 0.001
            while self.call(lambda: self._r.llen(self.key("items"))) >= self._maxsize:
                if not block or (end is not None and time.monotonic() >= end):
                    raise _queue.Full
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        pipe = self._r.pipeline()
        pipe.rpush(self.key("items"), blob)
        pipe.incr(self.key("unfinished"))
        self.touch(pipe)
        self.call(pipe.execute)

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        task = _task_id()
        if task is not None:
            blob = self._get_in_task(task, block, timeout)
        else:
            items = self.key("items")
            if not block:
                blob = self.call(lambda: self._r.lpop(items))
            else:
                t = 0.0 if timeout is None else max(float(timeout), 0.001)
                got = self.call(lambda: self._r.blpop([items], timeout=t))
                blob = None if got is None else got[1]
        if blob is None:
            raise _queue.Empty
        return loads(blob)

    def _get_in_task(self, task: str, block: bool, timeout: float | None) -> bytes | None:
        """At least once: see the module's docstring."""
        items, pending = self.key("items"), self.key("pending:" + task)
        held = _holding(task)
        h = held.get(pending)
        if h is None:  # this task's first get here: what did a killed run of it hold?
            pipe = self._r.pipeline()
            pipe.lrange(pending, 0, -1)
            pipe.expire(pending, self._ttl)
            pipe.sadd(self.key("consumers"), task)
            pipe.expire(self.key("consumers"), self._ttl)
            left = [b for b in self.call(pipe.execute)[0] if b != _MARK]
            h = held[pending] = _Held(self._url, redeliver=left)
        if h.redeliver:  # hand out what the killed run held first; each stays pending until the next get
            prev, h.current = h.current, h.redeliver.pop(0)
            if prev is not None:
                self.call(lambda: self._r.lrem(pending, 1, prev))
            return h.current
        # drop the item in hand, take the next: one transaction, so a crash leaves one or the other
        h.current = None
        pipe = self._r.pipeline()
        pipe.delete(pending)
        pipe.rpush(pending, _MARK)
        pipe.lmove(items, pending, "LEFT", "RIGHT")
        pipe.expire(pending, self._ttl)
        blob = self.call(pipe.execute)[2]
        if blob is not None or not block:
            return blob
        t = 0.0 if timeout is None else max(float(timeout), 0.001)
        return self.call(lambda: self._r.blmove(items, pending, t, "LEFT", "RIGHT"))

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return int(self.call(lambda: self._r.llen(self.key("items"))))

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        self._closed = True

    def join_thread(self) -> None:
        pass

    def cancel_join_thread(self) -> None:
        pass


class JoinableQueue(Queue):
    """Adds ``task_done`` and ``join`` (a count of items put and not yet done)."""

    def task_done(self) -> None:
        if self.call(lambda: self._r.decr(self.key("unfinished"))) < 0:
            self.call(lambda: self._r.incr(self.key("unfinished")))
            raise ValueError("task_done() called too many times")

    def join(self) -> None:
        delay = 0.002
        while int(self.call(lambda: self._r.get(self.key("unfinished"))) or 0) > 0:
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


class SimpleQueue(Queue):
    """``multiprocessing.SimpleQueue``: ``put(obj)``, ``get()`` (blocks), ``empty``, ``close``;
    after ``close`` both raise ``OSError: handle is closed``, as the standard library's do."""

    def __init__(self) -> None:
        super().__init__(0)

    def put(self, obj: Any) -> None:  # type: ignore[override]
        if self._closed:
            raise OSError("handle is closed")
        super().put(obj)

    def get(self) -> Any:  # type: ignore[override]
        if self._closed:
            raise OSError("handle is closed")
        return super().get()


class Connection(Resource):
    """One end of a ``Pipe``: reads its inbox list, writes the other end's."""

    _suffixes = ("a", "b")

    def __init__(self, *, _prefix: str | None = None, _inbox: str = "a", _outbox: str = "b",
                 readable: bool = True, writable: bool = True) -> None:
        super().__init__(_prefix=_prefix)
        self._inbox, self._outbox = _inbox, _outbox
        self.readable, self.writable = readable, writable
        self.closed = False

    def _state(self) -> dict[str, Any]:
        return {"inbox": self._inbox, "outbox": self._outbox, "readable": self.readable, "writable": self.writable}

    def _restore(self, state: dict[str, Any]) -> None:
        self._inbox, self._outbox = state["inbox"], state["outbox"]
        self.readable, self.writable, self.closed = state["readable"], state["writable"], False

    def _check(self, writing: bool) -> None:
        if self.closed:
            raise OSError("handle is closed")
        if writing and not self.writable:
            raise OSError("connection is read-only")
        if not writing and not self.readable:
            raise OSError("connection is write-only")

    def send_bytes(self, buf: bytes, offset: int = 0, size: int | None = None) -> None:
        self._check(True)
        data = bytes(memoryview(buf)[offset: None if size is None else offset + size])
        self.call(lambda: self._r.rpush(self.key(self._outbox), data))

    def send(self, obj: Any) -> None:
        self.send_bytes(dumps(obj))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        self._check(False)
        got = self.call(lambda: self._r.blpop([self.key(self._inbox)], timeout=0))
        data: bytes = got[1]
        if maxlength is not None and len(data) > maxlength:
            raise OSError("bad message length")
        return data

    def recv(self) -> Any:
        return loads(self.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether data is waiting; waits up to ``timeout`` (None: for ever) without taking it."""
        self._check(False)
        inbox = self.key(self._inbox)
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            if self.call(lambda: self._r.llen(inbox)):
                return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(delay if end is None else max(0.0, min(delay, end - time.monotonic())))
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        self.closed = True

    def fileno(self) -> int:
        raise OSError("a mesh Pipe end has no file descriptor")

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """``(conn1, conn2)`` as ``multiprocessing.Pipe``: with ``duplex=False`` conn1 only receives
    and conn2 only sends."""
    a = Connection(_inbox="a", _outbox="b", writable=duplex)
    b = Connection(_prefix=a._prefix, _inbox="b", _outbox="a", readable=duplex)
    return a, b
