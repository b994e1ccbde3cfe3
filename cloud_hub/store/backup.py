"""The SQL of ``mesh-hub backup`` / ``mesh-hub restore`` (``cloud_hub/backup.py``), on SQLite hub files.

Why here: these statements read and write the hub's own tables (tasks, results, endpoints, tokens,
result cursors) and the backup's marker table, so they live with the rest of the hub's SQL.
``cloud_hub/backup.py`` keeps the file handling: opening the files with ``sqlite3``, SQLite's
backup API, fsync and renames. The statements that are not about tables (the integrity check,
journal and locking modes, ``BEGIN``/``COMMIT``) are here too, so that no SQL text lives outside
``cloud_hub/store``.

Every function takes a ``sqlite3.Connection`` to a hub database file (the live one, a backup, or
the one a restore replaces), never the running hub's store. SQLite only: ``sqlite_master``,
``sqlite_sequence``, ``PRAGMA table_info`` and ``X''`` are SQLite's own.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "MARKER_TABLE", "quick_check", "exclusive_probe", "self_contained", "immediate", "tables", "schema_version", "counts", "marker", "lock_probe", "write_marker", "drop_marker",
    "user_cursors", "task_ids", "unfinished_task_ids", "task_states", "endpoint_ids", "live_endpoint_ids",
    "token_hashes", "revoked_endpoints", "unrevoked_endpoints", "revoke_endpoint", "api_token_columns",
    "revoked_api_tokens", "revoke_api_token", "max_result_seq", "results_sequence", "set_results_sequence",
    "user_ids", "set_user_cursors",
]

#: The table a backup file carries (when it was taken, from where, by which hub version).
MARKER_TABLE = "mesh_backup"


def quick_check(db: sqlite3.Connection) -> str | None:
    """SQLite's quick integrity check: ``"ok"``, the first problem found, or None. Raises
    ``sqlite3.DatabaseError`` on a file that is not a database at all."""
    row = db.execute("PRAGMA quick_check").fetchone()
    return None if row is None else str(row[0])


def exclusive_probe(db: sqlite3.Connection) -> None:
    """Take and release an exclusive lock on the file (``locking_mode=EXCLUSIVE``, ``BEGIN EXCLUSIVE``).

    Raises ``sqlite3.OperationalError`` ("locked"/"busy") when another process has it open: in WAL
    mode an idle hub still holds its shared lock, so a quiet moment does not fool it."""
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    db.execute("BEGIN EXCLUSIVE")
    lock_probe(db)
    db.execute("COMMIT")


def self_contained(db: sqlite3.Connection) -> None:
    """Switch a fresh copy to the rollback journal: one file, no ``-wal`` beside it."""
    db.execute("PRAGMA journal_mode=DELETE")


@contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``), rolled back when the body raises.

    The connection must be in autocommit mode (``isolation_level=None``)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def tables(db: sqlite3.Connection) -> set[str]:
    """The names of the file's tables (which migrations it has, whether it is a backup)."""
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def schema_version(db: sqlite3.Connection) -> Any:
    """The file's schema version (None on an empty ``schema_version``), checked against this hub's migrations."""
    return db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]


def counts(db: sqlite3.Connection) -> list[int]:
    """Rows in tasks, results and endpoints: what a backup holds, for ``mesh-hub backup``'s report."""
    return [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("tasks", "results", "endpoints")]


def marker(db: sqlite3.Connection) -> tuple[Any, ...] | None:
    """The backup's (taken_at, source), read from its marker table (the caller checks it exists)."""
    row = db.execute(f"SELECT taken_at, source FROM {MARKER_TABLE}").fetchone()
    return tuple(row) if row is not None else None


def lock_probe(db: sqlite3.Connection) -> None:
    """Read the catalog inside the caller's ``BEGIN EXCLUSIVE``: it fails when another process holds the file."""
    db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()


def write_marker(db: sqlite3.Connection, taken_at: float, source: str, hub_version: str) -> None:
    """Create and fill a new backup's marker table: when it was taken, from which file, by which hub."""
    db.execute(f"CREATE TABLE {MARKER_TABLE} (taken_at REAL NOT NULL, source TEXT NOT NULL, hub_version TEXT NOT NULL)")
    db.execute(f"INSERT INTO {MARKER_TABLE} VALUES (?, ?, ?)", (taken_at, source, hub_version))


def drop_marker(db: sqlite3.Connection) -> None:
    """Remove the marker table from a database being restored (a hub database has none)."""
    db.execute(f"DROP TABLE IF EXISTS {MARKER_TABLE}")


def user_cursors(db: sqlite3.Connection) -> dict[str, int]:
    """Each user's last result cursor: migration 14's counters, or before it the global seq of the
    user's newest result (what that hub's clients were handed)."""
    if "result_cursors" in tables(db):
        return dict(db.execute("SELECT user_id, last FROM result_cursors").fetchall())
    return dict(db.execute("SELECT user_id, MAX(seq) FROM results GROUP BY user_id").fetchall())


def task_ids(db: sqlite3.Connection) -> set[str]:
    """Every task id (which tasks a backup holds)."""
    return {r[0] for r in db.execute("SELECT id FROM tasks")}


def unfinished_task_ids(db: sqlite3.Connection) -> set[str]:
    """Ids of the tasks not done (in a backup: those that may run again after the restore)."""
    return {r[0] for r in db.execute("SELECT id FROM tasks WHERE state != 'done'")}


def task_states(db: sqlite3.Connection) -> list[tuple[str, str]]:
    """(id, state) of every task (of the database a restore replaces: what the backup lacks)."""
    return [(r[0], r[1]) for r in db.execute("SELECT id, state FROM tasks")]


def endpoint_ids(db: sqlite3.Connection) -> set[str]:
    """Every endpoint id, revoked ones too (which enrollments a backup holds)."""
    return {r[0] for r in db.execute("SELECT id FROM endpoints")}


def live_endpoint_ids(db: sqlite3.Connection) -> list[str]:
    """Ids of the endpoints not revoked (enrollments a restore may lose)."""
    return [r[0] for r in db.execute("SELECT id FROM endpoints WHERE revoked IS NULL")]


def token_hashes(db: sqlite3.Connection, table: str) -> list[str]:
    """Every token hash of ``table`` (``api_tokens`` or ``enroll_tokens``: tokens a restore may lose)."""
    return [r[0] for r in db.execute(f"SELECT hash FROM {table}")]


def revoked_endpoints(db: sqlite3.Connection) -> dict[str, float]:
    """endpoint id -> when it was revoked (revocations a restore must apply again)."""
    return dict(db.execute("SELECT id, revoked FROM endpoints WHERE revoked IS NOT NULL").fetchall())


def unrevoked_endpoints(db: sqlite3.Connection) -> list[tuple[Any, ...]]:
    """(id, revoked) of the endpoints not revoked (in the backup: candidates for a revocation made after it)."""
    return db.execute("SELECT id, revoked FROM endpoints WHERE revoked IS NULL").fetchall()


def revoke_endpoint(db: sqlite3.Connection, endpoint_id: str, revoked: float) -> None:
    """Apply a revocation again: the same wipe as ``cloud_hub/store/access.py`` (no key, no broker login)."""
    db.execute("UPDATE endpoints SET revoked=?, online=0, key=X'', mqtt_hash=NULL, curve_key=NULL WHERE id=?", (revoked, endpoint_id))


def api_token_columns(db: sqlite3.Connection) -> set[str]:
    """The columns of ``api_tokens`` (``revoked`` arrived with migration 13)."""
    return {r[1] for r in db.execute("PRAGMA table_info(api_tokens)")}


def revoked_api_tokens(db: sqlite3.Connection) -> list[tuple[Any, ...]]:
    """(hash, revoked) of the revoked API tokens (revocations a restore must apply again)."""
    return db.execute("SELECT hash, revoked FROM api_tokens WHERE revoked IS NOT NULL").fetchall()


def revoke_api_token(db: sqlite3.Connection, token_hash: str, revoked: float) -> int:
    """Revoke an API token again unless it is already revoked; returns the rows changed (0 or 1)."""
    return int(db.execute("UPDATE api_tokens SET revoked=? WHERE hash=? AND revoked IS NULL", (revoked, token_hash)).rowcount)


def max_result_seq(db: sqlite3.Connection) -> int:
    """The highest result cursor stored (0 without results): the restored hub's cursor starts above it."""
    return int(db.execute("SELECT COALESCE(MAX(seq), 0) FROM results").fetchone()[0])


def results_sequence(db: sqlite3.Connection) -> tuple[Any, ...] | None:
    """The AUTOINCREMENT counter of ``results.seq`` (above every seq ever handed out, deleted rows too), if any."""
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name='results'").fetchone()
    return tuple(row) if row is not None else None


def set_results_sequence(db: sqlite3.Connection, seq: int) -> None:
    """Set the AUTOINCREMENT counter of ``results.seq``: the next result's cursor is above ``seq``."""
    db.execute("DELETE FROM sqlite_sequence WHERE name='results'")
    db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('results', ?)", (seq,))


def user_ids(db: sqlite3.Connection) -> set[str]:
    """Every user id (each gets a result cursor after a restore)."""
    return {r[0] for r in db.execute("SELECT id FROM users")}


def set_user_cursors(db: sqlite3.Connection, cursors: list[tuple[str, int]]) -> None:
    """Write each user's result cursor (migration 14), replacing the one restored."""
    db.executemany(
        "INSERT INTO result_cursors (user_id, last) VALUES (?, ?) ON CONFLICT (user_id) DO UPDATE SET last=excluded.last",
        cursors,
    )
