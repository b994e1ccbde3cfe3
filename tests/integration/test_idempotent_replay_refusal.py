"""Idempotent submit without a read of the key first (cloud_hub/service/submit.py ``accept``, issue 30):
a replay is found when the key's insert fails inside the tasks' transaction, or when anything on
the way refuses it, and then answered with what the first attempt made. Through REST
(``POST /v1/tasks/batch``) on a real hub with a SQLite file; the endpoint's agent never runs, so
every accepted task stays queued and counts against the user's queue bound (``max_queued`` 5).

- a replay of an accepted batch gets the same task ids even though the bound is now full with the
  first attempt's own tasks (a fresh batch is refused 429 there);
- a different request with the same key gets 409 and stores nothing, whether it would have fit
  under the bound or not;
- a replay after the endpoint's allow-list stopped allowing the function (403 for new work) still
  gets the first attempt's ids;
- two copies of one request racing each other make one set of tasks, and both get its ids, also
  when both inserts land in one group commit (the copy's failure is reported before that group's
  COMMIT, so the key is read behind it: the last test makes that happen every time)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.client import Client, HubError
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from cloud_hub.service.schemas import TaskIn
from cloud_hub.service.submit import accept
from mesh_agent.cli import enroll

pytestmark = pytest.mark.integration

BOUND = 5


def triple(x: int) -> int:
    return 3 * x


def other(x: int) -> int:
    return x


def _count(db: Path, sql: str = "SELECT COUNT(*) FROM tasks") -> int:
    with sqlite3.connect(db) as c:
        return int(c.execute(sql).fetchone()[0])


def _hub(tmp_path: Path, limits: dict[str, Any]) -> Iterator[tuple[HubThread, Client, str, str, Path]]:
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="alice",
                    limits=limits)
    with HubThread(cfg) as h:
        client = Client(h.url, h.token)
        ep = enroll(h.url, client.create_enrollment_token(), "pi", tmp_path / "agent.yaml", transport="zmq").endpoint_id  # never started
        fid = client.register_function(triple)
        yield h, client, ep, fid, tmp_path / "hub.sqlite3"
        client.close()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[HubThread, Client, str, str, Path]]:
    yield from _hub(tmp_path, {"user": {"max_queued": BOUND}})


@pytest.fixture
def unbounded_hub(tmp_path: Path) -> Iterator[tuple[HubThread, Client, str, str, Path]]:
    """No queue bound: a submit reads nothing on the database thread before its insert."""
    yield from _hub(tmp_path, {})


def _post(client: Client, ep: str, fid: str, args: list[int], key: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"tasks": [Client.task_spec(ep, fid, (a,)) for a in args]}
    if key is not None:
        body["idempotency_key"] = key
    return dict(client.request("POST", "/v1/tasks/batch", json=body))


def test_a_replay_gets_the_first_tasks_although_they_now_fill_the_queue_bound(hub: Any) -> None:
    h, client, ep, fid, db = hub
    key = uuid.uuid4().hex
    first = _post(client, ep, fid, list(range(BOUND)), key)
    assert len(set(first["task_ids"])) == BOUND and _count(db) == BOUND
    with pytest.raises(HubError) as full:  # the bound is full: new work is refused
        _post(client, ep, fid, [99], None)
    assert full.value.status == 429
    for _ in range(3):  # the client did not hear the answer and sends the same batch again
        assert _post(client, ep, fid, list(range(BOUND)), key) == first
    assert _count(db) == BOUND, "a replay inserts nothing"
    assert h.hub.admission.stats["refused"] >= 1


def test_a_replay_of_part_of_the_bound_gets_its_tasks_when_the_rest_is_full(hub: Any) -> None:
    """3 accepted, then 2 more from another submit: the replay of the 3 would be 8 > 5 if counted as new."""
    _, client, ep, fid, db = hub
    key = uuid.uuid4().hex
    first = _post(client, ep, fid, [1, 2, 3], key)
    _post(client, ep, fid, [4, 5], uuid.uuid4().hex)
    assert _count(db) == BOUND
    assert _post(client, ep, fid, [1, 2, 3], key) == first
    assert _count(db) == BOUND


@pytest.mark.parametrize("fits", [True, False], ids=["under-the-bound", "over-the-bound"])
def test_another_request_with_the_same_key_gets_409_and_stores_nothing(hub: Any, fits: bool) -> None:
    _, client, ep, fid, db = hub
    key = uuid.uuid4().hex
    first = _post(client, ep, fid, [1, 2], key)
    if not fits:
        _post(client, ep, fid, [7, 8, 9], uuid.uuid4().hex)  # fill the bound: the other request is also over it
    before = _count(db)
    with pytest.raises(HubError) as err:
        _post(client, ep, fid, [1, 2, 3] if not fits else [3], key)
    assert err.value.status == 409 and "was used for a different request" in err.value.detail
    assert _count(db) == before, "nothing of the other request is stored"
    assert _post(client, ep, fid, [1, 2], key) == first, "the key still answers its own request"
    assert _count(db) == before


def test_a_replay_after_the_allow_list_changed_gets_the_first_tasks(hub: Any) -> None:
    _, client, ep, fid, db = hub
    key = uuid.uuid4().hex
    first = _post(client, ep, fid, [1, 2], key)
    client.set_allowed_functions(ep, [client.register_function(other)])  # triple is no longer allowed there
    with pytest.raises(HubError) as refused:
        _post(client, ep, fid, [1, 2], uuid.uuid4().hex)
    assert refused.value.status == 403
    before = _count(db)
    assert _post(client, ep, fid, [1, 2], key) == first, "the replay is answered, not refused"
    assert _count(db) == before


def test_racing_copies_of_one_request_make_one_set_of_tasks(hub: Any) -> None:
    h, client, ep, fid, db = hub
    key = uuid.uuid4().hex
    answers: list[Any] = []
    go = threading.Barrier(4)

    def post() -> None:
        c = Client(h.url, h.token)
        try:
            go.wait(10)
            answers.append(_post(c, ep, fid, [1, 2, 3], key))
        except Exception as exc:  # noqa: BLE001 - reported below
            answers.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 4 and all(isinstance(a, dict) for a in answers), answers
    assert all(a == answers[0] for a in answers)
    assert _count(db) == 3


def test_a_copy_in_the_same_group_commit_as_the_first_gets_its_ids(unbounded_hub: Any) -> None:
    """Deterministic form of the race above: two copies of one request meet just before their
    insert, then both inserts run in one group commit (the database thread is held while they
    queue), and an operation queued behind them keeps the COMMIT back half a second. The second
    copy's key insert fails in its savepoint and is answered at once (cloud_hub/store/group.py);
    its replay lookup must still find the first copy's key."""
    h, client, ep, fid, db = unbounded_hub
    hub_obj = h.hub
    store = hub_obj.store
    tasks = [TaskIn.model_validate(Client.task_spec(ep, fid, (i,))) for i in range(2)]
    key = uuid.uuid4().hex
    held, gate = threading.Event(), threading.Event()

    def hold(_db: Any) -> None:
        held.set()
        gate.wait(20)

    def slow(_db: Any) -> None:
        time.sleep(0.5)  # the group's COMMIT waits for this

    async def race() -> list[Any]:
        uid = await store.read(lambda d: d.execute("SELECT id FROM users WHERE name='alice'").fetchone()[0])
        inner = store.insert_tasks
        arrived: list[int] = []
        go = asyncio.Event()

        async def insert_tasks(*a: Any, **kw: Any) -> Any:  # both copies meet here, just before their insert
            arrived.append(1)
            await go.wait()
            return await inner(*a, **kw)

        store.insert_tasks = insert_tasks
        holder = None
        try:
            copies = [asyncio.ensure_future(accept(hub_obj, uid, tasks, key)) for _ in range(2)]
            for _ in range(1000):
                await asyncio.sleep(0.005)
                if len(arrived) == 2:
                    break
            else:
                raise AssertionError("the copies did not both reach their insert")
            holder = asyncio.ensure_future(store.read(hold))  # hold the database thread: both inserts queue for one group
            assert await asyncio.to_thread(held.wait, 20)
            go.set()
            for _ in range(1000):
                await asyncio.sleep(0.002)
                if sum("insert_tasks" in getattr(op.fn, "__qualname__", "") for op in store._group._pending) >= 2:
                    break
            else:
                raise AssertionError("the inserts were not queued")
            late = asyncio.ensure_future(store.tx(slow))  # behind them in the group: the COMMIT comes 0.5 s later
            await asyncio.sleep(0.01)
        finally:
            gate.set()
            go.set()
            del store.insert_tasks
        if holder is not None:
            await holder
        out = await asyncio.gather(*copies, return_exceptions=True)
        await late
        return list(out)

    out = asyncio.run_coroutine_threadsafe(race(), h._loop).result(30)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert out[0] == out[1]
    assert _count(db) == 2
