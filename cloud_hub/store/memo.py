"""The hub's memo table (migration 10): per user, cache key -> the task whose result answers it.

Why a pointer and not a copy: the result already sits in ``results``; the memo row only says which
one answers a key, until ``memo_ttl_s`` (and never past ``result_ttl_s``, when results are pruned:
a memo row whose result is gone simply stops matching). A hit costs one indexed read on submit
and, in the submit's own transaction, a task row born ``done`` plus a copy of the result row, so
the caller's stream delivers it like any other result: no dispatch, nothing on an endpoint.

Plain SQL that both stores run (portable ``INSERT ... ON CONFLICT``; the PostgreSQL store only
maps placeholders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from cloud_hub.store.sqlite import _chunks, number_results

__all__ = ["MemoSettings", "Hit", "record", "lookup", "pending", "write_hits", "count", "counts", "prune"]


@dataclass(frozen=True)
class MemoSettings:
    ttl_s: float = 86400.0
    max_entries: int = 100_000
    max_result_bytes: int = 2**20


@dataclass(frozen=True)
class Hit:
    key: str
    task_id: str  # the task whose result answers it
    endpoint_id: str  # where that result was made (the SDK's trust rule reads it)
    joined: bool = False  # that task is still queued or running: the repeat is answered with its id


def record(db: Any, fresh: Sequence[Mapping[str, Any]], settings: MemoSettings, now: float) -> int:
    """In the transaction that stores results: remember the successful ones of tasks submitted
    with a cache key (small enough to cache), then evict each touched user's least recently used
    entries beyond ``max_entries``. Returns how many entries were written."""
    ok = [r["id"] for r in fresh if r.get("ok") and len(r.get("data") or b"") <= settings.max_result_bytes]
    sizes = {r["id"]: len(r.get("data") or b"") for r in fresh}
    rows: list[tuple[Any, ...]] = []
    for chunk in _chunks(ok):
        rows.extend(db.execute(f"SELECT id, user_id, function_id, memo_key FROM tasks WHERE memo_key IS NOT NULL AND id IN ({','.join('?' * len(chunk))})",
                               list(chunk)).fetchall())
    if not rows:
        return 0
    db.executemany("INSERT INTO memo (user_id, key, task_id, function_id, created, expires, last_hit, hits, size) "
                   "VALUES (?, ?, ?, ?, ?, ?, NULL, 0, ?) ON CONFLICT (user_id, key) DO UPDATE SET task_id=excluded.task_id, "
                   "function_id=excluded.function_id, created=excluded.created, expires=excluded.expires, "
                   "last_hit=excluded.last_hit, hits=excluded.hits, size=excluded.size",
                   [(uid, key, tid, fid, now, now + settings.ttl_s, sizes.get(tid, 0)) for tid, uid, fid, key in rows])
    for uid in sorted({r[1] for r in rows}):
        n = db.execute("SELECT COUNT(*) FROM memo WHERE user_id=?", (uid,)).fetchone()[0]
        if n > settings.max_entries:
            db.execute("DELETE FROM memo WHERE user_id=? AND key IN (SELECT key FROM memo WHERE user_id=? ORDER BY COALESCE(last_hit, created), created "
                       "LIMIT ?)", (uid, uid, int(n - settings.max_entries)))
    return len(rows)


def lookup(db: Any, user_id: str, keys: Iterable[str], now: float) -> dict[str, Hit]:
    """Live entries among ``keys`` whose result is still stored and succeeded."""
    want = sorted(set(keys))
    out: dict[str, Hit] = {}
    for chunk in _chunks(want):
        for key, tid, ep in db.execute(
            "SELECT m.key, m.task_id, t.endpoint_id FROM memo m JOIN results r ON r.task_id = m.task_id JOIN tasks t ON t.id = m.task_id "
            f"WHERE m.user_id=? AND m.expires > ? AND r.ok = 1 AND m.key IN ({','.join('?' * len(chunk))})", (user_id, now, *chunk)).fetchall():
            out[key] = Hit(key, tid, ep)
    return out


def pending(db: Any, user_id: str, keys: Iterable[str]) -> dict[str, Hit]:
    """The user's tasks with these keys still queued or running (the oldest per key): a repeat
    submitted meanwhile joins it (migration 12's index makes this a lookup per key)."""
    want = sorted(set(keys))
    out: dict[str, Hit] = {}
    for chunk in _chunks(want):
        for key, tid, ep in db.execute(
            "SELECT memo_key, id, endpoint_id FROM tasks WHERE user_id=? AND memo_key IS NOT NULL AND state != 'done' "
            f"AND memo_key IN ({','.join('?' * len(chunk))}) ORDER BY created DESC", (user_id, *chunk)).fetchall():
            out[key] = Hit(key, tid, ep, joined=True)  # the last written is the oldest
    return out


def write_hits(db: Any, user_id: str, hits: Sequence[tuple[dict[str, Any], Hit]], misses: Mapping[str, int], now: float) -> None:
    """In the submit's transaction: each hit's task, born ``done``, with a copy of the cached
    result (a new result row: the caller's stream delivers it); hit and miss counters per function."""
    for row, hit in hits:
        if hit.joined:  # answered with the running task's id: nothing to write but the counter
            continue
        db.execute("INSERT INTO tasks (id, user_id, endpoint_id, function_id, args, state, created, expires, timeout, attempts, task_group_id, "
                   "memo_key, done) VALUES (?, ?, ?, ?, NULL, 'done', ?, ?, ?, 0, ?, ?, ?)",
                   (row["id"], user_id, hit.endpoint_id, row["function_id"], now, row["expires"], row["timeout"], row.get("task_group_id"),
                    hit.key, now))
        db.execute("INSERT INTO results (task_id, user_id, ok, data, started, finished, received, pid) "
                   "SELECT ?, user_id, ok, data, started, finished, ?, pid FROM results WHERE task_id=?", (row["id"], now, hit.task_id))
        db.execute("UPDATE memo SET hits = hits + 1, last_hit=? WHERE user_id=? AND key=?", (now, user_id, hit.key))
    number_results(db)
    per_fn: dict[str, list[int]] = {fid: [0, k] for fid, k in misses.items()}
    for row, _ in hits:
        per_fn.setdefault(row["function_id"], [0, 0])[0] += 1
    for fid, (h, m) in sorted(per_fn.items()):
        db.execute("INSERT INTO memo_counts (user_id, function_id, hits, misses) VALUES (?, ?, ?, ?) ON CONFLICT (user_id, function_id) "
                   "DO UPDATE SET hits = memo_counts.hits + excluded.hits, misses = memo_counts.misses + excluded.misses", (user_id, fid, h, m))


def count(db: Any, user_id: str) -> int:
    return int(db.execute("SELECT COUNT(*) FROM memo WHERE user_id=?", (user_id,)).fetchone()[0])


def counts(db: Any, user_id: str) -> dict[str, tuple[int, int]]:
    """function id -> (hits, misses) of the user's cached submits (the console's Functions page)."""
    return {fid: (int(h), int(m)) for fid, h, m in db.execute("SELECT function_id, hits, misses FROM memo_counts WHERE user_id=?", (user_id,))}


def prune(db: Any, now: float) -> int:
    return int(db.execute("DELETE FROM memo WHERE expires < ?", (now,)).rowcount)
