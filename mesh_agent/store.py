"""The agent's durable queue: one SQLite file (WAL) holding tasks and results across power cuts.

Why one table for both directions: a task row moves ``queued -> done -> acked``. It is written
before the hub is told "stored" (ack), its result is written into the same row before it is
sent, and the row keeps its id (without payloads) after the hub acknowledged the result, so a
late duplicate of the same task is recognised and not run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import aiosqlite

from mesh_agent import costs

__all__ = ["AgentStore", "StoreError", "StoreFull", "QueuedTask", "StoredResult"]

log = logging.getLogger(__name__)

_UNCHARGED = contextlib.nullcontext()  # a write outside the CPU ledger's stages (mesh_agent/costs.py)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS functions (
    id TEXT PRIMARY KEY, body BLOB NOT NULL, stored_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    function_id TEXT NOT NULL,
    args BLOB,
    timeout REAL,
    expires REAL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'done', 'acked')),
    received REAL NOT NULL,
    ok INTEGER,
    result BLOB,
    started REAL,
    finished REAL,
    worker_pid INTEGER,
    env TEXT,  -- the environment spec from the signed task (canonical JSON, mesh_agent/protocol/environment.py), or NULL
    now INTEGER  -- 1: start at once, outside the pool's count (a multiprocessing Process), or NULL
);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state, received);
-- A site gateway's store-and-forward queues (mesh_agent/gateway.py, docs/sites.md): whole signed
-- frames it relays and cannot alter, 'down' (hub -> a device: tasks held until the device acks
-- them) and 'up' (a device -> hub: results held until the hub acks them, acks until sent).
CREATE TABLE IF NOT EXISTS relay (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    dir TEXT NOT NULL CHECK (dir IN ('up', 'down')),
    endpoint TEXT NOT NULL,
    kind TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    frame BLOB NOT NULL,
    exp REAL NOT NULL,
    sent REAL NOT NULL DEFAULT 0,
    UNIQUE (dir, endpoint, msg_id)
);
CREATE TABLE IF NOT EXISTS relay_ids (
    seq INTEGER NOT NULL, task_id TEXT NOT NULL, PRIMARY KEY (seq, task_id)
);
CREATE INDEX IF NOT EXISTS relay_ids_task ON relay_ids (task_id);
"""


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back a failed transaction. SQLite may already have rolled back on its own
    (SQLITE_FULL): a second ROLLBACK would raise "no transaction is active" and hide the real error."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


class StoreError(RuntimeError):
    """The queue database cannot be used; the message says which file and why."""


class StoreFull(StoreError):
    """The disk holding the queue (or ``queue_max_mb``) is full: the write was rolled back whole."""


_SQLITE_FULL = 13  # sqlite3.SQLITE_FULL, which Python 3.10's sqlite3 module does not define


def _write_error(path: Path, exc: sqlite3.Error) -> StoreError:
    """Turn SQLite's error into one that names the file and, for a full disk, says so plainly."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if code == _SQLITE_FULL or "full" in str(exc).lower():
        return StoreFull(f"{path}: disk full ({exc}); free space on that filesystem (or raise queue_max_mb)")
    return StoreError(f"{path}: cannot write the queue database ({exc})")


@dataclass(slots=True)
class QueuedTask:
    id: str
    function_id: str
    args: bytes
    timeout: float | None
    expires: float | None
    env: str | None = None  # canonical JSON of the task's environment spec
    now: int | None = None  # 1: start at once (a multiprocessing Process)


@dataclass(slots=True)
class StoredResult:
    id: str
    ok: bool
    data: bytes
    started: float
    finished: float
    worker_pid: int


class AgentStore:
    def __init__(self, path: Path, sync: str = "full", max_mb: int | None = None) -> None:
        self.path = Path(path)
        self._sync = sync.upper()
        self._max_mb = max_mb
        self._db: aiosqlite.Connection | None = None
        # One connection is shared by the reader and the result flusher: transactions must not interleave.
        self._tx_lock = asyncio.Lock()

    async def open(self) -> "AgentStore":
        from mesh_agent._private import prepare_private_sqlite

        prepare_private_sqlite(self.path)  # 0600 before SQLite creates it: task data is private
        try:
            db = await aiosqlite.connect(self.path, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open queue database: {exc}") from None
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute(f"PRAGMA synchronous={self._sync}")
            await db.execute("PRAGMA busy_timeout=5000")
            if self._max_mb:
                page = (await (await db.execute("PRAGMA page_size")).fetchone())[0]  # type: ignore[index]
                await db.execute(f"PRAGMA max_page_count={max(1, self._max_mb * 2**20 // page)}")
            row = await (await db.execute("PRAGMA quick_check")).fetchone()
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else 'no answer'}")
            await db.executescript(_SCHEMA)
            cols = {r[1] for r in await (await db.execute("PRAGMA table_info(tasks)")).fetchall()}
            if "env" not in cols:  # a queue written by an agent before environments (issue 16)
                await db.execute("ALTER TABLE tasks ADD COLUMN env TEXT")
            if "now" not in cols:  # a queue written before tasks that start at once (issue 28)
                await db.execute("ALTER TABLE tasks ADD COLUMN now INTEGER")
            cur = await db.execute("SELECT value FROM meta WHERE key='schema_version'")
            found = await cur.fetchone()
            if found is None:
                await db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(found[0]) > SCHEMA_VERSION:
                raise StoreError(f"{self.path}: queue schema v{found[0]} is newer than this agent (v{SCHEMA_VERSION})")
        except sqlite3.DatabaseError as exc:
            await db.close()
            full = _write_error(self.path, exc)
            if isinstance(full, StoreFull):  # a sound queue on a full disk: say that, not "corrupt"
                raise full from None
            raise StoreError(
                f"{self.path}: not a usable queue database ({exc}). Run `mesh-agent queue recover` to move it "
                "aside and keep every task and result still readable in it; the hub re-sends the rest."
            ) from None
        self._db = db
        return self

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    async def add_tasks(
        self, functions: dict[str, bytes], tasks: Sequence[dict[str, Any]],
        on_fresh: Callable[[list[str]], None] | None = None, *, rerun_acked_before: float | None = None,
        held_back: list[str] | None = None,
    ) -> list[str]:
        """Store a batch durably in one transaction; return the ids that were new (not duplicates).

        ``rerun_acked_before`` (this machine's clock): a task whose result the hub acknowledged,
        and that finished before this time, is run again instead of being a duplicate. The agent
        passes the time the frame carrying the batch was signed, less a margin: a frame signed
        after the task finished is a hub that no longer has the result (restored from a backup),
        while a replayed frame was signed before the task first ran, so replaying it never makes
        a task run twice. None: every task already known is a duplicate.

        ``held_back`` (a list, filled in): tasks whose result the hub acknowledged and that were
        not run again because the frame's signing time was within the margin of their finish. The
        agent must not acknowledge these: a hub restored from a backup moments after they finished
        would otherwise mark them delivered and wait for a result forever. Unacknowledged, its lease
        expires and it signs them again later, past the margin (a replay still never runs).

        ``on_fresh(ids)`` is called once the duplicates are known, before the insert is written:
        the agent starts running new tasks while their rows are committed instead of after (the
        fsync is off the critical path). It is safe because the transaction lock is held until
        the commit, so a result of one of these tasks cannot be saved before its row exists, and
        the hub is acknowledged only after this returns: a crash before the commit means the
        hub re-sends, and the task runs again (at least once).
        """
        now = time.time()
        db = self.db
        async with self._tx_lock:
            return await self._add_tasks(db, now, functions, tasks, on_fresh, rerun_acked_before, held_back)

    async def _add_tasks(
        self, db: aiosqlite.Connection, now: float, functions: dict[str, bytes], tasks: Sequence[dict[str, Any]],
        on_fresh: Callable[[list[str]], None] | None, rerun_acked_before: float | None = None,
        held_back: list[str] | None = None,
    ) -> list[str]:
        """The whole transaction in one call on the connection's thread: one thread hop per
        batch instead of one per statement (BEGIN, SELECT, INSERTs, COMMIT: 4-5 hops, each a
        queue put, a thread switch and an event-loop wake-up on the round trip's critical path).
        ``on_fresh`` is handed to the event loop between the SELECT and the INSERT, so the agent
        starts the tasks while this thread writes and commits them, as before."""
        loop = asyncio.get_running_loop()

        def tx(conn: sqlite3.Connection) -> list[str]:
            with costs.stage("agent.store_task"):  # on the connection's thread, commit included
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    ids = [t["id"] for t in tasks]
                    known: set[str] = set()
                    rerun: list[str] = []
                    for i in range(0, len(ids), 500):
                        chunk = ids[i : i + 500]
                        rows = conn.execute(f"SELECT id, state, finished FROM tasks WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                        for tid, state, finished in rows:
                            # 'acked': the hub acknowledged its result, yet signed this task again after it
                            # finished, so the hub no longer has that result (restored from an older
                            # backup): run it again (at least once) rather than ack a task that would
                            # never finish. A re-send racing its own result's ack costs one extra run;
                            # the hub stores one result. (See the docstring: a replay never qualifies.)
                            if state == "acked" and rerun_acked_before is not None and (finished or 0.0) < rerun_acked_before:
                                rerun.append(tid)
                            else:
                                known.add(tid)
                                if state == "acked" and rerun_acked_before is not None and held_back is not None:
                                    held_back.append(tid)
                    if rerun:
                        conn.executemany("DELETE FROM tasks WHERE id=? AND state='acked'", [(t,) for t in rerun])
                        log.warning("%d tasks sent again after their results were acknowledged (a hub restored from a backup?): "
                                    "running them again", len(rerun))
                    fresh = [t for t in tasks if t["id"] not in known]
                    if on_fresh is not None and fresh:
                        loop.call_soon_threadsafe(on_fresh, [t["id"] for t in fresh])
                    if functions:
                        conn.executemany(
                            "INSERT OR IGNORE INTO functions (id, body, stored_at) VALUES (?, ?, ?)",
                            [(fid, body, now) for fid, body in functions.items()],
                        )
                    conn.executemany(
                        "INSERT OR IGNORE INTO tasks (id, function_id, args, timeout, expires, state, received, env, now) "
                        "VALUES (?, ?, ?, ?, ?, 'queued', ?, ?, ?)",
                        [(t["id"], t["fn"], t["args"], t.get("timeout"), t.get("exp"), now, t.get("env"), 1 if t.get("now") else None) for t in fresh],
                    )
                    conn.execute("COMMIT")
                except BaseException:
                    _rollback_quietly(conn)
                    raise
                return [t["id"] for t in fresh]

        try:
            return await db._execute(tx, db._conn)  # aiosqlite's own "run this on my thread"
        except sqlite3.Error as exc:
            raise _write_error(self.path, exc) from None

    @staticmethod
    async def _rollback(db: aiosqlite.Connection) -> None:
        # SQLite may already have rolled back on its own (SQLITE_FULL): a second ROLLBACK would
        # raise "no transaction is active" and hide the real error.
        if db.in_transaction:
            try:
                await db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    async def _many(self, sql: str, rows: list[tuple[Any, ...]], stage: str | None = None) -> None:
        """One transaction (one fsync) for a whole batch; autocommit would pay one per row. Run
        whole on the connection's thread: one thread hop, not three (BEGIN, executemany, COMMIT).
        ``stage``: the CPU ledger's stage charged with it, on that thread (mesh_agent/costs.py)."""
        db = self.db

        def tx(conn: sqlite3.Connection) -> None:
            with costs.stage(stage) if stage is not None else _UNCHARGED:
                if len(rows) == 1:  # one autocommit statement is its own transaction
                    conn.execute(sql, rows[0])
                    return
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.executemany(sql, rows)
                    conn.execute("COMMIT")
                except BaseException:
                    _rollback_quietly(conn)
                    raise

        async with self._tx_lock:
            try:
                await db._execute(tx, db._conn)
            except sqlite3.Error as exc:
                raise _write_error(self.path, exc) from None

    async def queued_tasks(self, exclude: Iterable[str] = ()) -> list[QueuedTask]:
        """Tasks stored but without a result: after a restart these run (again)."""
        skip = set(exclude)
        cur = await self.db.execute(
            "SELECT id, function_id, args, timeout, expires, env, now FROM tasks WHERE state='queued' ORDER BY received, rowid"
        )
        return [QueuedTask(*r) for r in await cur.fetchall() if r[0] not in skip]

    async def function_bodies(self, ids: Iterable[str]) -> dict[str, bytes]:
        ids = list(set(ids))
        out: dict[str, bytes] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            cur = await self.db.execute(f"SELECT id, body FROM functions WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            out.update({r[0]: r[1] for r in await cur.fetchall()})
        return out

    async def save_results(self, results: Sequence[StoredResult]) -> None:
        """Write results before they are sent; a result for an already-acked task is ignored."""
        await self._many(
            "UPDATE tasks SET state='done', ok=?, result=?, started=?, finished=?, worker_pid=?, args=NULL "
            "WHERE id=? AND state='queued'",
            [(int(r.ok), r.data, r.started, r.finished, r.worker_pid, r.id) for r in results],
            stage="agent.store_result",
        )

    async def cancel_tasks(self, ids: Sequence[str], now: float) -> list[str]:
        """The submitter cancelled these tasks (the hub's ``tasks.cancel``; the hub already holds
        their one ``cancelled`` result). In one transaction: a stored task without a result is
        finished with no result to send (state ``acked``: it is never run again, not even after a
        restart); an id never seen here is remembered the same way, so a tasks frame for it that
        arrives later (still held by a site gateway) is a duplicate, not a task. A task that has a
        result keeps it (the hub drops it as a repeat). Returns the ids that had no result."""
        ids = list(dict.fromkeys(ids))
        db = self.db

        def tx(conn: sqlite3.Connection) -> list[str]:
            try:
                conn.execute("BEGIN IMMEDIATE")
                known: dict[str, str] = {}
                for i in range(0, len(ids), 500):
                    chunk = ids[i : i + 500]
                    known.update(conn.execute(f"SELECT id, state FROM tasks WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
                stopped = [i for i in ids if known.get(i) == "queued"]
                conn.executemany("UPDATE tasks SET state='acked', ok=0, result=NULL, args=NULL, started=?, finished=? "
                                 "WHERE id=? AND state='queued'", [(now, now, i) for i in stopped])
                conn.executemany("INSERT OR IGNORE INTO tasks (id, function_id, state, received, ok, finished) VALUES (?, '', 'acked', ?, 0, ?)",
                                 [(i, now, now) for i in ids if i not in known])
                conn.execute("COMMIT")
                return stopped
            except BaseException:
                _rollback_quietly(conn)
                raise

        async with self._tx_lock:
            try:
                return await db._execute(tx, db._conn)
            except sqlite3.Error as exc:
                raise _write_error(self.path, exc) from None

    async def unacked_results(self, limit: int = 1000) -> list[StoredResult]:
        cur = await self.db.execute(
            "SELECT id, ok, result, started, finished, worker_pid FROM tasks WHERE state='done' "
            "ORDER BY finished LIMIT ?",
            (limit,),
        )
        return [StoredResult(r[0], bool(r[1]), r[2], r[3], r[4], r[5] or 0) for r in await cur.fetchall()]

    async def mark_acked(self, ids: Sequence[str]) -> None:
        """The hub holds these results durably: drop the payloads, keep the ids for de-duplication."""
        if not ids:
            return
        await self._many(
            "UPDATE tasks SET state='acked', result=NULL, args=NULL WHERE id=? AND state='done'", [(i,) for i in ids],
            stage="agent.ack",
        )

    async def held_ids(self, limit: int = 100_000) -> list[str]:
        """Ids of tasks this agent holds (queued or with a result not yet acked), for the hub's reconciliation."""
        cur = await self.db.execute("SELECT id FROM tasks WHERE state IN ('queued', 'done') LIMIT ?", (limit,))
        return [r[0] for r in await cur.fetchall()]

    async def counts(self) -> dict[str, int]:
        cur = await self.db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state")
        out = {"queued": 0, "done": 0, "acked": 0}
        out.update({r[0]: r[1] for r in await cur.fetchall()})
        return out

    async def listing(self, limit: int = 50) -> list[dict[str, Any]]:
        cur = await self.db.execute(
            "SELECT id, function_id, state, received, finished, ok FROM tasks "
            "WHERE state != 'acked' ORDER BY received DESC LIMIT ?",
            (limit,),
        )
        cols = ["id", "function_id", "state", "received", "finished", "ok"]
        return [dict(zip(cols, r)) for r in await cur.fetchall()]

    # ------------------------------------------------------------------ relay (site gateway)
    async def relay_put(self, direction: str, endpoint: str, kind: str, msg_id: str, frame: bytes, exp: float,
                        task_ids: Sequence[str] = ()) -> bool:
        """Keep a frame to forward, durably, before anyone is told it arrived; False: a duplicate."""
        db = self.db
        async with self._tx_lock:
            try:
                await db.execute("BEGIN IMMEDIATE")
                ids = sorted(set(task_ids))
                copy = direction == "up" and kind == "results" and bool(ids)
                if copy and await self._relay_held(db, endpoint, ids) == len(ids):
                    # A device's re-signed copy of results we hold already (new message id, same
                    # tasks): the copy we have goes up, this one is not kept (one copy per result).
                    await db.execute("COMMIT")
                    return False
                cur = await db.execute(
                    "INSERT OR IGNORE INTO relay (dir, endpoint, kind, msg_id, frame, exp) VALUES (?, ?, ?, ?, ?, ?)",
                    (direction, endpoint, kind, msg_id, frame, exp))
                new = cur.rowcount == 1
                if new and task_ids:
                    seq = cur.lastrowid
                    await db.executemany("INSERT OR IGNORE INTO relay_ids (seq, task_id) VALUES (?, ?)", [(seq, t) for t in ids])
                    if copy:  # older frames give up the tasks this one carries; a frame left with none goes
                        for i in range(0, len(ids), 500):
                            chunk = ids[i : i + 500]
                            await db.execute(
                                f"DELETE FROM relay_ids WHERE seq<>? AND task_id IN ({','.join('?' * len(chunk))}) AND seq IN "
                                "(SELECT seq FROM relay WHERE dir='up' AND endpoint=? AND kind='results')", (seq, *chunk, endpoint))
                        await db.execute("DELETE FROM relay WHERE dir='up' AND endpoint=? AND kind='results' "
                                         "AND seq NOT IN (SELECT seq FROM relay_ids)", (endpoint,))
                await db.execute("COMMIT")
                return new
            except sqlite3.Error as exc:
                await self._rollback(db)
                raise _write_error(self.path, exc) from None
            except BaseException:
                await self._rollback(db)
                raise

    @staticmethod
    async def _relay_held(db: Any, endpoint: str, ids: list[str]) -> int:
        """How many of ``ids`` an up results frame of ``endpoint`` held here already carries."""
        held = 0
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            cur = await db.execute(
                f"SELECT COUNT(DISTINCT i.task_id) FROM relay_ids i JOIN relay r ON r.seq = i.seq WHERE r.dir='up' "
                f"AND r.endpoint=? AND r.kind='results' AND i.task_id IN ({','.join('?' * len(chunk))})", (endpoint, *chunk))
            held += int((await cur.fetchone())[0])
        return held

    async def relay_pending(self, direction: str, *, endpoint: str | None = None, sent_before: float = float("inf"),
                            limit: int = 500) -> list[tuple[int, str, str, bytes]]:
        """(seq, endpoint, kind, frame) of frames to (re)send, oldest first."""
        where, args = "dir=? AND sent < ?", [direction, sent_before]
        if endpoint is not None:
            where += " AND endpoint=?"
            args.append(endpoint)
        cur = await self.db.execute(f"SELECT seq, endpoint, kind, frame FROM relay WHERE {where} ORDER BY seq LIMIT ?", (*args, limit))
        return [(r[0], r[1], r[2], r[3]) for r in await cur.fetchall()]

    async def relay_sent(self, seqs: Sequence[int], now: float, *, drop: bool = False) -> None:
        """Mark frames sent (kept until released), or drop them (nothing more to wait for)."""
        if seqs:
            sql = "DELETE FROM relay WHERE seq=?" if drop else f"UPDATE relay SET sent={float(now)!r} WHERE seq=?"
            await self._many(sql, [(q,) for q in seqs])

    async def relay_release(self, direction: str, endpoint: str, task_ids: Sequence[str]) -> int:
        """These tasks were acknowledged (a device's ack, the hub's result_ack): frames of theirs
        with no other task still waiting are dropped. Returns how many frames were dropped."""
        if not task_ids:
            return 0
        db = self.db
        async with self._tx_lock:
            try:
                await db.execute("BEGIN IMMEDIATE")
                for i in range(0, len(task_ids), 500):
                    chunk = list(task_ids[i : i + 500])
                    await db.execute(
                        f"DELETE FROM relay_ids WHERE task_id IN ({','.join('?' * len(chunk))}) AND seq IN "
                        "(SELECT seq FROM relay WHERE dir=? AND endpoint=?)", (*chunk, direction, endpoint))
                cur = await db.execute(
                    "DELETE FROM relay WHERE dir=? AND endpoint=? AND kind IN ('tasks', 'results') "
                    "AND seq NOT IN (SELECT seq FROM relay_ids)", (direction, endpoint))
                await db.execute("COMMIT")
                return cur.rowcount
            except sqlite3.Error as exc:
                await self._rollback(db)
                raise _write_error(self.path, exc) from None
            except BaseException:
                await self._rollback(db)
                raise

    async def relay_expire(self, now: float) -> int:
        """Drop frames past their expiry: the receiver would refuse them as stale anyway."""
        cur = await self.db.execute("DELETE FROM relay WHERE exp < ?", (now,))
        await self.db.execute("DELETE FROM relay_ids WHERE seq NOT IN (SELECT seq FROM relay)")
        return cur.rowcount

    async def relay_counts(self) -> dict[str, int]:
        cur = await self.db.execute("SELECT dir || ':' || kind, COUNT(*) FROM relay GROUP BY dir, kind")
        return {r[0]: r[1] for r in await cur.fetchall()}

    async def get_meta(self, key: str) -> str | None:
        row = await (await self.db.execute("SELECT value FROM meta WHERE key=?", (key,))).fetchone()
        return None if row is None else str(row[0])

    async def set_meta(self, key: str, value: str | None) -> None:
        if value is None:
            await self._many("DELETE FROM meta WHERE key=?", [(key,)])
        else:
            await self._many("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [(key, value)])

    async def prune(self, older_than_s: float = 7 * 86400) -> int:
        """Forget acked ids older than the retention window (longer than any message's lifetime)."""
        cur = await self.db.execute(
            "DELETE FROM tasks WHERE state='acked' AND finished < ?", (time.time() - older_than_s,)
        )
        await self.db.execute(
            "DELETE FROM functions WHERE id NOT IN (SELECT DISTINCT function_id FROM tasks) AND stored_at < ?",
            (time.time() - older_than_s,),
        )
        return cur.rowcount
