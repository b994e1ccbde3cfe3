"""Every start-up failure of ``mesh-hub serve`` exits non-zero with one clear line and no traceback
(issue 13, item 5): systemd and scripts must never see a hub that did not start as a success."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_hub.broker import free_port

pytestmark = pytest.mark.integration


def _serve(db: Path, port: int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from cloud_hub.cli import app; app()", "serve", "--db", str(db), "--port", str(port),
           "--mqtt-host", "", "--zmq-bind", ""]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case, says", [
    ("parent-is-a-file", "is a file, not a folder"),
    ("db-is-a-folder", "that is a folder"),
    ("corrupt-database", "not a usable hub database"),
    ("port-taken", "is already in use by pid"),
])
def test_start_up_failure_is_one_line_and_non_zero(tmp_path: Path, case: str, says: str) -> None:
    port = free_port()
    db = tmp_path / "hub.sqlite3"
    holder = None
    if case == "parent-is-a-file":
        (tmp_path / "afile").write_text("x")
        db = tmp_path / "afile" / "hub.sqlite3"
    elif case == "db-is-a-folder":
        db.mkdir()
    elif case == "corrupt-database":
        db.write_bytes(b"not a database at all" * 100)
    else:
        holder = socket.socket()
        holder.bind(("127.0.0.1", port))
        holder.listen()
    before = db.read_bytes() if db.is_file() else None
    try:
        r = _serve(db, port)
    finally:
        if holder is not None:
            holder.close()
    assert r.returncode != 0, r
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: hub did not start:") and says in err[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    if before is not None:
        assert db.read_bytes() == before, "a failed start changes no stored state"
    if case == "parent-is-a-file":
        assert (tmp_path / "afile").read_text() == "x"
    shutil.rmtree(tmp_path, ignore_errors=True)
