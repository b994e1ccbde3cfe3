"""Results: stored exactly once per task, numbered per user for the SDK's result stream, read
back by id or after a cursor, and pruned.
"""

from __future__ import annotations


import sqlite3
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TypeVar


if TYPE_CHECKING:
    pass

from cloud_hub.store import scheduling
from cloud_hub.store._engine import StoreEngine, _chunks, number_results

T = TypeVar("T")

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


class Fresh(list[tuple[str, str]]):
    """(task id, user id) of the results a frame stored for the first time, and ``rows``: per
    user, those results as ``results_after`` would read them back (numbered, with the endpoint's
    flags), read inside the storing transaction. Why: the SDK's result stream sends them from
    memory, which saves the hub a read on another thread per results frame (issue 30)."""

    rows: dict[str, list[dict[str, Any]]]

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(items)
        self.rows = {}


def _stream_rows(db: Any, endpoint_id: str, fresh: Sequence[dict[str, Any]], owners: dict[str, str],
                 numbers: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """The stream's rows of results just stored by one endpoint, by user: their numbers as
    ``number_results`` gave them, the endpoint's flags read once (one query, not one per row)."""
    row = db.execute("SELECT user_id, trusted FROM endpoints WHERE id=?", (endpoint_id,)).fetchone()
    owner, trusted = (row[0], bool(row[1])) if row is not None else (None, False)
    out: dict[str, list[dict[str, Any]]] = {}
    for r in fresh:
        seq = numbers.get(r["id"])
        if seq is None:  # stored before (a memo copy): the store has it, with its own number
            continue
        uid = owners[r["id"]]
        own = row is not None and owner == uid  # as _RESULT_SELECT reads it back
        out.setdefault(uid, []).append(
            {"seq": seq, "task_id": r["id"], "ok": bool(r["ok"]), "data": r["data"], "started": r.get("started"), "finished": r.get("finished"),
             "endpoint_id": endpoint_id, "own_endpoint": own, "trusted": own and trusted})
    for rows_of in out.values():
        rows_of.sort(key=lambda x: x["seq"])
    return out


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


class ResultStore(StoreEngine):
    """Results of tasks, and each user's result cursor."""

    async def store_results(self, endpoint_id: str, results: Sequence[dict[str, Any]]) -> Fresh:
        """Store results exactly once per task; return (task id, user id) of those that were new,
        with each new result as the result stream sends it (``Fresh.rows``). A malformed batch
        raises ValueError naming what is wrong, and stores none of it."""

        def q(db: sqlite3.Connection) -> Fresh:
            check_results(results)
            now = time.time()
            ids = [r["id"] for r in results]
            owners: dict[str, str] = {}
            cached: set[str] = set()  # submitted with a cache key (cloud_hub/store/memo.py)
            for chunk in _chunks(ids):
                for tid, uid, memo_key in db.execute(
                    f"SELECT id, user_id, memo_key FROM tasks WHERE endpoint_id=? AND state != 'done' AND id IN ({','.join('?' * len(chunk))})",
                    (endpoint_id, *chunk),
                ):
                    owners[tid] = uid
                    if memo_key is not None:
                        cached.add(tid)
            fresh = list({r["id"]: r for r in results if r["id"] in owners}.values())  # a batch may repeat an id
            db.executemany(
                "INSERT INTO results (task_id, user_id, ok, data, started, finished, received, pid) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO NOTHING",
                [(r["id"], owners[r["id"]], int(bool(r["ok"])), r["data"], r.get("started"), r.get("finished"), now, r.get("pid")) for r in fresh],
            )
            db.executemany("UPDATE tasks SET state='done', done=?, args=NULL WHERE id=?", [(now, r["id"]) for r in fresh])
            scheduling.complete_results(db, fresh, now)
            numbers = number_results(db)
            if getattr(self, "memo", None) is not None and cached:  # results of tasks submitted with cache=True answer repeats
                from cloud_hub.store import memo

                memo.record(db, [r for r in fresh if r["id"] in cached], self.memo, now)  # type: ignore[arg-type]
            out = Fresh((r["id"], owners[r["id"]]) for r in fresh)
            out.rows = _stream_rows(db, endpoint_id, fresh, owners, numbers)
            return out

        return await self.tx(q)

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

    async def prune_results(self, older_than: float) -> int:
        def q(db: sqlite3.Connection) -> int:
            old = db.execute("SELECT task_id FROM results WHERE received < ?", (older_than,)).fetchall()
            db.executemany("DELETE FROM results WHERE task_id=?", old)
            db.executemany("DELETE FROM tasks WHERE id=?", old)
            db.execute("DELETE FROM submit_keys WHERE created < ?", (older_than,))  # kept as long as results
            db.execute("DELETE FROM memo WHERE expires < ?", (time.time(),))  # cached results past memo_ttl_s
            return len(old)

        return await self.tx(q)
