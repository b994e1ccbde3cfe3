"""The agent's queue under local faults: a full disk (SQLite's own page quota, a real limit inside
SQLite), and damaged files (truncated, overwritten, garbage) with ``recover_queue``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
from pathlib import Path

import pytest

from mesh_agent.recover import recover_queue
from mesh_agent.store import AgentStore, StoredResult, StoreError, StoreFull

BODY = b"source\nf\ndef f(x):\n    return x\n"
FID = hashlib.sha256(BODY).hexdigest()


def task(i: int, size: int = 100) -> dict:
    return {"id": f"t{i:04d}", "fn": FID, "args": b"pickle\n" + os.urandom(size), "timeout": None, "exp": None}


def test_full_queue_refuses_a_batch_whole_and_keeps_what_it_had(tmp_path: Path) -> None:
    async def go() -> None:
        store = await AgentStore(tmp_path / "q.sqlite3", max_mb=1).open()
        try:
            assert await store.add_tasks({FID: BODY}, [task(i, 20_000) for i in range(10)]) == [f"t{i:04d}" for i in range(10)]
            with pytest.raises(StoreFull) as info:
                await store.add_tasks({}, [task(100 + i, 20_000) for i in range(60)])
            msg = str(info.value)
            assert str(tmp_path / "q.sqlite3") in msg and "disk full" in msg and "queue_max_mb" in msg
            assert isinstance(info.value, StoreError)
            # nothing of the refused batch was stored, everything before it still is
            assert [t.id for t in await store.queued_tasks()] == [f"t{i:04d}" for i in range(10)]
            # a result still fits (it frees its arguments), and acking frees room for new tasks
            await store.save_results([StoredResult(f"t{i:04d}", True, b"json\n1", 1.0, 2.0, 0) for i in range(10)])
            await store.mark_acked([f"t{i:04d}" for i in range(10)])
            assert len(await store.add_tasks({}, [task(200 + i, 20_000) for i in range(10)])) == 10
        finally:
            await store.close()

    asyncio.run(go())


def test_a_full_disk_at_open_is_not_called_corruption(tmp_path: Path) -> None:
    async def go() -> None:
        store = await AgentStore(tmp_path / "q.sqlite3").open()
        await store.add_tasks({FID: BODY}, [task(1)])
        await store.close()
        # a sound file: the integrity check passes, the next write fails only for lack of room
        store = await AgentStore(tmp_path / "q.sqlite3", max_mb=1).open()
        try:
            assert [t.id for t in await store.queued_tasks()] == ["t0001"]
        finally:
            await store.close()

    asyncio.run(go())


def _populated(path: Path) -> dict[str, tuple]:
    async def go() -> None:
        store = await AgentStore(path).open()
        try:
            await store.add_tasks({FID: BODY}, [task(i, 3000) for i in range(60)])
            await store.save_results([StoredResult(f"t{i:04d}", True, b"json\n" + str(i).encode(), 1.0, 2.0, 7) for i in range(20)])
            await store.mark_acked([f"t{i:04d}" for i in range(10)])
        finally:
            await store.close()

    asyncio.run(go())
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return {r[0]: r for r in db.execute("SELECT * FROM tasks")}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recovered(path: Path) -> dict[str, tuple]:
    async def check() -> None:  # the new file is a healthy queue the agent opens
        store = await AgentStore(path).open()
        await store.close()

    asyncio.run(check())
    with sqlite3.connect(path) as db:
        return {r[0]: r for r in db.execute("SELECT * FROM tasks")}


def test_recover_a_healthy_file_keeps_everything(tmp_path: Path) -> None:
    q = tmp_path / "queue.sqlite3"
    original = _populated(q)
    report = recover_queue(q)
    assert _recovered(q) == original
    assert report.tasks == {"queued": 40, "done": 10, "acked": 10} and report.functions == 1
    assert report.moved_to.exists() and report.unreadable_rows == 0


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "garbage"])
def test_recover_keeps_only_true_rows_and_never_touches_the_damaged_file(tmp_path: Path, damage: str) -> None:
    q = tmp_path / "queue.sqlite3"
    original = _populated(q)
    data = q.read_bytes()
    if damage == "truncate":
        q.write_bytes(data[: len(data) // 2])
    elif damage == "overwrite":  # a run of pages in the middle replaced with noise
        page = 4096
        q.write_bytes(data[: 8 * page] + os.urandom(6 * page) + data[14 * page :])
    else:
        q.write_bytes(b"not a database" * 1000)

    async def opening() -> None:
        await AgentStore(q).open()

    if damage != "overwrite":  # (noise may hit only freelist pages; then open can pass, recovery must still work)
        with pytest.raises(StoreError, match="not a usable queue database.*mesh-agent queue recover"):
            asyncio.run(opening())
    damaged_sha = _sha(q)
    report = recover_queue(q)
    assert _sha(report.moved_to) == damaged_sha, "the damaged file is kept as it was"
    kept = _recovered(q)
    for tid, row in kept.items():
        assert original[tid] == row, "a recovered row is exactly the stored row, never invented"
    assert all(row[5] != "queued" or row[1] == FID for row in kept.values())
    assert sum(report.tasks.values()) == len(kept)
    if damage == "garbage":
        assert kept == {} and report.notes
    else:  # one bad region costs only the rows on it
        assert 0 < len(kept) < len(original) or damage == "overwrite" and len(kept) > 0
