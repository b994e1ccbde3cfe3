"""Fair share on a shared endpoint (issue 16, item 3): one user's flood does not starve another.

User A (the endpoint's owner) floods one shared endpoint with 50,000 no-ops; then user B, with
whom it is shared, submits 100 short tasks. With plain arrival order B would wait behind all
50,000. The assertion is on positions, not on time: when B's last result is stored, most of A's
backlog has not run yet (results carry a global sequence number, so "before" is exact).
"""

from __future__ import annotations

import asyncio
import base64
import sqlite3
from typing import Any, Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import serialize

pytestmark = pytest.mark.integration

FLOOD = 50_000


def noop() -> None:
    return None


def short(i: int) -> int:
    return i


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalMesh, AgentProcess]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    m = LocalMesh(tmp_path_factory.mktemp("fair"), heartbeat_s=0.5, lost_after_s=5.0)
    m.start()
    try:
        agent = m.add_agent("shared", "zmq", workers=2, prefetch=64)
        m.wait_online(timeout=90)
        yield m, agent
    finally:
        m.stop()


def test_a_flood_by_one_user_does_not_make_another_wait_behind_it(mesh: Any) -> None:
    m, agent = mesh
    ep = agent.endpoint_id

    async def mint() -> str:
        store = await SqliteStore(m.hub_cfg.db_path).open()
        try:
            return await store.create_api_token(await store.create_user("bob"), "test")
        finally:
            await store.close()

    bob = Client(m.url, asyncio.run(mint()), trusted_endpoints=[ep])
    m.client.share_endpoint(ep, "bob")
    a = m.client
    fid = a.register_function(noop)
    args = base64.b64encode(serialize(((), {}))).decode()
    for _ in range(FLOOD // 5000):
        a.submit_batch_placed([{"endpoint_id": ep, "function_id": fid, "args": args}] * 5000)
    try:
        with Executor(bob, endpoint=ep) as ex:
            futs = [ex.submit(short, i) for i in range(100)]
            assert sorted(f.result(timeout=300) for f in futs) == list(range(100))
            ids = [f.task_id for f in futs]  # type: ignore[attr-defined]
    finally:
        bob.close()
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        users = dict(c.execute("SELECT name, id FROM users").fetchall())
        last_b = c.execute(f"SELECT MAX(seq) FROM results WHERE task_id IN ({','.join('?' * len(ids))})", ids).fetchone()[0]
        a_before = c.execute("SELECT COUNT(*) FROM results WHERE user_id=? AND seq < ?", (users["demo"], last_b)).fetchone()[0]
        a_queued = c.execute("SELECT COUNT(*) FROM tasks WHERE user_id=? AND function_id=?", (users["demo"], fid)).fetchone()[0]
    assert a_queued == FLOOD
    # FIFO would put all 50,000 of A's ahead of B's last task; fair share lets B's 100 through
    # after at most what the agent already held (capacity + prefetch) and their fair turns.
    assert a_before < FLOOD // 2, f"{a_before} of A's {FLOOD} tasks finished before B's last one"
    print(f"A's results stored before B's last: {a_before} of {FLOOD}")
