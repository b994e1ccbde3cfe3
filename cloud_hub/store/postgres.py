"""The hub store on PostgreSQL, for when one machine is outgrown (several hub replicas, one database).

Why a subclass of :class:`SqliteStore` and not a second implementation: every query, and the raw
SQL the scheduler runs through ``store.tx``, is written once, in SQL that both databases read
(upserts are ``INSERT ... ON CONFLICT (key) DO NOTHING / DO UPDATE SET c = excluded.c``, which
SQLite reads since 3.24, not SQLite's own ``OR IGNORE``/``OR REPLACE``; ``CASE`` rather than its
two-argument ``MIN``). The adapter (:class:`_PgConn`) maps placeholders and nothing else:
:func:`pg_query` walks a statement once, skipping string literals, quoted names and comments,
and turns ``?``, ``?N`` and ``:name`` into psycopg's ``%s``, ``%(_N)s`` and ``%(name)s`` (and
``%`` into ``%%``). No statement is rewritten: one that PostgreSQL would not accept is fixed at
its source. The migrations are one text too, with markers where the types differ
(cloud_hub/store/migrations.py: ``{real}`` is ``DOUBLE PRECISION`` here — timestamps need the
precision —, ``{blob}`` is ``BYTEA``, every table gets a ``rowid``), filled in per backend. So a
migration or query someone adds later works on both, and the store test suite runs against both.

What changes with several writers, and how it is handled:

* Every transaction runs ``SERIALIZABLE`` and is retried on a serialization failure or a
  deadlock: leasing a batch, consuming a single-use enrollment token, storing a result once are
  read-then-write sequences that two replicas may run at the same moment.
* ``results.seq`` is the cursor of result streams: a reader must never see seq 11 committed
  before seq 10 appears. Writes to ``results`` take a transaction-level advisory lock first, so
  sequence numbers are handed out and committed in the same order.
* Replicas learn about each other's work through ``LISTEN``/``NOTIFY``: new tasks for an
  endpoint (``mesh_tasks``: the replica that owns the endpoint's session leases them) and new
  results for a user (``mesh_results``: long-polls on any replica wake up) and endpoints a
  replica let go of (``mesh_released``: another replica claims them at once).
* Durability: ``synchronous_commit`` stays on (a 2xx means on disk, WAL-fsynced) except for
  the transactions the SQLite store also runs without fsync (leases, acks).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Callable, Iterable, NamedTuple, Sequence, TypeVar

from cloud_hub.store.migrations import PG_MIGRATIONS
from cloud_hub.store.results import Fresh
from cloud_hub.store.sqlite import SqliteStore, StoreError, StoreFull, _statements, pending_migrations
from mesh_agent.backoff import Backoff, retry

__all__ = ["PostgresStore", "PgQuery", "pg_query", "to_pg_sql"]

log = logging.getLogger("cloud_hub.store.postgres")
T = TypeVar("T")

_RETRIES = 30
#: A transaction that lost a serialization conflict or a deadlock (mesh_agent/backoff.py): 2 ms
#: doubling to 0.25 s, times 0.5-1.5 so replicas that collided do not collide again, 30 tries.
_TX_RETRY = Backoff(base=0.002, cap=0.25, jitter=(0.5, 1.5), max_tries=_RETRIES)
#: The LISTEN connection reconnecting after the server went away: 0.2 s doubling to 5 s, no jitter,
#: back to 0.2 s after a good connection. No bound: the listener lives until the store closes.
_LISTEN_RETRY = Backoff(base=0.2, cap=5.0, jitter=(1.0, 1.0))
_RESULTS_LOCK = 0x6D657368  # advisory lock key ("mesh") serializing writes to results
_MIGRATE_LOCK = 0x6D657369


class PgQuery(NamedTuple):
    sql: str  # with psycopg's placeholders
    numbered: bool  # it used ?N: positional params must become a mapping (``_params``)


_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_DIGITS = frozenset("0123456789")
_SPECIAL = frozenset("'\"-/%?:")


@lru_cache(maxsize=2048)
def pg_query(sql: str) -> PgQuery:
    """Map a statement's placeholders to psycopg's, in one pass; nothing else changes.

    ``?`` -> ``%s``; ``?N`` -> ``%(_N)s`` (then every ``?`` is numbered, as SQLite numbers them:
    one more than the highest before it); ``:name`` -> ``%(name)s``; a literal ``%`` -> ``%%``
    (psycopg reads ``%`` everywhere, in string literals too). String literals, quoted identifiers
    and comments are copied as they are (bar ``%``), and so are ``::`` casts and a ``:`` right
    after a word (``a[lo:hi]``). Mixing named and positional placeholders is refused, as psycopg
    would refuse it.
    """
    out: list[str | int] = []  # text, or the number of a ? (rendered once the whole statement is read)
    n, i, highest = len(sql), 0, 0
    numbered = positional = named = False
    while i < n:
        c = sql[i]
        if c == "'" or c == '"':  # to the closing quote; a doubled one ('it''s') just opens the next run
            j = sql.find(c, i + 1)
            j = n if j < 0 else j + 1
            out.append(sql[i:j].replace("%", "%%"))
        elif c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(sql[i:j].replace("%", "%%"))
        elif c == "/" and sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(sql[i:j].replace("%", "%%"))
        elif c == "%":
            j = i + 1
            out.append("%%")
        elif c == "?":
            j = i + 1
            while j < n and sql[j] in _DIGITS:
                j += 1
            positional = True
            number = int(sql[i + 1:j]) if j > i + 1 else highest + 1  # a plain ?: one more than the highest so far
            numbered = numbered or j > i + 1
            highest = max(highest, number)
            out.append(number)
        elif c == ":" and sql.startswith("::", i):
            j = i + 2
            out.append("::")
        elif c == ":" and i + 1 < n and sql[i + 1] in _WORD and sql[i + 1] not in _DIGITS and (i == 0 or sql[i - 1] not in _WORD):
            j = i + 1
            while j < n and sql[j] in _WORD:
                j += 1
            named = True
            out.append(f"%({sql[i + 1:j]})s")
        else:
            j = i + 1
            while j < n and sql[j] not in _SPECIAL:
                j += 1
            out.append(sql[i:j])
        i = j
    if named and positional:
        raise ValueError(f"a statement mixes named and positional placeholders: {sql[:200]}")
    text = "".join(p if isinstance(p, str) else f"%(_{p})s" if numbered else "%s" for p in out)
    return PgQuery(text, numbered)


def to_pg_sql(sql: str) -> str:
    """The statement as psycopg runs it: placeholders mapped (``pg_query``), nothing else."""
    return pg_query(sql).sql


def _params(q: PgQuery, params: Any) -> Any:
    """Positional params for a query that used ``?N``-style placeholders, as the mapping psycopg needs."""
    if q.numbered and isinstance(params, (list, tuple)):
        return {f"_{i}": v for i, v in enumerate(params, 1)}
    return params


class _PgConn:
    """The part of the sqlite3.Connection API the store's queries use, on a psycopg connection."""

    def __init__(self, conn: Any) -> None:
        self.raw = conn
        self.locked_results = False

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        q = pg_query(sql)
        self._maybe_lock(sql)
        cur = self.raw.cursor()
        cur.execute(q.sql, _params(q, params))
        return cur

    def executemany(self, sql: str, seq: Iterable[Any]) -> Any:
        rows = list(seq)
        cur = self.raw.cursor()
        if rows:
            q = pg_query(sql)
            self._maybe_lock(sql)
            cur.executemany(q.sql, [_params(q, r) for r in rows])
        return cur

    def _maybe_lock(self, sql: str) -> None:
        if not self.locked_results and _inserts_into_results(sql):
            self.raw.execute("SELECT pg_advisory_xact_lock(%s)", (_RESULTS_LOCK,))
            self.locked_results = True


class PostgresStore(SqliteStore):
    """Same interface as SqliteStore; ``url`` is a libpq URL (``postgresql://host:5432/db``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = _safe(url)  # type: ignore[assignment]  # named in error messages, as the SQLite file is: never with its password
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-pg")
        self._db: Any = None
        self._listener: threading.Thread | None = None
        self._listening = threading.Event()
        self._stop_listen = threading.Event()
        self.stats = {"serialization_retries": 0}
        self._owners: dict[str, str] = {}  # endpoint id -> its owner, as read (endpoint_owners_of)

    # ------------------------------------------------------------------ plumbing
    def _connect(self) -> Any:
        try:
            import psycopg
        except ImportError as exc:
            raise StoreError(f"PostgreSQL store needs psycopg (pip install 'continuum-mesh[postgres]'): {exc}") from None
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise StoreError(f"{_safe(self.url)}: cannot connect to PostgreSQL ({exc})") from None

    def _conn(self) -> _PgConn:  # type: ignore[override]
        if self._db is None:
            raise StoreError("store is not open")
        if self._db.closed or self._db.broken:
            log.warning("PostgreSQL connection lost; reconnecting")
            self._db = self._connect()
        return _PgConn(self._db)

    def _tx(self, fn: Callable[..., T], *args: Any, durable: bool = True, isolation: str = "SERIALIZABLE") -> T:
        import psycopg.errors as pe

        conflicts = (pe.SerializationFailure, pe.DeadlockDetected)

        def once() -> T:
            db = self._conn()
            db.raw.execute(f"BEGIN ISOLATION LEVEL {isolation}")
            try:
                if not durable:
                    db.raw.execute("SET LOCAL synchronous_commit = off")
                out = fn(db, *args)
                db.raw.execute("COMMIT")
                return out
            except conflicts:
                db.raw.execute("ROLLBACK")
                raise
            except BaseException as exc:
                if not db.raw.closed and not db.raw.broken:
                    db.raw.execute("ROLLBACK")
                if isinstance(exc, pe.DiskFull):
                    raise StoreFull(f"PostgreSQL {_safe(self.url)}: the server's disk is full; nothing was written") from None
                raise

        def conflicted(_n: int, _exc: BaseException, _delay: float) -> None:
            self.stats["serialization_retries"] += 1

        try:
            return retry(once, retry_on=conflicts, policy=_TX_RETRY, on_retry=conflicted)
        except conflicts:
            self.stats["serialization_retries"] += 1
            raise StoreError(f"transaction still conflicting after {_RETRIES} attempts") from None

    async def _tx_rc(self, fn: Callable[..., T], *, durable: bool = True) -> T:
        """READ COMMITTED, for statements whose WHERE clauses (re-checked on concurrent updates)
        and row locks already make them safe: far fewer conflicts on the hot path than SSI."""
        return await self._run(lambda: self._tx(fn, durable=durable, isolation="READ COMMITTED"))

    # ------------------------------------------------------------------ hot path without SSI conflicts
    async def lease(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: Any = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
        """As SqliteStore.lease; ``FOR UPDATE SKIP LOCKED`` keeps two replicas off the same rows."""
        return await self._tx_rc(self.lease_query(endpoint_id, n, lease_s, max_bytes, policy, only_now=only_now, placed_max=placed_max),
                                 durable=False)

    def lease_query(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: Any = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> Callable[[Any], tuple[list[dict[str, Any]], dict[str, bytes]]]:
        """As SqliteStore.lease_query (the dispatcher runs it inside an insert only without replicas,
        which a PostgreSQL hub always has: its leases run READ COMMITTED, its inserts serializable)."""
        from cloud_hub.store.lookahead import PLACED_SKIP, keep_placed

        def q(db: _PgConn) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
            now = time.time()
            pol = policy if policy is not None else getattr(self, "admission", None)
            if pol is None or only_now:
                rows = db.raw.execute(
                    "SELECT t.id, t.function_id, t.args, t.timeout, t.expires, LENGTH(f.body), t.placed FROM tasks t JOIN functions f ON f.id = t.function_id "
                    "WHERE t.endpoint_id = %s AND t.state = 'queued' " + ("AND t.start_now IS NOT NULL " if only_now else "")
                    + "ORDER BY t.created, t.rowid LIMIT %s FOR UPDATE OF t SKIP LOCKED",
                    (endpoint_id, n if placed_max is None else n + PLACED_SKIP),
                ).fetchall()
                rows = keep_placed(rows, n, placed_max)
            else:  # fair between users (cloud_hub/store/fair.py), the same row locks per flow
                from cloud_hub.store.sqlite import _fair_rows

                picked = _fair_rows(db, endpoint_id, n, pol, lock=" FOR UPDATE SKIP LOCKED")
                fids = sorted({r[1] for r in picked})
                lens = dict(db.raw.execute("SELECT id, LENGTH(body) FROM functions WHERE id = ANY(%s)", (fids,)).fetchall()) if fids else {}
                rows = keep_placed([(*r[:5], lens.get(r[1], 0), r[5]) for r in picked], n, placed_max)
            tasks: list[dict[str, Any]] = []
            seen: set[str] = set()
            size = 0
            for tid, fid, args, timeout, exp, body_len, placed in rows:
                if fid not in seen:  # each body travels once per frame: count it once
                    seen.add(fid)
                    size += body_len
                size += len(args)
                if tasks and size > max_bytes:
                    break
                tasks.append({"id": tid, "fn": fid, "args": args, "timeout": timeout, "exp": exp})
                if placed:
                    tasks[-1]["_placed"] = 1
            if tasks:
                from cloud_hub.store.sqlite import attach_envs

                attach_envs(db, tasks)
                db.raw.cursor().executemany(
                    # site=NULL as in the SQLite lease: a task leased directly is no longer held by a site
                    "UPDATE tasks SET state='leased', leased_until=%s, attempts=attempts+1, dispatched=%s, site=NULL "
                    "WHERE id=%s AND state='queued'",
                    [(now + lease_s, now, t["id"]) for t in tasks],
                )
            fids = sorted({t["fn"] for t in tasks})
            bodies = dict(db.raw.execute("SELECT id, body FROM functions WHERE id = ANY(%s)", (fids,)).fetchall()) if fids else {}
            return tasks, bodies

        return q

    async def ack(self, endpoint_id: str, ids: Sequence[str]) -> None:
        def q(db: _PgConn) -> None:
            db.raw.execute(
                "UPDATE tasks SET state='acked', acked=%s WHERE id = ANY(%s) AND endpoint_id=%s AND state IN ('leased','queued')",
                (time.time(), list(ids), endpoint_id),
            )

        await self._tx_rc(q, durable=False)

    async def requeue(self, endpoint_id: str | None = None, expired_before: float | None = None, not_in: set[str] | None = None) -> int:
        """As SqliteStore.requeue, at READ COMMITTED: each UPDATE re-checks its state condition on
        rows a concurrent transaction changed, so an acked or finished task is never re-queued."""

        def q(db: _PgConn) -> int:
            n = 0
            if expired_before is not None:
                n += db.raw.execute(
                    "UPDATE tasks SET state='queued', leased_until=NULL WHERE state='leased' AND leased_until < %s",
                    (min(expired_before, 1e300),)).rowcount
            if endpoint_id is not None and not_in is None:
                n += db.raw.execute(
                    "UPDATE tasks SET state='queued', leased_until=NULL WHERE state='leased' AND endpoint_id=%s", (endpoint_id,)).rowcount
            if endpoint_id is not None and not_in is not None:
                acked = [r[0] for r in db.raw.execute("SELECT id FROM tasks WHERE endpoint_id=%s AND state='acked'", (endpoint_id,))]
                lost = [i for i in acked if i not in not_in]
                if lost:
                    n += db.raw.execute("UPDATE tasks SET state='queued' WHERE id = ANY(%s) AND state='acked'", (lost,)).rowcount
            return n

        return await self._tx_rc(q)

    def _open(self) -> None:
        db = self._connect()
        try:
            db.execute("BEGIN")
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))  # replicas starting together
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
            current = db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
            for version, sql in pending_migrations(current, _safe(self.url), PG_MIGRATIONS):
                for statement in _statements(sql):
                    db.execute(statement)
                db.execute("INSERT INTO schema_version VALUES (%s)", (version,))
            db.execute("COMMIT")
        except BaseException as exc:
            if not db.closed and not db.broken:
                db.execute("ROLLBACK")
            db.close()
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"{_safe(self.url)}: cannot prepare the hub schema ({exc})") from None
        self._db = db

    async def read_parallel(self, fn: Callable[..., T], *args: Any) -> T:
        """The console's reads (``SqliteStore.read_parallel``): here on the store's own connection;
        PostgreSQL readers never block its writers anyway."""
        return await self._run(lambda: fn(self._conn(), *args))

    async def close(self) -> None:
        self._stop_listen.set()
        if self._listener is not None:
            await asyncio.to_thread(self._listener.join, 5)

        def _close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(_close)
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ replicas: notifications
    async def insert_tasks(self, rows: Sequence[dict[str, Any]], also: Callable[[Any], None] | None = None,
                           before: Callable[[Any], None] | None = None) -> None:
        endpoints = sorted({r["endpoint_id"] for r in rows})

        def with_notify(db: Any) -> None:
            if also is not None:
                also(db)
            for ep in endpoints:  # delivered at commit, to every replica (the owner leases them)
                db.execute("SELECT pg_notify('mesh_tasks', ?)", (ep,))

        await super().insert_tasks(rows, with_notify, before)

    async def store_results(self, endpoint_id: str, results: Sequence[dict[str, Any]]) -> Fresh:
        fresh = await super().store_results(endpoint_id, results)
        await self._notify("mesh_results", {u for _, u in fresh})
        return fresh

    async def expire_tasks(self, now: float, error_blob: Callable[[str], bytes]) -> list[tuple[str, str]]:
        expired = await super().expire_tasks(now, error_blob)
        await self._notify("mesh_results", {u for _, u in expired})
        return expired

    async def cancel_tasks(self, user_id: str, ids: Sequence[str] | None = None, *, group: str | None = None,
                           why: str = "cancelled by its submitter", now: float | None = None) -> dict[str, Any]:
        done = await super().cancel_tasks(user_id, ids, group=group, why=why, now=now)
        await self._notify("mesh_results", {user_id} if done["fresh"] else set())
        await self._notify("mesh_tasks", set(done["endpoints"]))  # the replica holding the session sends the cancel
        return done

    async def expire_group_leases(self, now: float, limit: int = 100) -> list[dict[str, Any]]:
        out = await super().expire_group_leases(now, limit)
        await self._notify("mesh_results", {g["user"] for g in out if g["fresh"]})
        await self._notify("mesh_tasks", {e for g in out for e in g["endpoints"]})
        return out

    async def release_endpoint(self, endpoint_id: str, replica: str) -> None:
        """Release, then tell the other replicas (``mesh_released``) so one claims it at once
        instead of on the agent's next frame."""
        await super().release_endpoint(endpoint_id, replica)
        await self._notify("mesh_released", {endpoint_id})

    async def _notify(self, channel: str, payloads: set[str]) -> None:
        if payloads:
            await self._run(lambda: [self._conn().execute("SELECT pg_notify(?, ?)", (channel, p)) for p in sorted(payloads)])

    async def listen(self, handlers: dict[str, Callable[[str], None]]) -> None:
        """Call ``handlers[channel](payload)`` on the event loop for every NOTIFY, from any replica."""
        loop = asyncio.get_running_loop()
        self._listener = threading.Thread(target=self._listen_forever, args=(loop, handlers), name="hub-pg-listen", daemon=True)
        self._listener.start()
        await asyncio.to_thread(self._listening.wait, 10)

    def _listen_forever(self, loop: asyncio.AbstractEventLoop, handlers: dict[str, Callable[[str], None]]) -> None:
        failed = 0  # tries since the last good connection; no bound on them: it listens until close()
        while not self._stop_listen.is_set():
            try:
                conn = self._connect()
                try:
                    for channel in handlers:
                        conn.execute(f"LISTEN {channel}")
                    self._listening.set()
                    failed = 0
                    while not self._stop_listen.is_set():
                        for n in conn.notifies(timeout=0.5):
                            handler = handlers.get(n.channel)
                            if handler is not None:
                                loop.call_soon_threadsafe(handler, n.payload)
                finally:
                    conn.close()
            except Exception as exc:  # the server restarted: reconnect; waiters also time out and re-poll
                if self._stop_listen.is_set() or loop.is_closed():
                    return
                delay = _LISTEN_RETRY.delay(failed)
                log.warning("PostgreSQL LISTEN connection lost (%s); retrying in %.1fs", exc, delay)
                self._stop_listen.wait(delay)
                failed += 1


def _inserts_into_results(sql: str) -> bool:
    """``INSERT INTO results ...``: the statements that take ``_RESULTS_LOCK`` first."""
    words = sql[:64].replace("(", " ").split(None, 3)
    return len(words) >= 3 and words[0].upper() == "INSERT" and words[1].upper() == "INTO" and words[2].lower() == "results"


def _safe(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)
