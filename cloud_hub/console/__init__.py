"""The hub's web console at ``/console``: server-rendered pages, live updates by server-sent events.

``create_app`` includes :data:`router`; see ``docs/console.md``.
"""

from cloud_hub.console.routes import router

__all__ = ["router"]
