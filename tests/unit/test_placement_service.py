"""The hub's placement service on a real SQLite store, driven through the dispatcher's hooks.

No broker and no agents: the hooks are called with what an agent's hello, heartbeat and
results would carry, which is exactly the interface the dispatcher uses.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path

import pytest

from cloud_hub.service.schemas import TaskIn
from cloud_hub.config import HubConfig
from cloud_hub.placement import PlacementError, PlacementService
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import function_id, serialize, serialize_function


def f(x: int) -> int:
    return x


ARGS = base64.b64encode(serialize(((1,), {}))).decode()


async def _setup(tmp: Path) -> tuple[SqliteStore, dict[str, str], list[str], str]:
    store = await SqliteStore(tmp / "hub.sqlite3").open()
    users = {n: await store.create_user(n) for n in ("alice", "bob")}
    tok = await store.create_enroll_token(users["alice"], 3600, 3)
    eids = [(await store.enroll_endpoint(tok, f"a{i}", "mqtt", b"k" * 32))["id"] for i in range(3)]  # type: ignore[index]
    body = serialize_function(f)
    fid = function_id(body)
    for u in users.values():
        await store.put_function(u, fid, body, "f")
    return store, users, eids, fid


def _rows(user: str, tasks: list[TaskIn]) -> list[dict]:
    now = time.time()
    return [{"id": uuid.uuid4().hex, "user_id": user, "function_id": t.function_id, "args": b"json\n[[1],{}]",
             "endpoint_id": t.endpoint_id if isinstance(t.endpoint_id, str) and t.endpoint_id != "auto" else None,
             "created": now, "expires": now + 3600, "timeout": None} for t in tasks]


def test_placement_ledger_persistence_and_tenancy(tmp_path: Path) -> None:
    async def main() -> None:
        store, users, eids, fid = await _setup(tmp_path)
        cfg = HubConfig(db_path=tmp_path / "hub.sqlite3")
        svc = PlacementService(cfg, store)
        await svc.start()
        now = time.time()
        for i, e in enumerate(eids):  # hellos (as the dispatcher handles them): 1, 2 and 4 workers; the last one has a tag
            info = {"capacity": 2 ** i, "tags": ["big"] if i == 2 else [], "memory_mb": 1024}
            await store.set_endpoint_state(e, True, now, info)
            svc.endpoint_online(e, now, info)
        for e, r in zip(eids, (4.0, 2.0, 1.0)):  # it runs 4x faster on the 4-worker one
            for k in range(3):
                svc.sched.task_completed(f"learn-{e}-{k}", now, r, endpoint_id=e, function_id=fid)

        # a batch: 3 tasks named for endpoint 0, then 35 "auto" and 2 by tag
        tasks = ([TaskIn(endpoint_id=eids[0], function_id=fid, args=ARGS) for _ in range(3)]
                 + [TaskIn(endpoint_id="auto", function_id=fid, args=ARGS) for _ in range(35)]
                 + [TaskIn(endpoint_id={"tags": ["big"]}, function_id=fid, args=ARGS) for _ in range(2)])
        rows = _rows(users["alice"], tasks)
        decisions = await svc.place(users["alice"], tasks, rows, now)
        await store.insert_tasks(rows, also=svc.writer(decisions))
        assert len(decisions) == 37 and all(r["endpoint_id"] in eids for r in rows)
        placed = [r["endpoint_id"] for r in rows[3:38]]
        # earliest finish: the 4-worker endpoint that is 4x faster takes most, the slow
        # single-worker one (which already has the 3 named tasks) the fewest
        assert placed.count(eids[2]) > placed.count(eids[1]) > placed.count(eids[0])
        assert {r["endpoint_id"] for r in rows[38:]} == {eids[2]}
        n_out = {e: svc.sched.fleet.nodes[e].n_out for e in eids}
        assert sum(n_out.values()) == 40  # named tasks are in the ledger too

        # another user's "auto" never reaches alice's endpoints
        btasks = [TaskIn(endpoint_id="auto", function_id=fid, args=ARGS)]
        with pytest.raises(PlacementError) as info:
            await svc.place(users["bob"], btasks, _rows(users["bob"], btasks), now)
        assert info.value.status == 409 and "none of your endpoints has connected" in str(info.value)

        # a result closes its decision; an expired task leaves the queue
        r0 = rows[3]
        res = [{"id": r0["id"], "ok": True, "data": b"json\n1", "started": now + 1, "finished": now + 2}]
        stored_at = time.time()
        await store.store_results(r0["endpoint_id"], res)  # closes the decision in its own transaction
        svc.results_stored(r0["endpoint_id"], now + 5, res, {r0["id"]})
        svc.tasks_expired([rows[4]["id"]], now + 6)
        await asyncio.sleep(0.2)
        page = await svc.decisions(users["alice"], 100)
        by_task = {d["task_id"]: d for d in page["decisions"]}
        assert by_task[r0["id"]]["state"] == "done" and by_task[r0["id"]]["runtime_s"] == pytest.approx(1.0)
        assert stored_at - now <= by_task[r0["id"]]["actual_s"] <= time.time() - now  # placed to stored
        assert by_task[rows[4]["id"]]["ok"] is False
        assert sum(svc.sched.fleet.nodes[e].n_out for e in eids) == 38
        assert (await svc.decisions(users["bob"], 100))["decisions"] == []
        await svc.stop()

        # restart: profiles come back from scheduler_state, the ledger from the tasks table
        # (r0's result is stored, so it is done; the expired one is still "queued" in the tasks table here)
        svc2 = PlacementService(cfg, store)
        await svc2.start()
        assert svc2.sched.profiles.mean_runtime(fid, eids[2]) == pytest.approx(1.0)
        assert sum(n.n_out for n in svc2.sched.fleet.nodes.values()) == 39
        assert all(not n.ep.online for n in svc2.sched.fleet.nodes.values())  # until their hellos
        saved = json.loads(await store.tx(lambda db: db.execute("SELECT state FROM scheduler_state").fetchone()[0], durable=False))
        assert saved["policy"] == "delta-outage-aware"
        await svc2.stop()
        await store.close()

    asyncio.run(main())


def test_unreadable_saved_profiles_start_empty(tmp_path: Path) -> None:
    async def main() -> None:
        store, _, _, _ = await _setup(tmp_path)
        await store.tx(lambda db: db.execute("INSERT INTO scheduler_state VALUES (1, 0, 'delta', '{\"profiles\": {\"version\": 99}}')"))
        svc = PlacementService(HubConfig(db_path=tmp_path / "hub.sqlite3"), store)
        await svc.start()  # logged, not fatal
        assert svc.sched.profiles.pair == {}
        await svc.stop()
        await store.close()

    asyncio.run(main())


def test_hub_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown scheduler policy 'fastest'"):
        HubConfig(scheduler_policy="fastest")
    assert HubConfig(scheduler_policy="round-robin").scheduler_policy == "round-robin"


def test_auto_placement_respects_function_allow_lists(tmp_path: Path) -> None:
    """An endpoint whose owner allows only other functions is never chosen for this one; if no
    allowed endpoint is left, the submit is a 403 that says why (docs/security.md)."""

    async def main() -> None:
        store, users, eids, fid = await _setup(tmp_path)
        lists: dict[str, frozenset[str]] = {}
        svc = PlacementService(HubConfig(db_path=tmp_path / "hub.sqlite3"), store, allow_list=lists.get)
        await svc.start()
        now = time.time()
        for e in eids:
            info = {"capacity": 2, "tags": ["t"], "memory_mb": 1024}
            await store.set_endpoint_state(e, True, now, info)
            svc.endpoint_online(e, now, info)
        lists[eids[0]] = frozenset({"0" * 64})  # endpoint 0 runs only some other function
        for sel in ("auto", {"tags": ["t"]}, [eids[0], eids[1]]):
            tasks = [TaskIn(endpoint_id=sel, function_id=fid, args=ARGS) for _ in range(30)]
            rows = _rows(users["alice"], tasks)
            decisions = await svc.place(users["alice"], tasks, rows, now)
            assert len(decisions) == 30 and eids[0] not in {r["endpoint_id"] for r in rows}, sel
            svc.retract(r["id"] for r in rows)
        lists[eids[1]] = lists[eids[2]] = lists[eids[0]]
        tasks = [TaskIn(endpoint_id="auto", function_id=fid, args=ARGS)]
        with pytest.raises(PlacementError) as info:
            await svc.place(users["alice"], tasks, _rows(users["alice"], tasks), now)
        assert info.value.status == 403 and f"function {fid} is not on the allow-list of any endpoint" in str(info.value)
        assert svc.sched.fleet.ledger == {}
        await svc.stop()
        await store.close()

    asyncio.run(main())
