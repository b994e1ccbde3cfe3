"""A full disk under the hub database (issue 13, item 5): the API answers 507 with a clear message,
nothing is half-written, reads keep working, and the same submit succeeds once space is freed.

The disk is a real one: a small tmpfs mounted for the test (root only; skipped with the reason
where mounting is not allowed)."""

from __future__ import annotations

import errno
import sqlite3
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.client import Client, HubError
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from mesh_agent.cli import enroll

pytestmark = pytest.mark.integration


def triple(x: int) -> int:
    return 3 * x


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {(r.stderr or r.stdout).strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> Path:
    """Take every free byte of the filesystem under ``path`` (a real ENOSPC, no quota games)."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * 65536
        try:
            for _ in range(10_000):
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _count(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return int(c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


def test_full_disk_answers_507_and_writes_nothing(small_disk: Path, tmp_path: Path) -> None:
    db = small_disk / "hub.sqlite3"
    cfg = HubConfig(db_path=db, port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="alice")
    with HubThread(cfg) as h:
        client = Client(h.url, h.token)
        ep = enroll(h.url, client.create_enrollment_token(), "pi", tmp_path / "agent.yaml", transport="zmq").endpoint_id
        fid = client.register_function(triple)
        client.submit_batch([Client.task_spec(ep, fid, (1,))])
        before = _count(db)
        filler = _fill(small_disk)
        specs = [Client.task_spec(ep, fid, (i, "x" * 512)) for i in range(2000)]  # ~1.5 MB of rows
        key = uuid.uuid4().hex
        with pytest.raises(HubError) as err:
            client.submit_batch_placed(specs, idempotency_key=key)
        assert err.value.status == 507 and "disk is full" in err.value.detail and str(small_disk) in err.value.detail
        assert _count(db) == before, "nothing half-written"
        assert [e["id"] for e in client.list_endpoints()] == [ep], "reads still work"
        filler.unlink()
        ids, _ = client.submit_batch_placed(specs, idempotency_key=key)  # the same submit, retried
        assert len(set(ids)) == 2000 and _count(db) == before + 2000
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
