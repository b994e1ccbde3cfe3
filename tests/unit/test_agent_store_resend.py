"""The agent's durable queue when the hub sends a task again (mesh_agent/store.py, ``add_tasks``).

A task still held (queued, or its result not yet acknowledged) is a duplicate and is not run
twice. A task whose result the hub already acknowledged runs again only when the frame sending it
was signed after the task finished: only a hub that lost the result (restored from an older
backup: tests/integration/test_backup_drill.py) does that. A replayed frame was signed before the
task first ran, so a replay never makes it run twice (tests/integration/test_attacks.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mesh_agent.store import AgentStore, StoredResult


def _task(tid: str) -> dict:  # type: ignore[type-arg]
    return {"id": tid, "fn": "f" * 64, "args": b"a"}


def test_resent_tasks_held_are_duplicates_acked_ones_run_again_only_if_signed_later(tmp_path: Path) -> None:
    async def go() -> None:
        store = await AgentStore(tmp_path / "queue.sqlite3").open()
        try:
            signed_first = time.time() - 60
            assert await store.add_tasks({"f" * 64: b"body"}, [_task("held"), _task("pending"), _task("acked")],
                                         rerun_acked_before=signed_first) == ["held", "pending", "acked"]
            finished = time.time() - 30
            await store.save_results([StoredResult(t, True, b"r", finished, finished, 1) for t in ("pending", "acked")])
            await store.mark_acked(["acked"])
            everything = [_task("held"), _task("pending"), _task("acked")]
            assert await store.add_tasks({}, everything) == [], "no signing time given: every known task is a duplicate"
            held_back: list[str] = []
            assert await store.add_tasks({}, everything, rerun_acked_before=signed_first, held_back=held_back) == [], \
                "a replay of the first frame"
            # Not run and not to be acknowledged: a hub restored moments after the task finished
            # would otherwise mark it delivered and wait forever; unacked, it signs it again later.
            assert held_back == ["acked"]
            fresh = await store.add_tasks({}, [*everything, _task("new")], rerun_acked_before=time.time())
            assert fresh == ["acked", "new"]
            queued = {t.id for t in await store.queued_tasks()}
            assert queued == {"held", "acked", "new"}, "the re-sent acked task is queued to run again"
            assert {r.id for r in await store.unacked_results()} == {"pending"}, "a result awaiting its ack is not run again"
            assert await store.add_tasks({}, [_task("acked")], rerun_acked_before=time.time()) == [], "once queued again it is a duplicate"
        finally:
            await store.close()

    asyncio.run(go())
