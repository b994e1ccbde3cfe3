"""Group commit for the hub's SQLite store: many callers' transactions, one COMMIT (one fsync).

Why: the hub has one database thread, and a durable commit costs an fsync. Measured with the
swarm (docs/benchmarks.md), the fsyncs per second, not the CPU, capped how many hellos, acks and
results the hub could take: 10,000 endpoints saying hello at once queued every other frame for
tens of seconds. Here every operation handed to :meth:`GroupCommitter.submit` waits in a list;
the database thread takes everything that arrived while it was busy with the previous group and
runs it in one transaction. An idle hub still commits each operation at once (no added delay);
a busy one commits hundreds per fsync.

What each caller is promised is unchanged:

* Its future resolves only after the COMMIT that holds its writes returned. So a caller that
  acknowledges something after ``await`` (the dispatcher's ``result_ack``) never acknowledges
  anything that is not on disk.
* Each operation runs inside its own SAVEPOINT: one that raises is rolled back alone and gets its
  own exception; the others in the group commit. Ops see each other's writes in arrival order,
  as they would have one transaction after another.
* If the whole transaction is lost (SQLite rolls back by itself on a full disk or an I/O error,
  or the COMMIT fails), every operation whose writes were in it fails with that error: nothing is
  reported as stored that is not.
* The group is durable (``synchronous=FULL``) when any of its operations asked to be; one made
  only of non-durable operations (leases, acks) commits without the fsync, as they did alone.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable

from mesh_agent import costs

__all__ = ["GroupCommitter", "MAX_GROUP"]

#: At most this many operations per transaction: a herd of hellos still lets reads queued on the
#: database thread (the API's, the console's) run between groups.
MAX_GROUP = 512


@dataclass
class _Op:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    durable: bool
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class GroupCommitter:
    """Collects transactions from the event loop and runs them in groups on the database thread.

    ``conn()`` returns the store's connection (used on the database thread only); ``translate``
    turns an exception that lost the whole transaction into the one callers should see (a full
    disk becomes ``StoreFull``) and returns it."""

    def __init__(self, pool: Executor, conn: Callable[[], sqlite3.Connection],
                 translate: Callable[[BaseException], BaseException]) -> None:
        self._pool = pool
        self._conn = conn
        self._translate = translate
        self._lock = threading.Lock()
        self._pending: list[_Op] = []
        self._scheduled = False  # a flush job is queued on the pool or running
        #: transactions committed, operations in them, the largest group, ops that failed alone
        self.stats = {"transactions": 0, "ops": 0, "largest": 0, "failed_ops": 0}

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...], durable: bool) -> asyncio.Future[Any]:
        """Queue ``fn(db, *args)``; the future holds its return value once its group committed."""
        loop = asyncio.get_running_loop()
        op = _Op(fn, args, durable, loop.create_future(), loop)
        with self._lock:
            self._pending.append(op)
            if self._scheduled:
                return op.future
            self._scheduled = True
        try:
            self._pool.submit(self._flush)
        except RuntimeError:  # the store is closing (its thread pool shut down)
            self._drop_pending()
            raise
        return op.future

    def _drop_pending(self) -> None:
        with self._lock:
            dropped, self._pending, self._scheduled = self._pending, [], False
        for op in dropped:
            self._fail(op, RuntimeError("the hub store is closed"))

    # ------------------------------------------------------------------ database thread
    def _flush(self) -> None:
        with self._lock:
            group, self._pending = self._pending[:MAX_GROUP], self._pending[MAX_GROUP:]
            more = bool(self._pending)
            self._scheduled = more
        try:
            if group:
                self._run_group(group)
        except BaseException as exc:  # the connection itself failed (closed store, ...): nobody may wait forever
            try:
                db = self._conn()
                if db.in_transaction:
                    db.execute("ROLLBACK")
            except BaseException:
                pass
            err = self._translate(exc)
            for op in group:
                self._fail(op, err)
        finally:
            if more:  # behind whatever else was queued on the thread meanwhile
                try:
                    self._pool.submit(self._flush)
                except RuntimeError:  # the store is closing
                    self._drop_pending()

    def _run_group(self, group: list[_Op]) -> None:
        db = self._conn()
        durable = any(op.durable for op in group)
        done: list[tuple[_Op, Any]] = []  # ran and released: waiting for the COMMIT
        if not durable:
            db.execute("PRAGMA synchronous=NORMAL")
        try:
            for op in group:
                if op.future.cancelled():
                    continue  # its caller is gone; as before, a cancelled wait may still have written (harmless)
                if not db.in_transaction:
                    try:
                        db.execute("BEGIN IMMEDIATE")
                    except BaseException as exc:
                        self._fail(op, self._translate(exc))
                        continue
                db.execute("SAVEPOINT op")
                try:
                    with costs.stage(db_stage(op.fn)):
                        out = op.fn(db, *op.args)
                except BaseException as exc:
                    if db.in_transaction:  # roll back this operation only
                        db.execute("ROLLBACK TO op")
                        db.execute("RELEASE op")
                        self.stats["failed_ops"] += 1
                        self._fail(op, exc)
                    else:  # SQLite rolled the whole transaction back (full disk, I/O error)
                        err = self._translate(exc)
                        self._fail(op, err)
                        for prev, _ in done:
                            self._fail(prev, err)
                        done.clear()
                    continue
                db.execute("RELEASE op")
                done.append((op, out))
            if db.in_transaction:
                try:
                    with costs.stage("db.commit"):
                        db.execute("COMMIT")
                except BaseException as exc:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    err = self._translate(exc)
                    for op, _ in done:
                        self._fail(op, err)
                    return
            if done:
                self.stats["transactions"] += 1
                self.stats["ops"] += len(done)
                self.stats["largest"] = max(self.stats["largest"], len(done))
            for op, out in done:
                try:
                    op.loop.call_soon_threadsafe(_resolve, op.future, out)
                except RuntimeError:  # its event loop is closed: nobody is waiting
                    pass
        finally:
            if not durable:
                db.execute("PRAGMA synchronous=FULL")

    @staticmethod
    def _fail(op: _Op, exc: BaseException) -> None:
        try:
            op.loop.call_soon_threadsafe(_reject, op.future, exc)
        except RuntimeError:  # its event loop is closed: nobody is waiting
            pass


def db_stage(fn: Callable[..., Any]) -> str:
    """The ledger's name for a database operation: ``db.`` and the store method that made it
    (not worked out while the ledger is off). A method's ``_query`` form (``lease_query``, what
    ``lease`` runs) is charged as the method."""
    if not costs.enabled:
        return ""
    name = getattr(fn, "__qualname__", "op").split(".<locals>")[0].rsplit(".", 1)[-1]
    return f"db.{name.removesuffix('_query')}"


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
