"""Promise 3 (issue 30): a retried batch with the same idempotency key returns the same task ids,
also when the retry alone would be refused (the queue bound is full with the first attempt's own
tasks), over REST and over the stream, and when many copies race; a different batch under the
same key is 409 and stores nothing."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from cloud_hub.client import Client, HubError

from ._mesh import mesh
from ._stream import RawStream

BOUND = 50


def work(x: int) -> int:
    return x * 3


def _specs(ep: str, fid: str, args: list[int]) -> list[dict]:
    return [Client.task_spec(ep, fid, (a,)) for a in args]


def _refused(fn) -> HubError:
    with pytest.raises(HubError) as ei:
        fn()
    return ei.value


@pytest.mark.timeout(90)
def test_idempotent_retries_against_a_full_queue_bound(tmp_path):
    env = {"MESH_HUB_LIMITS": '{"user": {"max_queued": %d}}' % BOUND}
    with mesh(tmp_path, env=env) as m:
        agent = m.add_agent("idle", "zmq", workers=3, prefetch=1, start=False)  # nothing drains the queue yet
        ep = agent.endpoint_id
        c = m.client
        fid = c.register_function(work)

        def queued_in(group: str) -> list[str]:
            return [t["task_id"] for t in c.task_group(group)]

        # 1. eight threads race the same 5-task batch under one key: one set of ids, 5 rows
        key_r, grp_r = f"race-{uuid.uuid4()}", f"g-{uuid.uuid4()}"
        race_specs = _specs(ep, fid, [1, 2, 3, 4, 5])
        answers: list[object] = []

        def racer() -> None:
            try:
                answers.append(tuple(c.submit_batch_placed(race_specs, key_r, task_group_id=grp_r)[0]))
            except Exception as e:  # noqa: BLE001
                answers.append(e)

        ts = [threading.Thread(target=racer) for _ in range(8)]
        [t.start() for t in ts]
        [t.join(30) for t in ts]
        assert all(isinstance(a, tuple) for a in answers), answers
        assert len(set(answers)) == 1, answers
        assert len(queued_in(grp_r)) == 5

        # 2. batch A (40): 45 queued of 50
        key_a, grp_a = f"a-{uuid.uuid4()}", f"g-{uuid.uuid4()}"
        specs_a = _specs(ep, fid, list(range(100, 140)))
        ids_a, _ = c.submit_batch_placed(specs_a, key_a, task_group_id=grp_a)
        assert len(ids_a) == 40
        # 3. its retry would be 85 > 50 if counted again: must answer the same ids, store nothing
        again, _ = c.submit_batch_placed(specs_a, key_a, task_group_id=grp_a)
        assert again == ids_a
        assert len(queued_in(grp_a)) == 40
        # 4. a new batch that does not fit: 429 with Retry-After, nothing stored
        grp_b = f"g-{uuid.uuid4()}"
        e = _refused(lambda: c.submit_batch_placed(_specs(ep, fid, [7] * 10), f"b-{uuid.uuid4()}", task_group_id=grp_b))
        assert e.status == 429 and e.retry_after, (e.status, e.detail, e.retry_after)
        assert queued_in(grp_b) == []
        # 5. a different batch under key A: 409, nothing stored (also while the bound is full)
        grp_c = f"g-{uuid.uuid4()}"
        e = _refused(lambda: c.submit_batch_placed(_specs(ep, fid, [1, 2]), key_a, task_group_id=grp_c))
        assert e.status == 409, (e.status, e.detail)
        assert queued_in(grp_c) == []
        specs_a2 = list(specs_a)
        specs_a2[-1] = Client.task_spec(ep, fid, (999,))  # one argument changed
        e = _refused(lambda: c.submit_batch_placed(specs_a2, key_a, task_group_id=grp_a))
        assert e.status == 409, (e.status, e.detail)
        assert len(queued_in(grp_a)) == 40
        # 6. fill the bound exactly (45 + 5 = 50), then retry that batch with the queue full
        key_f, grp_f = f"f-{uuid.uuid4()}", f"g-{uuid.uuid4()}"
        ids_f, _ = c.submit_batch_placed(_specs(ep, fid, [8, 9, 10, 11, 12]), key_f, task_group_id=grp_f)
        assert c.submit_batch_placed(_specs(ep, fid, [8, 9, 10, 11, 12]), key_f, task_group_id=grp_f)[0] == ids_f
        e = _refused(lambda: c.submit_batch_placed(_specs(ep, fid, [13]), f"x-{uuid.uuid4()}"))
        assert e.status == 429, (e.status, e.detail)
        # 7. the same keys over the stream: the same ids (one key means one request on both)
        s = RawStream(m.url, m.token)
        try:
            ans = s.submit(Client.batch_body(specs_a, key_a, None, grp_a))
            assert ans.get("op") == "accepted" and ans["task_ids"] == ids_a, ans
            ans = s.submit(Client.batch_body(_specs(ep, fid, [8, 9, 10, 11, 12]), key_f, None, grp_f))
            assert ans.get("op") == "accepted" and ans["task_ids"] == ids_f, ans
            ans = s.submit(Client.batch_body(_specs(ep, fid, [4, 4]), key_a, None, f"g-{uuid.uuid4()}"))
            assert ans.get("op") == "refused" and ans.get("status") == 409, ans
            ans = s.submit(Client.batch_body(_specs(ep, fid, [5]), f"y-{uuid.uuid4()}", None, None))
            assert ans.get("op") == "refused" and ans.get("status") == 429, ans
        finally:
            s.close()
        # 8. a key first used over the stream, retried over REST while the bound is full
        # (drain first: start the agent and wait, then fill again)
        agent.start()
        m.wait_online(agent)
        ids_all = queued_in(grp_r) + ids_a + ids_f
        res = {}
        deadline = time.monotonic() + 30
        while len(res) < len(ids_all) and time.monotonic() < deadline:
            for r in c.wait_results([i for i in ids_all if i not in res][:1000], timeout_s=5):
                res[r["task_id"]] = r
        assert len(res) == len(ids_all), f"{len(ids_all) - len(res)} of the queued tasks never ran"
        # 9. after they ran, the retry of A still gives A's ids (not new tasks)
        assert c.submit_batch_placed(specs_a, key_a, task_group_id=grp_a)[0] == ids_a
        assert len(queued_in(grp_a)) == 40
        # 10. memoized submits (REST cache_key): a batch answered by the hub from its cache, retried
        # under its key, gives the same (hit) ids, not new hits
        ck = uuid.uuid4().hex + uuid.uuid4().hex
        first = dict(Client.task_spec(ep, fid, (77,)), cache_key=ck)
        (run_id,), _ = c.submit_batch_placed([first], f"m1-{uuid.uuid4()}")
        deadline = time.monotonic() + 20
        while not c.wait_results([run_id], timeout_s=2) and time.monotonic() < deadline:
            pass
        key_h, grp_h = f"h-{uuid.uuid4()}", f"g-{uuid.uuid4()}"
        hit_specs = [dict(Client.task_spec(ep, fid, (77,)), cache_key=ck) for _ in range(3)]
        hit_ids, _ = c.submit_batch_placed(hit_specs, key_h, task_group_id=grp_h)
        assert c.submit_batch_placed(hit_specs, key_h, task_group_id=grp_h)[0] == hit_ids
        assert len(queued_in(grp_h)) == 3
        rows = c.wait_results(hit_ids, timeout_s=5)
        assert {r["task_id"] for r in rows} == set(hit_ids), rows
