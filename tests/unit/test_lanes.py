"""Per-endpoint frame lanes (cloud_hub/lanes.py): different endpoints run concurrently, each
endpoint's frames strictly in arrival order, a failing frame does not stop its lane, and the
number of queued frames is bounded. Real asyncio, no clocks: every wait is on an event."""

from __future__ import annotations

import asyncio
import random

import pytest

from cloud_hub.lanes import Lanes


async def test_each_endpoints_frames_run_in_order_while_endpoints_interleave() -> None:
    lanes = Lanes(max_running=64)
    rng = random.Random(7)
    seen: dict[str, list[int]] = {}
    running = peak = 0

    def job(key: str, i: int, yields: int):
        async def run() -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            for _ in range(yields):  # a handler that awaits the store a few times
                await asyncio.sleep(0)
            seen.setdefault(key, []).append(i)
            running -= 1
        return run

    keys = [f"ep-{k}" for k in range(40)]
    for i in range(25):
        for key in rng.sample(keys, len(keys)):
            await lanes.submit(key, job(key, i, rng.randint(0, 6)))
    assert await lanes.drain(30)
    assert all(seen[k] == list(range(25)) for k in keys), "a lane ran its frames out of order"
    assert peak > 1, "no two endpoints were ever handled at the same time"
    assert lanes.queued == 0 and lanes.stats["frames"] == 40 * 25


async def test_a_slow_frame_holds_up_only_its_own_endpoint() -> None:
    lanes = Lanes()
    release = asyncio.Event()
    order: list[str] = []

    async def slow_hello() -> None:
        await release.wait()
        order.append("a-hello")

    async def a_ack() -> None:
        order.append("a-ack")

    async def b_ack() -> None:
        order.append("b-ack")
        release.set()  # only possible if b ran while a's hello was still waiting

    await lanes.submit("a", slow_hello)
    await lanes.submit("a", a_ack)
    await lanes.submit("b", b_ack)
    assert await lanes.drain(30), "endpoint b waited behind endpoint a's hello"
    assert order == ["b-ack", "a-hello", "a-ack"]


async def test_a_failing_frame_does_not_stop_its_lane() -> None:
    lanes = Lanes()
    done: list[int] = []

    async def bad() -> None:
        raise RuntimeError("malformed")

    async def good() -> None:
        done.append(1)

    await lanes.submit("a", bad)
    await lanes.submit("a", good)
    assert await lanes.drain(30)
    assert done == [1] and lanes.stats["failed"] == 1


async def test_queued_frames_are_bounded_submit_waits_for_room() -> None:
    lanes = Lanes(max_queued=3)
    gate = asyncio.Event()

    async def blocked() -> None:
        await gate.wait()

    for k in "abc":
        await lanes.submit(k, blocked)
    fourth = asyncio.create_task(lanes.submit("d", blocked))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not fourth.done() and lanes.queued == 3, "a fourth frame was queued past the bound"
    gate.set()
    await asyncio.wait_for(fourth, 30)
    assert await lanes.drain(30) and lanes.queued == 0


async def test_close_cancels_what_is_left_and_refuses_more() -> None:
    lanes = Lanes()
    never = asyncio.Event()

    async def stuck() -> None:
        await never.wait()

    await lanes.submit("a", stuck)
    await lanes.submit("a", stuck)
    await lanes.close(timeout=0.05)
    assert lanes.queued == 0
    ran: list[int] = []

    async def later() -> None:
        ran.append(1)

    await lanes.submit("b", later)
    assert await lanes.drain(1) and ran == []


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Lanes(max_running=0)
