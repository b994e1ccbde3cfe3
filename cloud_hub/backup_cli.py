"""``mesh-hub backup`` and ``mesh-hub restore`` (the work is in cloud_hub/backup.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

__all__ = ["backup", "restore"]

_out = Console(soft_wrap=True, highlight=False)
_err = Console(stderr=True, soft_wrap=True, highlight=False)

_PG = ("a PostgreSQL hub is backed up with PostgreSQL's own tools (pg_dump -Fc, or WAL archiving with "
       "pg_basebackup): see docs/operations.md, \"Backups and restore\"")


def backup(
    out: Path = typer.Argument(..., help="the backup file to write (mode 0600)"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db", help="the hub's SQLite database"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="(PostgreSQL: refused, see the docs)"),
    force: bool = typer.Option(False, "--force", help="replace an existing file at OUT"),
) -> None:
    """Copy the hub database into OUT while the hub keeps serving (SQLite's online backup)."""
    from cloud_hub.backup import BackupError, backup_sqlite

    if database_url:
        _err.print(f"error: {_PG}", markup=False)
        raise typer.Exit(2)
    try:
        info = backup_sqlite(db, out, force=force)
    except BackupError as exc:
        _err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    _out.print(f"backup {out}: {info.tasks} tasks, {info.results} results, {info.endpoints} endpoints, schema v{info.schema_version}, "
               f"{info.bytes:,} bytes in {info.seconds:.2f} s (mode 0600)", markup=False)


def restore(
    backup_file: Path = typer.Argument(..., help="a file written by `mesh-hub backup`"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db", help="the hub's SQLite database to put it in place of"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="(PostgreSQL: refused, see the docs)"),
    force: bool = typer.Option(False, "--force", help="replace an existing database (it is kept beside, renamed)"),
    report: Optional[Path] = typer.Option(None, "--report", help="also write the report as JSON, with the lost task ids (mode 0600)"),
) -> None:
    """Put a backup in place of the hub database (stop the hub first), and say what was lost."""
    from cloud_hub.backup import BackupError, restore_sqlite, write_report

    if database_url:
        _err.print(f"error: {_PG}", markup=False)
        raise typer.Exit(2)
    try:
        r = restore_sqlite(backup_file, db, force=force)
    except BackupError as exc:
        _err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    b = r.backup
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(b.taken_at)) if b.taken_at else "unknown time (not written by mesh-hub backup)"
    _out.print(f"restored {backup_file} (taken {when}: {b.tasks} tasks, {b.endpoints} endpoints) into {db}", markup=False)
    if r.replaced:
        _out.print(f"the database it replaced is kept as {r.replaced}", markup=False)
    if r.compared:
        states = ", ".join(f"{n} {s}" for s, n in sorted(r.lost_by_state.items())) or "none"
        _out.print(f"lost: {r.lost_tasks} tasks accepted after the backup ({states}); their ids are not in the restored hub", markup=False)
        _out.print(f"will run again: {r.rerun_tasks} tasks that finished after the backup (their results are stored once)", markup=False)
        if r.lost_endpoints:
            _out.print(f"lost: {len(r.lost_endpoints)} endpoints enrolled after the backup; enroll them again: {', '.join(r.lost_endpoints)}", markup=False)
        if r.lost_api_tokens or r.lost_enroll_tokens:
            _out.print(f"lost: {r.lost_api_tokens} API tokens and {r.lost_enroll_tokens} enrollment tokens made after the backup; "
                       "make them again", markup=False)
        if r.revocations_reapplied:
            _out.print(f"revoked again: {len(r.revocations_reapplied)} endpoints revoked after the backup: {', '.join(r.revocations_reapplied)}", markup=False)
        if r.token_revocations_reapplied:
            _out.print(f"revoked again: {len(r.token_revocations_reapplied)} API tokens revoked after the backup: "
                       f"{', '.join(r.token_revocations_reapplied)}", markup=False)
    else:
        _out.print(f"lost: unknown: {r.not_compared_why}. Work accepted after the backup was taken is gone and cannot be counted here; "
                   "results agents send for tasks the hub does not know are acknowledged and dropped", markup=False)
    if report is not None:
        _out.print(f"report: {write_report(r, report)}", markup=False)
