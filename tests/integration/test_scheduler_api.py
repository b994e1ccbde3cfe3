"""Selectors, constraints and the decisions API refuse bad input clearly and store nothing.

One real agent (tags: field) is the whole fleet of user "demo"; a second user has none.
"""

from __future__ import annotations

import asyncio
import base64
import sqlite3

import httpx
import pytest

from cloud_hub.client import Client, Executor, HubError
from cloud_hub.localmesh import LocalMesh
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import serialize

pytestmark = pytest.mark.integration


def double(x: int) -> int:
    return 2 * x


def _counts(mesh: LocalMesh) -> tuple[int, int]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return (db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0],
                db.execute("SELECT COUNT(*) FROM scheduler_decisions").fetchone()[0])


def _spec(ep: object, fid: str, **extra: object) -> dict:
    return {"endpoint_id": ep, "function_id": fid, "args": base64.b64encode(serialize(((1,), {}))).decode(), **extra}


def _second_user_token(mesh: LocalMesh) -> str:
    async def mint() -> str:
        store = await SqliteStore(mesh.hub_cfg.db_path).open()
        try:
            return await store.create_api_token(await store.create_user("bob"), "test")
        finally:
            await store.close()

    return asyncio.run(mint())


def test_selectors_and_decisions_refuse_bad_input_without_state_change(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("field-1", workers=1, tags=["field", "solar"])
    mesh.wait_online(agent)
    c = mesh.client
    fid = c.register_function(double)
    ep = agent.endpoint_id
    sched = mesh.hub.hub.placement.sched  # type: ignore[union-attr]
    before = _counts(mesh)

    cases: list[tuple[str, dict, int, str]] = [
        ("empty tag selector", _spec({"tags": []}, fid), 422, "tags"),
        ("unknown selector key", _spec({"labels": ["field"]}, fid), 422, "endpoint_id"),
        ("empty list", _spec([], fid), 422, "endpoint_id"),
        ("tag with a space", _spec({"tags": ["a b"]}, fid), 422, "endpoint_id"),
        ("private owner tag", _spec({"tags": ["@owner:u_x"]}, fid), 422, "endpoint_id"),
        ("unknown constraint", _spec("auto", fid, constraints={"cpu": 4}), 422, "constraints"),
        ("negative memory", _spec("auto", fid, constraints={"min_memory_mb": -1}), 422, "min_memory_mb"),
        ("unknown id in a list", _spec([ep, "ep-nope"], fid), 404, "unknown endpoint ep-nope"),
        ("nobody has the tag", _spec({"tags": ["field", "gpu-lab"]}, fid), 409,
         "no eligible endpoint for task 0 (endpoint_id tags): none of your 1 endpoints satisfies {tags=field,gpu-lab}"),
        ("needs a GPU", _spec("auto", fid, constraints={"gpu": True}), 409, "satisfies {gpu}"),
        ("needs more memory", _spec([ep], fid, constraints={"min_memory_mb": 2**30}), 409,
         "none of the listed endpoints satisfies {memory>=1073741824MB}"),
        ("concrete endpoint lacks the tag", _spec(ep, fid, constraints={"tags": ["gpu-lab"]}), 409,
         f"endpoint {ep} does not satisfy the constraints {{tags=gpu-lab}}"),
    ]
    for name, spec, status, text in cases:
        with pytest.raises(HubError) as info:
            c.request("POST", "/v1/tasks", json=spec)
        assert info.value.status == status, name
        assert text in info.value.detail, (name, info.value.detail)
        # inside a batch after good selector tasks: the whole batch is refused
        with pytest.raises(HubError) as info:
            c.submit_batch([_spec("auto", fid), _spec({"tags": ["field"]}, fid), spec])
        assert info.value.status == status, name
        assert sched.fleet.ledger == {} and sched.in_flight == 0, name  # placements undone
    assert _counts(mesh) == before
    assert "@owner" not in str(c.request("GET", "/openapi.json"))

    # Tenancy: another user cannot name this endpoint, and their "auto" never reaches it.
    bob = Client(mesh.url, _second_user_token(mesh))
    bob_fid = bob.register_function(double)
    for spec, status, text in [
        (_spec([ep], bob_fid), 404, f"unknown endpoint {ep}"),
        (_spec("auto", bob_fid), 409, "none of your endpoints has connected to the hub yet"),
        (_spec({"tags": ["field"]}, bob_fid), 409, "none of your endpoints has connected"),
    ]:
        with pytest.raises(HubError) as info:
            bob.request("POST", "/v1/tasks", json=spec)
        assert (info.value.status, text in info.value.detail) == (status, True), info.value.detail
    assert _counts(mesh) == before

    # The good forms work, and each placement is recorded.
    with Executor(c, endpoint={"tags": ["solar"]}, constraints={"tags": ["field"]}) as ex:
        assert ex.submit(double, 4).result(30) == 8
    with Executor(c, endpoint=[ep]) as ex:
        assert ex.submit(double, 5).result(30) == 10
    with Executor(c, endpoint_id=ep) as ex:  # a concrete id: no scheduling, no decision
        assert ex.submit(double, 6).result(30) == 12
    page = c.scheduler_decisions()
    kinds = [(d["selector"]["kind"], d["selector"]["tags"], d["selector"]["endpoints"], d["constraints"]["tags"]) for d in page["decisions"]]
    assert kinds == [("list", None, [ep], []), ("tags", ["solar"], None, ["field"])]
    assert bob.scheduler_decisions()["decisions"] == []  # only the caller's own

    # The decisions API: bad queries are refused, no token is refused.
    for params in ({"limit": 0}, {"limit": 1001}, {"before": 0}, {"task_id": ""}, {"limit": "x"}):
        with pytest.raises(HubError) as info:
            c.request("GET", "/v1/scheduler/decisions", params=params)
        assert info.value.status == 422, params
    assert httpx.get(f"{mesh.url}/v1/scheduler/decisions").status_code == 401
    assert c.scheduler_decisions(task_id="no-such-task")["decisions"] == []

    # The SDK checks selectors and constraints before any request.
    for kw, err in [({"endpoint": {"tag": ["x"]}}, ValueError), ({"endpoint": []}, ValueError), ({"endpoint": 7}, TypeError),
                    ({"endpoint": "auto", "endpoint_id": "ep-x"}, ValueError), ({"constraints": {"gpus": 1}}, ValueError)]:
        with pytest.raises(err):
            Executor(c, **kw)  # type: ignore[arg-type]
