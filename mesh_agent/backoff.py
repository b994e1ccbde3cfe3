"""Timing of retries, pure logic: the one backoff and retry policy of the code base (issue 26).

Every loop that tries an operation again after it failed (the agent's reconnects and first-boot
enrollment, the SDK's submits, cancels and stream reconnects, the FL driver's and Flower grid's
hub calls, the PostgreSQL store's conflicting transactions, the hub's broker links) takes its
delays from a :class:`Backoff` and, where it simply calls something until it works, runs through
:func:`retry` (or :func:`aretry` on an event loop). Why one policy: fifteen loops that each did
their own delay arithmetic had drifted apart (jitter or not, exponent clamped or not, a final
sleep before giving up, one loop with no bound at all), and a bug fixed in one stayed in the rest.

The rules, once:

* delays grow geometrically from ``base`` by ``factor`` up to ``cap``, then are multiplied by a
  uniform draw from ``jitter`` (``(0.5, 1.5)`` by default, ``(0.0, 1.0)`` is "full jitter",
  ``(1.0, 1.0)`` none), so a fleet that lost its hub or broker does not come back in lockstep;
* every retry loop is bounded, in tries (``max_tries``) or in time (``deadline``, seconds from
  the first try) or both: :func:`retry` refuses a policy with neither. Loops that reconnect for a
  service's whole life (the agent, the hub's broker links, the SDK's result reader) take only
  their delays from a policy; a stop event or shut-down bounds them, not a count;
* a deadline is never overslept: the last wait is cut short to end at the deadline, one last try
  runs then, and no try starts after it. A wait the other side asked for (``Retry-After``,
  ``at_least``) is never cut short: when it does not fit before the deadline the loop ends at once;
* an error that is not retryable passes through at once; when the tries run out the last error is
  raised as it was (callers that owe their own error type wrap it).

No I/O here beyond the injected ``sleep``, and ``sleep``, ``clock`` and ``rng`` are parameters, so
the unit tests (tests/unit/test_backoff.py) run every schedule without waiting.

Also here: the agent's reconnect delay (:data:`RECONNECT`, :func:`reconnect_delay`, shared with
the simulator's swarm endpoints) and the site gateway's re-send timeout (:class:`AckTimeout`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from typing import Awaitable, Callable, Iterator, TypeVar, Union

__all__ = ["AckTimeout", "Attempts", "Backoff", "RECONNECT", "RetryOn", "aretry", "reconnect_delay", "retry"]

T = TypeVar("T")

#: What :func:`retry` retries: exception types, or a predicate for finer choices (a 5xx but not a 4xx).
RetryOn = Union[type[BaseException], tuple[type[BaseException], ...], Callable[[BaseException], bool]]


@dataclasses.dataclass(frozen=True)
class Backoff:
    """A retry policy: capped exponential delays with jitter, bounded in tries and/or time.

    ``delay(n)`` is the wait after the ``n + 1``-th failure: ``min(cap, base * factor ** n)`` times
    ``uniform(*jitter)`` (the jitter applies after the cap, as every loop here always did).
    ``max_tries`` counts tries, the first included (``max_tries=1``: no retry). ``deadline`` is in
    seconds from the first try. A policy is a frozen value: derive per-call variants with
    :meth:`replace` (``SUBMIT.replace(deadline=self.submit_timeout_s)``)."""

    base: float = 0.1
    cap: float = 5.0
    factor: float = 2.0
    jitter: tuple[float, float] = (0.5, 1.5)
    max_tries: int | None = None
    deadline: float | None = None

    def __post_init__(self) -> None:
        lo, hi = self.jitter
        if self.base < 0 or self.cap < 0 or self.factor < 1 or not 0 <= lo <= hi:
            raise ValueError(f"bad backoff: base and cap >= 0, factor >= 1, 0 <= jitter low <= high: {self!r}")
        if self.max_tries is not None and self.max_tries < 1:
            raise ValueError(f"bad backoff: max_tries must be at least 1: {self!r}")
        if self.deadline is not None and self.deadline < 0:
            raise ValueError(f"bad backoff: deadline must be >= 0: {self!r}")

    @property
    def bounded(self) -> bool:
        """Whether a loop under this policy ends by itself (tries or time)."""
        return self.max_tries is not None or self.deadline is not None

    def replace(self, **changes: object) -> "Backoff":
        """This policy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def nominal(self, n: int) -> float:
        """The ``n``-th delay before jitter: ``min(cap, base * factor ** max(n, 0))``."""
        n = max(n, 0)
        if self.factor > 1 and 0 < self.base < self.cap:
            # past this exponent the cap holds; clamping also keeps factor ** n finite for any n
            n = min(n, math.ceil(math.log(self.cap / self.base, self.factor)) + 1)
        else:
            n = 0  # constant delays (factor 1), or base already at or above the cap
        return min(self.cap, self.base * self.factor**n)

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        """The wait after the ``n + 1``-th failure (``n`` from 0), jitter included."""
        lo, hi = self.jitter
        d = self.nominal(n)
        return d * lo if lo == hi else d * (rng or random).uniform(lo, hi)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits between tries, in order: ``max_tries - 1`` of them, endless without
        ``max_tries``. The deadline needs a clock and is not applied here: :meth:`start` does."""
        n = 0
        while self.max_tries is None or n < self.max_tries - 1:
            yield self.delay(n, rng)
            n += 1

    def start(self, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> "Attempts":
        """A run of this policy, from now (``clock``): see :class:`Attempts`."""
        return Attempts(self, clock=clock, rng=rng)


class Attempts:
    """One run of a :class:`Backoff`: counts failures, keeps the deadline, and answers "how long
    until the next try, or is it time to give up".

    :func:`retry` is built on it; loops with more branches than "call until it works" use it
    directly (the SDK's submit: a 404 that re-sends function bodies at once, a 429 whose wait the
    hub set and which does not count against the budget: :meth:`pause`), as do reconnect loops
    that start over after a good connection (:meth:`reset`)."""

    def __init__(self, policy: Backoff, *, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng
        self.failures = 0
        self._started = clock()
        self._paused = 0.0

    def reset(self) -> None:
        """Start over: the operation worked (a reconnect loop's next outage begins at ``base``)."""
        self.failures, self._started, self._paused = 0, self._clock(), 0.0

    def pause(self, seconds: float) -> None:
        """``seconds`` spent waiting that do not count against the deadline (the other side was up
        and set the wait itself)."""
        self._paused += max(0.0, seconds)

    @property
    def elapsed(self) -> float:
        """Seconds counted against the deadline so far."""
        return self._clock() - self._started - self._paused

    @property
    def left(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        d = self.policy.deadline
        return None if d is None else d - self.elapsed

    def next_delay(self, at_least: float = 0.0) -> float | None:
        """Record a failure; the seconds to wait before the next try, or None to give up now (tries
        or time used up). ``at_least``: what the other side asked for (Retry-After): never cut
        short, so when it does not fit before the deadline this gives up instead."""
        self.failures += 1
        p = self.policy
        if p.max_tries is not None and self.failures >= p.max_tries:
            return None
        delay = max(at_least, p.delay(self.failures - 1, self._rng))
        left = self.left
        if left is not None:
            if left <= 0 or at_least > left:
                return None
            delay = min(delay, left)
        return delay


def _retryable(exc: BaseException, retry_on: RetryOn) -> bool:
    if isinstance(retry_on, (type, tuple)):
        return isinstance(exc, retry_on)
    return bool(retry_on(exc))


def _check(policy: Backoff) -> None:
    if not policy.bounded:
        raise ValueError(f"retry needs a bounded policy (max_tries or deadline): {policy!r}")


def retry(
    fn: Callable[[], T],
    *,
    retry_on: RetryOn,
    policy: Backoff,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    wait_hint: Callable[[BaseException], float | None] | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """``fn()``, tried again after each failure ``retry_on`` accepts, waiting as ``policy`` says.

    Returns ``fn``'s first result. An error ``retry_on`` does not accept is raised at once; when
    the policy's tries or time run out the last error is raised as it was. ``wait_hint(exc)``: the
    least wait that error asks for (a Retry-After), or None. ``on_retry(failures, exc, delay)`` runs
    before each wait (logging, counters). The policy must be bounded (ValueError otherwise)."""
    _check(policy)
    tries = policy.start(clock=clock, rng=rng)
    while True:  # bounded: next_delay ends it after max_tries or at the deadline
        try:
            return fn()
        except BaseException as exc:
            delay = _wait_after(exc, tries, retry_on, wait_hint, on_retry)
        sleep(delay)


async def aretry(
    fn: Callable[[], Awaitable[T]],
    *,
    retry_on: RetryOn,
    policy: Backoff,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    wait_hint: Callable[[BaseException], float | None] | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """:func:`retry` on an event loop: ``await fn()``, waiting with ``await sleep(delay)``. A
    cancellation is never retried (unless ``retry_on`` asks for it, which it should not)."""
    _check(policy)
    tries = policy.start(clock=clock, rng=rng)
    while True:  # bounded: next_delay ends it after max_tries or at the deadline
        try:
            return await fn()
        except BaseException as exc:
            delay = _wait_after(exc, tries, retry_on, wait_hint, on_retry)
        await sleep(delay)


def _wait_after(exc: BaseException, tries: "Attempts", retry_on: RetryOn,
                wait_hint: Callable[[BaseException], float | None] | None,
                on_retry: Callable[[int, BaseException, float], None] | None) -> float:
    """(Inside ``except``.) How long to wait before the next try of :func:`retry`/:func:`aretry`;
    re-raises ``exc`` when it is not retryable or the policy's tries or time ran out."""
    if not _retryable(exc, retry_on):
        raise exc
    delay = tries.next_delay((wait_hint(exc) or 0.0) if wait_hint is not None else 0.0)
    if delay is None:
        raise exc
    if on_retry is not None:
        on_retry(tries.failures, exc, delay)
    return delay


#: The agent's reconnect delays (also the simulator's swarm endpoints'): 0.2 * 2^n s, at most 30 s,
#: times a uniform 0.5-1.5 jitter, so a fleet that lost its broker does not come back in lockstep.
#: Unbounded on purpose: a device reconnects for as long as it runs (its stop event ends the loop).
RECONNECT = Backoff(base=0.2, cap=30.0, jitter=(0.5, 1.5))


def reconnect_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect ``attempt`` (counting from 1 after the first failure)."""
    return RECONNECT.delay(attempt, rng)


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
