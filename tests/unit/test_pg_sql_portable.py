"""One SQL text for both stores (issue 26 item 2): no SQLite-only upserts in the hub, and the
migrations' type markers filled in per backend (cloud_hub/store/migrations.py), with no database."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from cloud_hub.store.migrations import _SOURCE, DIALECTS, MIGRATIONS, PG_MIGRATIONS, migrations_for

ROOT = Path(__file__).resolve().parents[2]
MARKERS = set(DIALECTS["sqlite"])


def test_sqlite_reads_on_conflict() -> None:
    assert sqlite3.sqlite_version_info >= (3, 24, 0), "INSERT ... ON CONFLICT needs SQLite 3.24"


def test_no_sqlite_only_upserts_in_the_hub() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "cloud_hub").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bINSERT\s+OR\s+(IGNORE|REPLACE)\b", line)]
    assert not found, f"use INSERT ... ON CONFLICT (key) DO NOTHING / DO UPDATE, which both stores read: {found}"


def test_both_backends_get_every_marker_and_every_version() -> None:
    assert set(DIALECTS["postgres"]) == MARKERS
    assert [v for v, _ in MIGRATIONS] == [v for v, _ in PG_MIGRATIONS] == [v for v, _ in _SOURCE]
    assert MIGRATIONS == migrations_for("sqlite")
    for _, sql in MIGRATIONS + PG_MIGRATIONS:
        assert not any(m in sql for m in MARKERS)


def test_postgres_ddl_has_no_sqlite_types() -> None:
    for version, sql in PG_MIGRATIONS:
        code = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
        assert not re.search(r"\b(REAL|BLOB|INTEGER|AUTOINCREMENT)\b", code), f"migration {version}: write {{real}}, {{blob}}, {{bigint}}, {{serial_pk}}"
        for table in re.findall(r"CREATE TABLE (\w+) \(", code):
            assert re.search(rf"CREATE TABLE {table} \(\s*rowid BIGSERIAL, ", code), f"migration {version}: {table} lacks {{rowid}}"


def test_sqlite_migrations_build_a_schema() -> None:
    db = sqlite3.connect(":memory:")
    for _, sql in MIGRATIONS:
        for statement in (s.strip() for s in sql.split(";")):
            if statement:
                db.execute(statement)
    cols = {r[1]: r[2] for r in db.execute("PRAGMA table_info(results)")}
    assert cols["seq"] == "INTEGER" and cols["received"] == "REAL" and cols["data"] == "BLOB"
    assert "rowid" not in cols
