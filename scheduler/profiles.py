"""``Profiles``: everything the scheduler learns from observations, keyed by plain ids.

The estimators themselves live in :mod:`scheduler.estimators` (re-exported here). Every
estimator takes the current time explicitly (``now``); none reads a clock, so the hub and the
discrete-event simulator drive the very same code. Old samples decay (the world changes: a
device throttles, a link degrades) and the effective sample weight is capped so that a burst of
thousands of completions cannot freeze an estimate. Everything round-trips through plain dicts
(``to_dict``/``from_dict``) so that the hub can persist profiles across restarts.

Runtime model (see docs/scheduler.md): for function ``f`` on endpoint ``e`` of hardware group
``h`` the runtime is ``R(f, h, bytes) * s(f, e)`` where ``R`` is the group's pooled estimate
(optionally linear in payload size) and ``s`` is the endpoint's own deviation from its group,
1.0 unless its samples show a deviation that is both statistically clear and larger than
``deviation_threshold`` (15 % by default). Pooling gives tight estimates from few runs per
endpoint, and an endpoint that really differs (a thermally throttled Pi) still gets its own.
The raw per-(function, endpoint) runtime statistics are kept as well (for the console and the
fastest-endpoint baseline).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from .availability import Availability, BehindGateway, SiteOutages
from .estimators import DecayedMean, LinkStats, PairStats, RuntimeStats, Throughput

__all__ = ["Profiles", "RuntimeStats", "PairStats", "DecayedMean", "LinkStats", "Throughput"]


class Profiles:
    """Everything learned about functions and endpoints, keyed by plain ids.

    Feed it with ``observe_completion``, ``observe_transfer``/``observe_rtt``, ``heartbeat``
    and ``mark_offline``; ask it with ``runtime``/``cold_start``/``link``/``availability``.
    Endpoints must be registered (``register_endpoint``) so that their hardware group and
    speed hint are known; :class:`scheduler.fleet.Fleet` does that for you.
    """

    def __init__(
        self,
        *,
        half_life_s: float = 6 * 3600.0,
        max_weight: float = 64.0,
        group_max_weight: float = 256.0,
        deviation_threshold: float = 0.15,
        default_runtime_s: float = 1.0,
        default_cold_start_s: float = 2.0,
        default_rtt_s: float = 0.1,
        default_bandwidth_bps: float = 1e6,
        availability_period_s: float = 86400.0,
    ) -> None:
        self.half_life_s = half_life_s
        self.max_weight = max_weight
        # A hardware group pools the samples of all its members, so it can afford a longer
        # memory (tighter estimate) than a single (function, endpoint) pair.
        self.group_max_weight = group_max_weight
        self.deviation_threshold = deviation_threshold
        self.default_runtime_s = default_runtime_s
        self.default_cold_start_s = default_cold_start_s
        self.default_rtt_s = default_rtt_s
        self.default_bandwidth_bps = default_bandwidth_bps
        self.availability_period_s = availability_period_s
        # per uplink and per device (docs/sites.md): a site's uplink outage is not its devices'
        self.sites = SiteOutages(self.availability)
        self.hardware: dict[str, str] = {}  # endpoint -> hardware group
        self.speed: dict[str, float] = {}  # endpoint -> relative CPU score hint
        self.pair: dict[tuple[str, str], PairStats] = {}  # (function, endpoint)
        self.group: dict[tuple[str, str], RuntimeStats] = {}  # (function, hardware)
        self.work: dict[str, RuntimeStats] = {}  # function -> runtime x speed (speed-normalised)
        self.cold_pair: dict[tuple[str, str], DecayedMean] = {}
        self.cold_group: dict[tuple[str, str], DecayedMean] = {}
        self.cold_hw: dict[str, DecayedMean] = {}
        self.result_size: dict[str, DecayedMean] = {}
        self.links: dict[str, LinkStats] = {}
        self.hw_bandwidth: dict[str, DecayedMean] = {}  # hardware -> mean measured bandwidth
        self._refs: dict[tuple[str, str], tuple] = {}  # (function, endpoint) -> estimators
        # Bumped whenever a new group runtime or cold-start estimate appears, so that callers
        # may cache references to the estimator objects themselves.
        self.structure_version = 0
        self.throughput: dict[str, Throughput] = {}
        self.avail: dict[str, Availability] = {}
        # Cross-hardware runtime priors (issue 27): which functions each hardware group has run
        # and which groups ran each function; estimates derived from them are cached until the
        # next completion (``_obs``), i.e. once per placement batch.
        self.fns_of_hw: dict[str, dict[str, None]] = {}
        self.hws_of_fn: dict[str, dict[str, None]] = {}
        self._obs = 0
        self._xcache: dict[Any, tuple[int, Any]] = {}
        # Cold calls whose time stood in for the run time until a warm call of the same
        # (function, endpoint) arrives: (function, endpoint) -> [seconds of each cold call].
        self.standin: dict[tuple[str, str], list[float]] = {}

    # ------------------------------------------------------------------ registration
    def register_endpoint(self, endpoint_id: str, hardware: str, speed: float = 1.0) -> None:
        if self.hardware.get(endpoint_id) != hardware:
            self._refs = {k: v for k, v in self._refs.items() if k[1] != endpoint_id}
        self.hardware[endpoint_id] = hardware
        self.speed[endpoint_id] = speed if speed > 0 else 1.0

    # ------------------------------------------------------------------ observations
    def observe_completion(
        self,
        function_id: str,
        endpoint_id: str,
        runtime_s: float,
        now: float,
        payload_bytes: float = 0.0,
        result_bytes: float | None = None,
        cold_start_s: float = 0.0,
        busy: bool = True,
    ) -> bool:
        """Learn from one finished task. ``runtime_s`` is the function body's run time only;
        ``cold_start_s`` the extra time spent starting a cold worker (0 when it was warm);
        ``busy``: the endpoint still has work after this completion (for its throughput).

        Returns True when the endpoint's deviation factor for this function changed (the fleet
        must then refresh its bounds for that group).
        """
        key = (function_id, endpoint_id)
        refs = self._refs.get(key)
        if refs is None:
            refs = self._bind(function_id, endpoint_id)
        st, g, wk, rs, tp, hw = refs
        if g.n == 0:  # the group's first sample: nothing to compare it with yet
            st.observe(runtime_s, now)
            g.observe(runtime_s, now, payload_bytes)
            changed = False
        else:
            pred = g.intercept + g.slope * payload_bytes
            changed = st.observe(runtime_s, now, pred, self.deviation_threshold)
            g.observe(runtime_s / st.factor, now, payload_bytes)
        # The speed-normalised function mean only serves hardware groups that never ran the
        # function; past its first few hundred samples a 1-in-8 subsample keeps it current.
        if wk.n < 256 or st.n & 7 == 0:
            wk.observe(runtime_s * self.speed.get(endpoint_id, 1.0), now, payload_bytes)
        if cold_start_s > 0.0:
            self._observe_cold(function_id, endpoint_id, hw, cold_start_s, now)
        if result_bytes is not None and (result_bytes != rs.mean or rs.n < 8):
            rs.observe(result_bytes, now)  # (a sample equal to the mean would change nothing)
        tp.observe(now, busy)
        self._obs += 1
        return changed

    def observe_call(
        self,
        function_id: str,
        endpoint_id: str,
        runtime_s: float,
        now: float,
        payload_bytes: float = 0.0,
        result_bytes: float | None = None,
        *,
        cold_call: bool,
        busy: bool = True,
    ) -> tuple[bool, bool]:
        """Learn from a finished task whose measured time *includes* any cold start (the hub's
        agents report one span per call). ``cold_call``: this was the first call of the function
        in the worker that ran it (it deserialized the function and ran its imports first).

        A cold call is split against the warm reference (this endpoint's own warm mean, else its
        hardware group's): ``cold = max(0, time - warm)`` is a cold-start sample for (function,
        endpoint) and the rest a run-time sample. With no warm reference yet, the call's time
        stands in for the run time (the first wave must learn something) and is remembered; the
        first warm call then replaces a stand-in that is still the only sample and yields the cold
        start. Returns ``(deviation factor changed, cold-start estimate changed)``."""
        key = (function_id, endpoint_id)
        pending = self.standin.get(key)
        if cold_call:
            ref = None if pending is not None else self.warm_reference(function_id, endpoint_id, payload_bytes)
            if ref is None:
                if pending is not None:  # a second cold worker before any warm call: keep it for later
                    if len(pending) < 8:
                        pending.append(runtime_s)
                    return False, False
                self.standin[key] = [runtime_s]
                return self.observe_completion(function_id, endpoint_id, runtime_s, now, payload_bytes, result_bytes,
                                               busy=busy), False
            cold = runtime_s - ref if runtime_s > ref else 0.0
            changed = self.observe_completion(function_id, endpoint_id, runtime_s - cold, now, payload_bytes,
                                              result_bytes, busy=busy)
            self.observe_cold(function_id, endpoint_id, cold, now)
            return changed, True
        cold_changed = False
        if pending is not None:
            del self.standin[key]
            refs = self._refs.get(key) or self._bind(function_id, endpoint_id)
            st, g, wk = refs[0], refs[1], refs[2]
            if st.n <= 1 and g.n <= 1:  # the stand-in is still all there is: a real sample replaces it
                st.reset()
                g.reset()
                if wk.n <= 1:
                    wk.reset()
            for c in pending:
                self.observe_cold(function_id, endpoint_id, c - runtime_s if c > runtime_s else 0.0, now)
            cold_changed = True
        return self.observe_completion(function_id, endpoint_id, runtime_s, now, payload_bytes, result_bytes,
                                       busy=busy), cold_changed

    def warm_reference(self, function_id: str, endpoint_id: str, payload_bytes: float = 0.0) -> float | None:
        """Measured warm run time of a call on this endpoint (its own mean, else its hardware
        group's fit, else its group's by another member), or None when only cold calls (or
        nothing) were seen."""
        st = self.pair.get((function_id, endpoint_id))
        if st is not None and st.n and (function_id, endpoint_id) not in self.standin:
            return st.mean
        hw = self.hardware.get(endpoint_id, "generic")
        g = self.group.get((function_id, hw))
        if g is None or not g.n:
            return None
        for (f, e) in self.standin:
            if f == function_id and self.hardware.get(e, "generic") == hw:
                return None
        return g.predict(payload_bytes)

    def observe_cold(self, function_id: str, endpoint_id: str, cold_s: float, now: float) -> None:
        """A measured cold start (0 is a measurement too: the function loads for free)."""
        self._observe_cold(function_id, endpoint_id, self.hardware.get(endpoint_id, "generic"), max(cold_s, 0.0), now)

    def _bind(self, f: str, ep: str) -> tuple:
        """The estimators one completion of ``f`` on ``ep`` updates, created where missing and
        remembered (a completion then costs one lookup instead of five)."""
        hw = self.hardware.get(ep, "generic")
        hl = self.half_life_s
        st = self.pair.get((f, ep))
        if st is None:
            st = self.pair[(f, ep)] = PairStats()
        g = self.group.get((f, hw))
        if g is None:
            g = self.group[(f, hw)] = RuntimeStats(hl, self.group_max_weight)
            self.structure_version += 1
            self.fns_of_hw.setdefault(hw, {})[f] = None
            self.hws_of_fn.setdefault(f, {})[hw] = None
        wk = self.work.get(f)
        if wk is None:
            wk = self.work[f] = RuntimeStats(hl, self.max_weight)
        rs = self.result_size.get(f)
        if rs is None:
            rs = self.result_size[f] = DecayedMean(hl)
        refs = (st, g, wk, rs, self.throughput_of(ep), hw)
        self._refs[(f, ep)] = refs
        return refs

    def _observe_cold(self, f: str, ep: str, hw: str, cold_s: float, now: float) -> None:
        hl = self.half_life_s
        for table, key in ((self.cold_pair, (f, ep)), (self.cold_group, (f, hw))):
            d = table.get(key)
            if d is None:
                d = table[key] = DecayedMean(hl)
                self.structure_version += 1
            d.observe(cold_s, now)
        d = self.cold_hw.get(hw)
        if d is None:
            d = self.cold_hw[hw] = DecayedMean(hl)
            self.structure_version += 1
        d.observe(cold_s, now)

    def observe_transfer(self, endpoint_id: str, nbytes: float, seconds: float, now: float) -> None:
        """A message of ``nbytes`` took ``seconds`` one way between hub and endpoint."""
        ln = self.link(endpoint_id)
        ln.observe(nbytes, seconds, now)
        hw = self.hardware.get(endpoint_id, "generic")
        d = self.hw_bandwidth.get(hw)
        if d is None:
            d = self.hw_bandwidth[hw] = DecayedMean(self.half_life_s, 64.0)
        d.observe(ln.bandwidth, now)

    def bandwidth(self, endpoint_id: str) -> float:
        """Bytes/s to this endpoint: its own fit once a message was timed, else the mean of its
        hardware group's measured links, else the prior (similar hardware, similar link)."""
        ln = self.links.get(endpoint_id)
        if ln is not None and ln.n:
            return ln.bandwidth
        d = self.hw_bandwidth.get(self.hardware.get(endpoint_id, "generic"))
        return d.mean if d is not None else self.default_bandwidth_bps

    def observe_rtt(self, endpoint_id: str, rtt_s: float, now: float, offset_s: float | None = None) -> None:
        """A round trip of a tiny message took ``rtt_s`` (an echoed timestamp, the peer's hold
        time taken out); ``offset_s``: that exchange's NTP clock offset, if known."""
        self.link(endpoint_id).observe_rtt(rtt_s, now, offset_s)

    def heartbeat(self, endpoint_id: str, now: float) -> bool:
        """The endpoint was heard from at ``now``; returns True if it was believed offline."""
        self.sites.settle(now)
        return self.sites.heartbeat(endpoint_id, now)

    def mark_offline(self, endpoint_id: str, now: float, since: float | None = None) -> bool:
        """Declare the endpoint offline (silent since ``since``); returns True if it was online.
        A device behind a site gateway that went with its uplink is not charged (SiteOutages)."""
        self.sites.settle(now)
        return self.sites.mark_offline(endpoint_id, now, since)

    def set_gateway(self, endpoint_id: str, gateway_id: str | None) -> None:
        """``endpoint_id`` is a device behind the site gateway ``gateway_id`` (None: it is not)."""
        self.sites.set_gateway(endpoint_id, gateway_id)

    def availability_view(self, endpoint_id: str) -> "Availability | BehindGateway":
        """What the predictor asks: the endpoint's model, or for a device behind a gateway its own
        model combined with its site's uplink."""
        return self.sites.view(endpoint_id)

    # ------------------------------------------------------------------ queries
    def link(self, endpoint_id: str) -> LinkStats:
        ln = self.links.get(endpoint_id)
        if ln is None:
            ln = self.links[endpoint_id] = LinkStats(self.default_rtt_s, self.default_bandwidth_bps)
        return ln

    def availability(self, endpoint_id: str) -> Availability:
        a = self.avail.get(endpoint_id)
        if a is None:
            a = self.avail[endpoint_id] = Availability(period=self.availability_period_s)
        return a

    def deviation_factor(self, function_id: str, endpoint_id: str) -> float:
        d = self.pair.get((function_id, endpoint_id))
        return d.factor if d is not None else 1.0

    def group_runtime(self, function_id: str, hardware: str, payload_bytes: float, speed: float) -> tuple[float, str]:
        """Runtime of ``function_id`` on an ordinary member of ``hardware`` and the source.

        Falls back, as Delta does across hardware, to the function's runtime on the groups that
        ran it scaled by this group's measured speed relative to each of them (from the
        functions both ran), then to the function's speed-normalised mean over all endpoints
        divided by the speed hint ("function" either way); then to the prior scaled by the
        group's measured speed relative to the fleet, and only with nothing measured to the
        fixed prior divided by the speed hint ("prior").
        """
        g = self.group.get((function_id, hardware))
        if g is not None:
            return g.predict(payload_bytes), "group"
        wk = self.work.get(function_id)
        if wk is not None:
            x = self._cross(function_id, hardware, payload_bytes)
            if x is not None:
                return x, "function"
            return wk.predict(payload_bytes) / speed, "function"
        k = self._fleet_speed(hardware)
        if k is not None:
            return self.default_runtime_s * k, "prior"
        return self.default_runtime_s / speed, "prior"

    _X_FNS = 16  # functions compared per pair of groups
    _X_SRC = 8  # groups the function ran on that an estimate draws from

    def _ratio(self, hw: str, h2: str, skip: str) -> tuple[float, int] | None:
        """Mean log of (runtime on ``hw`` / runtime on ``h2``) over functions both ran."""
        mine, theirs = self.fns_of_hw.get(hw), self.fns_of_hw.get(h2)
        if not mine or not theirs:
            return None
        acc, n = 0.0, 0
        group = self.group
        for g in mine:
            if g == skip or g not in theirs:
                continue
            a, b = group[(g, hw)].mean, group[(g, h2)].mean
            if a > 0.0 and b > 0.0:
                acc += math.log(a / b)
                n += 1
                if n >= self._X_FNS:
                    break
        return (acc / n, n) if n else None

    def _cross(self, f: str, hw: str, payload_bytes: float) -> float | None:
        key = ("x", f, hw)
        hit = self._xcache.get(key)
        if hit is not None and hit[0] == self._obs:
            srcs = hit[1]
        else:
            srcs = []
            for h2 in self.hws_of_fn.get(f, ()):
                r = self._ratio(hw, h2, f)
                if r is not None:
                    srcs.append((self.group[(f, h2)], r[0], r[1]))
                    if len(srcs) >= self._X_SRC:
                        break
            if len(self._xcache) > 100_000:
                self._xcache.clear()
            self._xcache[key] = (self._obs, srcs)
        if not srcs:
            return None
        acc = wsum = 0.0
        for g2, lr, n in srcs:
            v = g2.predict(payload_bytes)
            if v <= 0.0:
                continue
            acc += n * (math.log(v) + lr)
            wsum += n
        return math.exp(acc / wsum) if wsum else None

    def _fleet_speed(self, hw: str) -> float | None:
        """This group's run times relative to the fleet's (geometric, over the functions it
        ran and at least one other group ran too); None when nothing compares."""
        key = ("k", hw)
        hit = self._xcache.get(key)
        if hit is not None and hit[0] == self._obs:
            return hit[1]
        acc, n = 0.0, 0
        group = self.group
        for g in self.fns_of_hw.get(hw, ()):
            others = self.hws_of_fn.get(g, {})
            if len(others) < 2:
                continue
            mine = group[(g, hw)].mean
            if mine <= 0.0:
                continue
            la, m = 0.0, 0
            for h2 in others:
                v = group[(g, h2)].mean
                if v > 0.0:
                    la += math.log(v)
                    m += 1
                    if m >= 32:
                        break
            if not m:
                continue
            acc += math.log(mine) - la / m
            n += 1
            if n >= self._X_FNS:
                break
        k = math.exp(acc / n) if n else None
        self._xcache[key] = (self._obs, k)
        return k

    def runtime(self, function_id: str, endpoint_id: str, payload_bytes: float = 0.0) -> tuple[float, str]:
        """Predicted runtime of one call on one endpoint, and where the estimate came from."""
        hw = self.hardware.get(endpoint_id, "generic")
        r, src = self.group_runtime(function_id, hw, payload_bytes, self.speed.get(endpoint_id, 1.0))
        d = self.pair.get((function_id, endpoint_id))
        if d is not None and d.factor != 1.0:
            return r * d.factor, "endpoint"
        return r, src

    def profiled(self, function_id: str, hardware: str) -> bool:
        """Has this hardware group ever completed this function (Delta's "tried once" rule)?"""
        return (function_id, hardware) in self.group

    def cold_start(self, function_id: str, endpoint_id: str | None = None, hardware: str | None = None) -> float:
        """Expected extra seconds for a call when the function is not warm on the endpoint."""
        if endpoint_id is not None:
            d = self.cold_pair.get((function_id, endpoint_id))
            if d is not None:
                return d.mean
            hardware = hardware or self.hardware.get(endpoint_id)
        if hardware is not None:
            d = self.cold_group.get((function_id, hardware))
            if d is not None:
                return d.mean
            d = self.cold_hw.get(hardware)
            if d is not None:
                return d.mean
        return self.default_cold_start_s

    def result_bytes(self, function_id: str) -> float:
        rs = self.result_size.get(function_id)
        return rs.mean if rs is not None else 0.0

    def throughput_of(self, endpoint_id: str) -> Throughput:
        tp = self.throughput.get(endpoint_id)
        if tp is None:
            tp = self.throughput[endpoint_id] = Throughput()
        return tp

    def endpoint_rate(self, endpoint_id: str) -> float | None:
        tp = self.throughput.get(endpoint_id)
        return tp.rate if tp is not None else None

    def mean_runtime(self, function_id: str, endpoint_id: str) -> float | None:
        """This endpoint's own measured mean runtime for the function (None if never run)."""
        st = self.pair.get((function_id, endpoint_id))
        return st.mean if st is not None else None

    def functions(self) -> Iterator[str]:
        return iter(self.work)

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        def nested(table: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            for (a, b), v in table.items():
                out.setdefault(a, {})[b] = v.to_dict()
            return out

        return {
            "version": 1,
            "config": {
                "half_life_s": self.half_life_s,
                "max_weight": self.max_weight,
                "group_max_weight": self.group_max_weight,
                "deviation_threshold": self.deviation_threshold,
                "default_runtime_s": self.default_runtime_s,
                "default_cold_start_s": self.default_cold_start_s,
                "default_rtt_s": self.default_rtt_s,
                "default_bandwidth_bps": self.default_bandwidth_bps,
                "availability_period_s": self.availability_period_s,
            },
            "hardware": dict(self.hardware),
            "speed": dict(self.speed),
            "pair": nested(self.pair),
            "group": nested(self.group),
            "work": {k: v.to_dict() for k, v in self.work.items()},
            "cold_pair": nested(self.cold_pair),
            "cold_group": nested(self.cold_group),
            "cold_hw": {k: v.to_dict() for k, v in self.cold_hw.items()},
            "result_size": {k: v.to_dict() for k, v in self.result_size.items()},
            "links": {k: v.to_dict() for k, v in self.links.items()},
            "hw_bandwidth": {k: v.to_dict() for k, v in self.hw_bandwidth.items()},
            "throughput": {k: v.to_dict() for k, v in self.throughput.items()},
            "availability": {k: v.to_dict() for k, v in self.avail.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profiles":
        if d.get("version") != 1:
            raise ValueError(f"unsupported profiles version {d.get('version')!r} (expected 1)")
        p = cls(**d["config"])

        def unnest(src: dict[str, dict[str, Any]], typ: Any) -> dict[tuple[str, str], Any]:
            return {(a, b): typ.from_dict(v) for a, inner in src.items() for b, v in inner.items()}

        p.hardware = dict(d["hardware"])
        p.speed = {k: float(v) for k, v in d["speed"].items()}
        p.pair = unnest(d["pair"], PairStats)
        p.group = unnest(d["group"], RuntimeStats)
        for f, hw in p.group:
            p.fns_of_hw.setdefault(hw, {})[f] = None
            p.hws_of_fn.setdefault(f, {})[hw] = None
        p.work = {k: RuntimeStats.from_dict(v) for k, v in d["work"].items()}
        p.cold_pair = unnest(d["cold_pair"], DecayedMean)
        p.cold_group = unnest(d["cold_group"], DecayedMean)
        p.cold_hw = {k: DecayedMean.from_dict(v) for k, v in d["cold_hw"].items()}
        p.result_size = {k: DecayedMean.from_dict(v) for k, v in d["result_size"].items()}
        p.links = {k: LinkStats.from_dict(v) for k, v in d["links"].items()}
        p.hw_bandwidth = {k: DecayedMean.from_dict(v) for k, v in d["hw_bandwidth"].items()}
        p.throughput = {k: Throughput.from_dict(v) for k, v in d["throughput"].items()}
        p.avail = {k: Availability.from_dict(v) for k, v in d["availability"].items()}
        return p
