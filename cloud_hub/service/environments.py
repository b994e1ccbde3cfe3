"""Execution environments on the submit path (docs/environments.md).

Why here and not in the SDK alone: the hub is where the submitter and the endpoint's owner are
both known, so it is the hub that turns the sandbox on for a function submitted by a user other
than the endpoint's owner (the owner's endpoint, shared with them: their code must not read the
agent's keys or other users' files). The spec is checked again (a client is not trusted), stored
canonical with the task and sent inside the signed task frame, so neither a gateway nor the
broker can change it, and the agent checks it a third time before building anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from cloud_hub.service.errors import ServiceError
from mesh_agent.protocol.environment import EnvSpecError, encode, normalize

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub
    from cloud_hub.service.schemas import TaskIn

__all__ = ["task_environments", "apply_environments", "env_for"]


def task_environments(tasks: Sequence["TaskIn"]) -> list[dict[str, Any] | None]:
    """Each task's normalized spec (None: the agent's own Python); 422 naming the first bad one."""
    out: list[dict[str, Any] | None] = []
    for i, t in enumerate(tasks):
        try:
            out.append(normalize(t.environment))
        except EnvSpecError as exc:
            raise ServiceError(422, f"task {i}: {exc}") from None
    return out


def env_for(spec: dict[str, Any] | None, user: str, owner: str | None) -> str | None:
    """The stored ``env`` of a task by ``user`` on an endpoint enrolled by ``owner``.

    One rule for every path that puts a task on an endpoint (submit, and a re-placement off a
    lost endpoint): anyone's task on an endpoint they do not own runs sandboxed, tagged with its
    submitter as the tenant. Never loosens: a spec already sandboxed stays sandboxed."""
    if owner is not None and owner != user and not (spec or {}).get("sandbox"):
        spec = {**(spec or {}), "sandbox": True}
    if spec and spec.get("sandbox"):
        # The submitter, never what a client claims: sandboxed workers of two users are never
        # the same process (one user's function could read what another's left in memory or /tmp).
        spec = normalize({**spec, "tenant": user})
    elif spec:
        spec = normalize({k: v for k, v in spec.items() if k != "tenant"})
    return encode(spec) if spec else None


async def apply_environments(h: "Hub", user: str, rows: list[dict[str, Any]], specs: list[dict[str, Any] | None]) -> None:
    """Set each row's ``env``: its spec, sandboxed where the endpoint it was placed on belongs to
    someone else. One indexed query per submit, for the endpoints of this batch only."""
    eps = {r["endpoint_id"] for r in rows if r["endpoint_id"] is not None}
    owners = await h.store.endpoint_owners_of(eps) if eps else {}
    for r, spec in zip(rows, specs):
        r["env"] = env_for(spec, user, owners.get(r["endpoint_id"]))
