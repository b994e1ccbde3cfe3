"""Link latency from echoed round trips (issue 27, item 1), through the real dispatcher and agent
clock code with a fake link: hub lag and clock skew are injected, and what comes out must be the
link, not the lag. Mechanisms only: the "times" are chosen, not measured."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from cloud_hub.config import HubConfig
from cloud_hub.dispatcher import Dispatcher, _Session
from cloud_hub.observer import DispatchObserver
from mesh_agent.clock import HubClock
from mesh_agent.protocol import Envelope, Kind, decode, encode
from scheduler import EndpointState, Scheduler
from scheduler.estimators import LinkClock

KEY = b"k" * 32
EP = "ep-0123456789ab"


class _Link:
    name = "mqtt"

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        self.sent.append(frame)


class _Seen(DispatchObserver):
    def __init__(self) -> None:
        self.echoes: list[tuple[float, float, float]] = []
        self.frames: list[tuple[float, float]] = []

    def link_echo(self, endpoint_id: str, rtt_s: float, offset_s: float, now: float, hub_lag_s: float) -> None:
        self.echoes.append((rtt_s, offset_s, hub_lag_s))

    def frame_received(self, endpoint_id: str, kind: str, nbytes: int, sent_at: float, now: float) -> None:
        self.frames.append((sent_at, now))


def test_an_echo_through_a_lagging_hub_yields_the_link_not_the_lag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hub sends a stamped frame at T1; the agent (clock 5 s ahead) reads it 20 ms later, holds it
    30 ms, answers; the answer is read by the hub 20 ms later, then waits 0.8 s in the hub's lane
    behind a slow frame (hub lag). Round trip: 40 ms; offset: +5 s; lag reported apart."""
    clock = {"t": 1000.0}
    monkeypatch.setattr("cloud_hub.dispatcher.time.time", lambda: clock["t"])

    async def main() -> None:
        d = Dispatcher(HubConfig(db_path=tmp_path / "hub.sqlite3"), None, None)  # type: ignore[arg-type]
        seen = d.observer = _Seen()
        d._keys[EP] = KEY
        link = _Link()
        s = d._sessions[EP] = _Session(EP, link, clock["t"])  # type: ignore[arg-type]
        await d._send(s, Kind.RESULT_ACK, {"ids": []})
        down = decode(link.sent[-1], KEY, check_fresh=False)
        stamp = down.body["t"]
        assert isinstance(stamp, int) and 0 < stamp <= 0xFFFF
        # the agent: reads at T1 + 20 ms, answers 30 ms later, stamping on its clock (5 s ahead)
        skew, one_way, hold = 5.0, 0.020, 0.030
        up = encode(Envelope(Kind.HEARTBEAT, EP, {"running": 0, "queued": 0, "e": [stamp, int(hold * 1e6)]},
                             ts=clock["t"] + one_way + hold + skew), KEY)
        gate = asyncio.Event()

        async def slow() -> None:  # the hub is busy with another frame of this endpoint
            await gate.wait()

        await d.lanes.submit(EP, slow)
        clock["t"] += 2 * one_way + hold  # the answer is read off the link now...
        await d.enqueue_frame(EP, up, link)  # type: ignore[arg-type]
        clock["t"] += 0.8  # ...and handled 0.8 s later
        gate.set()
        for _ in range(50):
            await asyncio.sleep(0)
            if seen.echoes:
                break
        assert len(seen.echoes) == 1
        rtt, offset, lag = seen.echoes[0]
        assert rtt == pytest.approx(2 * one_way, abs=1e-6)
        assert offset == pytest.approx(skew, abs=1e-6)
        assert lag == pytest.approx(0.8, abs=1e-6)
        assert seen.frames[-1][1] == pytest.approx(1000.0 + 2 * one_way + hold)  # stamped at read
        # an echo answers one stamp once: a replayed or stale echo is not a second sample
        d._echo(s, [stamp, 0], clock["t"], clock["t"])
        assert len(seen.echoes) == 1

    asyncio.run(main())


def test_echo_costs_a_few_bytes_per_frame() -> None:
    body = {"ids": ["a" * 32]}
    plain = len(encode(Envelope(Kind.RESULT_ACK, EP, body, ts=1.0), KEY))
    down = len(encode(Envelope(Kind.RESULT_ACK, EP, {**body, "t": 65535}, ts=1.0), KEY))
    up_plain = len(encode(Envelope(Kind.HEARTBEAT, EP, {"running": 0}, ts=1.0), KEY))
    up = len(encode(Envelope(Kind.HEARTBEAT, EP, {"running": 0, "e": [65535, 4_000_000]}, ts=1.0), KEY))
    assert down - plain <= 5  # "t": a uint16
    assert up - up_plain <= 12  # "e": [uint16, hold in microseconds]


def test_latency_is_a_low_percentile_that_a_burst_of_lag_does_not_survive_in() -> None:
    rng = random.Random(5)
    lc = LinkClock()
    t = 0.0
    for _ in range(60):  # quiet: 40-50 ms round trips
        t += 1.0
        lc.observe(rng.uniform(0.040, 0.050), t)
    assert lc.latency == pytest.approx(0.0205, abs=0.002)
    for _ in range(40):  # a flood: the hub is seconds behind on many of its frames
        t += 0.1
        lc.observe(rng.uniform(0.5, 2.0), t)
    assert lc.latency < 0.03  # a low percentile: the burst is a minority of the window
    for _ in range(400):  # afterwards, quiet again: the burst leaves with the window
        t += 1.0
        lc.observe(rng.uniform(0.040, 0.050), t)
    assert max(x[1] for x in lc.samples) < 0.06


def test_offset_converges_to_the_fastest_exchange_under_skew() -> None:
    """Each exchange's NTP offset is off by up to half its round trip's asymmetry; the offset kept
    is the one of the smallest round trip, so it converges on the true skew as fast exchanges come."""
    rng = random.Random(9)
    skew = -3.7
    lc = LinkClock()
    for i in range(200):
        up, down = 0.01 + rng.expovariate(1 / 0.2), 0.01 + rng.expovariate(1 / 0.2)  # queueing either way
        lc.observe(up + down, float(i), skew + (up - down) / 2)  # what the dispatcher computes from such an exchange
    assert lc.offset == pytest.approx(skew, abs=lc.offset_rtt / 2 + 1e-9)
    assert lc.offset_rtt is not None and lc.offset_rtt < 0.05
    assert abs(lc.offset - skew) < 0.02


def test_the_agent_takes_the_hubs_hold_out_of_its_welcome_sample() -> None:
    c = HubClock()
    # hello sent at 100.0 (agent clock); hub (clock 50 s behind) read it at 50.01, did 0.5 s of database
    # work, stamped hub_time 50.51; the welcome arrived at 100.52 (agent clock)
    c.sample(100.0, 100.52, 50.51, hold=0.5)
    assert c.offset == pytest.approx(-50.0, abs=1e-9)
    assert c.rtt == pytest.approx(0.02)
    old = HubClock()
    old.sample(100.0, 100.52, 50.51)  # a hub that does not say: skewed by half the hold
    assert old.offset == pytest.approx(-49.75, abs=1e-9)


def test_scheduler_latency_follows_echoes_not_one_way_timings_after_a_flood() -> None:
    s = Scheduler("delta")
    s.add_endpoint(EndpointState("a", workers=1), 0.0)
    t = 0.0
    for _ in range(30):
        t += 1.0
        s.link_echo("a", 0.04, t, 0.0)
        s.message_timing("a", 300, 0.02, t)
    for _ in range(200):  # flood: frames wait seconds in a busy hub; echoes do not count that wait
        t += 0.05
        s.message_timing("a", 300, 1.5, t)
        s.link_echo("a", 0.045, t, 0.0)
    assert s.fleet.nodes["a"].one_way == pytest.approx(0.02, abs=0.003)




def test_scheduler_state_reports_link_offset_and_calibration_per_endpoint(tmp_path: Path) -> None:
    import time as _time

    from cloud_hub.placement import PlacementService
    from cloud_hub.store import SqliteStore

    async def main() -> None:
        store = await SqliteStore(tmp_path / "hub.sqlite3").open()
        uid = await store.create_user("alice")
        tok = await store.create_enroll_token(uid, 3600, 1)
        eid = (await store.enroll_endpoint(tok, "a0", "mqtt", KEY))["id"]  # type: ignore[index]
        svc = PlacementService(HubConfig(db_path=tmp_path / "hub.sqlite3"), store)
        await svc.start()
        now = _time.time()
        info = {"capacity": 2}
        await store.set_endpoint_state(eid, True, now, info)
        svc.endpoint_online(eid, now, info)
        svc.link_echo(eid, 0.04, 2.5, now, 0.3)
        svc.frame_received(eid, "heartbeat", 200, now + 2.5 - 0.02, now)  # the agent's stamp, 2.5 s ahead
        st = svc.state(uid)
        assert st["endpoints"] and st["endpoints"][0]["endpoint_id"] == eid
        e = st["endpoints"][0]
        assert e["link"]["offset_s"] == pytest.approx(2.5) and e["latency_s"] == pytest.approx(0.02)
        assert e["hub_lag_s"] == pytest.approx(0.3) and e["workers"] == 2
        assert "calibration" in e and svc.state("someone-else")["endpoints"] == []
        await svc.stop()
        await store.close()

    asyncio.run(main())
