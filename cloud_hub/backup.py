"""Online backup and restore of a SQLite hub (``mesh-hub backup`` / ``mesh-hub restore``).

Why a command and not ``cp``: the hub keeps its database in WAL mode, so a copy of the main file
alone misses every commit still in ``hub.sqlite3-wal``, and a copy taken while the hub writes can
be torn. SQLite's backup API reads one consistent snapshot inside a single read transaction; in
WAL mode that does not block the hub's writer, so the hub keeps serving while the copy is made.

What a restore can promise, and what it cannot (docs/operations.md, "Backups and restore"):

- Every task the backup holds is brought back. Tasks it holds as queued or on a device are sent
  again or re-queued when the device says hello (the agent lists what it holds; the hub re-queues
  what the device no longer has), and agents re-send results the hub has not acknowledged. A
  task that finished after the backup was taken may therefore run again (execution is at least
  once); its result is stored once.
- Work accepted after the backup was taken is not in it and is gone. The restore counts it, by
  comparing the backup with the database it replaces, when that database is still readable (a
  bad upgrade, an operator's mistake, a lost table). When it is not (the disk died), nothing on
  the hub can say how much was lost: the restore says so in words instead of reporting zero.
- Enrollments made after the backup are gone (those devices enroll again); revocations made
  after it are applied again to the restored database, so a revoked device stays revoked.
- Result cursors never go back, the hub-wide ``results.seq`` nor each user's own (the cursor an
  SDK client holds, migration 14): clients that read results up to a cursor on the old database
  would otherwise skip results the restored hub stores.

Files are created 0600 (the database holds every endpoint's key and the hub's CURVE secret key),
a partial backup never carries the final name, and a failed restore leaves the old database in
place. PostgreSQL is backed up with its own tools (``pg_dump``, WAL archiving): see the docs.

The file handling is here (``sqlite3`` connections, SQLite's backup API, fsync, renames); every
SQL statement, on the hub's tables or not (integrity check, locking, transactions), is in
``cloud_hub/store/backup.py``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloud_hub.store import backup as sql
from cloud_hub.store.backup import MARKER_TABLE
from cloud_hub.store.migrations import MIGRATIONS
from cloud_hub.store.sqlite import migrate

__all__ = ["BackupError", "BackupInfo", "RestoreReport", "backup_sqlite", "inspect_backup", "restore_sqlite", "db_in_use"]

SQLITE_HEADER = b"SQLite format 3\x00"
# Without the old database, how far the result cursor jumps: more results than one hub stores
# between two backups, so that no SDK cursor from before the restore is ahead of new results.
_SEQ_JUMP_UNKNOWN = 1_000_000_000


class BackupError(RuntimeError):
    """A backup or restore that cannot be done; the message names the file and the reason, and
    nothing was changed."""


@dataclass
class BackupInfo:
    """What a backup file holds, read from its marker table (absent in a plain hub database)."""

    path: str
    taken_at: float | None
    source: str | None
    schema_version: int
    tasks: int
    results: int
    endpoints: int
    bytes: int
    seconds: float = 0.0


@dataclass
class RestoreReport:
    """What a restore brought back and what it could not: printed by the CLI, saved as JSON."""

    db: str
    backup: BackupInfo
    replaced: str | None = None  # where the database it replaced now lies (kept, never deleted)
    compared: bool = False  # the replaced database was readable and compared with the backup
    not_compared_why: str | None = None
    lost_tasks: int = 0  # accepted after the backup: gone
    lost_by_state: dict[str, int] = field(default_factory=dict)
    lost_task_ids: list[str] = field(default_factory=list)
    rerun_tasks: int = 0  # in the backup unfinished, finished after it: they run again
    lost_endpoints: list[str] = field(default_factory=list)  # enrolled after the backup: enroll again
    revocations_reapplied: list[str] = field(default_factory=list)
    token_revocations_reapplied: list[str] = field(default_factory=list)  # API token ids revoked after the backup
    lost_api_tokens: int = 0  # made after the backup: their users need new ones
    lost_enroll_tokens: int = 0
    result_seq: int = 0  # the restored database's next result cursor starts above this

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _ro(path: Path) -> sqlite3.Connection:
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=10)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_private(path: Path) -> None:
    """An empty file, 0600 from its first instant (SQLite's journal then gets the same mode)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _tables(db: sqlite3.Connection) -> set[str]:
    return sql.tables(db)


def _check_hub_db(db: sqlite3.Connection, path: Path) -> int:
    """Raise BackupError unless ``db`` is an intact hub database this hub can run; return its schema version."""
    try:
        check = sql.quick_check(db)
    except sqlite3.DatabaseError as exc:
        raise BackupError(f"{path}: corrupt or not a SQLite database ({exc})") from None
    if check != "ok":
        raise BackupError(f"{path}: corrupt SQLite database (integrity check: {check or '?'})")
    tables = _tables(db)
    missing = {"schema_version", "tasks", "results", "endpoints"} - tables
    if missing:
        raise BackupError(f"{path}: a SQLite database, but not a hub database or backup (no {', '.join(sorted(missing))} table)")
    version = sql.schema_version(db) or 0
    latest = max(v for v, _ in MIGRATIONS)
    if version > latest:
        raise BackupError(f"{path}: schema v{version} is newer than this hub (v{latest}); restore it with the hub version that made it")
    return int(version)


def inspect_backup(path: Path) -> BackupInfo:
    """Read and check a backup (or a plain hub database) without changing it."""
    path = Path(path)
    if not path.is_file():
        raise BackupError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if head != SQLITE_HEADER:
        raise BackupError(f"{path}: not a hub backup (not a SQLite database file)")
    try:
        db = _ro(path)
    except sqlite3.Error as exc:
        raise BackupError(f"{path}: cannot open it ({exc})") from None
    try:
        version = _check_hub_db(db, path)
        try:
            counts = sql.counts(db)
            marker = sql.marker(db) if MARKER_TABLE in _tables(db) else None
        except sqlite3.DatabaseError as exc:
            raise BackupError(f"{path}: corrupt hub backup ({exc})") from None
    finally:
        db.close()
    return BackupInfo(str(path), marker[0] if marker else None, marker[1] if marker else None, version, *counts, bytes=path.stat().st_size)


def db_in_use(path: Path, timeout_s: float = 0.5) -> bool:
    """Whether another process has the database open (a running hub keeps it open for its life).

    An exclusive-mode connection needs every other connection gone, in WAL mode too: a hub that
    is merely idle still holds its shared lock, so this is not fooled by a quiet moment."""
    db = sqlite3.connect(path, isolation_level=None, timeout=timeout_s)
    try:
        sql.exclusive_probe(db)
        return False
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return True
        raise
    finally:
        db.close()


def backup_sqlite(db_path: Path, out: Path, *, force: bool = False) -> BackupInfo:
    """Copy the hub database at ``db_path`` into ``out`` (mode 0600), safely while the hub runs."""
    db_path, out = Path(db_path), Path(out)
    if not db_path.is_file():
        raise BackupError(f"{db_path}: no such hub database")
    if out.is_dir():
        raise BackupError(f"{out}: that is a folder; give the backup's file name")
    if out.exists() and not force:
        raise BackupError(f"{out}: already exists; pass --force to replace it (or pick another name)")
    if not out.parent.is_dir():
        raise BackupError(f"{out.parent}: no such folder")
    t0 = time.monotonic()
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        # Read-write, though it only reads: a read-only connection cannot remove the -wal/-shm it
        # creates when it is the last one (hub stopped), and would leave them behind.
        src = sqlite3.connect(db_path, isolation_level=None, timeout=10)
    except sqlite3.Error as exc:
        raise BackupError(f"{db_path}: cannot open it ({exc})") from None
    try:
        _check_hub_db(src, db_path)
        _new_private(tmp)
        dst = sqlite3.connect(tmp, isolation_level=None)
        try:
            src.backup(dst)  # pages=-1: one read transaction, one consistent snapshot; WAL lets the hub write meanwhile
            sql.self_contained(dst)  # one file, no -wal beside it
            from cloud_hub import __version__

            sql.write_marker(dst, time.time(), str(db_path.resolve()), __version__)
        finally:
            dst.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except sqlite3.Error as exc:
        raise BackupError(f"backup of {db_path} into {out} failed: {exc}") from None
    except OSError as exc:
        raise BackupError(f"backup into {out} failed: {exc}") from None
    finally:
        src.close()
        for leftover in (tmp, Path(f"{tmp}-journal")):
            leftover.unlink(missing_ok=True)
    info = inspect_backup(out)
    info.seconds = time.monotonic() - t0
    return info


def _user_cursors(db: sqlite3.Connection) -> dict[str, int]:
    """Each user's last result cursor (``cloud_hub.store.backup.user_cursors``)."""
    return sql.user_cursors(db)


def _compare(old: sqlite3.Connection, new: sqlite3.Connection, report: RestoreReport) -> None:
    """Fill ``report`` with what ``old`` (the database being replaced) has that ``new`` (the backup) lacks."""
    in_backup = sql.task_ids(new)
    backup_unfinished = sql.unfinished_task_ids(new)
    for tid, state in sql.task_states(old):
        if tid not in in_backup:
            report.lost_task_ids.append(tid)
            report.lost_by_state[state] = report.lost_by_state.get(state, 0) + 1
        elif state == "done" and tid in backup_unfinished:
            report.rerun_tasks += 1
    report.lost_tasks = len(report.lost_task_ids)
    backup_eps = sql.endpoint_ids(new)
    report.lost_endpoints = sorted(ep for ep in sql.live_endpoint_ids(old) if ep not in backup_eps)
    for table, attr in (("api_tokens", "lost_api_tokens"), ("enroll_tokens", "lost_enroll_tokens")):
        kept = set(sql.token_hashes(new, table))
        setattr(report, attr, sum(1 for h in sql.token_hashes(old, table) if h not in kept))
    live_revoked = sql.revoked_endpoints(old)
    for ep, _ in sql.unrevoked_endpoints(new):
        if ep in live_revoked:
            # The same wipe as a revocation (cloud_hub/store/access.py): no key, no broker login.
            sql.revoke_endpoint(new, ep, live_revoked[ep])
            report.revocations_reapplied.append(ep)
    # An API token revoked after the backup stays revoked (migration 13; both databases have the column).
    if all("revoked" in sql.api_token_columns(c) for c in (old, new)):
        from cloud_hub.store.sqlite import token_id_of_hash

        for h, t in sql.revoked_api_tokens(old):
            if sql.revoke_api_token(new, h, t):
                report.token_revocations_reapplied.append(token_id_of_hash(h))
    report.result_seq = max(report.result_seq, sql.max_result_seq(old))
    seq = sql.results_sequence(old) if "sqlite_sequence" in _tables(old) else None
    if seq:
        report.result_seq = max(report.result_seq, int(seq[0]))


def restore_sqlite(backup: Path, db_path: Path, *, force: bool = False) -> RestoreReport:
    """Put ``backup`` in place as the hub database ``db_path``; the hub must be stopped.

    The database it replaces is renamed to ``<db>.before-restore-<time>`` (with its -wal/-shm),
    never deleted; when readable it is compared with the backup (what was lost, by count)."""
    backup, db_path = Path(backup), Path(db_path)
    info = inspect_backup(backup)  # every check on the backup before anything is touched
    if db_path.is_dir():
        raise BackupError(f"{db_path}: that is a folder; give the hub database's file name")
    if not db_path.parent.is_dir():
        raise BackupError(f"{db_path.parent}: no such folder")
    if backup.resolve() == db_path.resolve():
        raise BackupError(f"{backup}: is the hub database itself; restore from a backup file")
    exists = db_path.exists()
    if exists and not force:
        raise BackupError(f"{db_path}: a hub database is already there; pass --force to replace it "
                          "(it is kept beside, renamed, and compared with the backup)")
    if exists:
        try:
            busy = db_in_use(db_path)
        except sqlite3.Error:
            busy = False  # unreadable: replaced below, and the report says it could not be compared
        if busy:
            raise BackupError(f"{db_path}: a process has it open (is the hub still running?); stop the hub, then restore")
    report = RestoreReport(db=str(db_path), backup=info)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    tmp = db_path.with_name(f".{db_path.name}.restore-{os.getpid()}")
    src = _ro(backup)
    try:
        _new_private(tmp)
        new = sqlite3.connect(tmp, isolation_level=None)
        try:
            src.backup(new)
            migrate(new, backup)  # a backup from an older hub: its result cursors are fixed up below on the new schema
            old_cursors: dict[str, int] = {}
            with sql.immediate(new):
                sql.drop_marker(new)
                report.result_seq = sql.max_result_seq(new)
                if exists:
                    try:
                        old = _ro(db_path)
                        try:
                            _check_hub_db(old, db_path)
                            _compare(old, new, report)
                            old_cursors = _user_cursors(old)
                            report.compared = True
                        finally:
                            old.close()
                    except (sqlite3.Error, BackupError) as exc:
                        report.not_compared_why = f"the replaced database is not readable ({exc})"
                else:
                    report.not_compared_why = f"there was no database at {db_path} to compare with"
                if not report.compared:
                    report.result_seq += _SEQ_JUMP_UNKNOWN
                # The next result gets a cursor above every one a client may have read before.
                sql.set_results_sequence(new, report.result_seq)
                # Each user's own cursor (migration 14) never goes back either: it starts above the one
                # the replaced database had for that user, or jumps when that is unknown.
                jump = 0 if report.compared else _SEQ_JUMP_UNKNOWN
                mine = _user_cursors(new)
                users = sql.user_ids(new) | set(mine) | set(old_cursors)
                sql.set_user_cursors(new, [(u, max(mine.get(u, 0), old_cursors.get(u, 0)) + jump) for u in sorted(users)])
        finally:
            new.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if exists:
            aside = db_path.with_name(f"{db_path.name}.before-restore-{stamp}")
            for suffix in ("-wal", "-shm", "-journal", ""):  # the main file last: its name is what says "a database is here"
                side = Path(f"{db_path}{suffix}")
                if side.exists():
                    os.rename(side, f"{aside}{suffix}")
            report.replaced = str(aside)
        os.replace(tmp, db_path)
        _fsync_dir(db_path.parent)
    except sqlite3.Error as exc:
        raise BackupError(f"restore of {backup} into {db_path} failed: {exc}; {db_path} was not changed") from None
    except OSError as exc:
        raise BackupError(f"restore into {db_path} failed: {exc}") from None
    finally:
        src.close()
        for leftover in (tmp, Path(f"{tmp}-journal")):
            leftover.unlink(missing_ok=True)
    return report


def write_report(report: RestoreReport, path: Path) -> Path:
    """Save the report as JSON, 0600 (it lists task and endpoint ids)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(report.as_json(), f, indent=1)
    return path
