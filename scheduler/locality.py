"""Data locality: the transfer-time part of Delta's prediction, applied to a task's inputs.

Why: a task whose inputs are refs in one endpoint's local tier (cloud_hub.client.refs) finishes
sooner there, because elsewhere they must first be staged through the hub. Delta predicts
``transfer_in = latency + bytes / bandwidth``; here the bytes are the task's payload plus the
inputs *not already held by that endpoint*. So an endpoint holding the inputs wins unless its
queue or speed costs more than moving them; nothing is forced, and a task with no inputs is
placed exactly as before. Pure logic: no I/O.

``inputs`` are ``(endpoint_id, bytes)`` pairs: where each input lies and its size. An input in a
shared store (Redis, the hub's) is moved to every endpoint alike and is left out by the caller.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["moved_bytes", "transfer_s", "check_inputs", "MAX_INPUTS"]

MAX_INPUTS = 1024  # pairs per task: more is refused at the API, not silently truncated


def moved_bytes(inputs: Sequence[tuple[str, int]], endpoint_id: str) -> int:
    """Bytes of the task's inputs that ``endpoint_id`` does not hold."""
    return sum(n for ep, n in inputs if ep != endpoint_id)


def transfer_s(inputs: Sequence[tuple[str, int]], endpoint_id: str, bandwidth_bps: float) -> float:
    """Seconds to bring the inputs ``endpoint_id`` lacks over a link of ``bandwidth_bps`` bytes/s."""
    moved = moved_bytes(inputs, endpoint_id)
    if moved == 0:
        return 0.0
    return moved / bandwidth_bps if bandwidth_bps > 0 else float("inf")


def check_inputs(inputs: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The normalised pairs, or ValueError naming what is wrong (the API answers 422 with it)."""
    out: list[tuple[str, int]] = []
    for i, pair in enumerate(inputs):
        if i >= MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per task")
        try:
            ep, n = pair
        except (TypeError, ValueError):
            raise ValueError(f"input {i} is not an (endpoint_id, bytes) pair: {pair!r}") from None
        if not isinstance(ep, str) or not ep:
            raise ValueError(f"input {i}: endpoint_id must be a non-empty string, not {ep!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"input {i}: bytes must be an integer >= 0, not {n!r}")
        out.append((ep, n))
    return tuple(out)
