"""Python SDK: ``Client`` for the REST API, ``Executor`` (a ``concurrent.futures.Executor``) and
``AsyncExecutor`` for asyncio. Configuration comes from ``mesh-hub login`` (or ``MESH_HUB_URL`` /
``MESH_TOKEN``), so no arguments are needed beyond where to run (docs/sdk.md):

    from cloud_hub.client import Executor
    with Executor(endpoint_id="ep-...") as ex:
        print(ex.submit(pow, 2, 10).result())
        print(list(ex.map(abs, range(-5, 0), progress=True)))

Globus Compute scripts: ``from cloud_hub.client.globus_compute import Executor, ShellFunction``.
"""

import sys as _sys

from mesh_agent.protocol.serialize import by_value

# The SDK sends arguments that name the user's own modules by value (an agent need not look).
# (By sys.modules: the package attribute ``serialize`` is the function, not the module.)
_sys.modules["mesh_agent.protocol.serialize"].detect_user_modules_in_data = True

from cloud_hub.client._async import AsyncExecutor  # noqa: E402
from cloud_hub.client._client import AuthError, Client, HubError, HubUnreachable, NotAHub  # noqa: E402
from cloud_hub.client._config import ConfigError  # noqa: E402
from cloud_hub.client._executor import Executor, SubmitTimeout  # noqa: E402
from cloud_hub.client._results import RemoteExecutionError, RemoteTraceback  # noqa: E402

__all__ = ["AsyncExecutor", "AuthError", "Client", "ConfigError", "Executor", "HubError", "HubUnreachable", "NotAHub",
           "RemoteExecutionError", "RemoteTraceback", "SubmitTimeout", "by_value"]
