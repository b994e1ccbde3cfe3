"""The hub's embedded store: one SQLite file, WAL, ``synchronous=FULL`` (a 2xx means on disk).

Every public method is one transaction run on a single dedicated DB thread: the event loop
never blocks on fsync, there is exactly one writer (no SQLITE_BUSY games), and a multi-statement
operation (lease a batch, store a batch of results) costs one thread hop. Transactions that
arrive while the thread is busy are committed together (group commit, cloud_hub/store/group.py):
each in its own savepoint, each caller answered only after the COMMIT, one fsync for the group.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import sqlite3
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

from cloud_hub.store.group import GroupCommitter
from cloud_hub.store.lookahead import PLACED_SKIP as _PLACED_SKIP, keep_placed
from cloud_hub.store.migrations import MIGRATIONS

if TYPE_CHECKING:
    from cloud_hub.admission import AdmissionPolicy
    from cloud_hub.store.memo import MemoSettings

__all__ = ["SqliteStore", "StoreError", "UnknownTask", "check_results", "hash_token", "token_id"]

T = TypeVar("T")


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


def hash_token(token: str) -> str:
    """Tokens are 256-bit random strings, so one SHA-256 is enough (no need for a slow KDF)."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_id_of_hash(h: str) -> str:
    """An API token's public id: the start of its hash (``mesh-hub token ls`` / ``revoke``)."""
    return "tk_" + h[:12]


def token_id(token: str) -> str:
    return token_id_of_hash(hash_token(token))


def attach_envs(db: Any, tasks: list[dict[str, Any]]) -> None:
    """Add ``env`` (the environment spec, docs/environments.md) to the leased tasks that have one,
    and ``now: 1`` to those that must start at once (a multiprocessing Process).
    A second query by primary key rather than another column in every lease query: most tasks
    have neither, and the keys are left out of their frames entirely (no bytes on a metered link)."""
    by_id = {t["id"]: t for t in tasks}
    for chunk in _chunks(list(by_id)):
        for tid, env, now in db.execute(f"SELECT id, env, start_now FROM tasks WHERE (env IS NOT NULL OR start_now IS NOT NULL) "
                                        f"AND id IN ({','.join('?' * len(chunk))})", chunk).fetchall():
            if env is not None:
                by_id[tid]["env"] = env
            if now:
                by_id[tid]["now"] = 1


def _chunks(seq: Sequence[T], n: int = 500) -> Iterable[Sequence[T]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


class SqliteStore:
    #: Group commit of ``tx`` calls; None where a subclass runs its own transactions (PostgreSQL).
    _group: GroupCommitter | None = None

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-db")
        if type(self)._tx is SqliteStore._tx:
            self._group = GroupCommitter(self._pool, self._conn, self._lost_tx_error)
        self._db: sqlite3.Connection | None = None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-db-read")
        self._rdb: sqlite3.Connection | None = None
        #: Limits and shares for leases (cloud_hub/admission.py); None: plain arrival order. The hub sets it.
        self.admission: "AdmissionPolicy | None" = None
        #: Memoization settings (cloud_hub/store/memo.py); None: results are not remembered. The hub sets it.
        self.memo: "MemoSettings | None" = None
        self._owners: dict[str, str] = {}  # endpoint id -> its owner, as read (endpoint_owners_of)

    # ------------------------------------------------------------------ plumbing
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
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
        return fn(self._rdb, *args)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("store is not open")
        return self._db

    async def open(self) -> "SqliteStore":
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

    # ------------------------------------------------------------------ users and tokens
    async def create_user(self, name: str) -> str:
        def q(db: sqlite3.Connection) -> str:
            row = db.execute("SELECT id FROM users WHERE name=?", (name,)).fetchone()
            if row:
                return row[0]
            uid = "u_" + uuid.uuid4().hex[:16]
            db.execute("INSERT INTO users (id, name, created) VALUES (?, ?, ?)", (uid, name, time.time()))
            return uid

        return await self.tx(q)

    async def create_api_token(self, user_id: str, name: str = "default", expires: float | None = None) -> str:
        """A new API token (shown once; only its SHA-256 is stored). ``expires``: a Unix time after
        which the hub refuses it, or None for a token that lasts until it is revoked."""
        token = "cm_" + secrets.token_urlsafe(32)

        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO api_tokens (hash, user_id, name, created, expires) VALUES (?, ?, ?, ?, ?)",
                (hash_token(token), user_id, name, time.time(), expires),
            )

        await self.tx(q)
        return token

    async def api_token_state(self, token: str) -> tuple[str, float | None, float | None] | None:
        """``(user id, expires, revoked)`` of a token, whether or not it is still good; None when unknown."""
        def q(db: sqlite3.Connection) -> tuple[str, float | None, float | None] | None:
            row = db.execute("SELECT user_id, expires, revoked FROM api_tokens WHERE hash=?", (hash_token(token),)).fetchone()
            return (row[0], row[1], row[2]) if row else None

        return await self._run(lambda: q(self._conn()))

    async def user_for_token(self, token: str) -> str | None:
        """The token's user while it is good (known, not expired, not revoked), else None."""
        state = await self.api_token_state(token)
        if state is None or state[2] is not None or (state[1] is not None and state[1] <= time.time()):
            return None
        return state[0]

    async def list_api_tokens(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every API token (or one user's, by name): its id (:func:`token_id`), user, name, times."""
        def q(db: sqlite3.Connection) -> list[dict[str, Any]]:
            sql = ("SELECT t.hash, u.name, t.name, t.created, t.expires, t.revoked FROM api_tokens t JOIN users u ON u.id = t.user_id"
                   + (" WHERE u.name=?" if user is not None else "") + " ORDER BY t.created")
            rows = db.execute(sql, (user,) if user is not None else ()).fetchall()
            return [{"id": token_id_of_hash(r[0]), "user": r[1], "name": r[2], "created": r[3], "expires": r[4], "revoked": r[5]}
                    for r in rows]

        return await self._run(lambda: q(self._conn()))

    async def revoke_api_token(self, which: str) -> dict[str, Any]:
        """Revoke one API token, named by its id (``tk_`` and at least 6 hex digits of it, a
        unique prefix) or by the token itself. Returns its row (``already`` True when it was
        revoked before: nothing changes). Unknown or ambiguous: :class:`StoreError`, nothing changes."""
        which = which.strip()
        if which.startswith("cm_"):
            exact, prefix = hash_token(which), None
        else:
            prefix = which.removeprefix("tk_").lower()
            exact = None
            if len(prefix) < 6 or any(c not in "0123456789abcdef" for c in prefix):
                raise StoreError(f"{which!r} is not a token id: give the id `mesh-hub token ls` shows (tk_ and at least "
                                 "6 hex digits), or the token itself")
        now = time.time()

        def q(db: sqlite3.Connection) -> dict[str, Any]:
            if exact is not None:
                rows = db.execute("SELECT hash, name, revoked FROM api_tokens WHERE hash=?", (exact,)).fetchall()
            else:
                assert prefix is not None  # exact is None only for an id
                rows = db.execute("SELECT hash, name, revoked FROM api_tokens WHERE hash LIKE ?", (prefix + "%",)).fetchall()
            if not rows:
                raise StoreError(f"no API token {which!r} (see `mesh-hub token ls`)")
            if len(rows) > 1:
                raise StoreError(f"{which!r} matches {len(rows)} API tokens: give more digits of the id")
            h, name, revoked = rows[0]
            if revoked is None:
                db.execute("UPDATE api_tokens SET revoked=? WHERE hash=?", (now, h))
            return {"id": token_id_of_hash(h), "name": name, "revoked": revoked if revoked is not None else now,
                    "already": revoked is not None}

        return await self.tx(q)

    async def create_enroll_token(self, user_id: str, ttl_s: float, uses: int) -> str:
        token = "ce_" + secrets.token_urlsafe(32)

        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO enroll_tokens (hash, user_id, expires, uses_left, created) VALUES (?, ?, ?, ?, ?)",
                (hash_token(token), user_id, time.time() + ttl_s, uses, time.time()),
            )

        await self.tx(q)
        return token

    async def enroll_endpoint(self, token: str, name: str, transport: str, key: bytes,
                              mqtt_hash: str | None = None, curve_key: str | None = None,
                              gateway_id: str | None = None) -> dict[str, Any] | None:
        """Consume one use of an enrollment token and create the endpoint, atomically.

        ``mqtt_hash``: Mosquitto hash of the endpoint's broker password (username = endpoint id);
        ``curve_key``: the agent's ZeroMQ CURVE public key (z85)."""

        def q(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute(
                "SELECT user_id FROM enroll_tokens WHERE hash=? AND uses_left > 0 AND expires > ?",
                (hash_token(token), time.time()),
            ).fetchone()
            if row is None:
                return None
            if gateway_id is not None:  # the gateway must be a live MQTT endpoint of the same user
                gw = db.execute("SELECT user_id, transport FROM endpoints WHERE id=? AND revoked IS NULL", (gateway_id,)).fetchone()
                if gw is None or gw[0] != row[0] or gw[1] != "mqtt":
                    raise ValueError(f"gateway {gateway_id} is not an MQTT endpoint of this token's user")
            db.execute("UPDATE enroll_tokens SET uses_left = uses_left - 1 WHERE hash=?", (hash_token(token),))
            eid = "ep-" + uuid.uuid4().hex[:12]
            db.execute(
                "INSERT INTO endpoints (id, user_id, name, transport, key, created, online, info, mqtt_user, mqtt_hash, curve_key, gateway_id) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, '{}', ?, ?, ?, ?)",
                (eid, row[0], name, transport, key, time.time(), eid if mqtt_hash else None, mqtt_hash, curve_key, gateway_id),
            )
            return {"id": eid, "user_id": row[0]}

        return await self.tx(q)

    async def enroll_endpoints(self, token: str, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Consume ``len(items)`` uses of one enrollment token and create all those endpoints in one
        transaction, or none (a fleet enrolled in bulk must not end half-enrolled). Each item:
        ``name``, ``transport``, ``key``, optional ``mqtt_hash`` and ``curve_key``, as for
        :meth:`enroll_endpoint`. None when the token is unknown, expired or has too few uses left;
        ``sqlite3.IntegrityError`` (a CURVE key already enrolled) rolls everything back."""

        def q(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            th = hash_token(token)
            row = db.execute("SELECT user_id FROM enroll_tokens WHERE hash=? AND uses_left >= ? AND expires > ?",
                             (th, len(items), time.time())).fetchone()
            if row is None:
                return None
            db.execute("UPDATE enroll_tokens SET uses_left = uses_left - ? WHERE hash=?", (len(items), th))
            now, out, rows = time.time(), [], []
            for it in items:
                eid = "ep-" + uuid.uuid4().hex[:12]
                mh = it.get("mqtt_hash")
                rows.append((eid, row[0], it["name"], it["transport"], it["key"], now, eid if mh else None, mh, it.get("curve_key")))
                out.append({"id": eid, "user_id": row[0]})
            db.executemany(
                "INSERT INTO endpoints (id, user_id, name, transport, key, created, online, info, mqtt_user, mqtt_hash, curve_key) "
                "VALUES (?, ?, ?, ?, ?, ?, 0, '{}', ?, ?, ?)", rows)
            return out

        return await self.tx(q)

    # ------------------------------------------------------------------ endpoints
    async def endpoint_keys(self) -> dict[str, bytes]:
        return await self._run(lambda: dict(self._conn().execute("SELECT id, key FROM endpoints WHERE revoked IS NULL").fetchall()))

    async def list_endpoints(self, user_id: str | None = None, endpoint_id: str | None = None) -> list[dict[str, Any]]:
        def q() -> list[dict[str, Any]]:
            sql = (
                "SELECT e.id, e.user_id, e.name, e.transport, e.created, e.last_seen, e.online, e.info, "
                "(SELECT COUNT(*) FROM tasks t WHERE t.endpoint_id=e.id AND t.state='queued'), "
                "(SELECT COUNT(*) FROM tasks t WHERE t.endpoint_id=e.id AND t.state IN ('leased','acked')), e.trusted "
                "FROM endpoints e WHERE e.revoked IS NULL"
            )
            args: list[Any] = []
            if user_id is not None:  # the user's own endpoints and those shared with them
                sql += " AND (e.user_id=? OR e.id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?))"
                args += [user_id, user_id]
            if endpoint_id is not None:
                sql += " AND e.id=?"
                args.append(endpoint_id)
            rows = self._conn().execute(sql + " ORDER BY e.created", args).fetchall()
            cols = ["id", "user_id", "name", "transport", "created", "last_seen", "online", "info", "queued", "in_flight", "trusted"]
            out = [dict(zip(cols, r)) for r in rows]
            for e in out:
                e["online"] = bool(e["online"])
                e["trusted"] = bool(e["trusted"])
                e["info"] = json.loads(e["info"] or "{}")
            return out

        return await self._run(q)

    async def set_endpoint_state(self, endpoint_id: str, online: bool, last_seen: float, info: dict[str, Any] | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            if info is None:
                db.execute("UPDATE endpoints SET online=?, last_seen=? WHERE id=?", (int(online), last_seen, endpoint_id))
            else:
                db.execute(
                    "UPDATE endpoints SET online=?, last_seen=?, info=? WHERE id=?",
                    (int(online), last_seen, json.dumps(info), endpoint_id),
                )

        await self.tx(q)

    async def touch_endpoints(self, rows: Sequence[tuple[float, dict[str, Any], str]]) -> None:
        """Many endpoints' ``last_seen`` and live info, ``(last_seen, info, endpoint_id)`` each, in one
        transaction without an fsync. Why: heartbeats arrive at N / heartbeat_s per second (2,000/s
        for 10,000 endpoints at 5 s); one durable transaction each saturated the hub's one database
        thread. The row is what replicas and the console read, so seconds-stale is fine, and a
        crash loses only liveness figures that the next heartbeat brings back."""

        def q(db: sqlite3.Connection) -> None:
            db.executemany("UPDATE endpoints SET online=1, last_seen=?, info=? WHERE id=?",
                           [(seen, json.dumps(info), ep) for seen, info, ep in rows])

        if rows:
            await self.tx(q, durable=False)

    async def claim_endpoint(self, endpoint_id: str, replica: str, until: float, now: float) -> bool:
        """Hold (or renew) an endpoint's session for this hub replica unless another holds it."""

        def q(db: sqlite3.Connection) -> bool:
            db.execute(
                "INSERT INTO endpoint_owners (endpoint_id, replica, until) VALUES (?, ?, ?) "
                "ON CONFLICT(endpoint_id) DO UPDATE SET replica=excluded.replica, until=excluded.until "
                "WHERE endpoint_owners.replica=excluded.replica OR endpoint_owners.until < ?",
                (endpoint_id, replica, until, now),
            )
            row = db.execute("SELECT replica FROM endpoint_owners WHERE endpoint_id=?", (endpoint_id,)).fetchone()
            return bool(row and row[0] == replica)

        return await self.tx(q, durable=False)

    async def release_endpoint(self, endpoint_id: str, replica: str) -> None:
        await self.tx(lambda db: db.execute("DELETE FROM endpoint_owners WHERE endpoint_id=? AND replica=?", (endpoint_id, replica)), durable=False)

    async def endpoint_transport(self, endpoint_id: str) -> str | None:
        """The link an endpoint enrolled for: a replica takes over only endpoints it can reach."""
        row = await self._run(lambda: self._conn().execute("SELECT transport FROM endpoints WHERE id=? AND revoked IS NULL", (endpoint_id,)).fetchone())
        return str(row[0]) if row else None

    async def endpoint_key(self, endpoint_id: str) -> bytes | None:
        """One endpoint's key: for an endpoint enrolled through another hub replica."""
        row = await self._run(lambda: self._conn().execute("SELECT key FROM endpoints WHERE id=?", (endpoint_id,)).fetchone())
        return bytes(row[0]) if row else None

    # ------------------------------------------------------------------ functions
    async def put_function(self, user_id: str, fid: str, body: bytes, name: str) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO functions (id, body, name, created) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                       (fid, body, name, time.time()))
            db.execute("INSERT INTO function_owners (function_id, user_id) VALUES (?, ?) ON CONFLICT (function_id, user_id) DO NOTHING",
                       (fid, user_id))

        await self.tx(q)

    async def list_functions(self, user_id: str) -> list[dict[str, Any]]:
        def q() -> list[dict[str, Any]]:
            rows = self._conn().execute(
                "SELECT f.id, f.name, f.created, LENGTH(f.body) FROM functions f JOIN function_owners o "
                "ON o.function_id=f.id WHERE o.user_id=? ORDER BY f.created",
                (user_id,),
            ).fetchall()
            return [dict(zip(["id", "name", "created", "size"], r)) for r in rows]

        return await self._run(q)

    async def owned_refs(self, user_id: str, endpoint_ids: Iterable[str], fids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Which of these endpoints and functions the user may use: one hop on the submit path."""
        eps, fns = list(set(endpoint_ids)), list(set(fids))

        def q(db: Any) -> tuple[set[str], set[str]]:
            found_e: set[str] = set()
            found_f: set[str] = set()
            for chunk in _chunks(eps):
                found_e.update(r[0] for r in db.execute(
                    f"SELECT id FROM endpoints WHERE revoked IS NULL AND (user_id=? OR id IN (SELECT endpoint_id FROM endpoint_shares WHERE user_id=?)) "
                    f"AND id IN ({','.join('?' * len(chunk))})", (user_id, user_id, *chunk)))
            for chunk in _chunks(fns):
                found_f.update(r[0] for r in db.execute(
                    f"SELECT function_id FROM function_owners WHERE user_id=? AND function_id IN ({','.join('?' * len(chunk))})", (user_id, *chunk)))
            return found_e, found_f

        return await self.read_parallel(q)

    async def endpoint_owners_of(self, endpoint_ids: Iterable[str]) -> dict[str, str]:
        """endpoint id -> the user who enrolled it (sandbox by default for anyone else's tasks, docs/environments.md)."""
        # An endpoint's owner never changes (nothing updates endpoints.user_id), so known owners are
        # answered from memory: this runs on every submit and every stream's first task per endpoint.
        known = self._owners
        eps = [e for e in set(endpoint_ids) if e not in known]

        def q() -> dict[str, str]:
            db = self._conn()
            out: dict[str, str] = {}
            for chunk in _chunks(eps):
                out.update(db.execute(f"SELECT id, user_id FROM endpoints WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
            return out

        if eps:
            if len(known) > 100_000:  # bounded: a hub with more endpoints reads the rest each time
                known.clear()
            known.update(await self._run(q))
        return {e: known[e] for e in endpoint_ids if e in known}

    async def trusted_for(self, user_id: str, endpoint_ids: Iterable[str]) -> dict[str, tuple[bool, bool]]:
        """endpoint id -> (the user owns it, trusted for the user: owned and marked trusted), read
        fresh (the flag changes; the result stream asks again every few seconds)."""
        eps = list(set(endpoint_ids))

        def q() -> dict[str, tuple[bool, bool]]:
            db = self._conn()
            out: dict[str, tuple[bool, bool]] = {}
            for chunk in _chunks(eps):
                for eid, owner, trusted in db.execute(
                        f"SELECT id, user_id, trusted FROM endpoints WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall():
                    out[eid] = (owner == user_id, owner == user_id and bool(trusted))
            return out

        return await self._run(q) if eps else {}

    # ------------------------------------------------------------------ tasks
    async def insert_tasks(self, rows: Sequence[dict[str, Any]], also: Callable[[sqlite3.Connection], None] | None = None,
                           before: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """All or nothing: the caller has validated every row before this transaction.
        ``also`` runs in the same transaction (the scheduler stores its decisions with the tasks);
        ``before`` too, ahead of the tasks (function bodies that ride with a batch)."""

        def q(db: sqlite3.Connection) -> None:
            if before is not None:
                before(db)
            for r in rows:  # optional: the SDK's task group (Executor.reload_tasks), the cache key (cache=True)
                r.setdefault("task_group_id", None)  # type: ignore[attr-defined]
                r.setdefault("memo_key", None)  # type: ignore[attr-defined]
                r.setdefault("env", None)  # type: ignore[attr-defined]
                r.setdefault("start_now", None)  # type: ignore[attr-defined]
                r.setdefault("placed", None)  # type: ignore[attr-defined]
            db.executemany(
                "INSERT INTO tasks (id, user_id, endpoint_id, function_id, args, state, created, expires, timeout, attempts, task_group_id, memo_key, env, start_now, placed) "
                "VALUES (:id, :user_id, :endpoint_id, :function_id, :args, 'queued', :created, :expires, :timeout, 0, :task_group_id, :memo_key, :env, :start_now, :placed)",
                rows,
            )
            if also is not None:
                also(db)

        await self.tx(q)

    async def submit_key(self, user_id: str, key: str) -> tuple[str, list[str], list[str | None]] | None:
        """What a submit with this idempotency key made: (request hash, task ids, endpoint ids)."""
        # On the reader connection, as owned_refs and results_after: hot-path reads do not queue
        # behind the writer's commits (WAL: it sees every committed key).
        row = await self.read_parallel(lambda db: db.execute(
            "SELECT request_hash, task_ids, endpoint_ids FROM submit_keys WHERE user_id=? AND key=?", (user_id, key)).fetchone())
        return None if row is None else (str(row[0]), json.loads(row[1]), json.loads(row[2]))

    @staticmethod
    def put_submit_key(db: Any, user_id: str, key: str, request_hash: str, task_ids: list[str],
                       endpoint_ids: list[str | None], now: float) -> None:
        """Record a submit's key in the transaction that inserts its tasks: both or neither. A
        concurrent submit with the same key makes this insert fail, and with it the whole batch."""
        db.execute("INSERT INTO submit_keys (user_id, key, request_hash, task_ids, endpoint_ids, created) VALUES (?, ?, ?, ?, ?, ?)",
                   (user_id, key, request_hash, json.dumps(task_ids), json.dumps(endpoint_ids), now))

    async def lease(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: "AdmissionPolicy | None" = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
        """Take up to ``n`` queued tasks of an endpoint and the function bodies they need: oldest
        first, or with a ``policy`` fair between users under its limits (cloud_hub/store/fair.py).
        ``only_now``: only tasks that must start at once (sent outside the agent's credit).
        ``placed_max``: at most this many of the tasks the scheduler placed (the endpoint's
        lookahead, docs/scheduler.md "Late binding"); each of those comes marked ``"_placed": 1``,
        which the caller removes before sending."""

        def q(db: sqlite3.Connection) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
            now = time.time()
            pol = policy if policy is not None else self.admission
            if pol is None or only_now:
                rows = db.execute(
                    "SELECT id, function_id, args, timeout, expires, placed FROM tasks WHERE endpoint_id=? AND state='queued' "
                    + ("AND start_now IS NOT NULL " if only_now else "") + "ORDER BY created, rowid LIMIT ?",
                    (endpoint_id, n if placed_max is None else n + _PLACED_SKIP),
                ).fetchall()
            else:
                rows = _fair_rows(db, endpoint_id, n, pol)
            rows = keep_placed(rows, n, placed_max)
            tasks: list[dict[str, Any]] = []
            sizes: dict[str, int] = {}
            size = 0
            for tid, fid, args, timeout, exp, placed in rows:
                if fid not in sizes:  # each body travels once per frame: count it once
                    sizes[fid] = db.execute("SELECT LENGTH(body) FROM functions WHERE id=?", (fid,)).fetchone()[0]
                    size += sizes[fid]
                size += len(args)
                if tasks and size > max_bytes:
                    break
                tasks.append({"id": tid, "fn": fid, "args": args, "timeout": timeout, "exp": exp})
                if placed:
                    tasks[-1]["_placed"] = 1
            attach_envs(db, tasks)
            db.executemany(
                "UPDATE tasks SET state='leased', leased_until=?, attempts=attempts+1, dispatched=?, site=NULL WHERE id=?",
                [(now + lease_s, now, t["id"]) for t in tasks],
            )
            fids = list({t["fn"] for t in tasks})
            bodies: dict[str, bytes] = {}
            for chunk in _chunks(fids):
                bodies.update(db.execute(f"SELECT id, body FROM functions WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
            return tasks, bodies

        return await self.tx(q, durable=False)

    async def ack(self, endpoint_id: str, ids: Sequence[str]) -> None:
        def q(db: sqlite3.Connection) -> None:
            now = time.time()
            db.executemany(
                "UPDATE tasks SET state='acked', acked=? WHERE id=? AND endpoint_id=? AND state IN ('leased','queued')",
                [(now, i, endpoint_id) for i in ids],
            )

        await self.tx(q, durable=False)

    async def site_devices(self) -> dict[str, str]:
        """device endpoint id -> the gateway endpoint that serves it (docs/sites.md)."""
        rows = await self._run(lambda: self._conn().execute(
            "SELECT id, gateway_id FROM endpoints WHERE gateway_id IS NOT NULL AND revoked IS NULL").fetchall())
        return {r[0]: r[1] for r in rows}

    async def lease_site(self, gateway_id: str, devices: Sequence[str], n: int, hold_s: float, max_bytes: int,
                         *, skip_returned: bool = False) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bytes]]:
        """Lease up to ``n`` queued tasks of a site's devices ahead of time to its gateway: each is
        leased for ``hold_s`` and marked with the gateway, so the device's lost session does not
        re-queue it while the gateway holds it (the dispatcher leases for ``lease_s`` and extends
        to ``site_hold_s`` once the gateway confirms it stored them: :meth:`hold_site`). Returns tasks per device and the
        function bodies they need (each body once).

        ``skip_returned``: leave out tasks that went back to the queue from an unconfirmed lease
        ahead to this same gateway (``site`` still names it): the gateway may hold their frames
        and is about to confirm them (:meth:`hold_site` re-claims them then), e.g. right after
        it came back from an uplink outage."""

        def q(db: sqlite3.Connection) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bytes]]:
            now = time.time()
            out: dict[str, list[dict[str, Any]]] = {}
            if not devices or n <= 0:
                return out, {}
            marks = ",".join("?" * len(devices))
            skip = " AND (site IS NULL OR site != ?)" if skip_returned else ""
            rows = db.execute(
                f"SELECT id, endpoint_id, function_id, args, timeout, expires FROM tasks WHERE endpoint_id IN ({marks}) "
                f"AND state='queued'{skip} ORDER BY created, rowid LIMIT ?", (*devices, *((gateway_id,) if skip_returned else ()), n)).fetchall()
            sizes: dict[str, int] = {}
            size = taken = 0
            for tid, ep, fid, args, timeout, exp in rows:
                if fid not in sizes:
                    sizes[fid] = db.execute("SELECT LENGTH(body) FROM functions WHERE id=?", (fid,)).fetchone()[0]
                    size += sizes[fid]
                size += len(args or b"")
                if taken and size > max_bytes:
                    break
                out.setdefault(ep, []).append({"id": tid, "fn": fid, "args": args, "timeout": timeout, "exp": exp})
                taken += 1
            attach_envs(db, [t for ts in out.values() for t in ts])
            db.executemany(
                "UPDATE tasks SET state='leased', leased_until=?, attempts=attempts+1, dispatched=?, site=? WHERE id=?",
                [(now + hold_s, now, gateway_id, t["id"]) for ts in out.values() for t in ts],
            )
            bodies: dict[str, bytes] = {}
            fids = list({t["fn"] for ts in out.values() for t in ts})
            for chunk in _chunks(fids):
                bodies.update(db.execute(f"SELECT id, body FROM functions WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall())
            return out, bodies

        return await self.tx(q)

    async def set_gateway(self, device_id: str, gateway_id: str | None) -> tuple[str | None, int]:
        """Re-home a device to another site gateway (or to none: it dials the hub's broker). The new
        gateway must be a live MQTT endpoint of the device's user; a ValueError changes nothing.
        Tasks leased ahead to the old gateway for this device go back to the queue at once (a copy
        the old gateway still hands over is de-duplicated by task id). Returns (old gateway, re-queued)."""

        def q(db: sqlite3.Connection) -> tuple[str | None, int]:
            row = db.execute("SELECT user_id, transport, gateway_id FROM endpoints WHERE id=? AND revoked IS NULL", (device_id,)).fetchone()
            if row is None:
                raise ValueError(f"unknown endpoint {device_id}")
            if row[1] != "mqtt":
                raise ValueError("only an MQTT endpoint can sit behind a site gateway")
            if gateway_id is not None:
                if gateway_id == device_id:
                    raise ValueError("an endpoint cannot be its own gateway")
                gw = db.execute("SELECT user_id, transport, gateway_id FROM endpoints WHERE id=? AND revoked IS NULL", (gateway_id,)).fetchone()
                if gw is None or gw[0] != row[0] or gw[1] != "mqtt" or gw[2] is not None:
                    raise ValueError(f"gateway {gateway_id} is not an MQTT endpoint of the device's user (itself behind no gateway)")
            db.execute("UPDATE endpoints SET gateway_id=? WHERE id=?", (gateway_id, device_id))
            n = db.execute("UPDATE tasks SET state='queued', leased_until=NULL, site=NULL WHERE endpoint_id=? AND state='leased' "
                           "AND site IS NOT NULL", (device_id,)).rowcount
            # Work that went back to the queue from the old gateway: no longer its to re-claim.
            db.execute("UPDATE tasks SET site=NULL WHERE endpoint_id=? AND state='queued' AND site IS NOT NULL", (device_id,))
            return row[2], n

        return await self.tx(q)

    async def hold_site(self, gateway_id: str, ids: Sequence[str], until: float, frame_ttl_s: float | None = None) -> int:
        """The gateway confirmed it stored these tasks (its own signed ack): their lease at the site
        now lasts until ``until`` (``site_hold_s``) instead of ``lease_s``.

        With ``frame_ttl_s`` (the validity of a frame leased ahead, ``site_hold_s``) it also
        re-claims tasks that went back to the queue because this confirmation came after their
        unconfirmed lease ran out (the uplink went down, or was slow): still queued, last leased
        ahead to this gateway, of a device it still serves, and with that frame still valid. They
        are leased to the site again until the frame expires, without sending anything: the
        gateway holds the frame. A gateway that lies about holding one delays that task by at most
        the frame's validity, as a gateway that dies does."""

        def q(db: sqlite3.Connection) -> int:
            n = sum(db.execute("UPDATE tasks SET leased_until=? WHERE id=? AND site=? AND state='leased'",
                               (until, i, gateway_id)).rowcount for i in ids)
            if frame_ttl_s is not None:
                now = time.time()
                n += sum(db.execute(
                    # the earlier of until and the frame's expiry (CASE: scalar MIN() is SQLite's own, LEAST() PostgreSQL's)
                    "UPDATE tasks SET state='leased', leased_until=CASE WHEN ? < dispatched + ? THEN ? ELSE dispatched + ? END "
                    "WHERE id=? AND site=? AND state='queued' "
                    "AND dispatched + ? > ? AND endpoint_id IN (SELECT id FROM endpoints WHERE gateway_id=?)",
                    (until, frame_ttl_s, until, frame_ttl_s, i, gateway_id, frame_ttl_s, now + 1.0, gateway_id)).rowcount for i in ids)
            return n

        return await self.tx(q, durable=False)

    async def count_site_leased(self, gateway_id: str) -> int:
        """Tasks leased ahead to this gateway that no device has acknowledged yet."""
        return int(await self._run(lambda: self._conn().execute(
            "SELECT COUNT(*) FROM tasks WHERE site=? AND state='leased'", (gateway_id,)).fetchone()[0]))

    async def count_leased(self, endpoint_id: str) -> int:
        """Tasks of an endpoint sent but not yet acked: on their way, or lost on the way."""
        return int(await self._run(lambda: self._conn().execute(
            "SELECT COUNT(*) FROM tasks WHERE endpoint_id=? AND state='leased'", (endpoint_id,)).fetchone()[0]))

    async def unlease(self, endpoint_id: str, ids: Sequence[str]) -> int:
        """Put these leased tasks back in the queue at once: the frame carrying them failed to send."""

        def q(db: sqlite3.Connection) -> int:
            return sum(
                db.execute("UPDATE tasks SET state='queued', leased_until=NULL WHERE id=? AND endpoint_id=? AND state='leased'",
                           (i, endpoint_id)).rowcount
                for i in ids
            )

        return await self.tx(q, durable=False)

    async def requeue(self, endpoint_id: str | None = None, expired_before: float | None = None, not_in: set[str] | None = None) -> int:
        """Put tasks back in the queue: leases that expired, or an endpoint's leases when it is lost.

        With ``not_in`` (reconciliation after an agent's hello), also tasks the hub believes the
        agent acked but the agent no longer holds (its disk was wiped or replaced).
        """
        return await self.tx(_requeue, endpoint_id, expired_before, not_in)

    async def open_session(self, endpoint_id: str, held: set[str], now: float, info: dict[str, Any], transition: bool) -> tuple[int, int]:
        """A hello's writes, in one transaction: the endpoint's leases go back to the queue, acked
        tasks its agent no longer holds too, the row says online with the hello's info, and (for a
        new session) the availability history gets its transition. Returns (leases re-queued,
        acked tasks lost). Why one: a herd of hellos paid four fsynced transactions each, and they
        queued every other frame behind them (docs/benchmarks.md, swarm)."""
        from cloud_hub.store.availability import record_transition

        if self._group is None:  # a store that runs its own transactions (PostgreSQL): one call each, as before
            requeued = await self.requeue(endpoint_id=endpoint_id)
            lost = await self.requeue(endpoint_id=endpoint_id, not_in=held)
            await self.set_endpoint_state(endpoint_id, True, now, info)
            if transition:
                await self.tx(record_transition, endpoint_id, True, now)
            return requeued, lost

        def q(db: sqlite3.Connection) -> tuple[int, int]:
            requeued = _requeue(db, endpoint_id, None, None)
            lost = _requeue(db, endpoint_id, None, held)
            db.execute("UPDATE endpoints SET online=1, last_seen=?, info=? WHERE id=?", (now, json.dumps(info), endpoint_id))
            if transition:
                record_transition(db, endpoint_id, True, now)
            return requeued, lost

        return await self.tx(q)

    async def close_session(self, endpoint_id: str, last_seen: float, info: dict[str, Any]) -> int:
        """A lost session's writes in one transaction: its leases back to the queue (acked tasks
        stay on the device), the row offline, the transition recorded. Returns leases re-queued."""
        from cloud_hub.store.availability import record_transition

        if self._group is None:
            n = await self.requeue(endpoint_id=endpoint_id)
            await self.set_endpoint_state(endpoint_id, False, last_seen, info)
            await self.tx(record_transition, endpoint_id, False, last_seen)
            return n

        def q(db: sqlite3.Connection) -> int:
            n = _requeue(db, endpoint_id, None, None)
            db.execute("UPDATE endpoints SET online=0, last_seen=?, info=? WHERE id=?", (last_seen, json.dumps(info), endpoint_id))
            record_transition(db, endpoint_id, False, last_seen)
            return n

        return await self.tx(q)

    async def endpoint_info(self, endpoint_id: str) -> dict[str, Any] | None:
        """The info JSON kept in an endpoint's row (one indexed read, no task counts)."""
        row = await self._run(lambda: self._conn().execute("SELECT info FROM endpoints WHERE id=?", (endpoint_id,)).fetchone())
        return None if row is None else json.loads(row[0] or "{}")

    async def store_results(self, endpoint_id: str, results: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
        """Store results exactly once per task; return (task id, user id) of those that were new.
        A malformed batch raises ValueError naming what is wrong, and stores none of it."""

        def q(db: sqlite3.Connection) -> list[tuple[str, str]]:
            check_results(results)
            now = time.time()
            ids = [r["id"] for r in results]
            owners: dict[str, str] = {}
            for chunk in _chunks(ids):
                owners.update(
                    db.execute(
                        f"SELECT id, user_id FROM tasks WHERE endpoint_id=? AND state != 'done' AND id IN ({','.join('?' * len(chunk))})",
                        (endpoint_id, *chunk),
                    ).fetchall()
                )
            fresh = list({r["id"]: r for r in results if r["id"] in owners}.values())  # a batch may repeat an id
            db.executemany(
                "INSERT INTO results (task_id, user_id, ok, data, started, finished, received, pid) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO NOTHING",
                [(r["id"], owners[r["id"]], int(bool(r["ok"])), r["data"], r.get("started"), r.get("finished"), now, r.get("pid")) for r in fresh],
            )
            db.executemany("UPDATE tasks SET state='done', done=?, args=NULL WHERE id=?", [(now, r["id"]) for r in fresh])
            number_results(db)
            if getattr(self, "memo", None) is not None and fresh:  # results of tasks submitted with cache=True answer repeats (cloud_hub/store/memo.py)
                from cloud_hub.store import memo

                memo.record(db, fresh, self.memo, now)  # type: ignore[arg-type]
            return [(r["id"], owners[r["id"]]) for r in fresh]

        return await self.tx(q)

    async def expire_tasks(self, now: float, error_blob: Callable[[str], bytes]) -> list[tuple[str, str]]:
        """Tasks still queued past their expiry get an error result, so the caller learns of it."""

        def q(db: sqlite3.Connection) -> list[tuple[str, str]]:
            rows = db.execute(
                "SELECT id, user_id FROM tasks WHERE state='queued' AND expires IS NOT NULL AND expires < ? LIMIT 10000", (now,)
            ).fetchall()
            fail_tasks(db, [(tid, uid, error_blob(tid)) for tid, uid in rows], now)
            return [(tid, uid) for tid, uid in rows]

        return await self.tx(q)

    # ------------------------------------------------------------------ cancellation (docs/protocol.md, "Cancellation")
    async def cancel_tasks(self, user_id: str, ids: Sequence[str] | None = None, *, group: str | None = None,
                           why: str = "cancelled by its submitter", now: float | None = None) -> dict[str, Any]:
        """Cancel the user's tasks, by id or every unfinished one of a task group, in one
        transaction. Each task without a result gets its one ``cancelled`` result now (so the
        answer never depends on the agent); one already sent to its agent (leased or acked) is
        also marked ``cancel_pending`` until that agent confirms (the dispatcher sends the cancel).
        By id, every id must be a task of this user: else :class:`UnknownTask` naming the first
        that is not, and nothing changes. Returns ``{"cancelled": ids (now or before), "done":
        ids that had finished, "fresh": ids cancelled by this call, "endpoints": endpoints with
        cancels to send}``."""
        at = time.time() if now is None else now

        def q(db: Any) -> dict[str, Any]:
            return cancel_in(db, user_id, ids, group, why, at)

        return await self.tx(q)

    async def pending_cancels(self, endpoint_id: str, limit: int = 5000) -> list[str]:
        """Cancelled tasks whose agent has not confirmed the cancel yet (oldest first)."""
        return [r[0] for r in await self._run(lambda: self._conn().execute(
            "SELECT id FROM tasks WHERE endpoint_id=? AND cancel_pending IS NOT NULL ORDER BY cancelled LIMIT ?",
            (endpoint_id, limit)).fetchall())]

    async def cancel_endpoints(self) -> set[str]:
        """Endpoints with cancels their agents have yet to confirm."""
        return {r[0] for r in await self._run(lambda: self._conn().execute(
            "SELECT DISTINCT endpoint_id FROM tasks WHERE cancel_pending IS NOT NULL").fetchall())}

    async def cancels_applied(self, endpoint_id: str, ids: Sequence[str]) -> int:
        """The agent stored these cancels (its ``ack.c``): stop sending them. Without an fsync: one
        lost in a crash is sent again, and the agent acks it again."""

        def q(db: Any) -> int:
            return sum(db.execute("UPDATE tasks SET cancel_pending=NULL WHERE id=? AND endpoint_id=? AND cancel_pending IS NOT NULL",
                                  (i, endpoint_id)).rowcount for i in ids)

        return await self.tx(q, durable=False)

    async def renew_group_lease(self, user_id: str, group: str, ttl_s: float, now: float | None = None) -> float:
        """A driver's lease on its task group (docs/multiprocessing.md, "Lease"): made or renewed
        until ``now + ttl_s``. Returns that time."""
        at = time.time() if now is None else now

        def q(db: Any) -> None:
            db.execute("INSERT INTO task_group_leases (user_id, task_group_id, expires, created) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (user_id, task_group_id) DO UPDATE SET expires=excluded.expires",
                       (user_id, group, at + ttl_s, at))

        await self.tx(q)
        return at + ttl_s

    async def release_group_lease(self, user_id: str, group: str) -> bool:
        """Drop a lease (the driver ended cleanly); its tasks are left as they are."""
        return bool(await self.tx(lambda db: db.execute(
            "DELETE FROM task_group_leases WHERE user_id=? AND task_group_id=?", (user_id, group)).rowcount))

    async def expire_group_leases(self, now: float, limit: int = 100) -> list[dict[str, Any]]:
        """Leases past their expiry (a driver that died or stopped renewing): every unfinished task
        of the group is cancelled as by its submitter, and the lease is dropped, in one transaction.
        Returns per group ``{"user", "group", "cancelled", "fresh", "endpoints"}``."""

        def q(db: Any) -> list[dict[str, Any]]:
            out = []
            for user, group in db.execute("SELECT user_id, task_group_id FROM task_group_leases WHERE expires < ? LIMIT ?",
                                          (now, limit)).fetchall():
                done = cancel_in(db, user, None, group, "cancelled: the program that submitted it stopped renewing its lease", now)
                db.execute("DELETE FROM task_group_leases WHERE user_id=? AND task_group_id=?", (user, group))
                out.append({"user": user, "group": group, **done})
            return out

        return await self.tx(q)

    async def get_task(self, task_id: str, user_id: str) -> dict[str, Any] | None:
        def q() -> dict[str, Any] | None:
            row = self._conn().execute(
                "SELECT t.id, t.endpoint_id, t.function_id, t.state, t.created, t.dispatched, t.acked, t.done, t.attempts, "
                "r.ok, r.started, r.finished FROM tasks t LEFT JOIN results r ON r.task_id=t.id WHERE t.id=? AND t.user_id=?",
                (task_id, user_id),
            ).fetchone()
            cols = ["id", "endpoint_id", "function_id", "state", "created", "dispatched", "acked", "done", "attempts", "ok", "started", "finished"]
            return dict(zip(cols, row)) if row else None

        return await self._run(q)

    async def results(self, user_id: str, task_ids: Sequence[str]) -> list[dict[str, Any]]:
        def q() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for chunk in _chunks(list(task_ids)):
                rows = self._conn().execute(
                    f"{_RESULT_SELECT} WHERE r.user_id=? AND r.task_id IN ({','.join('?' * len(chunk))})",
                    (user_id, *chunk),
                ).fetchall()
                out.extend(_result_rows(rows))
            return out

        return await self._run(q)

    async def results_after(self, user_id: str, seq: int, limit: int) -> list[dict[str, Any]]:
        """The user's results after their cursor ``seq`` (a per-user number, see number_results)."""
        def q(db: Any) -> list[dict[str, Any]]:
            rows = db.execute(
                f"{_RESULT_SELECT} WHERE r.user_id=? AND r.user_seq > ? ORDER BY r.user_seq LIMIT ?",
                (user_id, seq, limit),
            ).fetchall()
            return _result_rows(rows)

        # The reader connection: a stream's read of fresh results runs while the writer commits the next ones.
        return await self.read_parallel(q)

    async def last_result_seq(self, user_id: str | None = None) -> int:
        """The newest result's cursor: a user's own (what a stream reader starts from, counted per
        user so it tells nothing of other users' results), or the whole table's (internal only)."""
        if user_id is None:
            return await self._run(lambda: self._conn().execute("SELECT COALESCE(MAX(seq), 0) FROM results").fetchone()[0])
        return await self._run(lambda: self._conn().execute(
            "SELECT COALESCE(MAX(last), 0) FROM result_cursors WHERE user_id=?", (user_id,)).fetchone()[0])

    async def task_counts(self, user_id: str | None = None) -> dict[str, int]:
        def q() -> dict[str, int]:
            sql = "SELECT state, COUNT(*) FROM tasks"
            args: tuple[str, ...] = ()
            if user_id:
                sql, args = sql + " WHERE user_id=?", (user_id,)
            return dict(self._conn().execute(sql + " GROUP BY state", args).fetchall())

        return await self._run(q)

    async def prune_results(self, older_than: float) -> int:
        def q(db: sqlite3.Connection) -> int:
            old = db.execute("SELECT task_id FROM results WHERE received < ?", (older_than,)).fetchall()
            db.executemany("DELETE FROM results WHERE task_id=?", old)
            db.executemany("DELETE FROM tasks WHERE id=?", old)
            db.execute("DELETE FROM submit_keys WHERE created < ?", (older_than,))  # kept as long as results
            db.execute("DELETE FROM memo WHERE expires < ?", (time.time(),))  # cached results past memo_ttl_s
            return len(old)

        return await self.tx(q)


def number_results(db: Any) -> None:
    """Give every result stored in this transaction the next number of its user's cursor.

    Called by each writer of ``results`` before its transaction commits, so no committed result is
    without a number. Why per user: one hub-wide sequence told a user, by the gaps between their
    own cursors, how many results everyone else got. Why a counter table and not MAX(user_seq):
    pruning a user's newest results must not hand their numbers out again (a client holding that
    cursor would skip the new results). In PostgreSQL the writer already holds the results lock
    (postgres.py), so numbers are committed in order for the stream readers too."""
    rows = db.execute("SELECT seq, user_id FROM results WHERE user_seq IS NULL ORDER BY seq").fetchall()
    by_user: dict[str, list[int]] = {}
    for seq, uid in rows:
        by_user.setdefault(uid, []).append(seq)
    for uid, seqs in by_user.items():
        row = db.execute("SELECT last FROM result_cursors WHERE user_id=?", (uid,)).fetchone()
        last = row[0] if row else 0
        db.executemany("UPDATE results SET user_seq=? WHERE seq=?", [(last + i, s) for i, s in enumerate(seqs, 1)])
        db.execute("INSERT INTO result_cursors (user_id, last) VALUES (?, ?) ON CONFLICT (user_id) DO UPDATE SET last=excluded.last",
                   (uid, last + len(seqs)))


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


class UnknownTask(KeyError):
    """A cancel named a task that is not the caller's (or no task at all); nothing was changed."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id

    def __str__(self) -> str:
        return f"unknown task {self.task_id}"


def cancel_in(db: Any, user_id: str, ids: Sequence[str] | None, group: str | None, why: str, now: float) -> dict[str, Any]:
    """The body of :meth:`SqliteStore.cancel_tasks`, also run for an expired lease."""
    from mesh_agent.protocol import cancelled_error, serialize

    rows: list[tuple[Any, ...]] = []
    if group is not None:
        rows = db.execute("SELECT id, state, endpoint_id, cancelled FROM tasks WHERE user_id=? AND task_group_id=? AND state != 'done'",
                          (user_id, group)).fetchall()
    else:
        want = list(dict.fromkeys(ids or ()))
        for chunk in _chunks(want):
            rows.extend(db.execute(f"SELECT id, state, endpoint_id, cancelled FROM tasks WHERE user_id=? "
                                   f"AND id IN ({','.join('?' * len(chunk))})", (user_id, *chunk)).fetchall())
        found = {r[0] for r in rows}
        for i in want:
            if i not in found:
                raise UnknownTask(i)
    cancelled: list[str] = []
    done: list[str] = []
    fresh: list[tuple[str, str, bytes]] = []
    marks: list[tuple[float, int | None, str]] = []
    endpoints: set[str] = set()
    for tid, state, ep, was in rows:
        if state == "done":
            (cancelled if was is not None else done).append(tid)
            continue
        cancelled.append(tid)
        fresh.append((tid, user_id, serialize(cancelled_error(tid, why))))
        sent = state in ("leased", "acked") and ep is not None
        marks.append((now, 1 if sent else None, tid))
        if sent:
            endpoints.add(ep)
    fail_tasks(db, fresh, now)
    db.executemany("UPDATE tasks SET cancelled=?, cancel_pending=? WHERE id=?", marks)
    return {"cancelled": cancelled, "done": done, "fresh": [t for t, _, _ in fresh], "endpoints": endpoints}


def fail_tasks(db: Any, rows: Sequence[tuple[str, str, bytes]], now: float) -> None:
    """Finish tasks with an error result the hub wrote itself (expired, revoked endpoint, function
    no longer allowed): ``rows`` are (task id, user id, error blob). A task that already has a
    result keeps it."""
    db.executemany(
        "INSERT INTO results (task_id, user_id, ok, data, started, finished, received, pid) VALUES (?, ?, 0, ?, ?, ?, ?, 0) "
        "ON CONFLICT (task_id) DO NOTHING",
        [(tid, uid, blob, now, now, now) for tid, uid, blob in rows],
    )
    db.executemany("UPDATE tasks SET state='done', done=?, args=NULL WHERE id=?", [(now, tid) for tid, _, _ in rows])
    number_results(db)


#: A result with the endpoint that produced it, whether that endpoint is the user's own, and
#: whether it is trusted *for this user*: the user owns it and marked it trusted (migration 15). The
#: SDK unpickles only trusted results (or those of endpoints the caller lists in trusted_endpoints),
#: read at every fetch, so marking or unmarking an endpoint applies to results already stored. No
#: endpoint (a task that expired before any ran it) means the hub made the result itself.
_RESULT_SELECT = (
    "SELECT r.user_seq, r.task_id, r.ok, r.data, r.started, r.finished, t.endpoint_id, e.user_id = r.user_id, e.trusted "
    "FROM results r LEFT JOIN tasks t ON t.id = r.task_id LEFT JOIN endpoints e ON e.id = t.endpoint_id"
)


def _result_rows(rows: Iterable[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [
        {"seq": r[0], "task_id": r[1], "ok": bool(r[2]), "data": r[3], "started": r[4], "finished": r[5],
         "endpoint_id": r[6], "own_endpoint": r[6] is None or bool(r[7]), "trusted": r[6] is None or (bool(r[7]) and bool(r[8]))}
        for r in rows
    ]


def _fair_rows(db: Any, endpoint_id: str, n: int, policy: "AdmissionPolicy", lock: str = "") -> list[tuple[Any, ...]]:
    """The tasks a fair lease takes, in the order the agent should run them (cloud_hub/store/fair.py):
    ``(id, function_id, args, timeout, expires, placed)``."""
    from cloud_hub.store import fair

    picked: dict[str, list[tuple[Any, ...]]] = {}
    for user, fid, k in fair.plan(db, endpoint_id, n, policy):
        picked.setdefault(user, []).extend(db.execute(fair.select_sql(lock), (endpoint_id, user, fid, k)).fetchall())
    for ts in picked.values():
        ts.sort(key=lambda t: t[5])
    return [(*r[:5], r[7]) for r in fair.frame_order(picked, policy.fair, lambda t: t[5])]  # ..., placed


def check_results(results: Any) -> None:
    """Raise ValueError, naming the first problem, unless ``results`` is a list of results as an
    agent sends them (``id`` str, ``ok`` bool, ``data`` bytes; ``started``/``finished``/``pid``
    numbers or absent). Why here: a batch is stored in one savepoint of a shared group commit,
    and a malformed one must fail alone, with a message, before anything of it is written."""
    if not isinstance(results, (list, tuple)):
        raise ValueError(f"results must be a list, not {type(results).__name__}")
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            raise ValueError(f"result {i} is a {type(r).__name__}, not a map")
        if not isinstance(r.get("id"), str) or not r["id"]:
            raise ValueError(f"result {i} has no task id (str)")
        if not isinstance(r.get("ok"), (bool, int)):
            raise ValueError(f"result {i} (task {r['id'][:40]}) has no 'ok' (bool)")
        if not isinstance(r.get("data"), (bytes, bytearray)):
            raise ValueError(f"result {i} (task {r['id'][:40]}) has no 'data' (bytes)")
        for k in ("started", "finished", "pid"):
            v = r.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"result {i} (task {r['id'][:40]}): '{k}' must be a number")


def _requeue(db: Any, endpoint_id: str | None, expired_before: float | None, not_in: set[str] | None) -> int:
    """The body of :meth:`SqliteStore.requeue`, also run inside a hello's one transaction."""
    n = 0
    now = time.time()
    # A task leased ahead to a site gateway (site set) waits there through the device's and
    # the gateway's lost sessions and a hub restart: only its own (long) lease frees it. Back in
    # the queue it keeps ``site``: the gateway may still hold its frame, and its confirmation
    # re-claims it (hold_site) instead of the hub sending it again (docs/sites.md).
    if expired_before is not None:
        n += db.execute(
            "UPDATE tasks SET state='queued', leased_until=NULL WHERE state='leased' AND leased_until < ? "
            "AND (site IS NULL OR leased_until < ?)",
            (expired_before, min(expired_before, now)),
        ).rowcount
    if endpoint_id is not None and not_in is None:
        n += db.execute(
            "UPDATE tasks SET state='queued', leased_until=NULL WHERE state='leased' AND endpoint_id=? "
            "AND (site IS NULL OR leased_until < ?)",
            (endpoint_id, now),
        ).rowcount
    if endpoint_id is not None and not_in is not None:
        acked = [r[0] for r in db.execute("SELECT id FROM tasks WHERE endpoint_id=? AND state='acked'", (endpoint_id,))]
        lost = [i for i in acked if i not in not_in]
        db.executemany("UPDATE tasks SET state='queued', site=NULL WHERE id=? AND state='acked'", [(i,) for i in lost])
        n += len(lost)
    return n


def _statements(sql: str) -> list[str]:
    return [s.strip() for s in sql.split(";") if s.strip()]
