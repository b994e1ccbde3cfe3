"""Regression (found by the outage simulator, ``mesh-sim run``): a ``tasks`` frame lost on its way
to a ZeroMQ agent left the hub without credit for it while the agent believed it was still owed
those tasks, so it never fetched again; ZeroMQ reconnects underneath without the agent saying
hello, so nothing re-synced them and the endpoint starved with tasks queued for it, forever.
The hub now takes the ``want`` of the agent's heartbeats as credit when the two have lost sync,
and puts tasks whose frame failed to send back in the queue at once instead of after ``lease_s``
(here 60 s, and endpoints are declared lost only after 30 s: longer than the test waits).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from sim.emulate.proxy import FaultProxy

pytestmark = pytest.mark.integration


def triple(x: int) -> int:
    return 3 * x


@pytest.fixture
def long_lease_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup")
    m = LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=30.0, lease_s=60.0).start()
    try:
        yield m
    finally:
        m.stop()


async def _until(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_zmq_agent_gets_its_tasks_after_a_tasks_frame_is_lost(long_lease_mesh: LocalMesh) -> None:
    mesh = long_lease_mesh
    assert mesh.hub is not None
    dispatcher = mesh.hub.hub.dispatcher
    zmq_port = int(str(mesh.hub.hub.zmq_address).rsplit(":", 1)[1])
    proxy = await FaultProxy("z", ("127.0.0.1", zmq_port)).start()
    try:
        agent = await asyncio.to_thread(mesh.add_agent, "z", "zmq", workers=1, prefetch=4, start=False)
        agent.cfg = agent.cfg.model_copy(update={"zmq": agent.cfg.zmq.model_copy(update={"address": f"tcp://127.0.0.1:{proxy.port}"})})
        agent.cfg.save(agent.config_path)
        agent.start()
        await asyncio.to_thread(mesh.wait_online, agent)
        ep = agent.endpoint_id
        await _until(lambda: (dispatcher.session_info(ep) or {}).get("credit", 0) > 0, 10, "the agent's first fetch")

        # The link drops (both TCP sides reset) while the hub sends: the frame is lost.
        proxy.cut("test", "reset")
        await asyncio.sleep(1.0)  # the hub's ROUTER has seen the peer go
        ex = Executor(mesh.client, ep)
        try:
            futures = [ex.submit(triple, i) for i in range(10)]
            await _until(lambda: all(hasattr(f, "task_id") for f in futures), 10, "the tasks to be accepted")

            def requeued() -> bool:
                # The send failed: the session's credit is spent (0; it had some above) and every
                # task is back in the queue, the failed attempt not counted (store.unlease).
                st = [mesh.client.task_status(f.task_id) for f in futures]  # type: ignore[attr-defined]
                return ((dispatcher.session_info(ep) or {}).get("credit") == 0
                        and all(t["state"] == "queued" and t["attempts"] == 0 and t["dispatched"] is None for t in st))

            await _until(requeued, 20, "the tasks of the failed send to be queued again (not leased for 60 s)")
            assert (dispatcher.session_info(ep) or {}).get("credit") == 0
            proxy.restore("test")  # back within lost_after_s: no new session, no hello
            await _until(lambda: all(f.done() for f in futures), 40, "every result after the lost frame")
            assert [f.result() for f in futures] == [3 * i for i in range(10)]
        finally:
            await asyncio.to_thread(ex.shutdown, False, cancel_futures=True)
    finally:
        await proxy.stop()
