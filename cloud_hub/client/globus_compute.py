"""Globus Compute's SDK names over the mesh: change the import line and the endpoint id.

    from cloud_hub.client.globus_compute import Executor, ShellFunction   # was: globus_compute_sdk

What maps to what (docs/sdk.md, "Migrating from Globus Compute"): ``Executor(endpoint_id=...)``,
``submit``, ``register_function``, ``submit_to_registered_function(function_id, args, kwargs)``,
``task_group_id``, ``reload_tasks()``, ``task_count_submitted``, ``shutdown``; ``Client()`` with
``register_function``, ``run``, ``create_batch`` / ``batch_run``, ``get_result``, ``get_task``,
``session_task_group_id``; ``ShellFunction`` / ``ShellResult``. Arguments that only make sense
for Globus's services (``amqp_port``, ``label``, ``user_endpoint_config``...) are accepted and
ignored, so scripts run unchanged.
"""

from __future__ import annotations

import uuid
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from cloud_hub.client._client import Client as _MeshClient
from cloud_hub.client._executor import Executor as _MeshExecutor
from cloud_hub.client._shell import ShellFunction, ShellResult

__all__ = ["Executor", "Client", "Batch", "ComputeFuture", "ShellFunction", "ShellResult"]

#: Globus Compute's future type is a ``concurrent.futures.Future``; so is ours.
ComputeFuture = Future

_IGNORED = {"amqp_port", "label", "user_endpoint_config", "resource_specification", "container_id", "api_burst_limit",
            "api_burst_window_s", "result_serializers", "serializer", "funcx_client", "batch_interval", "batch_size"}


class Client(_MeshClient):
    """Globus Compute's ``Client`` (configured by ``mesh-hub login`` instead of Globus Auth)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for k in list(kwargs):
            if k in _IGNORED or k in ("environment", "login_manager", "app_name", "code_serialization_strategy",
                                      "data_serialization_strategy", "do_version_check"):
                kwargs.pop(k)
        super().__init__(*args, **kwargs)
        self.session_task_group_id = str(uuid.uuid4())

    def register_function(self, function: Callable[..., Any], function_name: str | None = None, **_: Any) -> str:  # type: ignore[override]
        return super().register_function(function, function_name)

    def run(self, *args: Any, endpoint_id: str, function_id: str, **kwargs: Any) -> str:
        """Submit one task; returns its id."""
        ids, _ = self.submit_batch_placed([_MeshClient.task_spec(endpoint_id, function_id, args, kwargs)],
                                          uuid.uuid4().hex, task_group_id=self.session_task_group_id)
        return ids[0]

    def create_batch(self, task_group_id: str | None = None, endpoint_id: str | None = None, **_: Any) -> "Batch":
        return Batch(task_group_id or self.session_task_group_id, endpoint_id)

    def batch_run(self, batch: "Batch", endpoint_id: str | None = None) -> list[str]:
        specs = [_MeshClient.task_spec(ep or endpoint_id or batch.endpoint_id, fid, args, kwargs)  # type: ignore[arg-type]
                 for fid, ep, args, kwargs in batch.tasks]
        ids, _ = self.submit_batch_placed(specs, uuid.uuid4().hex, task_group_id=batch.task_group_id)
        return ids

    def get_task(self, task_id: str) -> dict[str, Any]:
        t = self.task_status(task_id)
        return {**t, "pending": t["state"] != "done", "status": t["state"]}

    def get_result(self, task_id: str, timeout_s: float = 60.0) -> Any:  # type: ignore[override]
        return super().get_result(task_id, timeout_s)


class Batch:
    """Tasks gathered for one ``Client.batch_run``."""

    def __init__(self, task_group_id: str, endpoint_id: str | None = None) -> None:
        self.task_group_id = task_group_id
        self.endpoint_id = endpoint_id
        self.tasks: list[tuple[str, str | None, tuple[Any, ...], dict[str, Any]]] = []

    def add(self, function_id: str, endpoint_id: str | None = None, args: Sequence[Any] | None = None,
            kwargs: dict[str, Any] | None = None) -> None:
        self.tasks.append((function_id, endpoint_id, tuple(args or ()), dict(kwargs or {})))


class Executor(_MeshExecutor):
    """Globus Compute's ``Executor``: ``Executor(endpoint_id=...)``; ``client=`` takes either client."""

    def __init__(self, endpoint_id: str | None = None, client: _MeshClient | None = None, task_group_id: str | None = None,
                 **kwargs: Any) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED}
        super().__init__(client, endpoint_id, task_group_id=task_group_id, **kwargs)

    def register_function(self, fn: Callable[..., Any], function_id: str | None = None, **func_register_kwargs: Any) -> str:  # type: ignore[override]
        if function_id is not None:
            return function_id
        return super().register_function(fn, func_register_kwargs.get("function_name"))
