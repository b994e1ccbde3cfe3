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
from typing import Any, Callable

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

    def normal_silence(self, now: float, last_seen: float, *, min_outages: int = 3, quantile: float = 0.9) -> float:
        """Seconds of silence after ``last_seen`` that this endpoint's history calls normal, on top
        of the liveness bound its heartbeats keep (the hub's alert rule adds the two).

        Why: an operator wants to hear about a device that went quiet *unexpectedly*, not about the
        solar Pi that sleeps every night. Two patterns count as normal:

        * a scheduled outage: if the silence reaches a recurring offline stretch of the day, the
          whole stretch (from ``last_seen`` to its end);
        * random outages: the ``quantile`` of the random outage durations seen, once at least
          ``min_outages`` were seen (fewer say nothing about what is normal: 0).
        """
        allowance = 0.0
        t_off, _share = self._first_scheduled(last_seen, max(now, last_seen))
        if t_off is not None:
            allowance = max(self._stretch_end(t_off) - last_seen, 0.0)
        rnd = sorted(self._random_durations)
        if len(rnd) >= min_outages:
            q = rnd[min(len(rnd) - 1, int(math.ceil(quantile * len(rnd))) - 1)]
            allowance = max(allowance, q)
        return allowance

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


# ---------------------------------------------------------------------- sites (docs/sites.md)
#: A device lost within this many seconds of its gateway (either order) went with the uplink.
UPLINK_GRACE_S = 30.0


class BehindGateway:
    """Availability of a device behind a site gateway: its own model (power, LAN) and its site's
    uplink (the gateway's session with the hub), kept apart.

    Why: when a village's uplink drops, every device behind it goes silent at the hub, but they
    keep working on what the hub leased ahead to their gateway. Fed into one model, those outages
    would make every device look as flaky as the uplink, and the scheduler would shy away from
    devices that were working all along. So the device's model learns only its own outages, the
    uplink's model the uplink's, and the questions combine them:

    * work **already at the gateway** (leased ahead) waits only for the device
      (:meth:`expected_delay` with ``held=True``, :meth:`can_take_held_work`);
    * **new** work waits for the uplink to come back to get to the site, then for the device,
      and its result waits at the gateway while the uplink is down.

    Same query interface as :class:`Availability` (what the scheduler's predictor asks), so the
    fleet can hold either.
    """

    __slots__ = ("device", "uplink")

    def __init__(self, device: Availability, uplink: Availability) -> None:
        self.device, self.uplink = device, uplink

    @property
    def online(self) -> bool | None:
        """The device's own state (not the uplink's)."""
        return self.device.online

    @property
    def known(self) -> bool:
        return self.device.known

    def reachable(self) -> bool:
        """New work from the hub can reach the device now."""
        return self.device.online is not False and self.uplink.online is not False

    def can_take_held_work(self) -> bool:
        """Work already at the gateway can run now (the uplink does not matter)."""
        return self.device.online is not False

    def state(self) -> str:
        """``online``, ``site-only`` (the uplink is down: the device works on what its gateway
        holds) or ``offline`` (the device itself is down, as far as anyone knows)."""
        if self.device.online is False:
            return "offline"
        return "site-only" if self.uplink.online is False else "online"

    def share_online(self, now: float) -> float:
        """Share of time new work could reach the device (both up, taken as independent)."""
        return self.device.share_online(now) * self.uplink.share_online(now)

    def p_offline(self, now: float, end: float) -> float:
        """Probability that the device cannot be reached from the hub at some point in ``[now, end]``."""
        pd, pu = self.device.p_offline(now, end), self.uplink.p_offline(now, end)
        return 1.0 - (1.0 - pd) * (1.0 - pu)

    def _result_wait(self, now: float, done_at: float) -> float:
        """Expected seconds a result finished at ``done_at`` waits at the gateway for the uplink."""
        up = self.uplink
        if up.online is False:
            back = now + up.time_until_back(now)
            if done_at < back:
                return back - done_at
        mu, md = up.mean_uptime(), up.mean_outage()
        return md / (mu + md) * md if mu + md > 0 else 0.0  # down at that moment, then the rest of a mean outage

    def expected_delay(self, now: float, start: float, duration: float, held: bool = False) -> float:
        """Expected extra seconds outages add to a task queued from ``now`` running ``[start,
        start + duration]`` on the device, until its result is at the hub. ``held``: the task is
        already at the gateway (the uplink matters only for the result's way back)."""
        d_in = 0.0
        if not held and self.uplink.online is False:
            d_in = self.uplink.time_until_back(now)
        d_dev = self.device.expected_delay(now + d_in, start + d_in, duration)
        return d_in + d_dev + self._result_wait(now, start + d_in + d_dev + duration)


class SiteOutages:
    """Routes what the hub observes about gateways and their devices to the right model.

    The hub sees a device go silent both when the device dies and when its site's uplink drops.
    A device lost within ``grace`` seconds of its gateway's loss (in either order: the hub's
    watchdog notices them in any order) is an uplink outage, and the device's own model is not
    told; one lost while its gateway stays up is the device's. Until the gateway's fate is known
    the device's loss is held back (``pending``). Pure: every time is an argument.
    """

    def __init__(self, model: Callable[[str], Availability], grace: float = UPLINK_GRACE_S) -> None:
        self._model = model  # endpoint id -> Availability (created on first use)
        self.grace = float(grace)
        self.gateway_of: dict[str, str] = {}
        self._pending: dict[str, tuple[float, float]] = {}  # device -> (now, since) of a loss not yet attributed
        self._gw_lost: dict[str, float] = {}  # gateway -> last seen before its current outage

    def set_gateway(self, device: str, gateway: str | None) -> None:
        if gateway is None or gateway == device:
            self.gateway_of.pop(device, None)
        else:
            self.gateway_of[device] = gateway

    def devices_of(self, gateway: str) -> list[str]:
        return sorted(d for d, g in self.gateway_of.items() if g == gateway)

    def view(self, endpoint: str) -> "Availability | BehindGateway":
        gw = self.gateway_of.get(endpoint)
        return self._model(endpoint) if gw is None else BehindGateway(self._model(endpoint), self._model(gw))

    def heartbeat(self, endpoint: str, now: float) -> bool:
        """Heard from ``endpoint``; True if it was believed offline (by the hub: its own model or the uplink)."""
        pend = self._pending.pop(endpoint, None)
        if pend is not None:  # lost while its uplink stayed up, back now: that was the device's own outage
            self._model(endpoint).mark_offline(pend[0], pend[1])
        self._gw_lost.pop(endpoint, None)
        back = self._model(endpoint).heartbeat(now)
        return back or pend is not None

    def mark_offline(self, endpoint: str, now: float, since: float | None = None) -> bool:
        """The hub's watchdog lost ``endpoint`` at ``now`` (last seen ``since``)."""
        model = self._model(endpoint)
        since = model.last_seen if since is None and model.last_seen is not None else (now if since is None else since)
        if self.devices_of(endpoint):  # a gateway: its uplink
            self._gw_lost[endpoint] = since
            for d in self.devices_of(endpoint):  # devices already lost with it: the uplink's outage
                p = self._pending.get(d)
                if p is not None and abs(p[1] - since) <= self.grace:
                    del self._pending[d]
            return model.mark_offline(now, since)
        gw = self.gateway_of.get(endpoint)
        if gw is None:
            return model.mark_offline(now, since)
        if self._model(gw).online is False:
            return False  # the uplink is down: the hub cannot tell anything about the device; its own model is not told
        if model.online is False or endpoint in self._pending:
            return False
        self._pending[endpoint] = (now, since)  # the uplink looks up: the device's, unless the gateway follows within grace
        return True

    def settle(self, now: float) -> None:
        """Pending device losses whose gateway stayed up for ``grace`` after them are the devices' own."""
        for d, (t, since) in list(self._pending.items()):
            gw = self.gateway_of.get(d)
            up = self._model(gw) if gw else None
            if now - since > self.grace and (up is None or up.online is not False):
                del self._pending[d]
                self._model(d).mark_offline(t, since)

    def pending(self) -> list[str]:
        return sorted(self._pending)
