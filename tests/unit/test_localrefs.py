"""The local tier's store (mesh_agent.refstore.LocalStore) on a real SQLite file: what a
second process reads back, expiry, the byte budget refusing whole, logins kept apart, the memory
copy bounded. (Staging and the agent restart are tested on a real mesh in
tests/integration/test_data_tiers.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh_agent.protocol.refs import owner_of
from mesh_agent.refstore import LocalFull, LocalStore

ALICE = owner_of("redis://alice:secret1@127.0.0.1:1/0")
MALLORY = owner_of("redis://alice:guess@127.0.0.1:1/0")


def test_another_process_reads_what_was_committed(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    s.put("k1", b"v" * 1000, "task t1", time.time() + 60, ALICE)
    prog = ("import sys, time; from pathlib import Path; from mesh_agent.refstore import LocalStore\n"
            f"hit = LocalStore(Path({str(tmp_path)!r})).get('k1', {ALICE!r}); print(len(hit[0]) if hit else None)")
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1000", out.stderr


def test_expired_rows_read_as_missing_and_are_deleted(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    s.put("k", b"x", "task t", time.time() + 0.05, ALICE)
    time.sleep(0.1)
    assert s.get("k", ALICE) is None
    assert s._db.execute("SELECT COUNT(*) FROM refs").fetchone()[0] == 0


def test_budget_refuses_whole_and_keeps_what_was_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_REF_LOCAL_MAX_BYTES", "1000")
    s = LocalStore(tmp_path)
    s.put("a", b"a" * 600, "task t", time.time() + 60, ALICE)
    with pytest.raises(LocalFull, match="holds 600 bytes; 600 more would pass MESH_REF_LOCAL_MAX_BYTES=1000"):
        s.put("b", b"b" * 600, "task t", time.time() + 60, ALICE)
    assert s.get("b", ALICE) is None and s.get("a", ALICE) == (b"a" * 600, pytest.approx(time.time() + 60, abs=5))


def test_another_login_reads_and_deletes_nothing(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    s.put("k", b"secret", "task t", time.time() + 60, ALICE)
    assert ALICE != MALLORY  # same user name, other credential
    assert s.get("k", MALLORY) is None
    s.delete("k", MALLORY)
    fresh = LocalStore(tmp_path)  # past the memory copy, from the file
    assert fresh.get("k", MALLORY) is None and fresh.get("k", ALICE)[0] == b"secret"  # type: ignore[index]


def test_memory_copy_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_REF_MEMORY_BYTES", "4000")
    s = LocalStore(tmp_path)
    for i in range(10):
        s.put(f"k{i}", bytes([i]) * 900, "task t", time.time() + 60, ALICE)
    assert s._mem_bytes <= 4000 and len(s._mem) == 4
    s.put("big", b"z" * 2000, "task t", time.time() + 60, ALICE)  # over a quarter of the cap: disk only
    assert "big" not in s._mem and s.get("big", ALICE)[0] == b"z" * 2000  # type: ignore[index]
