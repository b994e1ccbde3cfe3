"""The hub's placement service and environments: heartbeats' ``envs`` reach the fleet, ``eb`` (what
an agent's builds cost) teaches the environment's cold start once per figure, bad figures teach
nothing, and a task's environment reaches the scheduler (docs/environments.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import AsyncIterator

from cloud_hub.service.schemas import TaskIn
from cloud_hub.config import HubConfig
from cloud_hub.placement import PlacementService
from mesh_agent.protocol.environment import env_id, normalize
from scheduler.environments import CONTAINER_PRIOR, PIP_PRIOR, EnvCost
from tests.unit.test_placement_service import ARGS, _rows, _setup


@contextlib.asynccontextmanager
async def _online(tmp_path: Path) -> AsyncIterator[tuple[PlacementService, dict[str, str], list[str], str, float]]:
    """A started placement service whose endpoints are all online, idle and alike."""
    store, users, eids, fid = await _setup(tmp_path)
    svc = PlacementService(HubConfig(db_path=tmp_path / "hub.sqlite3"), store)
    await svc.start()
    try:
        now = time.time()
        for e in eids:
            info = {"capacity": 2, "tags": [], "memory_mb": 1024}
            await store.set_endpoint_state(e, True, now, info)
            svc.endpoint_online(e, now, info)
        yield svc, users, eids, fid, now
    finally:
        await svc.stop()
        await store.close()


def test_heartbeats_teach_held_environments_and_build_costs(tmp_path: Path) -> None:
    async def main() -> None:
        async with _online(tmp_path) as (svc, users, eids, fid, now):
            spec = {"pip": ["numpy>=1.26"]}
            sid = env_id(normalize(spec))
            assert svc.env_costs.get(sid) == PIP_PRIOR  # nothing measured yet
            svc.heartbeat(eids[1], now, {"capacity": 2, "envs": [sid], "eb": {sid: [12.5, 4_000_000]}, "beats": "adaptive"})
            ep = svc.sched.fleet.nodes[eids[1]].ep
            assert ep.envs == frozenset({sid}) and ep.metered
            assert svc.env_costs.get(sid) == EnvCost(12.5, 4_000_000)
            svc.heartbeat(eids[1], now + 1, {"capacity": 2, "envs": [sid], "eb": {sid: [12.5, 4_000_000]}})  # a repeat
            assert svc.env_costs.get(sid) == EnvCost(12.5, 4_000_000)
            svc.heartbeat(eids[0], now + 2, {"capacity": 2, "eb": {sid: ["x", -1], "other": "bad"}})  # teaches nothing
            assert svc.env_costs.get(sid) == EnvCost(12.5, 4_000_000)
            # A task naming the environment goes where it is held (all endpoints otherwise equal and idle).
            tasks = [TaskIn(endpoint_id=eids, function_id=fid, args=ARGS, environment=spec)]
            rows = _rows(users["alice"], tasks)
            await svc.place(users["alice"], tasks, rows, now + 3)
            assert rows[0]["endpoint_id"] == eids[1]

    asyncio.run(main())


def test_a_staged_container_image_in_the_heartbeat_attracts_its_tasks(tmp_path: Path) -> None:
    """An agent lists container specs whose image is staged there in ``envs``: the hub charges
    that endpoint no pull (CONTAINER_PRIOR elsewhere) and places the task there."""
    async def main() -> None:
        async with _online(tmp_path) as (svc, users, eids, fid, now):
            spec = {"container": "/srv/images/fl-rootfs"}
            sid = env_id(normalize(spec))
            assert svc.env_costs.get(sid, container=True) == CONTAINER_PRIOR
            holder = eids[-1]
            svc.heartbeat(holder, now, {"capacity": 2, "envs": [sid]})
            tasks = [TaskIn(endpoint_id=eids, function_id=fid, args=ARGS, environment=spec)]
            rows = _rows(users["alice"], tasks)
            await svc.place(users["alice"], tasks, rows, now + 1)
            assert rows[0]["endpoint_id"] == holder

    asyncio.run(main())
