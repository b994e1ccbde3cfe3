"""Python SDK: ``Client`` for the REST API, ``Executor`` (a ``concurrent.futures.Executor``) and
``AsyncExecutor`` for asyncio. Configuration comes from ``mesh-hub login`` (or ``MESH_HUB_URL`` /
``MESH_TOKEN``), so no arguments are needed beyond where to run (docs/sdk.md):

    from cloud_hub.client import Executor
    with Executor(endpoint_id="ep-...") as ex:
        print(ex.submit(pow, 2, 10).result())
        print(list(ex.map(abs, range(-5, 0), progress=True)))

Globus Compute scripts: ``from cloud_hub.client.globus_compute import Executor, ShellFunction``.
"""

# Importing the SDK changes no process-wide setting: arguments that name the user's own modules go
# by value because the SDK asks for it in each call (``serialize(..., user_modules=True)``,
# ``Client.task_spec``), not through a flag that would also change an agent's worker that loads
# the SDK to resolve a ref.
from cloud_hub.client._async import AsyncExecutor
from cloud_hub.client._client import AuthError, Client, HubError, HubUnreachable, NotAHub
from cloud_hub.client._config import ConfigError
from cloud_hub.client._executor import Executor, SubmitTimeout
from cloud_hub.client._results import RemoteExecutionError, RemoteTraceback
from mesh_agent.protocol.serialize import by_value

__all__ = ["AsyncExecutor", "AuthError", "Client", "ConfigError", "Executor", "HubError", "HubUnreachable", "NotAHub",
           "RemoteExecutionError", "RemoteTraceback", "SubmitTimeout", "by_value"]
