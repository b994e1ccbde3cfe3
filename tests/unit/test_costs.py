"""The CPU ledger (mesh_agent/costs.py): exclusive nesting, block counts, misnesting, the disabled
no-op and the file that ``start`` writes. Each test gets a fresh ledger (module globals patched),
so it neither needs MESH_COST_LEDGER nor disturbs a process that has it set."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from mesh_agent import costs

MS = 1_000_000  # ns


def _burn(ms: float) -> None:
    """Spend ``ms`` of this thread's CPU (not wall time: a busy test machine changes nothing)."""
    end = time.thread_time_ns() + int(ms * MS)
    while time.thread_time_ns() < end:
        pass


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(costs, "enabled", True)
    monkeypatch.setattr(costs, "_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_totals", {})
    monkeypatch.setattr(costs, "_by_thread", {}, raising=False)
    monkeypatch.setattr(costs, "_started", False)
    monkeypatch.setattr(costs, "_local", threading.local())  # no stack left over from another test
    return tmp_path


def test_nested_stages_are_exclusive(ledger: Path) -> None:
    with costs.stage("outer"):
        _burn(20)
        with costs.stage("inner"):
            _burn(40)
        _burn(20)
    outer_blocks, outer_ns = costs._totals["outer"]
    inner_blocks, inner_ns = costs._totals["inner"]
    assert (outer_blocks, inner_blocks) == (1, 1)
    assert 40 * MS <= inner_ns < 55 * MS
    assert 40 * MS <= outer_ns < 55 * MS  # inclusive would be 80 ms
    assert "ledger.misnested" not in costs._totals
    assert costs._local.stack == []


def test_blocks_are_counted(ledger: Path) -> None:
    for _ in range(3):
        with costs.stage("a"):
            with costs.stage("b"):  # pausing "a" for "b" charges "a" time, never a block
                pass
    assert costs._totals["a"][0] == 3
    assert costs._totals["b"][0] == 3


def test_stacks_are_per_thread(ledger: Path) -> None:
    def work() -> None:
        with costs.stage("worker"):
            _burn(20)

    with costs.stage("main"):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert costs._totals["worker"][0] == 1 and costs._totals["worker"][1] >= 20 * MS
    assert costs._totals["main"][0] == 1 and costs._totals["main"][1] < 15 * MS  # the other thread's CPU is not ours
    assert "ledger.misnested" not in costs._totals


def test_misnested_exit_is_counted_and_stack_survives(ledger: Path) -> None:
    a, b = costs.stage("a"), costs.stage("b")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # "b" is on top: what "a" took cannot be told
    assert costs._totals["ledger.misnested"] == [1, 0]
    assert costs._totals.get("a", [0, 0])[0] == 0  # no block charged for the misnested one
    assert len(costs._local.stack) == 1  # "a" left it; "b" is still open
    b.__exit__(None, None, None)
    assert costs._totals["b"][0] == 1
    assert costs._local.stack == []
    with costs.stage("c"):  # the ledger works on as before
        pass
    assert costs._totals["c"][0] == 1
    assert costs._totals["ledger.misnested"] == [1, 0]


def test_stage_spanning_a_suspending_await_is_misnested(ledger: Path) -> None:
    async def step(name: str) -> None:
        with costs.stage(name):  # wrong on purpose: the loop runs the other task inside it
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(step("x"), step("y"))

    asyncio.run(main())
    assert costs._totals["ledger.misnested"][0] == 1  # "x" ended with "y" on top
    assert costs._totals["y"][0] == 1
    assert costs._local.stack == []


def test_stage_suspended_while_another_task_ran_is_set_apart(ledger: Path) -> None:
    async def main() -> None:
        go = asyncio.Event()

        async def slow() -> None:
            with costs.stage("slow"):  # wrong on purpose: it waits inside
                await go.wait()

        async def quick() -> None:
            with costs.stage("quick"):
                _burn(1)
            go.set()

        await asyncio.gather(slow(), quick())

    asyncio.run(main())
    assert costs._totals["quick"][0] == 1
    assert costs._totals["ledger.suspended:slow"][0] == 1  # not a figure for "slow"
    assert "slow" not in costs._totals
    assert "ledger.misnested" not in costs._totals


def test_disabled_is_a_shared_noop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(costs, "enabled", False)
    monkeypatch.setattr(costs, "_DIR", None)
    monkeypatch.setattr(costs, "_totals", {})
    monkeypatch.setattr(costs, "_started", False)
    s = costs.stage("a")
    assert s is costs.stage("b") is costs._NULL
    with s:
        with costs.stage("c"):
            _burn(1)
    assert costs._totals == {}
    costs.start("off")  # writes nothing, starts nothing
    assert costs._started is False
    assert list(tmp_path.iterdir()) == []


class _OneRound:
    """Stands in for ``costs.time`` in the writer: its first sleep parks the thread for good, so
    it writes once and never again (not into a later test's ledger, nor after this tmp_path)."""

    parked = threading.Event()

    @classmethod
    def sleep(cls, _s: float) -> None:
        cls.parked.set()
        threading.Event().wait()


def test_start_writes_the_ledger(ledger: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(costs, "time", _OneRound)
    with costs.stage("work"):
        _burn(5)
    writers = sum(1 for t in threading.enumerate() if t.name == "cost-ledger")
    costs.start("test")
    costs.start("test")  # once per process: one writer
    assert sum(1 for t in threading.enumerate() if t.name == "cost-ledger") == writers + 1
    path = ledger / f"test-{os.getpid()}.json"
    assert _OneRound.parked.wait(5.0)  # the writer wrote, then parked
    deadline = time.monotonic() + 5.0
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = json.loads(path.read_text())
    assert snap["role"] == "test" and snap["pid"] == os.getpid()
    blocks, ns = snap["stages"]["work"]
    assert blocks == 1 and ns >= 5 * MS
    assert isinstance(snap["threads"], dict) and snap["threads"]
    assert all(isinstance(v, float) for v in snap["threads"].values())
    assert "cost-ledger" in snap["threads"]
    assert snap["process_cpu_s"] > 0
    assert "children_cpu_s" in snap
    assert not list(ledger.glob("*.tmp"))  # written aside, then renamed into place


def test_garbage_collections_are_stages_of_their_own(ledger: Path) -> None:
    """A collection tripped inside a stage is charged to ``<role>.gc.genN``, not to that stage; the
    callback is removed again so other tests see no ledger."""
    import gc

    costs.start("gc-test")
    try:
        junk = [[i] for i in range(200_000)]  # something for a full collection to walk
        with costs.stage("allocating"):
            gc.collect()  # a full collection inside the stage, as one tripped by an allocation would be
        del junk
    finally:
        while costs._gc_stage in gc.callbacks:
            gc.callbacks.remove(costs._gc_stage)
    snap = costs.snapshot()
    assert snap["stages"]["gc-test.gc.gen2"][0] >= 1
    assert snap["stages"]["gc-test.gc.gen2"][1] > snap["stages"]["allocating"][1]  # the walk was charged to gc, not to the stage
