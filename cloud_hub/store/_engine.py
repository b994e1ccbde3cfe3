"""The store's engine: the SQLite connection, the one writer thread with group commit, the
reader thread, open/close and migrations. Every concern's mixin (tokens, endpoints, tasks, sites,
results) runs its transactions through these methods, and the PostgreSQL store overrides them.

Why one writer thread: the event loop never blocks on fsync, there is exactly one writer (no
SQLITE_BUSY games), and a multi-statement operation costs one thread hop.
"""

from __future__ import annotations


import asyncio
import os
import sqlite3
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

from cloud_hub.store.group import GroupCommitter, db_stage
from mesh_agent import costs
from cloud_hub.store.migrations import MIGRATIONS

if TYPE_CHECKING:
    from cloud_hub.admission import AdmissionPolicy
    from cloud_hub.store.memo import MemoSettings


T = TypeVar("T")
_S = TypeVar("_S", bound="StoreEngine")


class StoreError(RuntimeError):
    """The hub database cannot be used; the message names the file and the problem."""


class StoreFull(StoreError):
    """The disk under the hub database is full. The transaction was rolled back whole, so nothing
    is half-written; the API answers 507 and the caller retries once space is freed."""


def _unopenable(path: Path) -> str | None:
    """Why the database file cannot be opened or created, in words, or None if it looks fine."""
    if path.is_dir():
        return "that is a folder; give the path of a database file"
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
                return f"no permission to create files in {parent}"
            break
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return "no permission to read and write it"
    return None


def _disk_full(exc: BaseException) -> bool:
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    return code == 13 if code is not None else "database or disk is full" in str(exc)  # 13: SQLITE_FULL


def _chunks(seq: Sequence[T], n: int = 500) -> Iterable[Sequence[T]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def number_results(db: Any) -> dict[str, int]:
    """Give every result stored in this transaction the next number of its user's cursor.

    Called by each writer of ``results`` before its transaction commits, so no committed result is
    without a number. Why per user: one hub-wide sequence told a user, by the gaps between their
    own cursors, how many results everyone else got. Why a counter table and not MAX(user_seq):
    pruning a user's newest results must not hand their numbers out again (a client holding that
    cursor would skip the new results). In PostgreSQL the writer already holds the results lock
    (postgres.py), so numbers are committed in order for the stream readers too. Returns the
    number each task's result got (task id -> number)."""
    rows = db.execute("SELECT seq, user_id, task_id FROM results WHERE user_seq IS NULL ORDER BY seq").fetchall()
    by_user: dict[str, list[tuple[int, str]]] = {}
    for seq, uid, tid in rows:
        by_user.setdefault(uid, []).append((seq, tid))
    given: dict[str, int] = {}
    for uid, seqs in by_user.items():
        row = db.execute("SELECT last FROM result_cursors WHERE user_id=?", (uid,)).fetchone()
        last = row[0] if row else 0
        db.executemany("UPDATE results SET user_seq=? WHERE seq=?", [(last + i, s) for i, (s, _) in enumerate(seqs, 1)])
        db.execute("INSERT INTO result_cursors (user_id, last) VALUES (?, ?) ON CONFLICT (user_id) DO UPDATE SET last=excluded.last",
                   (uid, last + len(seqs)))
        given.update((tid, last + i) for i, (_, tid) in enumerate(seqs, 1))
    return given


def _charged(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the database thread, its CPU charged to its store method in the ledger."""
    with costs.stage(db_stage(fn)):
        return fn(*args)


def migrate(db: sqlite3.Connection, path: Path | str) -> None:
    """Bring a hub database (autocommit connection) to the newest schema, one transaction per
    migration. Also used by restore, so a backup from an older hub is fixed up on the new schema."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    for version, sql in pending_migrations(db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0], path):
        db.execute("BEGIN IMMEDIATE")
        for statement in _statements(sql):  # executescript would commit behind our back
            db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
        db.execute("COMMIT")


def pending_migrations(current: int | None, where: object,
                       migrations: Sequence[tuple[int, str]] = MIGRATIONS) -> list[tuple[int, str]]:
    """The migrations a database at schema ``current`` still needs (both backends: PostgreSQL
    passes its own text, ``PG_MIGRATIONS``); a database newer than this hub is refused rather
    than half understood."""
    current = current or 0
    latest = max(v for v, _ in migrations)
    if current > latest:
        raise StoreError(f"{where}: database schema v{current} is newer than this hub (v{latest})")
    return [(v, sql) for v, sql in migrations if v > current]


def _statements(sql: str) -> list[str]:
    return [s.strip() for s in sql.split(";") if s.strip()]


class StoreEngine:
    """Transactions and reads on the hub database; the concern mixins build on it."""

    #: Group commit of ``tx`` calls; None where a subclass runs its own transactions (PostgreSQL).
    _group: GroupCommitter | None = None

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-db")
        if type(self)._tx is StoreEngine._tx:
            self._group = GroupCommitter(self._pool, self._conn, self._lost_tx_error)
        self._db: sqlite3.Connection | None = None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-db-read")
        self._rdb: sqlite3.Connection | None = None
        #: Limits and shares for leases (cloud_hub/admission.py); None: plain arrival order. The hub sets it.
        self.admission: "AdmissionPolicy | None" = None
        #: Memoization settings (cloud_hub/store/memo.py); None: results are not remembered. The hub sets it.
        self.memo: "MemoSettings | None" = None
        self._owners: dict[str, str] = {}  # endpoint id -> its owner, as read (endpoint_owners_of)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if costs.enabled:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _charged, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _tx(self, fn: Callable[..., T], *args: Any, durable: bool = True) -> T:
        db = self._conn()
        if not durable:
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db, *args)
            db.execute("COMMIT")
            return out
        except BaseException as exc:
            if db.in_transaction:  # SQLite may have rolled back already (a full disk does)
                db.execute("ROLLBACK")
            if _disk_full(exc):
                raise StoreFull(f"{self.path}: the disk is full; nothing was written (free space on {self.path.parent})") from None
            raise
        finally:
            if not durable:
                db.execute("PRAGMA synchronous=FULL")

    def _lost_tx_error(self, exc: BaseException) -> BaseException:
        """What callers see when a whole group's transaction was lost: a full disk in words."""
        if _disk_full(exc):
            return StoreFull(f"{self.path}: the disk is full; nothing was written (free space on {self.path.parent})")
        return exc

    async def tx(self, fn: Callable[..., T], *args: Any, durable: bool = True) -> T:
        """Run ``fn(db, *args)`` as one transaction (or one savepoint of a group commit) on the DB
        thread; return once it is committed. ``durable=False`` skips the fsync for state that is
        rebuilt after a crash anyway (leases and acks: every lease is re-queued at start-up, and
        agents de-duplicate re-sent tasks), unless a durable operation shares its group."""
        if self._group is not None:
            return await self._group.submit(fn, args, durable)  # type: ignore[no-any-return]
        return await self._run(lambda: self._tx(fn, *args, durable=durable))

    @property
    def group_stats(self) -> dict[str, int]:
        """Transactions committed by group commit and the operations in them (for benches and tests)."""
        return dict(self._group.stats) if self._group is not None else {}

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(db)`` on the DB thread without opening a write transaction."""
        return await self._run(lambda: fn(self._conn()))

    async def read_parallel(self, fn: Callable[..., T], *args: Any) -> T:
        """Run read-only ``fn(db, *args)`` on a second, read-only connection with its own thread.

        For the console's queries: a slow page query (a scan of a large task table) must not
        queue the dispatcher's leases and acks behind it on the DB thread. WAL lets this reader
        and the writer work at once; it sees what is committed."""
        return await asyncio.get_running_loop().run_in_executor(self._reader, self._read_parallel, fn, args)

    def _read_parallel(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if self._db is None:
            raise StoreError("store is not open")
        if self._rdb is None:
            uri = "file:" + urllib.parse.quote(str(self.path.resolve())) + "?mode=ro"
            self._rdb = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            self._rdb.execute("PRAGMA query_only=ON")
        return _charged(fn, self._rdb, *args)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    async def open(self: _S) -> _S:
        await self._run(self._open)
        return self

    def _open(self) -> None:
        from mesh_agent._private import prepare_private_sqlite

        why = _unopenable(self.path)
        if why is not None:  # SQLite itself would only say "unable to open database file"
            raise StoreError(f"{self.path}: cannot open the hub database: {why}")
        # 0600 before SQLite creates it (its -wal/-shm get the same mode): the database holds
        # every endpoint's HMAC key and the hub's CURVE secret key.
        prepare_private_sqlite(self.path)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            row = db.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else '?'}")
            migrate(db, self.path)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not a usable hub database ({exc})") from None
        self._db = db

    async def close(self) -> None:
        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        def _close_reader() -> None:
            if self._rdb is not None:
                self._rdb.close()
                self._rdb = None

        await asyncio.get_running_loop().run_in_executor(self._reader, _close_reader)
        self._reader.shutdown(wait=True)
        await self._run(_close)
        self._pool.shutdown(wait=True)
