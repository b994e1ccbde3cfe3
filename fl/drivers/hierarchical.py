"""Hierarchical rounds (``Hierarchical(inner, outer)`` + ``Federation(gateways=...)``): clients
train as in a synchronous round; then each gateway endpoint aggregates its group's updates with
the inner strategy (``fl.client.GatewayAggregator``, numpy only) and returns one update, and
the driver aggregates those with the outer strategy. A gateway that does not answer by the
deadline is replaced by the driver aggregating its group (``gateway_fallback``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List

from fl.client import PROTOCOL, GatewayAggregator
from fl.strategies import ClientUpdate, Hierarchical, Weights
from fl.wire import WireError, decode_weights, encode_weights

from ._base import Aggregate
from .sync import SyncDriver
from . import register_driver

__all__ = ["HierarchicalDriver"]

log = logging.getLogger("fl.federation")


@register_driver
class HierarchicalDriver(SyncDriver):
    mode = "hierarchical"

    def prepare(self) -> None:
        super().prepare()
        strat = self.run.strategy
        assert isinstance(strat, Hierarchical)
        self.run.gateway_fid = self.hub(self.client.register_function, GatewayAggregator(strat.inner), "fl-gateway")

    def aggregate(self, round: int, updates: List[ClientUpdate], current: Weights) -> Aggregate:
        run, r, weights = self.run, round, current
        strat = run.strategy
        assert isinstance(strat, Hierarchical)
        gateway_of = self.fed._gateway_of
        groups: Dict[str, List[ClientUpdate]] = {}
        for u in updates:
            groups.setdefault(gateway_of.get(u.client_id, f"direct:{u.client_id}"), []).append(u)
        cur = encode_weights(weights)
        payloads = []
        for gw, us in groups.items():
            if gw.startswith("direct:"):
                continue
            payloads.append((gw, {"v": PROTOCOL, "kind": "aggregate", "round": r, "gateway_id": gw, "current": cur,
                                  "updates": [{"client_id": u.client_id, "weights": encode_weights(u.weights),
                                               "num_samples": u.num_samples, "metrics": u.metrics} for u in us]}))
        t0 = time.monotonic()
        pending = self.submit(run.gateway_fid, payloads, run.ttl_s)
        answers: Dict[str, Any] = {}
        deadline = t0 + run.deadline_s
        while pending and time.monotonic() < deadline:
            for tid, arr in self.wait(list(pending), min(self.poll_s, deadline - time.monotonic())):
                gw = pending.pop(tid, None)
                if gw is not None and arr.ok and isinstance(arr.value, dict) and arr.value.get("kind") == "group":
                    answers[gw] = arr.value
        self.retire(pending, r)
        pseudo: List[ClientUpdate] = []
        accepted: List[str] = []
        rejected: Dict[str, str] = {}
        fallback: List[str] = []
        for gw in sorted(groups):
            ans = answers.get(gw)
            if ans is not None and ans.get("weights") is not None:
                try:
                    gw_w = decode_weights(ans["weights"])
                except WireError as exc:
                    ans = None
                    log.warning("gateway %s sent undecodable weights: %s", gw, exc)
                else:
                    for cid, why in ans.get("rejected") or []:
                        rejected[str(cid)] = str(why)
                    accepted += [str(c) for c in ans.get("accepted") or []]
                    pseudo.append(ClientUpdate(gw, gw_w, int(ans["num_samples"])))
                    continue
            if ans is not None:  # the gateway answered: its group had nothing usable
                for cid, why in ans.get("rejected") or []:
                    rejected[str(cid)] = str(why)
                for u in groups[gw]:
                    rejected.setdefault(u.client_id, f"gateway {gw}: {ans.get('reason')}")
                continue
            if not gw.startswith("direct:"):
                fallback.append(gw)
            gw_w2 = strat.inner.aggregate(r, groups[gw], weights)
            rep = strat.inner.last_report
            assert rep is not None
            rejected.update(dict(rep.rejected))
            if gw_w2 is None:
                for u in groups[gw]:
                    rejected.setdefault(u.client_id, f"group {gw}: {rep.reason}")
                continue
            accepted += rep.accepted
            pseudo.append(ClientUpdate(gw, gw_w2, rep.num_samples))
        new = strat.outer.aggregate(r, pseudo, weights)
        reason = None if new is not None else f"outer aggregation over {len(pseudo)} group(s): {strat.outer.last_report.reason}"
        extra: Dict[str, Any] = {"gateways": {g: list(cs) for g, cs in self.fed.gateways.items()}}
        if fallback:
            extra["gateway_fallback"] = fallback
        return Aggregate(new, accepted, rejected, reason, extra)
