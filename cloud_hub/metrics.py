"""The hub's metrics in Prometheus's text format (``prometheus-client``): what ``GET /metrics``
(``cloud_hub/api/metrics.py``) serves. Collection only; no HTTP here.

Why it is built the way it is:

* **Nothing on the hot path.** Submits bump one in-memory counter; everything else is read when
  Prometheus scrapes: the dispatcher's live sessions (memory) and one read on the store's reader
  connection (``read_parallel``: a scrape never holds up the dispatcher's writes). Event counts
  (tasks completed and failed, latencies, FL rounds, prediction error) come from a cursor over the
  ``results`` table (its ``seq``) and over ``fl_rounds`` (its ``created``), so they count what was
  stored, exactly once per hub process, and cost nothing between scrapes.
* **Bounded cardinality at 10,000 endpoints.** Per-endpoint series exist only for what the alert
  rules need (``cloud_hub/alerts/rules.yml``): when each endpoint was last seen and how long a
  silence is normal for it (two series per endpoint), plus a backlog series only for endpoints
  that have one. Everything else is aggregated: online endpoints by transport and site, tasks by
  state, bytes by transport, device counters as sums, minimum and maximum. ``metrics_endpoint_detail:
  full`` adds per-endpoint bytes and device counters for fleets small enough to afford them.
  Function labels are capped (``metrics_max_functions``, the rest are ``function="other"``).
* **Device counters ride on heartbeats** (queue depth, worker restarts, disk free, bytes sent, clock
  skew; ``mesh_agent/agent.py`` ``_beat_body``): no port on the device and no extra frame.

The scrape size and cost at 1k and 10k endpoints are measured by ``bench/metrics.py``
(docs/operations.md, "Monitoring").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cloud_hub.store import metrics as sql

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub

__all__ = ["HubMetrics", "CONTENT_TYPE_LATEST", "device_counters"]

log = logging.getLogger("cloud_hub")

#: Submit-to-dispatch and submit-to-result: from a warm LAN round trip (ms) to a device that was
#: offline all night (hours).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86400)
ROUND_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)
#: |actual - predicted| / predicted of the scheduler's completion-time predictions.
ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)
#: A device with less free disk than this counts in ``mesh_devices_disk_low``.
DISK_LOW_BYTES = 256 * 2**20
_ROWS_PER_SCRAPE = 50_000  # results ingested per scrape at most (the rest the next time)

#: Heartbeat keys of the device counters (compact: two letters each) and their metric names.
DEVICE_KEYS = {"rs": "worker_restarts", "df": "disk_free_bytes", "tx": "bytes_sent", "sk": "clock_skew_seconds"}


def device_counters(info: dict[str, Any]) -> dict[str, float]:
    """The device counters of an endpoint's heartbeat info, in base units (the agent sends disk
    free in MiB, bytes sent in KiB and skew in ms to stay small; docs/protocol.md). Non-numbers
    are dropped, so a malformed beat costs its counters, never the scrape."""
    out: dict[str, float] = {}
    scale = {"rs": 1.0, "df": float(2**20), "tx": 1024.0, "sk": 0.001}
    for k, name in DEVICE_KEYS.items():
        v = info.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v) * scale[k]
    q = [info.get(k) for k in ("stored", "outbox")]
    if any(isinstance(v, int) and not isinstance(v, bool) for v in q):
        out["queue_tasks"] = float(sum(v for v in q if isinstance(v, int) and not isinstance(v, bool)))
    return out


@dataclass
class _Snapshot:
    """What one scrape read from the store (on the reader thread)."""

    endpoints: list[tuple[Any, ...]] = field(default_factory=list)  # id, name, transport, last_seen, online, gateway_id, info
    backlog: list[tuple[str | None, str, int]] = field(default_factory=list)  # endpoint, state, count
    results: list[tuple[Any, ...]] = field(default_factory=list)  # seq, ok, received, function_id, created, dispatched, predicted_s, placed_at
    fl_status: dict[str, int] = field(default_factory=dict)
    fl_rounds: list[tuple[str, float]] = field(default_factory=list)  # record JSON, created
    names: dict[str, str] = field(default_factory=dict)  # function id -> name, for ids not seen before


def _read(db: sqlite3.Connection, seq: int, fl_after: float, fids: list[str]) -> _Snapshot:
    """Every read a scrape needs, in one visit to the reader connection (the SQL:
    ``cloud_hub/store/metrics.py``)."""
    s = _Snapshot()
    s.endpoints = sql.live_endpoints(db)
    s.backlog = sql.backlog(db)
    s.results = sql.results_after(db, seq, _ROWS_PER_SCRAPE)
    s.fl_status = sql.fl_status(db)
    s.fl_rounds = sql.fl_rounds_after(db, fl_after)
    s.names.update(sql.function_names(db, fids))
    return s


def _timed_read(db: sqlite3.Connection, seq: int, fl_after: float, fids: list[str]) -> tuple[_Snapshot, float]:
    """``_read`` and the CPU time it took on its thread (what a scrape costs, without the noise
    of everything else the hub does meanwhile)."""
    t = time.thread_time()
    snap = _read(db, seq, fl_after, fids)
    return snap, time.thread_time() - t


def _timed_format(registry: CollectorRegistry) -> tuple[bytes, float]:
    t = time.thread_time()
    text = generate_latest(registry)
    return text, time.thread_time() - t


def _cursors(db: sqlite3.Connection) -> tuple[int, float]:
    return sql.cursors(db)


class HubMetrics:
    """The hub's Prometheus registry (its own, not the global one: a test process may run
    several hubs) and the collector that fills it at scrape time."""

    def __init__(self, hub: "Hub") -> None:
        self.hub = hub
        self.cfg = hub.cfg
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.dispatch_latency = Histogram("mesh_task_submit_to_dispatch_seconds", "Seconds from submit (accepted) to first dispatch to the endpoint",
                                          buckets=LATENCY_BUCKETS, registry=self.registry)
        self.result_latency = Histogram("mesh_task_submit_to_result_seconds", "Seconds from submit (accepted) to the result stored at the hub",
                                        buckets=LATENCY_BUCKETS, registry=self.registry)
        self.round_time = Histogram("mesh_fl_round_seconds", "Wall time of one FL round", buckets=ROUND_BUCKETS, registry=self.registry)
        self.prediction_error = Histogram("mesh_scheduler_prediction_error_ratio",
                                          "|actual - predicted| / predicted completion time of tasks the scheduler placed",
                                          buckets=ERROR_BUCKETS, registry=self.registry)
        self.submitted: Counter[str] = Counter()  # function id -> tasks accepted
        self.completed: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.fl = {"rounds": 0, "asked": 0, "answered": 0}
        self._names: dict[str, str] = {}
        self._labels: dict[str, str] = {}  # function id -> its label (capped set)
        self._seq: int | None = None
        self._fl_after = 0.0
        self._snap = _Snapshot()
        self._now = 0.0
        self._lock = asyncio.Lock()
        self.scrapes = 0
        self.scrape_cpu_s = 0.0  # CPU time of the threads that served scrapes (bench/metrics.py reads it)
        self._families: list[Metric] = []
        self._collector = _Collector(self)
        self.registry.register(self._collector)

    async def start(self) -> None:
        """Count from now on: results and FL rounds stored before this hub started are history,
        not events of this process (Prometheus sees the counters restart at 0, as it expects)."""
        self._seq, self._fl_after = await self.hub.store.read_parallel(_cursors)

    def tasks_submitted(self, rows: list[dict[str, Any]]) -> None:
        """Called by the submit path after the tasks were committed (in memory: a dict bump)."""
        for r in rows:
            self.submitted[r["function_id"]] += 1

    async def render(self) -> bytes:
        """One scrape: read, ingest new events, format. Serialized: two scrapes at once would
        ingest the same rows twice."""
        async with self._lock:
            if self._seq is None:
                await self.start()
            assert self._seq is not None
            unknown = [f for f in set(self.submitted) | set(self.completed) | set(self.failed) if f not in self._names]
            snap, cpu = await self.hub.store.read_parallel(_timed_read, self._seq, self._fl_after, unknown)
            t = time.thread_time()
            self._ingest(snap)
            self._snap, self._now = snap, time.time()
            self.scrapes += 1
            # Built here, on the event loop, where the dispatcher's sessions do not change under us;
            # only the formatting (and the process collector) runs on a worker thread.
            self._families = list(self._collector.build())
            self.scrape_cpu_s += cpu + time.thread_time() - t  # this scrape's formatting is added after it
            text, cpu = await asyncio.to_thread(_timed_format, self.registry)
            self.scrape_cpu_s += cpu
            return text

    async def compress(self, body: bytes) -> bytes:
        """gzip at level 1 (most of level 9's gain on this repetitive text, a fraction of its CPU),
        on a worker thread; its CPU counts as the scrape's."""
        import gzip

        def z() -> tuple[bytes, float]:
            t = time.thread_time()
            out = gzip.compress(body, compresslevel=1)
            return out, time.thread_time() - t

        out, cpu = await asyncio.to_thread(z)
        self.scrape_cpu_s += cpu
        return out

    def _ingest(self, snap: _Snapshot) -> None:
        self._names.update({k: v or k[:12] for k, v in snap.names.items()})
        for seq, ok, received, fid, created, dispatched, predicted, placed_at in snap.results:
            self._seq = max(self._seq or 0, int(seq))
            (self.completed if ok else self.failed)[fid] += 1
            if created is not None:
                self.result_latency.observe(max(0.0, float(received) - float(created)))
                if dispatched is not None:
                    self.dispatch_latency.observe(max(0.0, float(dispatched) - float(created)))
            if predicted and placed_at is not None and predicted > 0:
                self.prediction_error.observe(abs((float(received) - float(placed_at)) - float(predicted)) / float(predicted))
        for record, created in snap.fl_rounds:
            self._fl_after = max(self._fl_after, float(created))
            try:
                r = json.loads(record)
            except (TypeError, ValueError):
                continue
            parts, late, dropped = (len(r.get(k) or ()) for k in ("participants", "stragglers", "dropped"))
            self.fl["rounds"] += 1
            self.fl["asked"] += parts + late + dropped
            self.fl["answered"] += parts
            if isinstance(r.get("round_time_s"), (int, float)):
                self.round_time.observe(float(r["round_time_s"]))

    def function_label(self, fid: str) -> str:
        """The function's name as a label; past ``metrics_max_functions`` distinct labels, "other"."""
        label = self._labels.get(fid)
        if label is None:
            name = self._names.get(fid, fid[:12])
            label = name if len(set(self._labels.values())) < self.cfg.metrics_max_functions or name in self._labels.values() else "other"
            self._labels[fid] = label
        return label

    def silence_allowed(self, endpoint_id: str, bound: float, last_seen: float, now: float) -> float:
        """``bound``, the liveness bound the endpoint's beats keep, plus the silence its own outage
        history calls normal (``scheduler.availability.Availability.normal_silence``). A device
        behind a site gateway (``BehindGateway``) is silent at the hub when it or its site's uplink
        is down, so the larger of what each of the two models calls normal."""
        from scheduler.availability import BehindGateway

        node = self.hub.placement.sched.fleet.nodes.get(endpoint_id)
        av = getattr(node, "avail", None)
        if av is None:
            return bound
        models = (av.device, av.uplink) if isinstance(av, BehindGateway) else (av,)
        return bound + max(x.normal_silence(now, last_seen) for x in models)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class _Collector:
    """Turns the last snapshot plus the hub's live state into metric families (``build``, on the
    event loop); ``collect`` hands them to ``generate_latest``."""

    def __init__(self, m: HubMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        return iter(self.m._families)

    def build(self) -> Iterator[Metric]:
        m, snap, now = self.m, self.m._snap, self.m._now or time.time()
        hub, cfg = m.hub, m.cfg
        disp = hub.dispatcher
        full = cfg.metrics_endpoint_detail == "full"
        sessions = disp._sessions

        yield from self._tasks(snap)

        # --------------------------------------------------------- endpoints
        online = GaugeMetricFamily("mesh_endpoints_online", "Endpoints online, by transport and site (site: the gateway id, '' for direct)",
                                   labels=["transport", "site"])
        enrolled = GaugeMetricFamily("mesh_endpoints_enrolled", "Endpoints enrolled and not revoked, by transport", labels=["transport"])
        seen = GaugeMetricFamily("mesh_endpoint_last_seen_timestamp_seconds", "When the hub last heard from the endpoint (Unix time)",
                                 labels=["endpoint"])
        allowed = GaugeMetricFamily("mesh_endpoint_silence_allowed_seconds",
                                    "Silence that is normal for the endpoint: its liveness bound plus its learned outage pattern",
                                    labels=["endpoint", "name"])
        up_site = GaugeMetricFamily("mesh_site_uplink_up", "1 while the site gateway's uplink session to the hub is live", labels=["site", "name"])
        site_devs = GaugeMetricFamily("mesh_site_devices", "Devices enrolled behind the site gateway", labels=["site"])
        dev = {k: GaugeMetricFamily(f"mesh_device_{k}", f"Device counter {k} from heartbeats", labels=["endpoint"])
               for k in ("queue_tasks", "worker_restarts", "disk_free_bytes", "bytes_sent", "clock_skew_seconds")}
        agg: dict[str, list[float]] = {k: [] for k in dev}
        by_ts: Counter[tuple[str, str]] = Counter()
        n_enrolled: Counter[str] = Counter()
        names = {r[0]: r[1] for r in snap.endpoints}
        devices_behind: Counter[str] = Counter()
        live_ids: set[str] = set()
        for eid, name, transport, last_seen, row_online, gateway_id, info_json in snap.endpoints:
            n_enrolled[transport] += 1
            if gateway_id:
                devices_behind[gateway_id] += 1
            s = sessions.get(eid)
            info: dict[str, Any] | None = s.info if s is not None else None
            if info is None:
                try:
                    info = json.loads(info_json or "{}")
                except ValueError:
                    info = {}
            assert info is not None
            adaptive = info.get("beats") == "adaptive"
            last = s.last_seen if s is not None else _num(last_seen)
            is_online = s is not None or (disp.replicated and bool(row_online) and last is not None
                                          and now - last < disp.silence_bound(adaptive))
            if is_online:
                live_ids.add(eid)
                by_ts[(s.link.name if s is not None else transport, gateway_id or "")] += 1
            if last is None:  # enrolled, never connected: nothing to be silent from
                continue
            seen.add_metric([eid], last)
            bound = (s.bound or cfg.lost_after_s) if s is not None else disp.silence_bound(adaptive)
            allowed.add_metric([eid, name], m.silence_allowed(eid, bound, last, now))
            if not is_online:
                continue
            counters = device_counters(info)
            for k, v in counters.items():
                agg[k].append(v)
                if full or (k == "queue_tasks" and v > 0):
                    dev[k].add_metric([eid], v)
        for gid in devices_behind:  # a site: a gateway with devices enrolled behind it (docs/sites.md)
            up_site.add_metric([gid, names.get(gid, gid)], 1.0 if gid in live_ids else 0.0)
            site_devs.add_metric([gid], devices_behind.get(gid, 0))
        for (t, site), n in sorted(by_ts.items()):
            online.add_metric([t, site], n)
        for t, n in sorted(n_enrolled.items()):
            enrolled.add_metric([t], n)
        yield from (online, enrolled, seen, allowed, up_site, site_devs, *dev.values())
        sums = GaugeMetricFamily("mesh_devices_sum", "Sum over online devices of a heartbeat counter", labels=["counter"])
        for k in ("queue_tasks", "worker_restarts", "bytes_sent"):
            sums.add_metric([k], sum(agg[k]))
        yield sums
        yield GaugeMetricFamily("mesh_devices_disk_free_min_bytes", "Least free disk among online devices",
                                value=min(agg["disk_free_bytes"], default=float("nan")))
        yield GaugeMetricFamily("mesh_devices_disk_low", f"Online devices with less than {DISK_LOW_BYTES // 2**20} MiB of free disk",
                                value=sum(1 for v in agg["disk_free_bytes"] if v < DISK_LOW_BYTES))
        yield GaugeMetricFamily("mesh_devices_clock_skew_max_seconds", "Largest |clock skew| to the hub among online devices",
                                value=max((abs(v) for v in agg["clock_skew_seconds"]), default=0.0))

        # --------------------------------------------------------- bytes
        b_in = CounterMetricFamily("mesh_frame_bytes_received", "Frame bytes received from endpoints (no TCP/IP or TLS overhead)", labels=["transport"])
        b_out = CounterMetricFamily("mesh_frame_bytes_sent", "Frame bytes sent to endpoints", labels=["transport"])
        e_in = CounterMetricFamily("mesh_endpoint_frame_bytes_received", "Frame bytes received from the endpoint", labels=["endpoint"])
        e_out = CounterMetricFamily("mesh_endpoint_frame_bytes_sent", "Frame bytes sent to the endpoint", labels=["endpoint"])
        transport_of = {r[0]: r[2] for r in snap.endpoints}
        tot_in: Counter[str] = Counter()
        tot_out: Counter[str] = Counter()
        for eid, t in list(disp.traffic.items()):
            tr = transport_of.get(eid, "unknown")
            tot_in[tr] += t[0]
            tot_out[tr] += t[1]
            if full:
                e_in.add_metric([eid], t[0])
                e_out.add_metric([eid], t[1])
        for tr in sorted(set(tot_in) | set(tot_out)):
            b_in.add_metric([tr], tot_in[tr])
            b_out.add_metric([tr], tot_out[tr])
        yield b_in
        yield b_out
        # By frame kind: what heartbeats, tasks, results, site frames ... cost (docs/sites.md counts a
        # site's uplink this way). A site_up/site_down counts as itself, and its inner frames again
        # under their own kinds when the hub handles them.
        by_kind = CounterMetricFamily("mesh_frame_bytes_by_kind", "Frame bytes by direction (in: from endpoints, out: to them) and "
                                      "frame kind; inner frames of site frames are counted under their kinds as well", labels=["direction", "kind"])
        for (out, kind), n in sorted(getattr(disp, "kind_bytes", {}).items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            by_kind.add_metric(["out" if out else "in", kind.value], n)
        yield by_kind
        if full:
            yield e_in
            yield e_out

        # --------------------------------------------------------- refused frames
        # Per endpoint and reason (cloud_hub/dispatcher.py reject_reason): a device whose frames
        # fail their MAC, come stale or replayed is misconfigured, tampered with, or in someone
        # else's hands. Bounded: only enrolled endpoints get their own label, at most
        # REJECT_LABELS_MAX of them ("other" past that), unknown channels are "unknown".
        rejected = CounterMetricFamily("mesh_frames_rejected", "Frames the hub refused, by endpoint (its channel; 'unknown' for a channel "
                                       "no enrolled endpoint has, 'other' past the label cap) and reason "
                                       "(bad_mac, stale, replay, malformed, oversize, wrong_direction, wrong_channel, unknown_endpoint)",
                                       labels=["endpoint", "reason"])
        for (eid, reason), n in sorted(getattr(disp, "rejected", {}).items()):
            rejected.add_metric([eid, reason], n)
        yield rejected

        # --------------------------------------------------------- FL
        runs = GaugeMetricFamily("mesh_fl_runs", "FL runs by status", labels=["status"])
        for st in ("running", "finished", "failed", "aborted"):
            runs.add_metric([st], snap.fl_status.get(st, 0))
        yield runs
        yield CounterMetricFamily("mesh_fl_rounds", "FL rounds stored", value=m.fl["rounds"])
        yield CounterMetricFamily("mesh_fl_clients_asked", "FL clients asked to train, summed over rounds", value=m.fl["asked"])
        yield CounterMetricFamily("mesh_fl_clients_answered", "FL clients whose update arrived in time, summed over rounds", value=m.fl["answered"])

        # --------------------------------------------------------- the hub itself
        yield from self._hub_host()
        yield GaugeMetricFamily("mesh_hub_scrapes", "Scrapes this hub process answered", value=m.scrapes)
        yield CounterMetricFamily("mesh_hub_scrape_cpu_seconds", "CPU time the hub spent answering scrapes (reads, building, formatting; "
                                  "the current scrape's formatting is counted in the next)", value=m.scrape_cpu_s)

    def _tasks(self, snap: _Snapshot) -> Iterator[Metric]:
        m = self.m
        by_state: Counter[str] = Counter()
        queued = GaugeMetricFamily("mesh_endpoint_queued_tasks", "Tasks queued at the hub for the endpoint (endpoints with none are left out)",
                                   labels=["endpoint"])
        for eid, state, n in snap.backlog:
            by_state[state] += n
            if state == "queued" and eid is not None and n > 0:
                queued.add_metric([eid], n)
        tasks = GaugeMetricFamily("mesh_tasks", "Tasks at the hub by state (queued; leased: sent, not acked; acked: on the device)", labels=["state"])
        for st in ("queued", "leased", "acked"):
            tasks.add_metric([st], by_state.get(st, 0))
        yield tasks
        yield queued
        for metric, counts, what in (("mesh_tasks_submitted", m.submitted, "accepted by the hub"),
                                     ("mesh_tasks_completed", m.completed, "with a successful result stored"),
                                     ("mesh_tasks_failed", m.failed, "with an error result stored (remote exception, expiry)")):
            fam = CounterMetricFamily(metric, f"Tasks {what}, by function name", labels=["function"])
            per: Counter[str] = Counter()
            for fid, n in list(counts.items()):
                per[m.function_label(fid)] += n
            for label, n in sorted(per.items()):
                fam.add_metric([label], n)
            yield fam

    def _hub_host(self) -> Iterator[Metric]:
        cfg = self.m.cfg
        if cfg.database_url is None:  # SQLite: the disk under the database (PostgreSQL: watch the database host)
            db = cfg.db_path.resolve()
            try:
                du = shutil.disk_usage(db.parent)
            except OSError:
                du = None
            if du is not None:
                yield GaugeMetricFamily("mesh_hub_disk_free_bytes", "Free bytes on the hub database's filesystem (for unprivileged users)",
                                        value=du.free)
                yield GaugeMetricFamily("mesh_hub_disk_size_bytes", "Size of the hub database's filesystem", value=du.total)
            size = 0
            for suffix in ("", "-wal", "-shm"):
                try:
                    size += os.stat(f"{db}{suffix}").st_size
                except OSError:
                    pass
            yield GaugeMetricFamily("mesh_hub_database_bytes", "Size of the hub's SQLite database with its WAL", value=size)
        certs = GaugeMetricFamily("mesh_tls_cert_not_after_timestamp_seconds", "When the certificate expires (Unix time)", labels=["role", "file"])
        for role, path in (("api", cfg.tls_cert_file), ("ca", cfg.tls_ca_file)):
            if path is None:
                continue
            t = _not_after(str(path))
            if t is not None:
                certs.add_metric([role, str(path)], t)
        yield certs


_CERT_CACHE: dict[tuple[str, float], float | None] = {}


def _not_after(path: str) -> float | None:
    """Expiry of the first certificate in a PEM file, re-read only when the file changes."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    key = (path, mtime)
    if key not in _CERT_CACHE:
        from cloud_hub.tls import load_certs
        from pathlib import Path

        try:
            _CERT_CACHE[key] = load_certs(Path(path))[0].not_valid_after_utc.timestamp()
        except Exception as exc:  # a broken file is the TLS code's error to report; here it costs one series
            log.warning("metrics: cannot read certificate %s: %s", path, exc)
            _CERT_CACHE[key] = None
    return _CERT_CACHE[key]
