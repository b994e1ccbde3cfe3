"""The online estimators behind :class:`scheduler.profiles.Profiles`.

Every estimator takes the current time explicitly (``now``); none reads a clock. Old samples
decay (by a half-life in time, or by count for per-pair statistics) and the effective sample
weight is capped so that a burst of thousands of completions cannot freeze an estimate. Every
class round-trips through plain dicts (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import math
from typing import Any

_LN2 = math.log(2.0)


def _decay(w: float, last: float, now: float, half_life: float, cap: float) -> float:
    """Factor to multiply decayed sums by before adding a sample of weight 1 at ``now``."""
    f = 1.0
    if now > last and half_life > 0:
        f = math.exp(-_LN2 * (now - last) / half_life)
    if w * f > cap - 1.0:
        f = (cap - 1.0) / w
    return f


class RuntimeStats:
    """Decayed mean/variance of a duration, robust to outliers, optionally linear in payload size.

    Why these choices: function runtimes are noisy and heavy-tailed (GC pauses, a page-in), so
    while the (decayed) estimate carries the weight of at least 5 samples each new sample is
    winsorised to mean +- ``clip_sd`` standard deviations before it is added; the floor on the standard deviation (5 % of the mean) keeps a constant
    function adaptable when it really changes. The linear term (least squares on payload bytes)
    is used only when payload sizes actually vary, with a non-negative slope.
    """

    __slots__ = (
        "half_life", "max_weight", "clip_sd",
        "w", "sx", "sy", "sxx", "sxy", "syy", "n", "last",
        "mean", "var", "slope", "intercept",
    )

    def __init__(self, half_life: float = 6 * 3600.0, max_weight: float = 64.0, clip_sd: float = 4.0) -> None:
        self.half_life = half_life
        self.max_weight = max_weight
        self.clip_sd = clip_sd
        self.w = self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
        self.n = 0
        self.last = 0.0
        self.mean = self.var = self.slope = self.intercept = 0.0

    def observe(self, y: float, now: float, x: float = 0.0) -> float:
        """Add one sample (``y`` seconds at payload ``x`` bytes); returns the value actually used."""
        w = self.w
        n = self.n + 1
        self.n = n
        if w > 0.0:
            last = self.last
            f = math.exp(-_LN2 * (now - last) / self.half_life) if now > last else 1.0
            if w * f > self.max_weight - 1.0:
                f = (self.max_weight - 1.0) / w
            if w * f >= 5.0:  # clip only against an estimate that still carries weight
                sd = self.var ** 0.5
                floor = 0.05 * self.mean
                if sd < floor:
                    sd = floor
                c = self.clip_sd * sd
                mid = self.intercept + self.slope * x
                if y > mid + c:
                    y = mid + c
                elif y < mid - c and mid - c > 0.0:
                    y = mid - c
            w = w * f + 1.0
            sy = self.sy * f + y
            syy = self.syy * f + y * y
            if x or self.sx:
                sx = self.sx * f + x
                sxx = self.sxx * f + x * x
                sxy = self.sxy * f + x * y
                self.sx, self.sxx, self.sxy = sx, sxx, sxy
            else:
                sx = 0.0
        else:
            w, sx, sy, syy = 1.0, x, y, y * y
            self.sx, self.sxx, self.sxy = x, x * x, x * y
        self.w, self.sy, self.syy = w, sy, syy
        if now > self.last:
            self.last = now
        if n & 7 and w >= 32.0:
            # Well established: refit the mean/variance/slope every 8th sample only (the sums
            # above take every sample; the fit lags by at most 7 of >= 32 weighted samples).
            return y
        my = sy / w
        var = syy / w - my * my
        if var < 0.0:
            var = 0.0
        self.mean = my
        self.var = var
        slope = 0.0
        if sx:
            mx = sx / w
            vx = self.sxx / w - mx * mx
            if n >= 4 and vx > 1e-4 * mx * mx + 1.0:
                slope = (self.sxy / w - mx * my) / vx
                # Keep the payload term only when it is clearly there (t > 2): with noisy
                # runtimes and no real dependence a fitted slope is just noise.
                if slope > 0.0:
                    res = var - slope * slope * vx
                    if slope * slope * w * vx <= 4.0 * (res if res > 0.0 else 0.0):
                        slope = 0.0
                else:
                    slope = 0.0
            self.intercept = my - slope * mx
        else:
            self.intercept = my
        self.slope = slope
        return y

    def reset(self) -> None:
        """Forget every sample (a stand-in sample is replaced by the first real one)."""
        self.__init__(self.half_life, self.max_weight, self.clip_sd)  # type: ignore[misc]

    def predict(self, x: float = 0.0) -> float:
        v = self.intercept + self.slope * x
        return v if v > 0.0 else 0.0

    @property
    def std(self) -> float:
        return self.var ** 0.5

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RuntimeStats":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            setattr(o, k, d[k])
        return o


class DecayedMean:
    """Time-decayed mean of a scalar (cold-start seconds, result bytes, ping RTT)."""

    __slots__ = ("half_life", "max_weight", "w", "s", "n", "last", "mean")

    def __init__(self, half_life: float = 6 * 3600.0, max_weight: float = 32.0) -> None:
        self.half_life = half_life
        self.max_weight = max_weight
        self.w = self.s = self.mean = 0.0
        self.n = 0
        self.last = 0.0

    def observe(self, y: float, now: float) -> None:
        w = self.w
        if w > 0.0:
            last = self.last
            f = math.exp(-_LN2 * (now - last) / self.half_life) if now > last else 1.0
            if w * f > self.max_weight - 1.0:
                f = (self.max_weight - 1.0) / w
            self.w = w = w * f + 1.0
            self.s = sm = self.s * f + y
        else:
            self.w, self.s = w, sm = 1.0, y
        if now > self.last:
            self.last = now
        self.n += 1
        self.mean = sm / w

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DecayedMean":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            setattr(o, k, d[k])
        return o


class PairStats:
    """One (function, endpoint) pair: its own runtime statistics and its deviation from the
    endpoint's hardware group.

    Both are exponentially weighted moving averages over the last ~``memory`` samples (weight
    ``max(1/n, 1/memory)`` per new sample: an exact mean while there are few, then a decaying
    one). A single pair sees few enough samples that decay by count is what matters; the pooled
    group estimate carries the time-based decay and the payload term.

    Runtime: mean and variance, each new sample winsorised to mean +- 4 standard deviations
    (floor 5 % of the mean) once there are 5 samples.

    Deviation: mean and variance of ``runtime / group prediction`` (a ratio of arithmetic
    means, not a mean of logs: with skewed noise the mean log ratio is biased low and would make
    every endpoint look a little fast). ``factor`` is that mean when, after at least 12 samples,
    it differs from 1 by more than ``threshold`` (practically relevant) and by more than 4
    standard errors. The strict z-value is deliberate: hundreds of endpoints are each re-tested
    after every sample, and at 2 standard errors a few of them would look "fast" by chance.
    Otherwise the factor is exactly 1.0, so that ordinary members of a group share one model
    (which also lets the placement search prune whole groups exactly). Hysteresis (back to 1.0
    below half the threshold) avoids flapping, and the stored factor only moves in steps above
    2 % so that the fleet re-indexes rarely.
    """

    __slots__ = ("memory", "n", "last", "mean", "var", "rn", "rmean", "rvar", "factor")

    def __init__(self, memory: float = 32.0) -> None:
        self.memory = memory
        self.n = 0
        self.last = 0.0
        self.mean = self.var = 0.0
        self.rn = 0
        self.rmean = 1.0
        self.rvar = 0.0
        self.factor = 1.0

    @property
    def std(self) -> float:
        return self.var ** 0.5

    def reset(self) -> None:
        """Forget every sample (a stand-in sample is replaced by the first real one)."""
        self.__init__(self.memory)  # type: ignore[misc]

    def observe(self, y: float, now: float, group_pred: float = 0.0, threshold: float = 0.15) -> bool:
        """Add one runtime; with a group prediction also a deviation sample. Returns True when
        ``factor`` changed."""
        n = self.n + 1
        self.n = n
        if now > self.last:
            self.last = now
        mem = self.memory
        a = 1.0 / n if n < mem else 1.0 / mem
        m = self.mean
        if n > 5:
            sd = self.var ** 0.5
            if sd < 0.05 * m:
                sd = 0.05 * m
            if y > m + 4.0 * sd:
                y = m + 4.0 * sd
            elif y < m - 4.0 * sd and m - 4.0 * sd > 0.0:
                y = m - 4.0 * sd
        d = y - m
        self.mean = m + a * d
        self.var = (1.0 - a) * (self.var + a * d * d)
        if group_pred <= 0.0 or y <= 0.0:
            return False

        ratio = y / group_pred
        if ratio > 20.0:
            ratio = 20.0
        elif ratio < 0.05:
            ratio = 0.05
        rn = self.rn + 1
        self.rn = rn
        a = 1.0 / rn if rn < mem else 1.0 / mem
        d = ratio - self.rmean
        self.rmean = rm = self.rmean + a * d
        self.rvar = rv = (1.0 - a) * (self.rvar + a * d * d)
        if rn < 12:
            return False
        se = (rv / (rn if rn < mem else mem)) ** 0.5
        dev = rm - 1.0 if rm > 1.0 else 1.0 - rm
        old = self.factor
        if old == 1.0:
            if dev >= threshold and dev > 4.0 * se:
                self.factor = rm
                return True
            return False
        if dev < threshold / 2.0:
            self.factor = 1.0
            return True
        if abs(rm / old - 1.0) > 0.02:
            self.factor = rm
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PairStats":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            setattr(o, k, d[k])
        return o


class LinkClock:
    """Round trips of one endpoint's link from echoed timestamps, and its clock offset.

    Each sample is a round trip with the peer's hold time taken out (``rtt``) and, where the
    peer's send stamp is known, the NTP offset of that exchange (``offset``: the peer's stamps
    minus our clock). Samples live in a window of the last ``max_age`` seconds (at most
    ``size`` of them):

    * ``latency`` is half the ``q``-quantile (10 %) of the window's round trips: a robust low
      percentile, so a burst of lag on either side (a busy hub event loop, a flood in the
      broker) moves it only if it fills nine tenths of the window, and it leaves with the window;
    * ``offset`` is the offset of the sample with the smallest round trip (NTP's clock filter:
      the fastest exchange bounds the error best, by half its round trip).
    """

    __slots__ = ("size", "max_age", "q", "samples", "n", "latency", "offset", "offset_rtt")

    def __init__(self, size: int = 128, max_age: float = 300.0, q: float = 0.1) -> None:
        self.size = size
        self.max_age = max_age
        self.q = q
        self.samples: list[tuple[float, float, float | None]] = []  # (at, rtt, offset)
        self.n = 0  # samples ever
        self.latency: float | None = None
        self.offset: float | None = None
        self.offset_rtt: float | None = None

    def observe(self, rtt: float, now: float, offset: float | None = None) -> None:
        if not (rtt >= 0.0 and rtt < 3600.0):
            return
        sm = self.samples
        sm.append((now, rtt, offset))
        self.n += 1
        cut = now - self.max_age
        drop = 0
        n = len(sm)
        while drop < n - 1 and (n - drop > self.size or sm[drop][0] < cut):
            drop += 1
        if drop:
            del sm[:drop]
        rtts = sorted(x[1] for x in sm)
        self.latency = rtts[int(self.q * (len(rtts) - 1))] / 2.0
        best = None
        for x in sm:
            if x[2] is not None and (best is None or x[1] < best[1]):
                best = x
        if best is not None:
            self.offset, self.offset_rtt = best[2], best[1]

    def to_report(self) -> dict[str, Any]:
        rtts = sorted(x[1] for x in self.samples)
        return {"samples": len(rtts), "samples_ever": self.n,
                "rtt_min_s": rtts[0] if rtts else None,
                "rtt_p10_s": rtts[int(self.q * (len(rtts) - 1))] if rtts else None,
                "rtt_median_s": rtts[len(rtts) // 2] if rtts else None,
                "latency_s": self.latency, "offset_s": self.offset, "offset_rtt_s": self.offset_rtt}

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinkClock":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            setattr(o, k, d[k])
        o.samples = [tuple(x) for x in o.samples]  # type: ignore[misc]
        return o


class LinkStats:
    """Link latency and bandwidth of one endpoint, from message timings.

    A message of ``nbytes`` taking ``seconds`` one way is modelled as
    ``seconds = latency + nbytes / bandwidth`` (decayed least squares, as Delta and UniFaaS fit
    transfer time on size). Pings (``observe_rtt``) pin the latency directly. Until the sizes
    seen vary enough to fit a slope, bandwidth comes from ``(seconds - latency) / nbytes`` of
    the larger messages, else the prior.

    Only a size term the timings really show is believed: the slope must stand out of the
    scatter (t > 3 against its standard error). Why: on a fast link small messages carry no size
    term worth measuring, and a slope fitted to their jitter can come out tiny, which read as
    gigabytes per second; extrapolated to a 32 MiB input, that made moving it look free and sent
    work away from its data (seen on loopback in the data-locality test). Where the timings
    cannot tell, the bandwidth stays what it was: the prior, or the last estimate that could.
    """

    __slots__ = ("half_life", "max_weight", "w", "sx", "sy", "sxx", "sxy", "syy", "n", "last",
                 "rtt", "latency", "bandwidth", "clock")

    def __init__(self, rtt: float = 0.1, bandwidth: float = 1e6, half_life: float = 3600.0,
                 max_weight: float = 64.0) -> None:
        self.half_life = half_life
        self.max_weight = max_weight
        self.w = self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0
        self.n = 0
        self.last = 0.0
        self.rtt = DecayedMean(half_life, 16.0)
        self.latency = rtt / 2.0
        self.bandwidth = bandwidth
        self.clock = LinkClock()

    def observe_rtt(self, rtt_s: float, now: float, offset_s: float | None = None) -> None:
        """A measured round trip (the peer's hold time taken out); with ``offset_s`` the NTP
        offset of that exchange. It pins the latency: half the window's low percentile."""
        self.rtt.observe(rtt_s, now)
        self.clock.observe(rtt_s, now, offset_s)
        self._fit()

    def observe(self, nbytes: float, seconds: float, now: float) -> None:
        if self.w > 0.0:
            f = _decay(self.w, self.last, now, self.half_life, self.max_weight)
            self.w = self.w * f + 1.0
            self.sx = self.sx * f + nbytes
            self.sy = self.sy * f + seconds
            self.sxx = self.sxx * f + nbytes * nbytes
            self.sxy = self.sxy * f + nbytes * seconds
            self.syy = self.syy * f + seconds * seconds
        else:
            self.w, self.sx, self.sy = 1.0, float(nbytes), float(seconds)
            self.sxx, self.sxy = float(nbytes) * nbytes, float(nbytes) * seconds
            self.syy = float(seconds) * seconds
        if now > self.last:
            self.last = now
        self.n += 1
        self._fit()

    def _fit(self) -> None:
        lat = self.clock.latency if self.clock.latency is not None else (self.rtt.mean / 2.0 if self.rtt.n else None)
        if self.w <= 0.0:
            if lat is not None:
                self.latency = lat
            return
        w = self.w
        mx, my = self.sx / w, self.sy / w
        vx = self.sxx / w - mx * mx
        vy = max(self.syy / w - my * my, 0.0)
        slope = None
        if self.n >= 3 and vx > 0.01 * mx * mx and vx > 1.0:
            slope = (self.sxy / w - mx * my) / vx
            # Residual scatter around the line, and the slope's standard error from it (w - 2
            # degrees of freedom: decayed weights count as samples).
            resid = max(vy - slope * slope * vx, 0.0)
            se = math.sqrt(resid / (vx * (w - 2.0))) if w > 2.0 else math.inf
            if slope <= 0.0 or slope <= 3.0 * se:
                slope = None
        if slope is not None:
            self.bandwidth = min(1.0 / slope, 1e11)
            fitted = my - slope * mx
            self.latency = lat if lat is not None else max(fitted, 0.0)
        else:
            if lat is None:
                # Sizes do not vary: split the mean time using the current bandwidth guess.
                lat = max(my - mx / self.bandwidth, 0.0) if mx else my
            self.latency = lat
            # The time above latency must stand out of the scatter too (t > 3), for the reason
            # in the class docstring.
            if mx > 1e4 and my - lat > 3.0 * math.sqrt(vy / w):
                self.bandwidth = min(mx / (my - lat), 1e11)

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("rtt", "clock")}
        d["rtt"] = self.rtt.to_dict()
        d["clock"] = self.clock.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LinkStats":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            if k not in ("rtt", "clock"):
                setattr(o, k, d[k] if k != "syy" else d.get(k, 0.0))  # saved before syy existed
        o.rtt = DecayedMean.from_dict(d["rtt"])
        o.clock = LinkClock.from_dict(d["clock"]) if "clock" in d else LinkClock()  # saved before echoes existed
        return o


class Throughput:
    """Completions per second of one endpoint while it has work.

    A moving average (over about ``memory`` completions) of the time between consecutive
    completions. Only gaps that began with work still outstanding count: a completion that
    left the endpoint idle (``busy=False``) starts no service interval, so the time until the
    next task arrived is idle time, not backlog work (issue 27: gaps of up to 5 min used to be
    averaged in, making an endpoint that idles between waves look slow). Gaps longer than
    ``idle_gap`` are skipped as well. ``rate`` is the inverse of the mean gap.
    """

    __slots__ = ("memory", "idle_gap", "n", "mean_dt", "last", "busy")

    def __init__(self, memory: float = 64.0, idle_gap: float = 300.0) -> None:
        self.memory = memory
        self.idle_gap = idle_gap
        self.n = 0
        self.mean_dt = 0.0
        self.last: float | None = None
        self.busy = True  # did the endpoint still have work after the last completion?

    def observe(self, now: float, busy: bool = True) -> None:
        """A completion at ``now``; ``busy``: the endpoint still has work after it."""
        last = self.last
        was_busy = self.busy
        self.last = now
        self.busy = busy
        if last is None or not was_busy:
            return
        dt = now - last
        if dt < 0.0 or dt > self.idle_gap:
            return
        n = self.n + 1
        self.n = n
        self.mean_dt += (dt - self.mean_dt) / (n if n < self.memory else self.memory)

    @property
    def rate(self) -> float | None:
        """Tasks per second, or None until measured."""
        if self.n < 2 or self.mean_dt <= 0.0:
            return None
        return 1.0 / self.mean_dt

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Throughput":
        o = cls.__new__(cls)
        for k in cls.__slots__:
            setattr(o, k, d.get(k, True) if k == "busy" else d[k])  # saved before "busy" existed
        return o


class TermError:
    """Prediction error of one term (run, queue wait, transfer out, total) on one endpoint:
    ``actual - predicted`` in seconds, as a moving mean and variance over about ``memory``
    completions, plus the mean absolute and mean relative error.

    Robust on purpose, because a correction built on it moves placement: once it has 5 samples,
    each new error is winsorised to mean +- 4 standard deviations (floor 10 ms), and each sample
    moves the mean by at most ``1/memory`` of that. ``bias`` is the mean error when it is
    consistently there (at least ``min_n`` samples and more than 3 standard errors from 0),
    else 0.
    """

    __slots__ = ("memory", "n", "mean", "var", "mae", "mre", "act")

    def __init__(self, memory: float = 32.0) -> None:
        self.memory = memory
        self.n = 0
        self.mean = self.var = self.mae = self.mre = self.act = 0.0

    def observe(self, predicted: float, actual: float) -> None:
        e = actual - predicted
        n = self.n + 1
        self.n = n
        m = self.mean
        if n > 5:
            sd = self.var ** 0.5
            if sd < 0.01:
                sd = 0.01
            if e > m + 4.0 * sd:
                e = m + 4.0 * sd
            elif e < m - 4.0 * sd:
                e = m - 4.0 * sd
        a = 1.0 / n if n < self.memory else 1.0 / self.memory
        d = e - m
        self.mean = m + a * d
        self.var = (1.0 - a) * (self.var + a * d * d)
        ae = e if e >= 0.0 else -e
        self.mae += a * (ae - self.mae)
        self.act += a * (actual - self.act)
        if actual > 0.0:
            self.mre += a * (ae / actual - self.mre)

    def bias(self, min_n: int = 8) -> float:
        n = self.n
        if n < min_n:
            return 0.0
        se = (self.var / (n if n < self.memory else self.memory)) ** 0.5
        m = self.mean
        return m if (m if m >= 0.0 else -m) > 3.0 * se else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean_error_s": self.mean, "sd_s": self.var ** 0.5, "mean_abs_error_s": self.mae,
                "mean_rel_error": self.mre, "mean_actual_s": self.act, "bias_s": self.bias()}
