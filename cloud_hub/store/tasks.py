"""The task queue: inserting tasks (with submit keys), leasing them to endpoints, acks,
requeues, expiry, cancellation and the leases that bound a task group's life.
"""

from __future__ import annotations


import json
import sqlite3
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from cloud_hub.store.lookahead import PLACED_SKIP as _PLACED_SKIP, keep_placed

if TYPE_CHECKING:
    from cloud_hub.admission import AdmissionPolicy

from cloud_hub.store._engine import StoreEngine, _chunks, number_results

T = TypeVar("T")


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


class TaskStore(StoreEngine):
    """Tasks from submit to lease, ack, requeue, expiry or cancel."""

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
        """What a submit with this idempotency key made: (request hash, task ids, endpoint ids).

        Read in a transaction of the writer, queued behind whatever is committing: the submit path
        asks only after its own insert failed, and a copy of the same request in the same group
        commit has not committed its key yet when that failure is reported (group.py)."""
        def q(db: Any) -> Any:
            return db.execute("SELECT request_hash, task_ids, endpoint_ids FROM submit_keys WHERE user_id=? AND key=?", (user_id, key)).fetchone()

        row = await self.tx(q, durable=False)
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
        return await self.tx(self.lease_query(endpoint_id, n, lease_s, max_bytes, policy, only_now=only_now, placed_max=placed_max),
                             durable=False)

    def lease_query(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: "AdmissionPolicy | None" = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> Callable[[sqlite3.Connection], tuple[list[dict[str, Any]], dict[str, bytes]]]:
        """:meth:`lease` as a function of a connection, to run inside another transaction: a
        submit for an endpoint with credit leases in the transaction that inserts its tasks, one
        database hop and one commit instead of two (issue 30; ``Dispatcher.claim_insert_leases``)."""

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

        return q

    async def ack(self, endpoint_id: str, ids: Sequence[str]) -> None:
        def q(db: sqlite3.Connection) -> None:
            now = time.time()
            db.executemany(
                "UPDATE tasks SET state='acked', acked=? WHERE id=? AND endpoint_id=? AND state IN ('leased','queued')",
                [(now, i, endpoint_id) for i in ids],
            )

        await self.tx(q, durable=False)

    async def count_leased(self, endpoint_id: str) -> int:
        """Tasks of an endpoint sent but not yet acked: on their way, or lost on the way."""
        return int(await self._run(lambda: self._conn().execute(
            "SELECT COUNT(*) FROM tasks WHERE endpoint_id=? AND state='leased'", (endpoint_id,)).fetchone()[0]))

    async def endpoints_with_queued(self, endpoint_ids: Sequence[str]) -> set[str]:
        """Which of these endpoints have a task waiting in the queue: the watchdog's recheck of
        drained sessions asks for all that came due in one pass, in one hop to the database
        thread, instead of a lease (two queries and a hop) each. One indexed probe per endpoint."""

        def q() -> set[str]:
            db = self._conn()
            return {ep for ep in endpoint_ids
                    if db.execute("SELECT 1 FROM tasks WHERE endpoint_id=? AND state='queued' LIMIT 1", (ep,)).fetchone()}

        return await self._run(q)

    async def unlease(self, endpoint_id: str, ids: Sequence[str]) -> int:
        """Put these leased tasks back in the queue at once: the frame carrying them failed to send.
        That attempt never happened: it is not counted, and a task on its first attempt is again
        never dispatched, so the scheduler may still move it (late binding) if its endpoint is lost
        (found by the outsider's check of issue 30: two "auto" tasks waited for a dead endpoint)."""

        def q(db: sqlite3.Connection) -> int:
            return sum(
                db.execute("UPDATE tasks SET state='queued', leased_until=NULL, attempts=CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END, "
                           "dispatched=CASE WHEN attempts <= 1 THEN NULL ELSE dispatched END "
                           "WHERE id=? AND endpoint_id=? AND state='leased'",
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

    async def expire_tasks(self, now: float, error_blob: Callable[[str], bytes]) -> list[tuple[str, str]]:
        """Tasks still queued past their expiry get an error result, so the caller learns of it."""

        def q(db: sqlite3.Connection) -> list[tuple[str, str]]:
            rows = db.execute(
                "SELECT id, user_id FROM tasks WHERE state='queued' AND expires IS NOT NULL AND expires < ? LIMIT 10000", (now,)
            ).fetchall()
            fail_tasks(db, [(tid, uid, error_blob(tid)) for tid, uid in rows], now)
            return [(tid, uid) for tid, uid in rows]

        return await self.tx(q)

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

    async def task_counts(self, user_id: str | None = None) -> dict[str, int]:
        def q() -> dict[str, int]:
            sql = "SELECT state, COUNT(*) FROM tasks"
            args: tuple[str, ...] = ()
            if user_id:
                sql, args = sql + " WHERE user_id=?", (user_id,)
            return dict(self._conn().execute(sql + " GROUP BY state", args).fetchall())

        return await self._run(q)
