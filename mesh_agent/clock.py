"""The agent's estimate of the hub's clock, learned from hello/welcome round trips.

Frames are checked for freshness against the hub's clock, and a Pi after a power cut has no RTC,
so the agent learns an offset from each signed welcome: ``hub_time - (hello sent + welcome
received) / 2``, exact to within half the round trip. A welcome can arrive very late, though:
one queued in the broker for the agent's persistent session while its link was down, or a hello
that waited in the broker while the hub was restarting. From a 70 s round trip the offset can be
35 s wrong, past the 30 s freshness window, and then every frame after it is refused on one side
or the other while the link looks healthy (found by ``mesh-sim run``: 121 tasks stuck at one agent).

So, as NTP does, a slow sample never replaces a better one, and it asks for a new measurement.
Pure logic: the caller passes the times.
"""

from __future__ import annotations

import math
import time

__all__ = ["HubClock", "GOOD_RTT_S"]

#: A round trip up to this long gives an offset within half of it: well inside the 30 s window.
GOOD_RTT_S = 10.0


class HubClock:
    def __init__(self) -> None:
        self.offset = 0.0  # hub clock minus ours
        self.rtt = math.inf  # round trip of the sample behind ``offset``

    def now(self) -> float:
        return time.time() + self.offset

    def sample(self, sent: float, received: float, hub_time: float, hold: float = 0.0) -> bool:
        """Learn from a welcome (``sent``: when its hello left, ``received``: when it arrived, both
        on our clock; ``hold``: how long the hub held the hello before stamping ``hub_time``, its
        database work). NTP: the hub read the hello at ``hub_time - hold``, so the offset is
        ``((T2 - T1) + (T3 - T4)) / 2`` and the link's round trip excludes the hold. Returns True
        when the sample was too slow to trust: measure again."""
        hold = min(max(hold, 0.0), max(0.0, received - sent))
        rtt = max(0.0, received - sent - hold)
        if rtt <= GOOD_RTT_S or rtt <= self.rtt:
            self.offset = hub_time - hold / 2 - (sent + received) / 2
            self.rtt = rtt
        return rtt > GOOD_RTT_S
