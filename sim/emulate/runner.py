"""Runs an emulation scenario against real processes and returns its report.

What runs: Mosquitto, the hub as its own ``mesh-hub serve`` process, and one ``mesh-agent start``
process per agent (all through :class:`cloud_hub.localmesh.LocalMesh`); each agent's config
points at its own :class:`~sim.emulate.proxy.FaultProxy` instead of the broker (MQTT) or the
hub's ZeroMQ port. This process holds the proxies (asyncio), replays the fault schedule, submits
the workload through the SDK (``Client.submit_batch``) and reads the SDK's result stream raw.

Phases: start and enroll everything; ``duration_s`` of workload and faults (replayed on the
wall clock, each target's events in order); heal (links up, agents, hub and broker running);
drain until every accepted task has its result or ``drain_timeout_s`` passes; stop; check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import platform
import shutil
import signal
import threading
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx

from cloud_hub.client import Client, HubError
from cloud_hub.localmesh import AgentProcess, LocalMesh
from cloud_hub.store import readback

from .checker import Records, check, percentiles, reconnect_delays
from .faults import FaultEvent, FaultSchedule, build_schedule
from .functions import CATALOG
from .proxy import FaultProxy, LinkShape
from .scenario import EmulationScenario
from .sites import frame_bytes_by_kind, lan_upstream, move_device, site_figures
from .workload import TaskPlan, payload_of, plan_workload

__all__ = ["Emulation"]

log = logging.getLogger("sim.emulate")


def _not_sent(exc: BaseException) -> bool:
    """True when a failed submit certainly never reached the hub (so it cannot have been stored)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


class Emulation:
    def __init__(self, sc: EmulationScenario, workdir: Path, *, echo: Callable[[str], None] = print,
                 without_gateways: bool = False) -> None:
        self.sc = sc
        self.without_gateways = without_gateways  # the baseline of a site scenario (sim/emulate/sites.py)
        self.frame_kinds: dict[str, int] = {}  # the hub's frame bytes by direction and kind, at the end of the run
        self.moves: list[tuple[float, str, str, str]] = []  # (when, device, from gateway group, to)
        self.workdir = Path(workdir)
        self.echo = echo
        self.schedule: FaultSchedule = build_schedule(sc)
        self.site_now = {s.name: g.gateway for g in sc.agents if g.gateway is not None for s in self.schedule.agents if s.group == g.name}
        self.plan: list[TaskPlan] = plan_workload(sc, len(self.schedule.agents))
        self.records = Records(sc.seed, self.plan)
        self.mesh: LocalMesh | None = None
        self.proxies: dict[str, FaultProxy] = {}
        self.agents: dict[str, AgentProcess] = {}
        self.endpoints: dict[str, str] = {}  # agent name -> endpoint id
        self.dead: dict[str, list[list[float]]] = defaultdict(list)  # agent -> [[killed, restarted]]
        self.service_down: dict[str, list[list[float]]] = defaultdict(list)  # hub/broker -> [[stopped, up]]
        self.t0 = 0.0
        self._lock = threading.Lock()
        self._stop_reader = threading.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        self.errors: list[str] = []
        self.phases: dict[str, float] = {}
        self.agent_log: Counter[str] = Counter()
        self.applied: list[tuple[float, float, float, str, str, str]] = []  # planned t, began, took, kind, target, mode
        self.cgroups: Any = None  # constrain.CgroupRun when some group has a device profile
        self.fsync_shim: Path | None = None
        self.device_stats: dict[str, dict[str, Any]] = {}
        self.fl_result: dict[str, Any] | None = None

    # ------------------------------------------------------------------ entry point
    async def run(self) -> dict[str, Any]:
        sc = self.sc
        wall0 = time.time()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "runs").mkdir(exist_ok=True)
        self.mesh = LocalMesh(self.workdir / "mesh", heartbeat_s=sc.hub.heartbeat_s, lost_after_s=sc.hub.lost_after_s,
                              lease_s=sc.hub.lease_s, hub_process=True)
        reader: threading.Thread | None = None
        drain_s = None
        try:
            await asyncio.to_thread(self._prepare_devices)
            await asyncio.to_thread(self.mesh.start)
            await self._start_agents()
            self.phases["setup_s"] = round(time.time() - wall0, 2)
            client = self.mesh.client
            fids = {name: await asyncio.to_thread(client.register_function, fn, name) for name, fn in CATALOG.items()}
            cursor = await asyncio.to_thread(client.result_cursor)
            reader = threading.Thread(target=self._read_results, args=(cursor,), name="sim-results", daemon=True)
            reader.start()
            self.echo(f"{sc.name}: {len(self.agents)} agents up; {len(self.plan)} tasks and {len(self.schedule.events)} faults over {sc.duration_s:.0f}s")
            self.t0 = time.time()
            submitter = asyncio.create_task(self._submit_all(fids))
            fl_run = asyncio.create_task(self._run_fl()) if sc.fl is not None else None
            progress = asyncio.create_task(self._progress())
            await self._replay_faults()
            await self._sleep_until(sc.duration_s)
            await self._heal()
            t_heal = time.time()
            deadline = t_heal + sc.drain_timeout_s
            while time.time() < deadline:
                if submitter.done() and (self._outstanding() == 0 or submitter.exception() is not None) \
                        and (fl_run is None or fl_run.done()):
                    break
                await asyncio.sleep(0.25)
            drain_s = time.time() - t_heal
            if not submitter.done():
                submitter.cancel()
                self.errors.append("submissions still failing at the drain deadline")
            elif submitter.exception() is not None:
                self.errors.append(f"workload: {submitter.exception()!r}")
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await submitter
            if fl_run is not None and not fl_run.done():
                self.errors.append("the FL run had not finished at the drain deadline")
            await asyncio.sleep(max(1.0, 2 * sc.hub.heartbeat_s))  # late duplicates would show up now
            self.frame_kinds = await asyncio.to_thread(frame_bytes_by_kind, self.mesh.url)
            progress.cancel()
        finally:
            self._stop_reader.set()
            t_stop = time.time()
            if reader is not None:
                reader.join(15)
            await self._shutdown()
            self._release_devices()
            self.phases["shutdown_s"] = round(time.time() - t_stop, 2)
        self._collect()
        result = check(self.records)
        return self._report(result, started, wall0, drain_s)

    # ------------------------------------------------------------------ setup and teardown
    async def _start_agents(self) -> None:
        assert self.mesh is not None
        mesh = self.mesh
        zmq_port = int(str(mesh.hub_cfg.zmq_bind).rsplit(":", 1)[1])
        groups = {g.name: g for g in self.sc.agents}
        gateways: dict[str, Any] = {}  # gateway group -> its GatewayProcess (docs/sites.md)
        # Gateways first: their devices enroll behind them and dial their site broker (through a proxy: the LAN link).
        for slot in sorted(self.schedule.agents, key=lambda sl: groups[sl.group].site_hold is None):
            g = groups[slot.group]
            up = ("127.0.0.1", mesh.broker.port if g.transport == "mqtt" else zmq_port)
            if g.gateway is not None:
                up = lan_upstream(self, g, gateways)
            shape = LinkShape(g.link.latency_ms / 1000, g.link.jitter_ms / 1000, g.link.bandwidth_kbps * 1000 if g.link.bandwidth_kbps else None)
            proxy = await FaultProxy(slot.name, up, shape, seed=self.sc.seed).start()
            self.proxies[slot.name] = proxy
            if g.site_hold is not None and not self.without_gateways:
                agent = await asyncio.to_thread(mesh.add_gateway, slot.name, hold=g.site_hold, start=False, workers=g.workers, prefetch=g.prefetch)
                gateways[g.name] = agent
            elif g.gateway is not None and not self.without_gateways:
                agent = await asyncio.to_thread(mesh.add_site_device, slot.name, gateways[g.gateway], start=False, workers=g.workers,
                                                prefetch=g.prefetch)
            else:
                agent = await asyncio.to_thread(mesh.add_agent, slot.name, g.transport, workers=g.workers, prefetch=g.prefetch, start=False)
            agent = self._on_device(agent, g.device, len(self.agents))
            cfg = agent.cfg
            if g.transport == "mqtt":
                cfg = cfg.model_copy(update={"mqtt": cfg.mqtt.model_copy(update={"host": "127.0.0.1", "port": proxy.port, "keepalive": g.mqtt_keepalive_s})})
            else:
                cfg = cfg.model_copy(update={"zmq": cfg.zmq.model_copy(update={"address": f"tcp://127.0.0.1:{proxy.port}"})})
            cfg.save(agent.config_path)
            agent.cfg = cfg
            self.agents[slot.name] = agent
            self.endpoints[slot.name] = agent.endpoint_id
        if self.sc.fl is not None:
            from .flrun import declare

            fl_agents = self._fl_agents()
            for k, name in enumerate(fl_agents):
                declare(self.agents[name], k, len(fl_agents), self.sc.fl, self.sc.seed)
        for agent in self.agents.values():
            agent.start()
        await asyncio.to_thread(mesh.wait_online, *self.agents.values(), timeout=60 + 3 * len(self.agents))

    # ------------------------------------------------------------------ devices and FL
    def _prepare_devices(self) -> None:
        """Cgroups and the fsync shim, if any group names a device profile (raises
        ``constrain.Unavailable`` where this machine cannot; run_emulation checks first)."""
        if not any(g.device for g in self.sc.agents):
            return
        from .constrain import CgroupRun, build_fsync_shim

        self.fsync_shim = build_fsync_shim()
        self.cgroups = CgroupRun(f"mesh-sim-{os.getpid()}-{self.sc.name}").probe()

    def _on_device(self, agent: AgentProcess, device: str | None, slot: int) -> AgentProcess:
        """The agent, started inside its device's cgroups with the slow-fsync shim preloaded."""
        if device is None:
            return agent
        from .constrain import ConstrainedAgent, fsync_env
        from .devices import profile

        assert self.mesh is not None and self.cgroups is not None and self.fsync_shim is not None
        prof = profile(device)
        files = self.cgroups.add(agent.cfg.name, prof, slot)
        counter = self.workdir / "devices" / f"{agent.cfg.name}.fsync"  # the shim counts this tree's flushes here
        counter.parent.mkdir(exist_ok=True)
        boxed = ConstrainedAgent(agent, files, fsync_env(self.fsync_shim, delay_ms=prof.fsync_delay_ms, counter=counter))
        self.mesh.agents[self.mesh.agents.index(agent)] = boxed
        return boxed

    def _release_devices(self) -> None:
        if self.cgroups is None:
            return
        try:
            for name in self.cgroups.profiles:
                from .constrain import read_fsync_counter

                flushes = read_fsync_counter(self.workdir / "devices" / f"{name}.fsync")
                self.device_stats[name] = {"device": self.cgroups.profiles[name].name, **self.cgroups.stats(name),
                                           "flushes": flushes, "fsync_delay_ms": self.cgroups.profiles[name].fsync_delay_ms}
        except Exception as exc:
            self.errors.append(f"reading device cgroups: {exc!r}")
        finally:
            self.cgroups.remove()

    def _fl_agents(self) -> list[str]:
        assert self.sc.fl is not None
        groups = set(self.sc.fl.groups or [g.name for g in self.sc.agents])
        return [s.name for s in self.schedule.agents if s.group in groups]

    async def _run_fl(self) -> None:
        assert self.mesh is not None and self.sc.fl is not None
        from .flrun import run_fl

        await self._sleep_until(self.sc.fl.start_s)
        eps = [self.endpoints[n] for n in self._fl_agents()]
        self.fl_result = await asyncio.to_thread(run_fl, self.mesh.url, self.mesh.token, eps, self.sc.fl, self.sc.seed,
                                                 f"mesh-sim-{self.sc.name}")
        from .flrun import summary

        self.echo(f"  FL run: {summary(self.fl_result)}")

    async def _shutdown(self) -> None:
        for p in self.proxies.values():
            p.restore_all()
        # SIGTERM every agent at once (each drains its engine and closes its queue), then the rest.
        for a in self.agents.values():
            if a.alive() and a.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    a.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(asyncio.to_thread(a.stop, 15) for a in self.agents.values()))
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.stop)
        for p in self.proxies.values():
            await p.stop()

    # ------------------------------------------------------------------ faults
    async def _sleep_until(self, t: float) -> None:
        delay = self.t0 + t - time.time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _replay_faults(self) -> None:
        """Replay the schedule on the wall clock; each target's events run in order, while a slow
        one (a hub start takes seconds) does not hold up the links of the others."""
        tasks = []
        for ev in self.schedule.events:
            await self._sleep_until(ev.t)
            lock = self._locks.setdefault(ev.target, asyncio.Lock())
            tasks.append(asyncio.create_task(self._apply(ev, lock)))
        for t in tasks:
            await t

    async def _apply(self, ev: FaultEvent, lock: asyncio.Lock) -> None:
        assert self.mesh is not None
        mesh = self.mesh
        async with lock:
            began = time.time()
            try:
                if ev.kind == "link_down":
                    self.proxies[ev.target].cut(ev.cause, ev.mode)  # type: ignore[arg-type]
                elif ev.kind == "link_up":
                    self.proxies[ev.target].restore(ev.cause)
                elif ev.kind == "agent_kill":
                    t = time.time()
                    await asyncio.to_thread(self.agents[ev.target].kill)
                    self.dead[ev.target].append([t, float("nan")])
                elif ev.kind == "agent_start":
                    await self._start_agent(ev.target)
                elif ev.kind == "gateway_move":
                    await move_device(self, ev.target, ev.cause)
                elif ev.kind == "hub_stop":
                    self.service_down["hub"].append([time.time(), float("nan")])
                    await asyncio.to_thread(mesh.kill_hub if ev.mode == "kill" else mesh.stop_hub)
                elif ev.kind == "hub_start":
                    await asyncio.to_thread(mesh.start_hub)
                    self.service_down["hub"][-1][1] = time.time()
                elif ev.kind == "broker_stop":
                    self.service_down["broker"].append([time.time(), float("nan")])
                    await asyncio.to_thread(self._stop_broker, ev.mode)
                elif ev.kind == "broker_start":
                    await asyncio.to_thread(mesh.broker.start)
                    self.service_down["broker"][-1][1] = time.time()
            except Exception as exc:
                self.errors.append(f"t={ev.t:.1f}s {ev.kind} {ev.target}: {exc!r}")
                log.exception("fault %s failed", ev)
            finally:
                self.applied.append((ev.t, began - self.t0, time.time() - began, ev.kind, ev.target, ev.mode))

    async def _start_agent(self, name: str) -> None:
        agent = self.agents[name]
        if not agent.alive():
            if not (self.dead[name] and math.isnan(self.dead[name][-1][1])):
                # Not one of our power cuts: the agent died by itself. Say so; then restart it.
                self.errors.append(f"agent {name} exited on its own (see {agent.log_path})")
                self.dead[name].append([time.time(), float("nan")])
            await asyncio.to_thread(agent.start)
            self.dead[name][-1][1] = time.time()

    def _stop_broker(self, mode: str) -> None:
        assert self.mesh is not None
        b = self.mesh.broker
        if mode == "kill" and b.proc is not None and b.proc.poll() is None:
            os.kill(b.proc.pid, signal.SIGKILL)  # a crash: whatever was not yet autosaved is gone
            b.proc.wait(10)
        b.stop()

    async def _heal(self) -> None:
        """End of the fault window: every link up, every process running."""
        assert self.mesh is not None
        for p in self.proxies.values():
            p.restore_all()
        for name in self.agents:
            await self._start_agent(name)
        for svc in ("broker", "hub"):
            spans = self.service_down.get(svc)
            if spans and math.isnan(spans[-1][1]):
                if svc == "broker":
                    await asyncio.to_thread(self.mesh.broker.start)
                else:
                    await asyncio.to_thread(self.mesh.start_hub)
                spans[-1][1] = time.time()

    # ------------------------------------------------------------------ workload
    async def _submit_all(self, fids: dict[str, str]) -> None:
        assert self.mesh is not None
        client = Client(self.mesh.url, self.mesh.token)
        try:
            plan, i, n = self.plan, 0, len(self.plan)
            batch_max = self.sc.workload.batch_max
            while i < n:
                now = time.time() - self.t0
                j = i
                while j < n and plan[j].t <= now and j - i < batch_max:
                    j += 1
                if j == i:
                    await asyncio.sleep(min(0.05, max(0.0, plan[i].t - now)))
                    continue
                await self._submit_batch(client, plan[i:j], fids)
                i = j
        finally:
            await asyncio.to_thread(client.close)

    async def _submit_batch(self, client: Client, batch: list[TaskPlan], fids: dict[str, str]) -> None:
        """Submit until the hub answers 2xx; a retry after an ambiguous failure is a new key."""
        r = self.records
        names = [s.name for s in self.schedule.agents]
        attempt = 0
        backoff = 0.25
        while True:
            keys = [f"{p.seq}.{attempt}" for p in batch]
            specs = [
                Client.task_spec(self.endpoints[names[p.agent]], fids[p.fn],
                                 (k, payload_of(self.sc.seed, p.seq, p.size), p.param, str(self.workdir / "runs" / f"{names[p.agent]}.log")),
                                 ttl_s=self.sc.workload.ttl_s)
                for p, k in zip(batch, keys)
            ]
            r.submit_attempts += 1
            try:
                ids = await asyncio.to_thread(client.submit_batch, specs)
            except HubError as exc:
                if exc.status < 500:
                    raise RuntimeError(f"hub refused a valid batch: {exc}") from None
                r.submit_failures += 1
                r.ambiguous_submits += 1
            except Exception as exc:  # hub down or restarting: retry, results are durable once accepted
                r.submit_failures += 1
                if not _not_sent(exc):
                    r.ambiguous_submits += 1
                else:
                    attempt -= 1  # certainly not stored: the same keys may be reused
            else:
                now = time.time()
                for p, k, tid in zip(batch, keys, ids):
                    r.accepted[p.seq] = (tid, k, now)
                return
            attempt += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _read_results(self, cursor: int) -> None:
        """The SDK's result stream, read raw: every delivered row is recorded, duplicates too."""
        assert self.mesh is not None
        client = Client(self.mesh.url, self.mesh.token, timeout=30)
        backoff = 0.1
        try:
            while not self._stop_reader.is_set():
                try:
                    rows, cursor = client.result_stream(cursor, timeout_s=2.0, limit=5000)
                    backoff = 0.1
                except Exception:  # hub restarting
                    self._stop_reader.wait(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                now = time.time()
                with self._lock:
                    for row in rows:
                        self.records.deliveries.setdefault(row["task_id"], []).append((now, bool(row["ok"]), row["data"]))
        finally:
            client.close()

    def _outstanding(self) -> int:
        with self._lock:
            return sum(1 for tid, _, _ in self.records.accepted.values() if tid not in self.records.deliveries)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(10)
            down = sum(1 for p in self.proxies.values() if p.state != "up")
            dead = sum(1 for a in self.agents.values() if not a.alive())
            with self._lock:
                acc = len(self.records.accepted)
                dlv = sum(1 for tid, _, _ in self.records.accepted.values() if tid in self.records.deliveries)
            self.echo(f"  t={time.time() - self.t0:5.0f}s accepted {acc}/{len(self.plan)} delivered {dlv} "
                      f"in flight {acc - dlv}; links down {down}/{len(self.proxies)}, agents dead {dead}")

    # ------------------------------------------------------------------ results
    def _collect(self) -> None:
        """Hub database and run logs, read after everything stopped."""
        assert self.mesh is not None
        r = self.records
        db_path = self.mesh.hub_cfg.db_path
        r.hub_tasks.update(readback.task_states(db_path))
        r.hub_results.update(readback.result_summary(db_path))
        for a in self.agents.values():  # what the agents had to say about it (warnings they logged)
            text = a.log_path.read_text(errors="replace") if a.log_path.exists() else ""
            self.agent_log["clock_remeasures"] += text.count("measuring the hub's clock again")
            self.agent_log["rejected_frames"] += text.count("rejected frame from hub")
            self.agent_log["link_losses"] += text.count("link to hub lost")
        for f in (self.workdir / "runs").glob("*.log"):
            for line in f.read_text().splitlines():
                key = line.split(" ", 1)[0]
                if key:
                    r.runs[key] += 1

    def _intervals(self) -> dict[str, Any]:
        """Realized disruptions, in seconds after t0: per agent link states, deaths; hub, broker."""
        end = self.t0 + self.sc.duration_s
        links: dict[str, list[tuple[float, float, str]]] = {}
        for name, p in self.proxies.items():
            spans = []
            tr = p.transitions + [(time.time(), "up")]
            for (t, st), (t2, _) in zip(tr, tr[1:]):
                if st != "up" and t2 > t:
                    spans.append((t - self.t0, t2 - self.t0, st))
            links[name] = spans
        dead = {n: [(a - self.t0, (end if math.isnan(b) else b) - self.t0) for a, b in v] for n, v in self.dead.items()}
        svc = {k: [(a - self.t0, (end if math.isnan(b) else b) - self.t0) for a, b in v] for k, v in self.service_down.items()}
        return {"links": links, "dead": dead, "services": svc}

    def _report(self, result: dict[str, Any], started: str, wall0: float, drain_s: float | None) -> dict[str, Any]:
        sc, r = self.sc, self.records
        iv = self._intervals()
        T = sc.duration_s
        from sim.outages import down_time

        link_down = {n: down_time([(a, b) for a, b, _ in v], 0.0, T) for n, v in iv["links"].items()}
        share = sum(link_down.values()) / (len(self.proxies) * T) if self.proxies else 0.0
        outages = sum(len(v) for v in iv["links"].values())
        modes = Counter(st for v in iv["links"].values() for _, _, st in v)
        # Delivery times, per task, relative to t0.
        names = [s.name for s in self.schedule.agents]
        by_seq = {p.seq: p for p in self.plan}
        lifes: list[tuple[float, float, str]] = []
        completion: list[float] = []
        for seq, (tid, _, acc) in r.accepted.items():
            rows = r.deliveries.get(tid)
            if rows:
                done = rows[0][0]
                completion.append(done - acc)
                lifes.append((acc - self.t0, done - self.t0, names[by_seq[seq].agent]))
        disruptions: dict[str, list[tuple[float, float]]] = {
            n: [(a, b) for a, b, _ in iv["links"].get(n, [])] + iv["dead"].get(n, []) for n in names
        }
        transports = {s.name: s.transport for s in self.schedule.agents}
        shared = {n: iv["services"].get("hub", []) + (iv["services"].get("broker", []) if transports[n] == "mqtt" else []) for n in names}
        delays = reconnect_delays(lifes, disruptions, shared)
        inv = result["invariants"]
        expectations: dict[str, bool] = {}
        if sc.expect.min_outage_share is not None:
            expectations[f"outage_share >= {sc.expect.min_outage_share}"] = share >= sc.expect.min_outage_share
        if sc.expect.min_tasks is not None:
            expectations[f"accepted tasks >= {sc.expect.min_tasks}"] = inv["accepted"] >= sc.expect.min_tasks
        expectations["every fault applied and every task submitted"] = not self.errors
        if self.cgroups is not None:
            expectations["every device stayed within its memory limit (no OOM kill)"] = bool(self.device_stats) and all(
                d["within_limit"] for d in self.device_stats.values())
        if sc.fl is not None:
            expectations["the FL run finished every round with enough clients"] = bool(self.fl_result and self.fl_result["ok"])
        ok = bool(inv["ok"]) and all(expectations.values())
        return {
            "scenario": sc.name,
            "description": sc.description.strip(),
            "seed": sc.seed,
            "ok": ok,
            "started": started,
            "wall_s": round(time.time() - wall0, 1),
            "machine": f"{platform.machine()} {os.cpu_count()} cpu, Python {platform.python_version()}",
            "duration_s": T,
            "drain_s": None if drain_s is None else round(drain_s, 2),
            "phases_s": self.phases,
            "agents": {"count": len(self.agents), "mqtt": sum(1 for t in transports.values() if t == "mqtt"),
                       "zmq": sum(1 for t in transports.values() if t == "zmq")},
            "schedule": {"digest": self.schedule.digest(), "events": len(self.schedule.events),
                         "planned_outage_share": round(self.schedule.outage_share(), 4)},
            "faults": {
                "outage_share": round(share, 4),
                "link_outages": outages,
                "link_outages_by_mode": dict(modes),
                "agent_kills": sum(len(v) for v in self.dead.values()),
                "hub_restarts": len(self.service_down.get("hub", [])),
                "broker_restarts": len(self.service_down.get("broker", [])),
                "errors": self.errors,
                "max_lag_s": round(max((b - t for t, b, *_ in self.applied), default=0.0), 3),
                "applied": [[round(t, 3), round(b, 3), round(d, 3), k, tg, m] for t, b, d, k, tg, m in sorted(self.applied)],
            },
            "workload": {"tasks": len(self.plan), "functions": dict(Counter(p.fn for p in self.plan)),
                         "payload_bytes_mean": round(sum(p.size for p in self.plan) / max(1, len(self.plan)), 1),
                         "payload_bytes_max": max((p.size for p in self.plan), default=0), **result["submits"]},
            "invariants": inv,
            "agent_logs": {k: self.agent_log[k] for k in ("link_losses", "rejected_frames", "clock_remeasures")},
            "executions": result["executions"],
            "expectations": expectations,
            "completion_s": percentiles(completion),
            "delay_after_reconnect_s": percentiles(delays),
            "proxies": {n: p.stats for n, p in self.proxies.items()},
            "devices": self.device_stats or None,
            "fl": self.fl_result,
            "sites": site_figures(self),
            "timeline": {
                "t0": self.t0,
                "links": {n: [[round(a, 3), round(b, 3), st] for a, b, st in v] for n, v in iv["links"].items()},
                "dead": {n: [[round(a, 3), round(b, 3)] for a, b in v] for n, v in iv["dead"].items()},
                "services": {k: [[round(a, 3), round(b, 3)] for a, b in v] for k, v in iv["services"].items()},
                "tasks": [[round(a, 3), round(b, 3)] for a, b, _ in lifes],
                "undelivered": [round(acc - self.t0, 3) for tid, _, acc in r.accepted.values() if not r.deliveries.get(tid)],
            },
            "workdir": str(self.workdir),
        }


def remove_workdir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
