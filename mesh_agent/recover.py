"""``mesh-agent queue recover``: move a damaged queue database aside and keep what can still be read.

Why this is enough for "nothing lost": the hub knows every task it handed to this endpoint. On the
next hello the agent lists the tasks it holds (``have``); the hub re-queues every task it believed
stored here that is missing from that list. So a row that cannot be read back is not lost, it is
sent again; and a row that can be read back (a task waiting to run, a result waiting for its ack)
is kept, so work already done is not repeated.

The damaged file is never modified: it is renamed (with its ``-wal`` and ``-shm``) and rows are read
from a scratch copy, row by row where whole-table reads fail, so one bad page costs only its rows.
A stored task whose function body cannot be read back is dropped rather than kept: kept, it could
only fail with FunctionMissing; dropped, the hub re-sends it with its body.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from mesh_agent.store import _SCHEMA, SCHEMA_VERSION

__all__ = ["RecoveryReport", "recover_queue"]

_TASK_COLS = ("id", "function_id", "args", "timeout", "expires", "state", "received", "ok", "result", "started", "finished", "worker_pid")
_MISS_RUN = 2000  # consecutive unreadable rowids after which a row-by-row scan stops


@dataclass
class RecoveryReport:
    damaged: Path
    moved_to: Path
    tasks: dict[str, int] = field(default_factory=lambda: {"queued": 0, "done": 0, "acked": 0})
    functions: int = 0
    dropped_without_body: int = 0
    unreadable_rows: int = 0  # rows read back but unusable (bad state, result missing)
    read_errors: int = 0  # rowid lookups that hit a damaged page
    notes: list[str] = field(default_factory=list)


def _rows(db: sqlite3.Connection, table: str, cols: tuple[str, ...], report: RecoveryReport) -> Iterator[tuple[Any, ...]]:
    """Every readable row: the whole table if it reads cleanly, else rowid by rowid."""
    sql = f"SELECT {', '.join(cols)} FROM {table}"
    try:
        yield from db.execute(sql).fetchall()
        return
    except sqlite3.DatabaseError as exc:
        report.notes.append(f"{table}: full read failed ({exc}); reading row by row")
    try:
        top = db.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()[0] or 0
    except sqlite3.DatabaseError:
        top = None
    rowid, misses = 1, 0
    while (top is None and misses < _MISS_RUN) or (top is not None and rowid <= top):
        try:
            row = db.execute(f"{sql} WHERE rowid=?", (rowid,)).fetchone()
        except sqlite3.DatabaseError:
            row = None
            report.read_errors += 1
        if row is None:
            misses += 1
        else:
            misses = 0
            yield row
        rowid += 1


def recover_queue(path: Path) -> RecoveryReport:
    """Rename ``path`` (and its WAL files) aside, create a fresh queue there, copy readable rows in."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no queue database to recover")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    report = RecoveryReport(damaged=path, moved_to=aside)
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            src.rename(f"{aside}{suffix}")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".recover-") as scratch:
        copy = Path(scratch) / "copy.sqlite3"
        for suffix in ("", "-wal"):
            if Path(f"{aside}{suffix}").exists():
                shutil.copyfile(f"{aside}{suffix}", f"{copy}{suffix}")
        functions: dict[str, tuple[bytes, float]] = {}
        tasks: list[tuple[Any, ...]] = []
        meta: list[tuple[str, str]] = []
        try:
            old = sqlite3.connect(copy)
            # Lets SQLite read a file shorter than its header claims (a truncated copy) instead
            # of refusing it outright; we only ever read from this scratch copy.
            old.execute("PRAGMA writable_schema=ON")
            try:
                for fid, body, stored in _rows(old, "functions", ("id", "body", "stored_at"), report):
                    if isinstance(fid, str) and isinstance(body, bytes):
                        functions[fid] = (body, stored)
                tasks = list(_rows(old, "tasks", _TASK_COLS, report))
                meta = [(k, v) for k, v in _rows(old, "meta", ("key", "value"), report) if k != "schema_version"]
            finally:
                old.close()
        except sqlite3.DatabaseError as exc:
            report.notes.append(f"nothing readable: {exc}")
    from mesh_agent._private import prepare_private_sqlite

    prepare_private_sqlite(path)  # the fresh queue is as private as the one it replaces
    new = sqlite3.connect(path, isolation_level=None)
    try:
        new.execute("PRAGMA journal_mode=WAL")
        new.executescript(_SCHEMA)
        new.execute("BEGIN IMMEDIATE")
        new.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        new.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", meta)
        new.executemany("INSERT OR IGNORE INTO functions (id, body, stored_at) VALUES (?, ?, ?)", [(k, b, t) for k, (b, t) in functions.items()])
        keep = []
        for row in tasks:
            t = dict(zip(_TASK_COLS, row))
            if t["state"] not in report.tasks or not isinstance(t["id"], str):
                report.unreadable_rows += 1
                continue
            if t["state"] == "queued" and (t["function_id"] not in functions or not isinstance(t["args"], bytes)):
                report.dropped_without_body += 1  # the hub re-sends it whole
                continue
            if t["state"] == "done" and not isinstance(t["result"], bytes):
                report.unreadable_rows += 1  # not in `have`, so the hub re-queues it and it runs again
                continue
            keep.append(row)
            report.tasks[t["state"]] += 1
        new.executemany(f"INSERT OR IGNORE INTO tasks ({', '.join(_TASK_COLS)}) VALUES ({', '.join('?' * len(_TASK_COLS))})", keep)
        new.execute("COMMIT")
        report.functions = len(functions)
    finally:
        new.close()
    return report
