"""Flower on the mesh.

Two ways in:

* **Flower apps, unchanged** (today's Message API): a Flower App directory (or a FAB from
  ``flwr build``) with ``[tool.flwr.app.components]`` runs with ``mesh-fl run APP_DIR ...``
  (:func:`fl.flower.run.run_app`). Its ``ServerApp`` drives the rounds through
  :class:`fl.flower.grid.MeshGrid`, a Flower ``Grid`` whose messages are mesh tasks; its
  ``ClientApp`` runs on each endpoint (:class:`fl.flower.clientapp.ClientAppRunner`) with a real
  ``Message`` and ``Context``; the app's package reaches the devices content-addressed
  (:mod:`fl.flower.delivery`).
* **Inside ``fl.Federation``** (:mod:`fl.flower.legacy`): ``FlowerClientApp(client_fn)`` runs a
  ``NumPyClient``/``client_fn`` as the client function, ``FlowerStrategy`` aggregates with a
  Flower strategy.

flwr is imported only when these run (``import fl.flower`` alone stays cheap).
"""

from __future__ import annotations

from typing import Any

from .legacy import FlowerClientApp, FlowerStrategy, node_config_for

__all__ = ["FlowerClientApp", "FlowerStrategy", "node_config_for", "MeshGrid", "ClientAppRunner", "AppPackage",
           "run_app", "node_id_of"]

_LAZY = {
    "MeshGrid": "fl.flower.grid",
    "ClientAppRunner": "fl.flower.clientapp",
    "node_id_of": "fl.flower.clientapp",
    "AppPackage": "fl.flower.delivery",
    "run_app": "fl.flower.run",
}


def __getattr__(name: str) -> Any:  # PEP 562
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fl.flower' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
