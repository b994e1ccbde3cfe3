"""The swarm endpoint's protocol logic (sans-IO) against the real envelope code, without a broker:
it must answer as the agent does and refuse what the agent refuses."""

from __future__ import annotations

import random

from mesh_agent.protocol import Envelope, Kind, ReplayGuard, decode, encode, open_frame
from sim.swarm.core import NOOP_RESULT, Counters, Creds, SwarmEndpoint, reconnect_delay

KEY = bytes(range(32))
EP = "ep-0123456789ab"


def _ep(**kw: object) -> SwarmEndpoint:
    return SwarmEndpoint(Creds(EP, KEY, "mqtt"), Counters(), ReplayGuard(), **kw)  # type: ignore[arg-type]


def _hub(kind: Kind, body: dict, **kw: object) -> bytes:
    return encode(Envelope(kind, EP, body, **kw), KEY)  # type: ignore[arg-type]


def _up(frame: bytes) -> Envelope:
    return decode(frame, KEY, check_fresh=False)


def _welcomed(ep: SwarmEndpoint) -> list[bytes]:
    hello = _up(ep.connected()[0])
    assert hello.kind is Kind.HELLO and hello.body["capacity"] == ep.capacity
    return ep.on_frame(_hub(Kind.WELCOME, {"reply_to": hello.body["nonce"], "hub_time": 1e9}, id=hello.body["nonce"]))


def test_welcome_answering_our_hello_starts_a_session_and_fetches() -> None:
    ep = _ep(capacity=2, prefetch=6)
    out = _welcomed(ep)
    assert ep.welcomed and [_up(f).kind for f in out] == [Kind.FETCH] and _up(out[0]).body == {"want": 8}
    # the learned offset puts our stamps on the hub's clock (1e9 here), not ours
    assert abs(_up(out[0]).ts - 1e9) < 60


def test_welcome_for_a_hello_we_never_sent_is_refused() -> None:
    ep = _ep()
    ep.connected()
    assert ep.on_frame(_hub(Kind.WELCOME, {"reply_to": "abababababababab", "hub_time": 1e9}, id="abababababababab")) == []
    assert not ep.welcomed and ep.counters.rejected == 1


def test_tasks_are_acked_answered_with_the_noop_result_and_deduplicated() -> None:
    ep = _ep()
    _welcomed(ep)
    tasks = {"tasks": [{"id": "t1", "fn": "f" * 64, "args": b"json\n[[],{}]"}, {"id": "t2", "fn": "f" * 64, "args": b"x"}], "functions": {}}
    out = [_up(f) for f in ep.on_frame(_hub(Kind.TASKS, tasks, ts=ep.now()))]
    assert [e.kind for e in out] == [Kind.ACK, Kind.RESULTS, Kind.FETCH]
    assert out[0].body["ids"] == ["t1", "t2"]
    assert [(r["id"], r["ok"], r["data"]) for r in out[1].body["results"]] == [("t1", True, NOOP_RESULT), ("t2", True, NOOP_RESULT)]
    # the same tasks again (a re-sent batch): acked again, not run again
    again = [_up(f) for f in ep.on_frame(_hub(Kind.TASKS, tasks, ts=ep.now()))]
    assert [e.kind for e in again][:1] == [Kind.ACK] and Kind.RESULTS not in [e.kind for e in again]
    assert ep.counters.tasks == 2 and ep.counters.duplicates == 2
    # results stay in "have" until the hub acks them, then go
    assert set(_up(ep.hello()).body["have"]) == {"t1", "t2"}
    ep.on_frame(_hub(Kind.RESULT_ACK, {"ids": ["t1", "t2"]}, ts=ep.now()))
    assert ep.unacked == {}


def test_forged_stale_and_replayed_frames_are_dropped_without_reply() -> None:
    ep = _ep()
    _welcomed(ep)
    tasks = {"tasks": [{"id": "t9", "fn": "f" * 64, "args": b"x"}], "functions": {}}
    forged = encode(Envelope(Kind.TASKS, EP, tasks, ts=ep.now()), b"\x01" * 32)
    stale = _hub(Kind.TASKS, tasks, ts=ep.now() - 1000, exp=ep.now() - 500)
    reflected = _hub(Kind.FETCH, {"want": 1}, ts=ep.now())
    good = _hub(Kind.TASKS, tasks, ts=ep.now())
    assert ep.on_frame(forged) == [] and ep.on_frame(stale) == [] and ep.on_frame(reflected) == []
    assert ep.on_frame(good) and ep.on_frame(good) == []  # the second is a replay
    assert ep.counters.rejected == 4 and ep.counters.tasks == 1


def test_hello_required_brings_a_new_hello_and_heartbeats_go_out_without_a_session() -> None:
    ep = _ep()
    # As the agent: it beats from the start of the connection; a beat the hub cannot place brings
    # hello_required (below), which is how an unanswered hello is said again (no timer).
    early = [_up(f) for f in ep.heartbeat()]
    assert [e.kind for e in early] == [Kind.HEARTBEAT]
    _welcomed(ep)
    beat = _up(ep.heartbeat()[0])
    assert beat.kind is Kind.HEARTBEAT and beat.body["want"] == ep.full
    ep.nonces.clear()
    out = ep.on_frame(_hub(Kind.ERROR, {"code": "hello_required", "message": "no session; say hello"}, ts=ep.now()))
    assert [open_frame(f, KEY).kind for f in out] == [Kind.HELLO] and not ep.welcomed


def test_reconnect_delay_is_the_agents_backoff_with_jitter() -> None:
    rng = random.Random(1)
    for attempt, base in ((1, 0.4), (3, 1.6), (8, 30.0), (50, 30.0)):
        for _ in range(50):
            d = reconnect_delay(attempt, rng)
            assert base * 0.5 <= d <= base * 1.5
    # jitter: a fleet does not come back in lockstep
    assert len({round(reconnect_delay(4, rng), 6) for _ in range(20)}) > 15


def test_creds_round_trip_through_json() -> None:
    c = Creds(EP, KEY, "zmq", zmq_address="tcp://127.0.0.1:1", zmq_server_key="k" * 40, curve_public="p" * 40, curve_secret="s" * 40)
    assert Creds.from_json(c.to_json()) == c


def test_a_late_welcome_brings_one_hello_as_the_agent_does_and_keeps_the_better_clock() -> None:
    now = [1000.0]
    ep = _ep(clock=lambda: now[0])
    hello = _up(ep.connected()[0])
    now[0] += 0.2  # a quick welcome: trusted
    ep.on_frame(_hub(Kind.WELCOME, {"reply_to": hello.body["nonce"], "hub_time": 2000.0}, id=hello.body["nonce"]))
    good = ep.offset
    hello2 = _up(ep.hello())
    now[0] += 25.0  # the next one waited 25 s in a queue: too slow to trust (mesh_agent/clock.py, GOOD_RTT_S)
    out = ep.on_frame(_hub(Kind.WELCOME, {"reply_to": hello2.body["nonce"], "hub_time": 9999.0}, id=hello2.body["nonce"]))
    assert [_up(f).kind for f in out] == [Kind.FETCH, Kind.HELLO]  # measure the hub's clock again
    assert ep.offset == good and ep.welcomed
