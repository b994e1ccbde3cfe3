"""The hub's service layer: what a request does, whichever way it came in (REST, the SDK's
WebSocket stream, the console). Below ``cloud_hub.api`` (HTTP only: routers, dependencies, request
and response schemas) and above the hub's core (``store``, ``dispatcher``, ``placement``).

- ``hub``: :class:`Hub`, what every route shares (config, store, dispatcher, placement, admission,
  access, metrics) and its start and stop; ``endpoint_out``.
- ``submit``: task acceptance (``accept``), one path for every way a task arrives.
- ``admit``: admission control and memoization on that path.
- ``environments``: execution environments on that path (``env_for``: the sandbox rule).
- ``cancel``: cancelling tasks.
- ``schemas``: the task and endpoint shapes the service takes and gives (pydantic; the API's
  request and response bodies use them).
- ``errors``: :class:`ServiceError`, a refusal that changed nothing; ``cloud_hub.api`` answers it
  with its HTTP status.

Never imports ``cloud_hub.api`` nor FastAPI (tests/unit/test_layers.py). Nothing is imported here,
so a core module may import one of these modules lazily (placement's ``env_for``) without
loading the rest.
"""
