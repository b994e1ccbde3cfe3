"""Timing of retries, pure logic. Reconnect backoff shared by the agent and the simulator's swarm
endpoints: 0.2 * 2^n s, at most 30 s, times a uniform 0.5-1.5 jitter, so a fleet that lost its
broker does not come back in lockstep. And the site gateway's re-send timeout (AckTimeout)."""

from __future__ import annotations

import random

__all__ = ["AckTimeout", "reconnect_delay"]


def reconnect_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect ``attempt`` (counting from 1 after the first failure)."""
    r = rng or random
    return min(30.0, 0.2 * 2 ** min(max(attempt, 0), 8)) * r.uniform(0.5, 1.5)


class AckTimeout:
    """How long a site gateway waits for the hub's result_ack before sending a held results frame
    again: TCP's retransmission timer (RFC 6298) on the ack delays it measures.

    Why: a fixed 10 s re-sent every results frame whose ack was slower than that, and on a
    congested satellite or LTE uplink (acks queued behind tasks frames) that was most of them:
    bytes the site pays for twice. Samples come only from frames sent once (Karn's rule: the ack of
    a re-sent frame cannot say which copy it answers), and each pass that had to re-send doubles
    the timeout until a fresh sample arrives."""

    def __init__(self, floor: float = 10.0, ceiling: float = 300.0) -> None:
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0
        self._backoff = 1.0

    def sample(self, delay: float) -> None:
        """An ack arrived ``delay`` seconds after its frame was first (and only) sent."""
        delay = max(0.0, delay)
        if self.srtt is None:
            self.srtt, self.rttvar = delay, delay / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - delay)
            self.srtt = 0.875 * self.srtt + 0.125 * delay
        self._backoff = 1.0

    def backoff(self) -> None:
        """Frames had to be sent again: wait longer next time (up to the ceiling)."""
        self._backoff = min(self._backoff * 2, 64.0)

    @property
    def timeout(self) -> float:
        base = self.floor if self.srtt is None else max(self.floor, self.srtt + 4 * self.rttvar)
        return min(self.ceiling, base * self._backoff)
