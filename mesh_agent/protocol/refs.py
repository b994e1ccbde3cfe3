"""Data-ref addresses: the names the SDK and an agent's workers agree on for refs (docs/data.md).

A ref's value lies under a key in a store both sides reach (a Redis, or the hub's embedded store),
or, for a local-tier ref, on the endpoint that put it, which stages it into that store for a
consumer elsewhere. The two sides are different programs (the user's, and a worker on a device),
so the keys they meet on are part of the wire protocol:

* ``mesh:ref:<32 hex>`` (:func:`new_ref_key`): a ref's value; ``<key>:by``: who put it (shared tier);
* ``mesh:stage:<endpoint id>`` (:func:`stage_list`): where a consumer pushes the key of a local ref
  it wants that endpoint to stage;
* ``<key>:staged``: the staged copy (with the ref's remaining TTL); ``<key>:ready``: the stager's
  answer, ``ok`` or ``lost``;
* :func:`owner_of`: whose local refs these are, from the store URL's login.

Pure: no I/O. The worker side (the local store and the stager) is ``mesh_agent.refstore``; the
program side is ``cloud_hub.client.refs``.
"""

from __future__ import annotations

import hashlib
import uuid
from urllib.parse import urlsplit

__all__ = ["REF_PREFIX", "STAGE_LIST", "STAGED", "READY", "STAGE_OK", "STAGE_LOST", "new_ref_key", "stage_list", "owner_of"]

REF_PREFIX = "mesh:ref:"
STAGE_LIST = "mesh:stage:"
STAGED = ":staged"
READY = ":ready"
STAGE_OK = "ok"
STAGE_LOST = "lost"


def new_ref_key() -> str:
    """A fresh ref key: ``mesh:ref:`` and 32 hex digits of a random uuid."""
    return f"{REF_PREFIX}{uuid.uuid4().hex}"


def stage_list(endpoint_id: str) -> str:
    """The list an endpoint's stagers pop staging requests from."""
    return STAGE_LIST + endpoint_id


def owner_of(url: str) -> str:
    """Whose refs these are: a hash of the store URL's login *and* credential (the hub's store
    gives each user an unguessable one), so a task cannot claim another user's local ref by
    writing their user name into a forged ref."""
    u = urlsplit(url)
    return hashlib.sha256(f"{u.username or ''}:{u.password or ''}".encode()).hexdigest()[:32]
