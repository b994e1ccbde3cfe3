"""The SDK's ``environment=``, ``container=`` and ``sandbox=`` (docs/environments.md).

Spelled as Ray's ``runtime_env`` users know it: ``environment={"pip": [...], "env_vars": {...}}``
on the Executor (every task), on ``register_function`` (every call of that function) or on one
``submit``; per key, a submit overrides its function, which overrides the Executor, as a Ray
task's runtime_env overrides the job's. The spec is checked here, before anything is queued, so a
typo fails the submit with a ValueError naming the key and nothing is sent.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from mesh_agent.protocol.environment import EnvSpecError, normalize

__all__ = ["ENV_KEYWORDS", "EnvSpecError", "env_options", "pop_env_options", "merge_env"]

#: Submit keywords that are options, not arguments of the function (unless it has such a parameter).
ENV_KEYWORDS = ("environment", "container", "sandbox")


def env_options(environment: Mapping[str, Any] | None = None, container: str | None = None,
                sandbox: bool | None = None) -> dict[str, Any]:
    """One level's options as a plain spec (not yet normalized: levels merge per key first)."""
    if environment is not None and not isinstance(environment, Mapping):
        raise EnvSpecError(f"environment must be a map (e.g. {{'pip': ['numpy']}}), got {type(environment).__name__}")
    out = dict(environment or {})
    if container is not None:
        out["container"] = container
    if sandbox is not None:
        out["sandbox"] = sandbox
    normalize(out)  # fail here, at the level that is wrong
    return out


def pop_env_options(fn: Callable[..., Any] | None, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Take ``environment=``/``container=``/``sandbox=`` out of a submit's keyword arguments,
    unless ``fn`` has a parameter of that name (then it is the function's own argument)."""
    if not any(k in kwargs for k in ENV_KEYWORDS):
        return None
    try:
        params: Mapping[str, Any] = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):
        params = {}
    picked = {k: kwargs.pop(k) for k in ENV_KEYWORDS if k in kwargs and k not in params}
    return env_options(**picked) if picked else None


def merge_env(*levels: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Executor, function, submit (later wins per key) -> the normalized spec, or None."""
    merged: dict[str, Any] = {}
    for level in levels:
        if level:
            merged.update(level)
    return normalize(merged) if merged else None
