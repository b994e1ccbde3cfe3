"""Availability model of one endpoint, learned from its heartbeat history.

Why: rural devices go away in two distinct ways, and a scheduler that plans around outages has
to tell them apart.

* Random outages (a flaky LTE link, a brown-out) look like an on/off Markov process: the
  chance of an outage in a window grows with its length (``1 - exp(-T / mean_up)``) and the
  time until the endpoint is back is drawn from the outage durations seen before.
* Scheduled outages (a solar-powered Pi that sleeps every night, a lab machine switched off at
  22:00) recur at the same time of day. A 24-bin time-of-day profile of the share of time
  spent offline captures them: a bin offline on most days (share >= 0.6) is "scheduled".

The hub feeds ``heartbeat(now)`` whenever it hears from the endpoint and ``mark_offline(now,
since)`` when its watchdog declares it dead (silent since ``since``, the last heartbeat). Short
blips below the watchdog timeout are invisible to the hub and therefore to this model; they
only delay work a little. All times are explicit arguments; nothing reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

_LN2 = math.log(2.0)
# A time-of-day bin offline more than this share of the observed days is a recurring
# (scheduled) outage. Above one half so that a single long outage seen over two days is not
# mistaken for a schedule.
SCHEDULED_SHARE = 0.6


class Availability:
    __slots__ = (
        "period", "nbins", "half_life", "prior_up", "prior_down",
        "online", "since", "last_seen", "last_decay",
        "up_total", "down_total", "n_outages", "outages",
        "bin_off", "bin_obs", "_sched", "_mean_up", "_e_down", "_random_durations",
    )

    def __init__(
        self,
        period: float = 86400.0,
        nbins: int = 24,
        half_life: float = 3 * 86400.0,
        prior_up: float = 6 * 3600.0,
        prior_down: float = 600.0,
    ) -> None:
        self.period = period
        self.nbins = nbins
        self.half_life = half_life
        self.prior_up = prior_up  # one pseudo up-spell: a device never seen failing is not immortal
        self.prior_down = prior_down
        self.online: bool | None = None  # None: never heard of
        self.since = 0.0  # start of the current spell
        self.last_seen: float | None = None
        self.last_decay = 0.0
        self.up_total = 0.0
        self.down_total = 0.0
        self.n_outages = 0.0  # decayed count
        self.outages: deque[tuple[float, float]] = deque(maxlen=64)  # (start, duration)
        self.bin_off = [0.0] * nbins
        self.bin_obs = [0.0] * nbins
        self._refresh()

    # ------------------------------------------------------------------ observations
    def heartbeat(self, now: float) -> bool:
        """Heard from the endpoint at ``now``. Returns True if it was offline (it is back)."""
        if self.last_seen is None or now > self.last_seen:
            self.last_seen = now
        if self.online is None:
            self.online, self.since, self.last_decay = True, now, now
            return False
        if self.online:
            return False
        start = self.since
        dur = max(now - start, 0.0)
        self._decay(now)
        self.down_total += dur
        self.n_outages += 1.0
        self.outages.append((start, dur))
        self._add_bins(start, now, offline=True)
        self.online, self.since = True, now
        self._refresh()
        return True

    def mark_offline(self, now: float, since: float | None = None) -> bool:
        """The watchdog declared the endpoint dead at ``now``; it was last seen at ``since``.

        Returns True if it was believed online until now.
        """
        if since is None:
            since = self.last_seen if self.last_seen is not None else now
        since = min(since, now)
        if self.online is None:
            self.online, self.since, self.last_decay = False, since, since
            self._refresh()
            return False
        if not self.online:
            return False
        since = max(since, self.since)
        self._decay(now)
        self.up_total += since - self.since
        self._add_bins(self.since, since, offline=False)
        self.online, self.since = False, since
        self._refresh()
        return True

    def _decay(self, now: float) -> None:
        dt = now - self.last_decay
        if dt <= 0.0:
            return
        f = math.exp(-_LN2 * dt / self.half_life)
        self.up_total *= f
        self.down_total *= f
        self.n_outages *= f
        self.bin_off = [v * f for v in self.bin_off]
        self.bin_obs = [v * f for v in self.bin_obs]
        self.last_decay = now

    def _add_bins(self, a: float, b: float, offline: bool) -> None:
        if b <= a:
            return
        blen = self.period / self.nbins
        span = b - a
        full = int(span // self.period)
        if full:  # whole periods cover every bin equally
            for i in range(self.nbins):
                self.bin_obs[i] += full * blen
                if offline:
                    self.bin_off[i] += full * blen
            a += full * self.period
        t = a
        while t < b:
            i = int((t % self.period) // blen)
            end = min(b, t - (t % blen) + blen)
            self.bin_obs[i] += end - t
            if offline:
                self.bin_off[i] += end - t
            t = end

    def _refresh(self) -> None:
        """Recompute the cached model parameters (only transitions change them)."""
        blen = self.period / self.nbins
        sched: list[float] = []
        enough = sum(self.bin_obs) >= 1.5 * self.period
        for off, obs in zip(self.bin_off, self.bin_obs):
            share = off / obs if enough and obs >= 0.5 * blen else 0.0
            sched.append(share if share >= SCHEDULED_SHARE else 0.0)
        self._sched = sched
        self._mean_up = (self.up_total + self.prior_up) / (self.n_outages + 1.0)
        rnd = [d for s, d in self.outages if not self._scheduled_at(s)]
        self._random_durations = rnd
        self._e_down = sum(rnd) / len(rnd) if rnd else self.prior_down

    def _scheduled_at(self, t: float) -> float:
        blen = self.period / self.nbins
        return self._sched[int((t % self.period) // blen)]

    # ------------------------------------------------------------------ queries
    @property
    def known(self) -> bool:
        return self.online is not None

    def share_online(self, now: float) -> float:
        """Share of observed time the endpoint was online (the current spell included)."""
        up, down = self.up_total, self.down_total
        if self.online:
            up += max(now - self.since, 0.0)
        elif self.online is False:
            down += max(now - self.since, 0.0)
        tot = up + down
        return up / tot if tot > 0 else 1.0

    def mean_uptime(self) -> float:
        """Mean length of an online spell (with one pseudo-spell of ``prior_up`` as prior)."""
        return self._mean_up

    def mean_outage(self) -> float:
        """Mean length of a random (not time-of-day scheduled) outage."""
        return self._e_down

    def scheduled_profile(self) -> list[float]:
        """Per time-of-day bin: share offline where it marks a recurring outage, else 0."""
        return list(self._sched)

    def _stretch_end(self, t: float) -> float:
        """End of the run of scheduled bins that contains ``t`` (``t`` if not in one)."""
        blen = self.period / self.nbins
        end = t
        for _ in range(self.nbins):
            if self._sched[int((end % self.period) // blen)] <= 0.0:
                break
            end = end - (end % blen) + blen
        return end

    def time_until_back(self, now: float) -> float:
        """Expected seconds until an offline endpoint is back (0 when online or unknown)."""
        if self.online is not False:
            return 0.0
        if self._sched[int((now % self.period) // (self.period / self.nbins))] > 0.0:
            return max(self._stretch_end(now) - now, 0.0)
        d = now - self.since
        longer = [x - d for x in self._random_durations if x > d]
        if longer:
            return sum(longer) / len(longer)
        return max(self._e_down, d)  # offline longer than ever seen: expect as long again

    def p_offline(self, now: float, end: float) -> float:
        """Probability that the endpoint is offline at some point in ``[now, end]``."""
        if self.online is False:
            return 1.0
        if end <= now:
            return 0.0
        p = -math.expm1(-(end - now) / self._mean_up)
        first, share = self._first_scheduled(now, end)
        return share if share > p else p

    def _first_scheduled(self, a: float, b: float) -> tuple[float | None, float]:
        """First time in ``[a, b]`` that falls in a scheduled bin, and that bin's share."""
        sched = self._sched
        if not any(sched):
            return None, 0.0
        blen = self.period / self.nbins
        t = a
        for _ in range(self.nbins + 1):
            if t > b:
                break
            s = sched[int((t % self.period) // blen)]
            if s > 0.0:
                return t, s
            t = t - (t % blen) + blen
        return None, 0.0

    def expected_delay(self, now: float, start: float, duration: float) -> float:
        """Expected extra seconds outages add to a task queued from ``now``, running
        ``[start, start + duration]``.

        Semantics match the agent: while offline nothing progresses, and a task running when
        the device goes down is re-run from the start when it is back (its durable inbox still
        holds it), so an outage during the run also costs the work done so far.
        """
        delay = 0.0
        if self.online is False:
            delay = self.time_until_back(now)
            now += delay
            start += delay
        end = start + duration
        if end <= now:
            return delay
        p_window = -math.expm1(-(end - now) / self._mean_up)
        p_run = -math.expm1(-duration / self._mean_up) if duration > 0 else 0.0
        d_markov = p_window * self._e_down + p_run * 0.5 * duration
        t_off, share = self._first_scheduled(now, end)
        d_sched = 0.0
        if t_off is not None:
            lost = min(max(t_off - start, 0.0), duration)
            d_sched = share * (self._stretch_end(t_off) - t_off + lost)
        return delay + (d_sched if d_sched > d_markov else d_markov)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "nbins": self.nbins,
            "half_life": self.half_life,
            "prior_up": self.prior_up,
            "prior_down": self.prior_down,
            "online": self.online,
            "since": self.since,
            "last_seen": self.last_seen,
            "last_decay": self.last_decay,
            "up_total": self.up_total,
            "down_total": self.down_total,
            "n_outages": self.n_outages,
            "outages": [list(o) for o in self.outages],
            "bin_off": list(self.bin_off),
            "bin_obs": list(self.bin_obs),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Availability":
        a = cls(d["period"], d["nbins"], d["half_life"], d["prior_up"], d["prior_down"])
        a.online = d["online"]
        a.since = d["since"]
        a.last_seen = d["last_seen"]
        a.last_decay = d["last_decay"]
        a.up_total = d["up_total"]
        a.down_total = d["down_total"]
        a.n_outages = d["n_outages"]
        a.outages = deque((tuple(o) for o in d["outages"]), maxlen=64)
        a.bin_off = list(d["bin_off"])
        a.bin_obs = list(d["bin_obs"])
        a._refresh()
        return a
