"""Reconnect backoff shared by the agent and the simulator's swarm endpoints: 0.2 * 2^n s, at most
30 s, times a uniform 0.5-1.5 jitter, so a fleet that lost its broker does not come back in lockstep."""

from __future__ import annotations

import random

__all__ = ["reconnect_delay"]


def reconnect_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect ``attempt`` (counting from 1 after the first failure)."""
    r = rng or random
    return min(30.0, 0.2 * 2 ** min(max(attempt, 0), 8)) * r.uniform(0.5, 1.5)
