"""Hierarchical FL through site gateways, the LAN half (docs/fl.md "Hierarchical", docs/sites.md).

A round at a site whose gateway runs a blob store (``info.site.store`` on the gateway's endpoint,
``mesh_agent/site_store.py``) moves its models on the site's LAN, not the uplink:

1. **down once per site**: the driver sends the global model to the gateway in one ``stage``
   task (hub-signed for the gateway); the gateway's worker puts it in the site store and answers
   its key (SHA-256);
2. each child's ``train`` task names the model by that key (``weights_ref``) instead of carrying
   it, plus the store's address (``site_store``). The child fetches it on the LAN and checks the
   hash (the key is inside the hub's signature, so the gateway cannot swap the model);
3. the child puts its update (compressed as the run asks, ``fl.compression``) in the site store and
   its signed result carries only the update's key, size, sample count and metrics;
4. the driver sends the gateway one ``aggregate`` task naming every child's key (taken from the
   children's signed results); the gateway fetches them on the LAN, checks each hash, undoes the
   compression against the staged model, aggregates with the inner strategy (weighted by
   examples) and sends **one** update up.

Pure helpers here (no network): what a task names and how a child's result names its update. The
network calls are ``mesh_agent.site_store.put_blob``/``get_blob``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

__all__ = ["SiteError", "task_weights_blob", "lan_update", "site_stores"]


class SiteError(ValueError):
    """A LAN task or result is malformed (a bad key, no store address)."""


def _key(v: Any, what: str) -> str:
    if not (isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
        raise SiteError(f"{what} is not a blob key (64 hex digits): {v!r}")
    return v


def task_weights_blob(task: Mapping[str, Any]) -> bytes:
    """The global model's wire blob a task names: inline (``weights``), or by key in the site
    store (``weights_ref`` + ``site_store``), fetched on the LAN and checked against the key."""
    ref = task.get("weights_ref")
    if ref is None:
        return task["weights"]
    from mesh_agent.site_store import get_blob

    addr = task.get("site_store")
    if not isinstance(addr, str):
        raise SiteError("a task with weights_ref needs site_store (host:port)")
    return get_blob(addr, _key(ref, "weights_ref"))


def lan_update(task: Mapping[str, Any], out: Dict[str, Any]) -> Dict[str, Any]:
    """A child's result whose update stays on the LAN: put ``out["weights"]`` in the site store
    and keep only its key (``weights_ref``) and size (``bytes_lan``) in the result that goes up."""
    from mesh_agent.site_store import put_blob

    addr = task.get("site_store")
    if not isinstance(addr, str):
        raise SiteError("a task with update_to_site needs site_store (host:port)")
    blob = out.pop("weights")
    out["weights_ref"] = put_blob(addr, blob)
    out["bytes_lan"] = len(blob)
    return out


def site_stores(rows: Mapping[str, Mapping[str, Any]], gateways: Any) -> Dict[str, str]:
    """``{gateway: "host:port"}`` for the gateways that are online and announce a site store in
    their hello (``info.site.store``); the others' groups go through the hub as before."""
    out: Dict[str, str] = {}
    for g in gateways:
        row = rows.get(g) or {}
        site = (row.get("info") or {}).get("site") or {}
        addr: Optional[str] = site.get("store") if isinstance(site, dict) else None
        if row.get("online") and isinstance(addr, str) and addr.count(":") == 1:
            out[g] = addr
    return out
