"""Queue, SimpleQueue, JoinableQueue and Pipe over Redis lists.

Delivery: a ``get`` removes the item from Redis in the same command that returns it (``BLPOP``),
so a consumer SIGKILLed after ``get`` loses that item and no other consumer sees it twice:
**at most once**, the standard library's semantics (an item read from its pipe is gone too).
Programs that must not lose work on a crash use ``JoinableQueue`` and re-put what was not
``task_done``, or the Pool, whose tasks the mesh re-runs (at least once).
"""

from __future__ import annotations

import queue as _queue
import time
from typing import Any

from cloud_hub.client.multiprocessing._resource import Resource, dumps, loads

__all__ = ["Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Connection"]


class Queue(Resource):
    """``multiprocessing.Queue(maxsize=0)``; ``get`` raises ``queue.Empty`` on timeout, ``put``
    ``queue.Full`` when ``maxsize`` stays reached."""

    _suffixes = ("items", "unfinished")

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
