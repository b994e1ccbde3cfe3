"""``mesh-hub backup`` / ``restore`` on real SQLite hub databases (cloud_hub/backup.py).

The drill with real processes (hub, broker, agents) is tests/integration/test_backup_drill.py;
these cover every refusal (each leaves the stored state as it was) and what the report counts."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
import stat
import time
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from cloud_hub.backup import BackupError, backup_sqlite, db_in_use, inspect_backup, restore_sqlite
from cloud_hub.cli import app
from cloud_hub.store import SqliteStore
from cloud_hub.store.sqlite import number_results


def make_hub_db(path: Path) -> None:
    """A hub database as the hub creates it (every migration), with one user, endpoint and function."""

    async def go() -> None:
        store = await SqliteStore(path).open()
        await store.close()

    asyncio.run(go())
    with connect(path) as db:
        db.execute("INSERT INTO users (id, name, created) VALUES ('u1', 'alice', 0)")
        db.execute("INSERT INTO functions (id, body, created) VALUES ('f1', x'00', 0)")
        add_endpoint(db, "ep1")


@contextlib.contextmanager
def connect(path: Path) -> Iterator[sqlite3.Connection]:
    """Commit and close (sqlite3's own context manager commits but leaves the connection open)."""
    db = sqlite3.connect(path)
    try:
        with db:
            yield db
    finally:
        db.close()


def add_endpoint(db: sqlite3.Connection, ep: str) -> None:
    db.execute("INSERT INTO endpoints (id, user_id, name, transport, key, created) VALUES (?, 'u1', ?, 'mqtt', x'01', 0)", (ep, ep))


def add_tasks(db: sqlite3.Connection, ids: list[str], state: str = "queued") -> None:
    db.executemany("INSERT INTO tasks (id, user_id, endpoint_id, function_id, state, created) VALUES (?, 'u1', 'ep1', 'f1', ?, ?)",
                   [(t, state, time.time()) for t in ids])


def finish(db: sqlite3.Connection, ids: list[str]) -> None:
    for t in ids:
        db.execute("UPDATE tasks SET state='done' WHERE id=?", (t,))
        db.execute("INSERT INTO results (task_id, user_id, ok, data, received) VALUES (?, 'u1', 1, x'00', 0)", (t,))
    number_results(db)  # as every writer of results in the hub does


def user_cursor(db: sqlite3.Connection, user: str = "u1") -> int:
    row = db.execute("SELECT last FROM result_cursors WHERE user_id=?", (user,)).fetchone()
    return row[0] if row else 0


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def hub_db(tmp_path: Path) -> Path:
    path = tmp_path / "hub.sqlite3"
    make_hub_db(path)
    return path


def test_backup_while_the_database_is_open_and_written(hub_db: Path, tmp_path: Path) -> None:
    live = sqlite3.connect(hub_db, isolation_level=None)  # stands in for the hub: open, WAL, writing
    live.execute("PRAGMA journal_mode=WAL")
    add_tasks(live, [f"t{i}" for i in range(50)])
    finish(live, ["t0", "t1"])
    out = tmp_path / "b" / "hub-backup.sqlite3"
    out.parent.mkdir()
    info = backup_sqlite(hub_db, out)
    add_tasks(live, ["after"])  # the hub keeps writing: not in the backup
    live.close()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert (info.tasks, info.results, info.endpoints) == (50, 2, 1)
    assert info.taken_at is not None and abs(info.taken_at - time.time()) < 600
    assert sorted(p.name for p in out.parent.iterdir()) == ["hub-backup.sqlite3"], "no -wal, -journal or partial file left"
    with connect(out) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert db.execute("SELECT COUNT(*) FROM tasks WHERE id='after'").fetchone()[0] == 0


def test_backup_refusals_change_nothing(hub_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.sqlite3"
    out.write_bytes(b"keep me")
    with pytest.raises(BackupError, match="already exists; pass --force"):
        backup_sqlite(hub_db, out)
    assert out.read_bytes() == b"keep me"
    with pytest.raises(BackupError, match="no such hub database"):
        backup_sqlite(tmp_path / "missing.sqlite3", tmp_path / "x.sqlite3")
    with pytest.raises(BackupError, match="that is a folder"):
        backup_sqlite(hub_db, tmp_path)
    not_hub = tmp_path / "queue.sqlite3"
    with connect(not_hub) as db:
        db.execute("CREATE TABLE inbox (id TEXT)")
    with pytest.raises(BackupError, match="not a hub database"):
        backup_sqlite(not_hub, tmp_path / "y.sqlite3")
    assert not (tmp_path / "x.sqlite3").exists() and not (tmp_path / "y.sqlite3").exists()
    backup_sqlite(hub_db, out, force=True)
    assert inspect_backup(out).tasks == 0


@pytest.mark.parametrize("kind", ["text", "other-sqlite", "corrupt", "newer", "missing"])
def test_restore_refuses_a_bad_backup_and_leaves_the_database(hub_db: Path, tmp_path: Path, kind: str) -> None:
    bad = tmp_path / "bad.sqlite3"
    if kind == "text":
        bad.write_text("not a database\n" * 100)
        why = "not a SQLite database file"
    elif kind == "other-sqlite":
        with connect(bad) as db:
            db.execute("CREATE TABLE inbox (id TEXT)")
        why = "not a hub database or backup"
    elif kind == "corrupt":
        backup_sqlite(hub_db, bad)
        data = bytearray(bad.read_bytes())
        for off in range(4096, len(data), 512):  # garble every page after the first
            data[off:off + 64] = b"\xa5" * 64
        bad.write_bytes(bytes(data))
        why = "corrupt"
    elif kind == "newer":
        backup_sqlite(hub_db, bad)
        with connect(bad) as db:
            db.execute("INSERT INTO schema_version VALUES (9999)")
        why = "schema v9999 is newer than this hub"
    else:
        why = "no such file"
    before = digest(hub_db)
    with pytest.raises(BackupError, match=why):
        restore_sqlite(bad, hub_db, force=True)
    assert digest(hub_db) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("hub", ".hub"))) == ["hub.sqlite3"]


def test_restore_refuses_to_overwrite_without_force_and_while_in_use(hub_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.sqlite3"
    backup_sqlite(hub_db, out)
    with connect(hub_db) as db:
        add_tasks(db, ["later"])
    before = digest(hub_db)
    with pytest.raises(BackupError, match="already there; pass --force"):
        restore_sqlite(out, hub_db)
    assert digest(hub_db) == before
    held = sqlite3.connect(hub_db, isolation_level=None)  # a running hub keeps its database open, idle or not
    held.execute("PRAGMA journal_mode=WAL")
    held.execute("SELECT 1 FROM tasks").fetchall()
    try:
        assert db_in_use(hub_db)
        with pytest.raises(BackupError, match="is the hub still running"):
            restore_sqlite(out, hub_db, force=True)
        with connect(hub_db) as db:
            assert db.execute("SELECT COUNT(*) FROM tasks WHERE id='later'").fetchone()[0] == 1
    finally:
        held.close()
    assert not db_in_use(hub_db)
    with pytest.raises(BackupError, match="is the hub database itself"):
        restore_sqlite(hub_db, hub_db, force=True)


def test_restore_counts_what_was_lost_and_keeps_cursors_and_revocations(hub_db: Path, tmp_path: Path) -> None:
    with connect(hub_db) as db:
        add_endpoint(db, "ep_revoked_later")
        db.execute("INSERT INTO api_tokens (hash, user_id, name, created) VALUES ('0123456789abcdef-before', 'u1', 'stolen', 0)")
        add_tasks(db, [f"a{i}" for i in range(10)])
        finish(db, ["a0", "a1"])
    out = tmp_path / "b.sqlite3"
    backup_sqlite(hub_db, out)
    with connect(hub_db) as db:  # after the backup: work, an enrollment, a revocation
        finish(db, ["a2", "a3", "a4"])  # these run again after the restore
        add_tasks(db, ["b0", "b1", "b2"])
        add_tasks(db, ["b3"], state="acked")
        finish(db, ["b2"])
        add_endpoint(db, "ep_new")
        db.execute("INSERT INTO api_tokens (hash, user_id, name, created) VALUES ('h-after', 'u1', 'later', 0)")
        db.execute("UPDATE api_tokens SET revoked=5 WHERE hash='0123456789abcdef-before'")  # mesh-hub token revoke
        db.execute("UPDATE endpoints SET revoked=1, key=X'' WHERE id='ep_revoked_later'")
        live_seq = db.execute("SELECT MAX(seq) FROM results").fetchone()[0]
        live_cursor = user_cursor(db)
    assert live_cursor == 6, "alice's own cursor counts her results only"
    r = restore_sqlite(out, hub_db, force=True)
    assert r.compared and r.not_compared_why is None
    assert r.lost_tasks == 4 and sorted(r.lost_task_ids) == ["b0", "b1", "b2", "b3"]
    assert r.lost_by_state == {"queued": 2, "done": 1, "acked": 1}
    assert r.rerun_tasks == 3
    assert r.lost_endpoints == ["ep_new"]
    assert r.revocations_reapplied == ["ep_revoked_later"]
    assert r.token_revocations_reapplied == ["tk_0123456789ab"], "a token revoked after the backup stays revoked"
    assert (r.lost_api_tokens, r.lost_enroll_tokens) == (1, 0)
    assert r.replaced is not None and Path(r.replaced).exists(), "the replaced database is kept"
    assert stat.S_IMODE(hub_db.stat().st_mode) == 0o600
    with connect(hub_db) as db:
        assert db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == 10
        assert db.execute("SELECT name FROM sqlite_master WHERE name='mesh_backup'").fetchone() is None
        assert db.execute("SELECT revoked IS NOT NULL, key FROM endpoints WHERE id='ep_revoked_later'").fetchone() == (1, b"")
        assert db.execute("SELECT revoked FROM api_tokens WHERE hash='0123456789abcdef-before'").fetchone() == (5,)
        assert user_cursor(db) == live_cursor, "alice's cursor does not go back to the backup's 2"
        db.execute("INSERT INTO results (task_id, user_id, ok, data, received) VALUES ('a5', 'u1', 1, x'00', 0)")
        number_results(db)
        new_seq, mine = db.execute("SELECT seq, user_seq FROM results WHERE task_id='a5'").fetchone()
    assert new_seq > live_seq, "a client's cursor from before the restore must not skip the next result"
    assert mine == live_cursor + 1, "nor one from the user's own cursor"

    async def opens() -> None:  # the hub starts on it
        store = await SqliteStore(hub_db).open()
        await store.close()

    asyncio.run(opens())


def test_restore_without_the_old_database_says_the_loss_is_unknown(hub_db: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.sqlite3"
    backup_sqlite(hub_db, out)
    gone = tmp_path / "new" / "hub.sqlite3"
    gone.parent.mkdir()
    r = restore_sqlite(out, gone)
    assert not r.compared and r.lost_tasks == 0 and "no database" in (r.not_compared_why or "")
    assert r.result_seq >= 1_000_000_000
    with connect(gone) as db:
        assert user_cursor(db) >= 1_000_000_000, "every user's own cursor jumps too when the old one is unknown"
    garbage = tmp_path / "garbage" / "hub.sqlite3"
    garbage.parent.mkdir()
    garbage.write_bytes(b"\x00" * 8192)  # a database the disk ate: replaced, kept beside, not comparable
    r = restore_sqlite(out, garbage, force=True)
    assert not r.compared and "not readable" in (r.not_compared_why or "")
    assert Path(r.replaced or "").read_bytes() == b"\x00" * 8192


def test_cli_backup_and_restore(hub_db: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "nightly.sqlite3"
    res = runner.invoke(app, ["backup", str(out), "--db", str(hub_db)])
    assert res.exit_code == 0, res.output
    assert "backup" in res.output and "mode 0600" in res.output
    res = runner.invoke(app, ["restore", str(out), "--db", str(hub_db)])
    assert res.exit_code == 2 and "--force" in res.output
    report = tmp_path / "report.json"
    res = runner.invoke(app, ["restore", str(out), "--db", str(hub_db), "--force", "--report", str(report)])
    assert res.exit_code == 0, res.output
    assert "lost: 0 tasks accepted after the backup" in res.output
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    res = runner.invoke(app, ["backup", str(tmp_path / "pg.dump"), "--database-url", "postgresql://127.0.0.1/test"])
    assert res.exit_code == 2 and "pg_dump" in res.output
    res = runner.invoke(app, ["restore", str(tmp_path / "pg.dump"), "--database-url", "postgresql://127.0.0.1/test"])
    assert res.exit_code == 2 and "pg_dump" in res.output
