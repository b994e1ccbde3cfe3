"""The protocol side of one swarm endpoint, without any I/O (sans-IO): frames in, frames out.

Why separate: the harness packs thousands of endpoints into one asyncio process, so an endpoint
must cost a few KB and no task of its own per message; and the protocol logic is then testable
on its own (tests/unit/test_swarm_core.py) against the real envelope code, without a broker.

What it speaks is the agent's protocol (docs/protocol.md), trimmed to what a load test needs:
hello (capacity, prefetch, the ids whose results are not yet acked as ``have``), welcome (nonce
check before parsing, clock offset), fetch (credit as the agent computes it), tasks (freshness,
replay, de-duplication by task id), ack, results, result_ack, heartbeats, and ``hello_required``.
Frames are built and checked with ``mesh_agent.protocol`` (encode/open_frame/ReplayGuard), the
same code the agent and hub run. Tasks are *not* executed: each gets the result a no-op returns
(``serialize(None)``), inline, so the load is on the hub and the broker, not on workers. The
task's code is never deserialized (a load harness has no business unpickling anything).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from mesh_agent.backoff import reconnect_delay  # the agent's own formula, re-exported for the workers
from mesh_agent.clock import GOOD_RTT_S
from mesh_agent.protocol import DOWN_KINDS, Envelope, Kind, ProtocolError, ReplayGuard, check_freshness, encode, open_frame, serialize

__all__ = ["Creds", "SwarmEndpoint", "reconnect_delay", "NOOP_RESULT"]

#: What ``lambda: None`` returns, as the agent would send it.
NOOP_RESULT = serialize(None)
_SEEN_MAX = 4096  # task ids remembered per endpoint for de-duplication (bounded memory)
_RESEND_AFTER_S = 10.0  # as the agent: re-send results unacked this long


@dataclass(frozen=True)
class Creds:
    """What bulk enrollment returned for one endpoint (``POST /v1/endpoints/enroll-batch``)."""

    endpoint_id: str
    key: bytes
    transport: str
    mqtt_host: str | None = None
    mqtt_port: int | None = None
    mqtt_prefix: str = "mesh"
    mqtt_username: str | None = None
    mqtt_password: str | None = None
    zmq_address: str | None = None
    zmq_server_key: str | None = None
    curve_public: str | None = None
    curve_secret: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["key"] = self.key.hex()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Creds":
        return cls(**{**d, "key": bytes.fromhex(d["key"])})

    @classmethod
    def from_enrollment(cls, out: dict[str, Any], curve: tuple[str, str] | None = None) -> "Creds":
        mqtt = out.get("mqtt") or {}
        return cls(endpoint_id=out["endpoint_id"], key=bytes.fromhex(out["key"]), transport=out["transport"],
                   mqtt_host=mqtt.get("host"), mqtt_port=mqtt.get("port"), mqtt_prefix=mqtt.get("topic_prefix") or "mesh",
                   mqtt_username=mqtt.get("username"), mqtt_password=mqtt.get("password"), zmq_address=out.get("zmq_address"),
                   zmq_server_key=out.get("zmq_server_key"), curve_public=curve[0] if curve else None, curve_secret=curve[1] if curve else None)


@dataclass
class Counters:
    """Per process, summed over its endpoints; the harness reads them as JSON lines."""

    frames_out: int = 0
    frames_in: int = 0
    hellos: int = 0
    heartbeats: int = 0
    tasks: int = 0
    duplicates: int = 0
    rejected: int = 0
    hello_required: int = 0


@dataclass
class SwarmEndpoint:
    """One light endpoint's protocol state. Methods return the frames to send, in order."""

    creds: Creds
    counters: Counters
    replay: ReplayGuard
    capacity: int = 1
    prefetch: int = 16
    clock: Callable[[], float] = time.time
    offset: float = 0.0
    rtt: float = math.inf  # round trip of the welcome behind ``offset`` (as mesh_agent.clock.HubClock)
    welcomed: bool = False
    conn_gen: int = 0  # connections made so far: "reconnected after the broker restart" = a welcome on a newer one
    welcomed_gen: int = -1
    nonces: dict[str, float] = field(default_factory=dict)
    granted: int = 0
    received: int = 0
    seen: deque[str] = field(default_factory=lambda: deque(maxlen=_SEEN_MAX))
    seen_set: set[str] = field(default_factory=set)
    unacked: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)  # task id -> (sent at, result)

    @property
    def endpoint_id(self) -> str:
        return self.creds.endpoint_id

    def now(self) -> float:
        """The hub's clock as this endpoint estimates it (learned from the welcome)."""
        return self.clock() + self.offset

    def _frame(self, kind: Kind, body: dict[str, Any], **kw: Any) -> bytes:
        self.counters.frames_out += 1
        return encode(Envelope(kind, self.endpoint_id, body, ts=self.now(), **kw), self.creds.key)

    # ------------------------------------------------------------------ session
    def connected(self) -> list[bytes]:
        """A new connection: forget the session, say hello."""
        self.conn_gen += 1
        self.welcomed = False
        return [self.hello()]

    def hello(self) -> bytes:
        nonce = os.urandom(8).hex()
        self.nonces[nonce] = self.clock()
        while len(self.nonces) > 8:
            self.nonces.pop(next(iter(self.nonces)))
        self.counters.hellos += 1
        return self._frame(Kind.HELLO, {"nonce": nonce, "capacity": self.capacity, "prefetch": self.prefetch, "have": list(self.unacked),
                                        "engine": "swarm", "host": "swarm", "version": "swarm", "pid": os.getpid()})

    @property
    def full(self) -> int:
        return self.capacity + self.prefetch

    def _fetch(self) -> bytes:
        self.granted, self.received = self.full, 0
        return self._frame(Kind.FETCH, {"want": self.full})

    def heartbeat(self) -> list[bytes]:
        """A ``lan``-profile beat (every heartbeat_s, welcomed or not, as the agent's beat loop
        runs from the start of the connection), plus results unacked for too long (only in a
        session). A beat the hub cannot place in a session is answered ``hello_required``: that,
        not a timer, is how an agent whose hello went unanswered says hello again."""
        self.counters.heartbeats += 1
        out = [self._frame(Kind.HEARTBEAT, {"capacity": self.capacity, "running": 0, "queued": 0, "stored": 0, "outbox": len(self.unacked),
                                            "want": self.full})]
        if not self.welcomed:
            return out
        t = self.clock()
        stale = [r for sent, r in self.unacked.values() if t - sent > _RESEND_AFTER_S]
        if stale:
            out.append(self._results(stale))
        return out

    def _results(self, results: list[dict[str, Any]]) -> bytes:
        t = self.clock()
        for r in results:
            self.unacked[r["id"]] = (t, r)
        return self._frame(Kind.RESULTS, {"results": results})

    # ------------------------------------------------------------------ incoming
    def on_frame(self, frame: bytes) -> list[bytes]:
        """Check a frame from the hub as the agent does (header and MAC, direction, welcome nonce
        or freshness and replay) before its body is parsed, then answer it. A refused frame is
        counted and dropped, with no reply."""
        self.counters.frames_in += 1
        try:
            sealed = open_frame(frame, self.creds.key)
            if sealed.endpoint != self.endpoint_id:
                raise ProtocolError(f"frame addressed to {sealed.endpoint}")
            if sealed.kind not in DOWN_KINDS:
                raise ProtocolError(f"a {sealed.kind.value} frame cannot come from the hub")
            if sealed.kind is Kind.WELCOME:
                if sealed.id not in self.nonces:
                    raise ProtocolError("welcome does not answer a hello of ours")
            else:
                now = self.now()
                check_freshness(sealed, now=now)
                self.replay.check(sealed, now=now)
            env = sealed.open()
        except ProtocolError:
            self.counters.rejected += 1
            return []
        body = env.body
        if env.kind is Kind.WELCOME:
            t = self.clock()
            sent = self.nonces.get(body["reply_to"], t)
            self.nonces.clear()
            rtt = max(0.0, t - sent)
            if rtt <= GOOD_RTT_S or rtt <= self.rtt:  # as HubClock.sample: a slow sample never replaces a better one
                self.offset, self.rtt = float(body["hub_time"]) - (sent + t) / 2, rtt
            self.welcomed, self.welcomed_gen = True, self.conn_gen
            out = [self._fetch()]
            if self.unacked:  # as the agent: every unacked result again after a welcome
                out.append(self._results([r for _, r in self.unacked.values()]))
            if rtt > GOOD_RTT_S:  # as the agent: that welcome waited somewhere; measure the hub's clock again
                out.append(self.hello())
            return out
        if env.kind is Kind.TASKS:
            return self._on_tasks(body["tasks"])
        if env.kind is Kind.RESULT_ACK:
            for tid in body["ids"]:
                self.unacked.pop(tid, None)
            return []
        if env.kind is Kind.ERROR and body.get("code") == "hello_required":
            self.counters.hello_required += 1
            if self.clock() - max(self.nonces.values(), default=0.0) > 1.0:  # one hello a second while frames bounce
                self.welcomed = False
                return [self.hello()]
        return []

    def _on_tasks(self, tasks: list[dict[str, Any]]) -> list[bytes]:
        ids = [t["id"] for t in tasks]
        self.received += len(tasks)
        fresh = []
        for tid in ids:
            if tid in self.seen_set:
                self.counters.duplicates += 1
                continue
            if len(self.seen) == self.seen.maxlen:
                self.seen_set.discard(self.seen[0])
            self.seen.append(tid)
            self.seen_set.add(tid)
            fresh.append(tid)
        out = [self._frame(Kind.ACK, {"ids": ids})]
        if fresh:
            t = self.now()
            self.counters.tasks += len(fresh)
            out.append(self._results([{"id": tid, "ok": True, "data": NOOP_RESULT, "started": t, "finished": t, "pid": 0} for tid in fresh]))
        # The agent's rule (mesh_agent/agent.py, _maybe_fetch): ask again when the gap matters or
        # nothing runs; inline execution means nothing ever runs, so after every batch.
        if self.full - max(0, self.granted - self.received) > 0:
            out.append(self._fetch())
        return out
