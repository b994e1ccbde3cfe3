"""Python SDK: ``Client`` for the REST API and ``Executor``, a ``concurrent.futures.Executor``.

    from cloud_hub.client import Client, Executor
    client = Client("http://127.0.0.1:8700", token)
    with Executor(client, endpoint_id="ep-...") as ex:
        print(ex.submit(pow, 2, 10).result())
        print(list(ex.map(abs, range(-5, 0), progress=True)))
"""

from cloud_hub.client._client import Client, HubError
from cloud_hub.client._executor import Executor
from cloud_hub.client._results import RemoteExecutionError, RemoteTraceback

__all__ = ["Client", "Executor", "HubError", "RemoteExecutionError", "RemoteTraceback"]
