"""Synchronous rounds (FedAvg, FedProx, Flower strategies, ...): select, send, wait until all
are back or the deadline passes (extended while too few arrived, ``on_insufficient="extend"``),
aggregate what arrived, evaluate, checkpoint. A round with too few valid updates is skipped,
keeping the global model, with the reason in its record.

Updates of earlier rounds that arrive now (a device back from an outage, a straggler) are by
default discarded and listed (``late_discarded``), as Flower never uses a late reply. With
``fit(late_updates="use")`` they join the round they arrive in instead (unless the client sent
a fresh update in it), their sample count scaled by the staleness factor ``(1 + s)^-0.5`` of
FedAsync/FedBuff (s = model versions since the one they trained on); the record lists them in
``late_used``. A slow device's data then still counts, at a discount, instead of being lost.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

from fl.history import History, RoundRecord
from fl.strategies import ClientUpdate, Weights, polynomial_staleness

from ._base import Arrival, Collected, RoundDriver
from . import register_driver

__all__ = ["SyncDriver"]


@register_driver
class SyncDriver(RoundDriver):
    mode = "sync"

    @staticmethod
    def resume_point(history: History) -> Tuple[int, Tuple[Optional[float], Optional[float]]]:
        """The model version the rounds so far reached, and its last known (loss, accuracy):
        a skipped round keeps the model, so it reports those."""
        version = int(history.rounds[-1].extra.get("version", len(history))) if history.rounds else 0
        init = history.metadata.get("initial_eval") or {}
        last: Tuple[Optional[float], Optional[float]] = (init.get("loss"), init.get("accuracy"))
        for rec in history.rounds:
            if rec.accuracy is not None or rec.loss is not None:
                last = (rec.loss, rec.accuracy)
        return version, last

    def on_late(self, client: str, round: int, arr: Arrival) -> None:
        if self.run.options.get("late_updates") != "use" or not arr.ok:
            return super().on_late(client, round, arr)
        upd, _why, info = self.decode_update(client, arr.value, -1)
        if upd is None or upd.base_version < 0:
            return super().on_late(client, round, arr)
        self._late_updates.append((round, upd, info))

    def use_late(self, col: Collected, version: int) -> list:
        """Late updates that arrived by now join this round's (``late_updates="use"``): each
        client's newest, unless it sent a fresh one; the rest are listed as discarded."""
        late, self._late_updates = list(getattr(self, "_late_updates", [])), []
        fresh = {u.client_id for u in col.updates}
        used, newest = [], {}
        for rnd, upd, info in late:
            if upd.client_id in fresh or (upd.client_id in newest and newest[upd.client_id][1].base_version >= upd.base_version):
                col.late.append({"client": upd.client_id, "round": rnd})
                continue
            if upd.client_id in newest:
                col.late.append({"client": upd.client_id, "round": newest[upd.client_id][0]})
            newest[upd.client_id] = (rnd, upd, info)
        for rnd, upd, info in newest.values():
            staleness = max(0, version - upd.base_version)
            w = max(1, int(round(upd.num_samples * polynomial_staleness(staleness))))
            col.updates.append(ClientUpdate(upd.client_id, upd.weights, w, base_version=upd.base_version, metrics=upd.metrics))
            col.info[upd.client_id] = info
            used.append({"client": upd.client_id, "round": rnd, "staleness": staleness, "num_samples": upd.num_samples,
                         "weight": w})
        return used

    def run_rounds(self, history: History, weights: Weights, start_round: int, state: Dict[str, Any]) -> Weights:
        run = self.run
        self._late_updates: list = []  # (round, update, info) that came back after their round (late_updates="use")
        version, last = self.resume_point(history)
        for r in range(start_round, run.rounds + 1):
            t0 = time.monotonic()
            self.outage_s = 0.0
            instructions, rows = self.wait_for_clients(t0, r)
            asked = [i.client_id for i in instructions]
            extra: Dict[str, Any] = {"asked": asked}
            if not instructions:
                failed = self.all_excluded(rows)  # the warm-up's first error of each client
                reason = ("every client failed its warm-up" if failed
                          else run.strategy.last_selection_reason or "no client available")
                late = self.drain_late()
                rec = RoundRecord(r, last[0], last[1], [], [], failed, time.monotonic() - t0,
                                  {**extra, "skipped": True, "reason": reason, "version": version,
                                   **({"late_discarded": late} if late else {})})
                if not self.finish_round(history, rec, weights, {"version": version}):
                    break
                continue
            base = self.encode_global(r, weights, version)
            if self.mode != "hierarchical" and run.options.get("site_models", True):  # flat: the model goes down once per site too
                self.stage_at_sites(r, base, self.sites_of(asked, rows), rows)
                if self._staged:
                    extra["site_staged"] = {g: len(base) for g in self._staged}
            payloads = [(ins.client_id, self.train_payload(ins, r, base, version)) for ins in instructions]
            down = {c: len(p["weights"]) for c, p in payloads if isinstance(p.get("weights"), (bytes, bytearray))}
            t_sent = time.monotonic()
            if t_sent - t0 > 0.05:
                extra["selection_wait_s"] = round(t_sent - t0, 3)  # waiting for clients to (re)join
            pending = self.submit(run.fid, payloads, run.ttl_s)
            if run.on_round_start is not None:
                run.on_round_start(r, {c: tid for tid, c in pending.items()})
            col = Collected()
            self.collect(pending, col, t_sent, r, version)
            col.late += self.drain_late()
            back = set(col.info) | set(col.failed)
            late_used = self.use_late(col, version) if run.options.get("late_updates") == "use" else []
            if late_used:
                extra["late_used"] = late_used
            stragglers = [c for c in asked if c not in back]
            agg = self.aggregate(r, col.updates, weights)
            extra.update(agg.extra)
            accepted = list(agg.accepted)
            dropped = {**col.failed, **agg.rejected}
            used = [u for u in col.updates if u.client_id in set(accepted)]
            ev = None
            if agg.weights is not None:
                weights = agg.weights
                version += 1
                extra["num_samples"] = int(sum(u.num_samples for u in used))
                ev = self.evaluate(r, weights, used)
                last = (ev.loss, ev.accuracy)
                extra.update(ev.extra)
            else:
                extra.update({"skipped": True, "reason": agg.reason or "no new model"})
                accepted = []
            loss, acc = last
            round_time = time.monotonic() - t0
            train_times = {c: float(i["train_time_s"]) for c, i in col.info.items() if c in set(accepted) and "train_time_s" in i}
            extra.update(self.col_extra(col))
            if self.outage_s:  # the whole round's, including waiting to select clients
                extra["hub_outage_s"] = round(self.outage_s, 3)
            extra.update({"version": version, "train_time_s": train_times,
                          "client_metrics": {c: col.info[c].get("metrics", {}) for c in accepted if c in col.info}})
            extra.update(self.traffic_extra(down, col.info, asked))
            if train_times:
                extra["max_train_time_s"] = max(train_times.values())
                extra["overhead_s"] = round_time - extra["max_train_time_s"]
            rec = RoundRecord(r, loss, acc, list(accepted), stragglers, dropped, round_time, extra)
            if not self.finish_round(history, rec, weights, {"version": version}):
                break
        return weights
