"""Sequential round trips, bursts of 50-300 tasks and idle gaps of 0.5-3 s, on an MQTT agent
(2 workers, prefetch 0: every result is a "room" signal that must find the next task) and a
ZeroMQ agent (3 workers, prefetch 7). The gaps let the hub find the queue empty and its watchdog
back off, so the next submit must wake the endpoint by itself."""

from __future__ import annotations

import random
import time

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from tests.outsider_issue30b._util import Tracker, drop_log, hub_log, hub_results_once, marks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    wd = tmp_path_factory.mktemp("rhythm")
    log = hub_log(wd)
    m = LocalMesh(wd, heartbeat_s=1.0, lost_after_s=4.0, lease_s=10.0).start()
    try:
        a_mqtt = m.add_agent("rh-mqtt", "mqtt", workers=2, prefetch=0)
        a_zmq = m.add_agent("rh-zmq", "zmq", workers=3, prefetch=7)
        # metered: heartbeats only on change, workers end after 1.5 s idle and start on the next task
        a_met = m.add_agent("rh-metered", "mqtt", workers=2, prefetch=2, profile="metered", worker_idle_s=1.5)
        m.wait_online(a_mqtt, a_zmq, a_met, timeout=60)
        m.hublog = log
        yield m, {"mqtt": a_mqtt, "zmq": a_zmq, "metered": a_met}
    finally:
        m.stop()
        drop_log(log)


@pytest.mark.parametrize("kind,how,seed", [("mqtt", "pinned", 3011), ("zmq", "pinned", 7019),
                                           ("zmq", "list", 1187), ("metered", "pinned", 5003)])
def test_round_trips_bursts_and_gaps(mesh, kind, how, seed, tmp_path):
    """``how="list"``: ``endpoint=[id]``, so the scheduler places each task (late binding holds
    all but the lookahead at the hub, and each result must release the next)."""
    m, agents = mesh
    agent = agents[kind]
    rng = random.Random(seed)
    logs = [agent.log_path, m.hublog]
    mark = str(tmp_path / "marks.txt")
    tr = Tracker()
    cursor0 = m.client.result_cursor()
    t_end = time.monotonic() + 20  # bounded in time as well as in count
    cycles = 0
    n = 0
    in_burst: set[int] = set()
    with Executor(m.client, endpoint=agent.endpoint_id if how == "pinned" else [agent.endpoint_id]) as ex:
        for cycle in range(12):
            if time.monotonic() > t_end:
                break
            cycles += 1
            # 1. sequential round trips (each the only task on the mesh), some right after a gap
            for _ in range(rng.randint(4, 9)):
                k = n; n += 1
                tr.submit(ex, k, k, mark=mark)
                tr.wait([k], timeout=20, client=m.client, logs=logs)
            # 2. a burst of 50-300 short tasks; singles submitted while it drains
            size = rng.randint(50, 300)
            burst = []
            for _ in range(size):
                k = n; n += 1
                tr.submit(ex, k, k, delay=rng.choice((0.0, 0.0, 0.002, 0.01)), mark=mark)
                burst.append(k)
            for _ in range(3):
                time.sleep(rng.uniform(0.0, 0.2))
                k = n; n += 1
                tr.submit(ex, k, k, mark=mark)
                burst.append(k)
            tr.wait(burst, timeout=45, client=m.client, logs=logs)
            in_burst.update(burst)
            # 3. idle: the hub finds the queue empty; its watchdog backs off 1, 2, 4 s ...
            time.sleep(rng.choice((0.5, 1.1, 2.2, 3.0, rng.uniform(0.5, 3.0))))
            # 4. a single task, then a pair submitted together after a short lull
            k = n; n += 1
            tr.submit(ex, k, k, mark=mark)
            tr.wait([k], timeout=20, client=m.client, logs=logs)
            time.sleep(rng.uniform(0.05, 0.6))
            pair = [n, n + 1]; n += 2
            for k in pair:
                tr.submit(ex, k, k, mark=mark)
            tr.wait(pair, timeout=20, client=m.client, logs=logs)
        keys = list(tr.futs)
        stats = tr.check(keys, what=f"rhythm/{kind}/{how} cycles={cycles}", client=m.client, logs=logs)
    # exactly once: one run per task (no kill here, so no re-execution is excused) and one stored result
    runs = marks(mark)
    assert sorted(runs) == sorted(tr.futs), f"tasks never run: {sorted(set(tr.futs) - set(runs))[:10]}"
    assert all(c == 1 for c in runs.values()), f"tasks run more than once: {[(k, c) for k, c in runs.items() if c > 1][:10]}"
    hub_results_once(m.client, cursor0, [tr.futs[k].task_id for k in keys])
    # on an idle mesh a lone round trip must not wait for the watchdog (>= 1 s) either
    lone = [tr.done[k] - tr.sub[k] for k in keys if k not in in_burst]
    print(f"[rhythm/{kind}/{how}] {len(keys)} tasks, {cycles} cycles, slowest {stats['raw']:.2f}s; "
          f"lone round trips: {len(lone)}, slowest {max(lone):.3f}s, over 1 s: {sum(1 for v in lone if v > 1.0)}")
