"""The one retry policy (mesh_agent/backoff.py: Backoff, Attempts, retry, aretry): pure logic.

Every test runs on a fake clock that only the fake sleep moves, so nothing here really waits.
AckTimeout has its own module (test_ack_timeout.py)."""

from __future__ import annotations

import random

import pytest

from mesh_agent.backoff import RECONNECT, Attempts, Backoff, aretry, reconnect_delay, retry


class FakeTime:
    """A monotonic clock that moves only when something sleeps (sync or async)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


class Flaky:
    """Fails with ``errors`` in turn, then returns ``value``; counts its calls."""

    def __init__(self, *errors: BaseException, value: str = "ok") -> None:
        self.errors, self.value, self.calls = list(errors), value, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value

    async def acall(self) -> str:
        return self()


NO_JITTER = (1.0, 1.0)


# ---------------------------------------------------------------------- the schedule


def test_delays_grow_by_the_factor_and_stop_at_the_cap() -> None:
    p = Backoff(base=0.1, cap=2.0, factor=2.0, jitter=NO_JITTER)
    assert [p.delay(n) for n in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert p.delay(10_000) == 2.0, "a huge exponent neither overflows nor passes the cap"
    assert p.delay(-3) == pytest.approx(0.1), "before the first failure counts as the first"
    assert Backoff(base=0.5, cap=0.5, factor=1.0, jitter=NO_JITTER).delay(40) == 0.5  # constant
    assert Backoff(base=0.0, cap=1.0, jitter=NO_JITTER).delay(5) == 0.0
    assert Backoff(base=3.0, cap=1.0, jitter=NO_JITTER).delay(0) == 1.0, "the cap holds from the start"


def test_jitter_stays_in_its_bounds_and_spreads() -> None:
    rng = random.Random(7)
    for lo, hi in ((0.5, 1.5), (0.0, 1.0), (0.5, 1.0), (1.0, 1.25)):
        p = Backoff(base=0.2, cap=5.0, jitter=(lo, hi))
        for n in range(12):
            for _ in range(50):
                d = p.delay(n, rng)
                assert p.nominal(n) * lo <= d <= p.nominal(n) * hi
    p = Backoff(base=1.0, cap=1.0, jitter=(0.5, 1.5))
    assert len({round(p.delay(0, rng), 9) for _ in range(30)}) > 25, "a fleet does not come back in lockstep"
    assert len({Backoff(base=1.0, cap=1.0, jitter=NO_JITTER).delay(0) for _ in range(10)}) == 1


def test_the_iterator_of_delays_is_bounded_by_max_tries() -> None:
    p = Backoff(base=1.0, cap=4.0, jitter=NO_JITTER, max_tries=5)
    assert list(p.delays()) == [1.0, 2.0, 4.0, 4.0], "five tries, four waits between them"
    assert list(Backoff(max_tries=1).delays()) == []
    endless = Backoff(base=1.0, cap=1.0, jitter=NO_JITTER).delays()
    assert [next(endless) for _ in range(100)] == [1.0] * 100, "no max_tries: the caller's stop bounds it"


def test_bad_policies_are_refused() -> None:
    for kw in ({"base": -1.0}, {"cap": -1.0}, {"factor": 0.5}, {"jitter": (1.5, 0.5)}, {"jitter": (-0.1, 1.0)},
               {"max_tries": 0}, {"deadline": -1.0}):
        with pytest.raises(ValueError):
            Backoff(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Backoff().replace(max_tries=0)
    assert Backoff(base=1.0).replace(deadline=3.0) == Backoff(base=1.0, deadline=3.0)


def test_the_agents_reconnect_delay_is_the_reconnect_policy() -> None:
    # 0.2 * 2^n s, at most 30 s, times 0.5-1.5 (the formula before the helper existed)
    for attempt in range(0, 40):
        nominal = min(30.0, 0.2 * 2 ** min(attempt, 8))
        assert RECONNECT.nominal(attempt) == pytest.approx(nominal)
        rng = random.Random(attempt)
        assert reconnect_delay(attempt, rng) == pytest.approx(nominal * random.Random(attempt).uniform(0.5, 1.5))
    assert not RECONNECT.bounded, "an agent reconnects for as long as it runs"


# ---------------------------------------------------------------------- retry()


def test_retry_returns_the_first_success_and_waits_the_policy_between_tries() -> None:
    t, fn = FakeTime(), Flaky(OSError("a"), OSError("b"), OSError("c"))
    seen: list[tuple[int, str, float]] = []
    p = Backoff(base=0.1, cap=0.3, jitter=NO_JITTER, max_tries=10)
    out = retry(fn, retry_on=OSError, policy=p, sleep=t.sleep, clock=t.clock, on_retry=lambda n, e, d: seen.append((n, str(e), d)))
    assert out == "ok" and fn.calls == 4
    assert t.slept == pytest.approx([0.1, 0.2, 0.3])
    assert [(n, e) for n, e, _ in seen] == [(1, "a"), (2, "b"), (3, "c")]
    assert [d for _, _, d in seen] == pytest.approx(t.slept), "on_retry hears the wait that follows"


def test_max_tries_ends_the_loop_and_reraises_the_last_error() -> None:
    t, fn = FakeTime(), Flaky(*(TimeoutError(f"#{i}") for i in range(10)))
    with pytest.raises(TimeoutError, match="#2") as info:
        retry(fn, retry_on=(TimeoutError, ConnectionError), policy=Backoff(base=1.0, jitter=NO_JITTER, max_tries=3), sleep=t.sleep, clock=t.clock)
    assert fn.calls == 3 and len(t.slept) == 2, "no wait after the last try"
    assert info.value.__traceback__ is not None


def test_the_deadline_ends_the_loop_without_oversleeping_it() -> None:
    t, fn = FakeTime(), Flaky(*(ConnectionError(f"#{i}") for i in range(100)))
    p = Backoff(base=1.0, cap=4.0, jitter=NO_JITTER, deadline=10.0)
    start = t.now
    with pytest.raises(ConnectionError):
        retry(fn, retry_on=ConnectionError, policy=p, sleep=t.sleep, clock=t.clock)
    # waits 1, 2, 4, then 3 (cut to end at the deadline), one last try there, none after it
    assert t.slept == pytest.approx([1.0, 2.0, 4.0, 3.0])
    assert t.now - start == pytest.approx(10.0) and fn.calls == 5
    zero = Flaky(ConnectionError("down"))
    with pytest.raises(ConnectionError):
        retry(zero, retry_on=ConnectionError, policy=Backoff(deadline=0.0), sleep=t.sleep, clock=t.clock)
    assert zero.calls == 1, "deadline 0: one try"


def test_the_tries_own_time_counts_against_the_deadline() -> None:
    t = FakeTime()

    def slow() -> str:
        t.now += 4.0  # each try takes 4 s
        raise ConnectionError("slow")

    with pytest.raises(ConnectionError):
        retry(slow, retry_on=ConnectionError, policy=Backoff(base=1.0, cap=1.0, jitter=NO_JITTER, deadline=10.0), sleep=t.sleep, clock=t.clock)
    assert t.slept == [1.0, 1.0] and t.now - 1000.0 == pytest.approx(14.0), "no try starts after the deadline"


def test_a_non_retryable_error_passes_through_at_once() -> None:
    t, fn = FakeTime(), Flaky(ValueError("refused"), value="never")
    with pytest.raises(ValueError, match="refused"):
        retry(fn, retry_on=OSError, policy=Backoff(max_tries=5), sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1 and t.slept == []
    # a predicate decides finer: a 5xx is retried, a 4xx is not
    class Status(Exception):
        def __init__(self, code: int) -> None:
            super().__init__(code)
            self.code = code

    fn = Flaky(Status(503), Status(404))
    with pytest.raises(Status) as info:
        retry(fn, retry_on=lambda e: isinstance(e, Status) and e.code >= 500, policy=Backoff(max_tries=5), sleep=t.sleep, clock=t.clock)
    assert info.value.code == 404 and fn.calls == 2 and len(t.slept) == 1
    with pytest.raises(KeyboardInterrupt):  # never swallowed by a broad retry_on
        retry(Flaky(KeyboardInterrupt()), retry_on=Exception, policy=Backoff(max_tries=5), sleep=t.sleep, clock=t.clock)


def test_a_wait_the_other_side_asked_for_is_kept_or_ends_the_loop() -> None:
    class Busy(Exception):
        def __init__(self, after: float) -> None:
            super().__init__(after)
            self.after = after

    t = FakeTime()
    p = Backoff(base=0.1, cap=0.1, jitter=NO_JITTER, deadline=10.0)
    fn = Flaky(Busy(3.0), Busy(0.0))
    assert retry(fn, retry_on=Busy, policy=p, sleep=t.sleep, clock=t.clock, wait_hint=lambda e: getattr(e, "after", None)) == "ok"
    assert t.slept == pytest.approx([3.0, 0.1]), "at least the Retry-After, else the policy"
    t2, late = FakeTime(), Flaky(Busy(1.0), Busy(20.0))
    with pytest.raises(Busy):
        retry(late, retry_on=Busy, policy=p, sleep=t2.sleep, clock=t2.clock, wait_hint=lambda e: getattr(e, "after", None))
    assert t2.slept == [1.0] and late.calls == 2, "a Retry-After past the deadline is not cut short: give up now"


def test_retry_refuses_an_unbounded_policy() -> None:
    with pytest.raises(ValueError, match="bounded"):
        retry(lambda: "x", retry_on=OSError, policy=Backoff())


# ---------------------------------------------------------------------- Attempts (loops with more branches)


def test_attempts_pause_and_reset() -> None:
    t = FakeTime()
    a = Attempts(Backoff(base=1.0, cap=8.0, jitter=NO_JITTER, deadline=5.0), clock=t.clock)
    assert a.next_delay() == 1.0 and a.failures == 1
    t.sleep(1.0)
    t.sleep(30.0)
    a.pause(30.0)  # a 429's wait, set by the hub: not counted
    assert a.elapsed == pytest.approx(1.0) and a.left == pytest.approx(4.0)
    assert a.next_delay() == 2.0
    t.sleep(2.0)
    assert a.next_delay() == pytest.approx(2.0), "4 s, cut to the 2 s left"
    t.sleep(2.0)
    assert a.next_delay() is None, "deadline reached"
    a.reset()
    assert a.failures == 0 and a.next_delay() == 1.0, "after a good connection the next outage starts at base"
    assert Attempts(Backoff(), clock=t.clock).left is None


# ---------------------------------------------------------------------- aretry()


async def test_aretry_retries_and_gives_up_like_retry() -> None:
    t, fn = FakeTime(), Flaky(OSError("a"), OSError("b"))
    p = Backoff(base=0.5, cap=1.0, jitter=NO_JITTER, max_tries=5)
    assert await aretry(fn.acall, retry_on=OSError, policy=p, sleep=t.asleep, clock=t.clock) == "ok"
    assert fn.calls == 3 and t.slept == [0.5, 1.0]

    t, fn = FakeTime(), Flaky(*(OSError(f"#{i}") for i in range(9)))
    with pytest.raises(OSError, match="#3"):
        await aretry(fn.acall, retry_on=OSError, policy=p.replace(max_tries=4), sleep=t.asleep, clock=t.clock)
    assert fn.calls == 4 and len(t.slept) == 3

    t, fn = FakeTime(), Flaky(*(OSError("down") for _ in range(99)))
    with pytest.raises(OSError):
        await aretry(fn.acall, retry_on=OSError, policy=Backoff(base=1.0, cap=1.0, jitter=NO_JITTER, deadline=2.5), sleep=t.asleep, clock=t.clock)
    assert t.slept == pytest.approx([1.0, 1.0, 0.5])

    t, fn = FakeTime(), Flaky(ValueError("no"))
    with pytest.raises(ValueError):
        await aretry(fn.acall, retry_on=OSError, policy=p, sleep=t.asleep, clock=t.clock)
    assert fn.calls == 1 and t.slept == []


async def test_aretry_never_retries_a_cancellation() -> None:
    import asyncio

    t, fn = FakeTime(), Flaky(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await aretry(fn.acall, retry_on=Exception, policy=Backoff(max_tries=5), sleep=t.asleep, clock=t.clock)
    assert fn.calls == 1
