"""Hierarchical rounds (``Hierarchical(inner, outer)`` + ``Federation(gateways=...)``): clients
train as in a synchronous round; then each gateway endpoint aggregates its group's updates with
the inner strategy (``fl.client.GatewayAggregator``, numpy only) and returns one update, and
the driver aggregates those with the outer strategy. A gateway that does not answer by the
deadline is replaced by the driver aggregating its group (``gateway_fallback``).

A gateway that announces a site blob store (a site gateway, ``info.site.store``) gets its
group's round on its LAN (``fl.sites``): the global model goes down once per site (a ``stage``
task), children fetch it and leave their updates on the LAN, their results carry only keys, and
one aggregated update comes up. Its group cannot fall back to the driver (the updates never left
the site); a site whose stage task is not answered in time gets the round the old way."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple


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

    # ---------------------------------------------------------------- the LAN path (fl.sites)
    def encode_global(self, round: int, weights: Weights, version: int) -> bytes:
        """The global model's blob, staged once per site (RoundDriver.stage_at_sites): children of
        a staged site get its key instead of the model, and leave their updates on the LAN."""
        blob = super().encode_global(round, weights, version)
        self._staged_base = [w.astype("float32") if w.dtype == "float16" else w for w in decode_weights(blob)]
        self._lan_updates: Dict[str, Dict[str, Any]] = {}
        self.stage_at_sites(round, blob, self.fed.gateways, self.endpoint_rows())
        return blob

    def site_of(self, client: str) -> Optional[str]:
        return self.fed._gateway_of.get(client)

    def train_payload(self, ins: Any, round: int, blob: bytes, version: int) -> Dict[str, Any]:
        p = super().train_payload(ins, round, blob, version)
        if "weights_ref" in p:
            p["update_to_site"] = True
        return p

    def decode_update(self, client: str, value: Any, base_version: int) -> Tuple[Optional[ClientUpdate], Optional[str], Dict[str, Any]]:
        """A LAN child's result names its update by key: kept for the gateway's aggregate task
        (the driver never holds those weights; the update stands in with no arrays)."""
        if not (isinstance(value, dict) and value.get("weights_ref") is not None):
            return super().decode_update(client, value, base_version)
        if value.get("v") != PROTOCOL or value.get("kind") != "update" or value.get("client_id") != client:
            return None, "not an fl update of this client", {}
        if self.fed._gateway_of.get(client) not in getattr(self, "_staged", {}):
            return None, "an update left on a site's LAN, but this round did not stage that site", {}
        info = {k: v for k, v in value.items() if k not in ("weights", "v", "kind")}
        try:
            n = int(value.get("num_samples", 0))
            bv = int(value.get("base_version", base_version))
        except (TypeError, ValueError):
            return None, "num_samples/base_version are not integers", info
        ref = value["weights_ref"]
        if not (isinstance(ref, str) and len(ref) == 64):
            return None, f"weights_ref is not a blob key: {ref!r}", info
        self._lan_updates[client] = {"client_id": client, "ref": ref, "encoding": value.get("encoding"), "num_samples": n,
                                     "metrics": dict(value.get("metrics") or {})}
        return ClientUpdate(client, [], n, base_version=bv, metrics=dict(value.get("metrics") or {})), None, info

    def aggregate(self, round: int, updates: List[ClientUpdate], current: Weights) -> Aggregate:
        run, r, weights = self.run, round, current
        strat = run.strategy
        assert isinstance(strat, Hierarchical)
        gateway_of = self.fed._gateway_of
        groups: Dict[str, List[ClientUpdate]] = {}
        for u in updates:
            groups.setdefault(gateway_of.get(u.client_id, f"direct:{u.client_id}"), []).append(u)
        staged = getattr(self, "_staged", {})
        lan = getattr(self, "_lan_updates", {})
        cur: Optional[bytes] = None
        payloads = []
        for gw, us in groups.items():
            if gw.startswith("direct:"):
                continue
            if gw in staged:  # on the site's LAN: keys only (a child answered the old way: its weights ride along)
                payloads.append((gw, {"v": PROTOCOL, "kind": "aggregate", "run_id": self.run_id, "round": r, "gateway_id": gw,
                                      "current_ref": staged[gw][0],
                                      "site_store": staged[gw][1],
                                      **({"uplink": run.compression.spec()} if run.compression is not None else {}),
                                      "updates": [lan[u.client_id] if u.client_id in lan else
                                                  {"client_id": u.client_id, "weights": encode_weights(u.weights),
                                                   "num_samples": u.num_samples, "metrics": u.metrics} for u in us]}))
                continue
            cur = cur if cur is not None else encode_weights(weights)
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
                    if ans.get("encoding") is not None:  # the site's update, compressed against the model it staged
                        from fl.compression import CompressionError, decode_update

                        try:
                            gw_w = decode_update(ans["weights"], ans["encoding"], self._staged_base, expected=run.compression)
                        except CompressionError as exc:
                            raise WireError(str(exc)) from None
                    else:
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
            if any(u.client_id in lan for u in groups[gw]):  # the updates are on the site's LAN: nothing to fall back on
                for u in groups[gw]:
                    rejected.setdefault(u.client_id, f"gateway {gw} did not aggregate its site's updates by the deadline")
                continue
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
        if staged:
            extra["site_lan"] = {g: {"staged": True, "lan_updates": sum(1 for u in groups.get(g, []) if u.client_id in lan),
                                     "bytes_lan": int((answers.get(g) or {}).get("bytes_lan") or 0),
                                     # the site's one update as it came up the uplink (compressed as the run asks)
                                     "bytes_up": len((answers.get(g) or {}).get("weights") or b"")} for g in staged}
        if fallback:
            extra["gateway_fallback"] = fallback
        return Aggregate(new, accepted, rejected, reason, extra)
