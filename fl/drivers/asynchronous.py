"""Asynchronous rounds (FedAsync, FedBuff): every available client always has a task; each
update is handed to the strategy as it arrives (staleness = versions since the client's base);
one record per new global model.

A task not back within ``deadline_s`` makes its client a straggler and frees it for a new
task; if the old task's update still arrives it is used, weighted by its staleness (and refused
past the strategy's ``max_staleness``). If no new model appears within ``deadline_s * (1 +
max_extensions)`` a skipped record is written, so a run with no live clients still ends.

Failing loudly, as in sync mode: when every client failed its warm-up nobody can ever train, so
each record is written at once (skipped, the warm-up errors as ``dropped``) instead of after the
give-up time; and when every ready client has failed since the last record with no update back,
the record is closed then (skipped, ``reason`` says so) rather than after the give-up time. Both
count towards ``max_failed_rounds`` (:meth:`RoundDriver.note_failures`) like sync rounds do.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from fl.history import History, RoundRecord
from fl.strategies import ClientInstruction, ClientUpdate, Weights

from ._base import RoundDriver
from . import register_driver

__all__ = ["AsyncDriver"]


@register_driver
class AsyncDriver(RoundDriver):
    mode = "async"

    def select(self, round: int, ready: List[str]) -> List[ClientInstruction]:
        """Every ready client that has no task in flight gets one (``ready`` holds only those)."""
        cfg = self.run.strategy.client_round_config(round)
        return [ClientInstruction(c, round, dict(cfg)) for c in ready]

    def run_rounds(self, history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        run = self.run
        strat = run.strategy
        version = int(state.get("version", 0))
        if hasattr(strat, "register_version"):
            strat.register_version(version, weights)  # FedBuff needs the base weights of this version
        in_flight: Dict[str, Tuple[str, int, float]] = {}  # task id -> (client, base version, asked at)
        overdue_seen: set = set()
        give_up = run.deadline_s * (1 + run.max_extensions)
        r = start_round
        last_t = time.monotonic()
        stragglers: List[str] = []
        dropped: Dict[str, str] = {}
        staleness: Dict[str, int] = {}
        infos: Dict[str, Dict[str, Any]] = {}
        down: Dict[str, int] = {}
        while r <= run.rounds:
            now = time.monotonic()
            for tid, (c, _, at) in in_flight.items():
                if now - at >= run.deadline_s and tid not in overdue_seen:
                    overdue_seen.add(tid)
                    stragglers.append(c)
            busy = {c for c, _, at in in_flight.values() if now - at < run.deadline_s}
            rows = self.endpoint_rows()
            self.refresh(rows)
            excluded = self.all_excluded(rows)
            if excluded:  # every client failed its warm-up: nobody can ever train, do not wait
                rec = RoundRecord(r, None, None, [], [], excluded, now - last_t,
                                  {"version": version, "skipped": True, "reason": "every client failed its warm-up"})
                last_t = now
                if not self.finish_round(history, rec, weights, {"version": version}):
                    break
                r += 1
                continue
            ready = self.ready(rows)
            idle = [c for c in ready if c not in busy]
            if idle:
                base = self.encode_global(r, weights, version)
                payloads = [(ins.client_id, self.train_payload(ins, r, base, version)) for ins in self.select(r, idle)]
                for c, p in payloads:
                    if isinstance(p.get("weights"), (bytes, bytearray)):
                        down[c] = down.get(c, 0) + len(p["weights"])
                for tid, c in self.submit(run.fid, payloads, run.ttl_s).items():
                    in_flight[tid] = (c, version, time.monotonic())
            accepted: Optional[List[str]] = None
            for tid, arr in self.wait(list(in_flight), min(self.poll_s, run.deadline_s)):
                if tid not in in_flight:
                    continue
                client, base_v, _ = in_flight.pop(tid)
                overdue_seen.discard(tid)
                if not arr.ok:
                    dropped[client] = arr.error or "failed on the endpoint"
                    continue
                upd, why, info = self.decode_update(client, arr.value, base_v)
                if upd is None:
                    dropped[client] = why or "invalid update"
                    continue
                if "bytes_up" in info:
                    info["bytes_up"] = int(info["bytes_up"]) + int(infos.get(client, {}).get("bytes_up", 0))
                infos[client] = info
                staleness[client] = version - upd.base_version
                out = strat.on_update(upd, weights, version)
                rep = strat.last_report
                if rep is not None and rep.rejected:
                    dropped.update(dict(rep.rejected))
                if out is not None:
                    weights, version = out, version + 1
                    accepted = list(rep.accepted) if rep is not None else [client]
                    break  # one record per model; the other results stay at the hub for the next pass
            now = time.monotonic()
            # every client that could train failed since the last record and none sent an update:
            # waiting out the give-up time would only repeat the failure (a missing key, module, ...)
            all_failed = accepted is None and bool(ready) and not infos and set(ready) <= set(dropped)
            if accepted is None and not all_failed and now - last_t < give_up:
                continue
            extra: Dict[str, Any] = {"version": version, "buffered": int(getattr(strat, "buffered", 0))}
            if accepted is None:
                reason = ("every client failed since the last model" if all_failed
                          else f"no new global model within {give_up:.0f}s")
                extra.update({"skipped": True, "reason": reason, "staleness": dict(staleness)})
                extra.update(self.traffic_extra(down, infos, sorted(set(down) | set(infos))))
                rec = RoundRecord(r, None, None, [], list(stragglers), dict(dropped), now - last_t, extra)
            else:
                used = [ClientUpdate(c, [], max(1, int(infos.get(c, {}).get("num_samples", 1))),
                                     metrics=infos.get(c, {}).get("metrics", {})) for c in accepted]
                ev = self.evaluate(r, weights, [] if run.eval_data is not None else used)
                tt = {c: float(infos[c]["train_time_s"]) for c in accepted if "train_time_s" in infos.get(c, {})}
                extra.update({"staleness": {c: staleness[c] for c in accepted if c in staleness}, "train_time_s": tt,
                              "num_samples": int(sum(u.num_samples for u in used))})
                extra.update(ev.extra)
                # bytes since the last record: every task sent and every update received meanwhile
                extra.update(self.traffic_extra(down, infos, sorted(set(down) | set(infos))))
                rec = RoundRecord(r, ev.loss, ev.accuracy, list(accepted), list(stragglers), dict(dropped), now - last_t, extra)
            last_t = now
            stragglers, dropped, staleness, infos, down = [], {}, {}, {}, {}
            if not self.finish_round(history, rec, weights, {"version": version}):
                break
            r += 1
        self.retire({tid: c for tid, (c, _, _) in in_flight.items()}, r)
        return weights
