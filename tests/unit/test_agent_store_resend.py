"""The agent's durable queue when the hub sends a task again (mesh_agent/store.py, ``add_tasks``).

A task still held (queued, or its result not yet acknowledged) is a duplicate and is not run
twice. A task whose result the hub already acknowledged is sent again only by a hub that lost that
result (restored from an older backup: tests/integration/test_backup_drill.py); the agent runs it
again instead of acknowledging a task that would then never finish."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mesh_agent.store import AgentStore, StoredResult


def _task(tid: str) -> dict:  # type: ignore[type-arg]
    return {"id": tid, "fn": "f" * 64, "args": b"a"}


def test_resent_tasks_held_are_duplicates_acked_ones_run_again(tmp_path: Path) -> None:
    async def go() -> None:
        store = await AgentStore(tmp_path / "queue.sqlite3").open()
        try:
            assert await store.add_tasks({"f" * 64: b"body"}, [_task("held"), _task("pending"), _task("acked")]) == ["held", "pending", "acked"]
            now = time.time()
            await store.save_results([StoredResult(t, True, b"r", now, now, 1) for t in ("pending", "acked")])
            await store.mark_acked(["acked"])
            fresh = await store.add_tasks({}, [_task("held"), _task("pending"), _task("acked"), _task("new")])
            assert fresh == ["acked", "new"]
            queued = {t.id for t in await store.queued_tasks()}
            assert queued == {"held", "acked", "new"}, "the re-sent acked task is queued to run again"
            assert {r.id for r in await store.unacked_results()} == {"pending"}, "a result awaiting its ack is not run again"
            assert await store.add_tasks({}, [_task("acked")]) == [], "once queued again it is a duplicate like any other"
        finally:
            await store.close()

    asyncio.run(go())
