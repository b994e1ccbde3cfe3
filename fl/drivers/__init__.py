"""Round drivers: one per mode of federated rounds, behind one small interface.

``Federation.fit`` builds the run's :class:`RunParams` and hands it to the driver of its mode:

* ``sync`` (:class:`SyncDriver`): FedAvg, FedProx, Flower strategies;
* ``async`` (:class:`AsyncDriver`): FedAsync, FedBuff;
* ``hierarchical`` (:class:`HierarchicalDriver`): ``Hierarchical`` with gateways.

A new mode is one new module with one ``@register_driver`` class (a :class:`RoundDriver`
subclass with a ``mode`` name and ``run_rounds``, or a subclass of an existing driver that
overrides a hook); a strategy picks it with ``driver = "<mode>"``, or ``fit(..., driver=...)``
names it. See docs/fl.md, "Writing a round driver".
"""

from __future__ import annotations

from typing import Dict, Type, Union

from ._base import (
    Aggregate,
    Arrival,
    Collected,
    Evaluation,
    FederationError,
    RoundDriver,
    RunParams,
    json_safe,
    short_error,
    to_update,
)

__all__ = ["Aggregate", "Arrival", "Collected", "Evaluation", "FederationError", "RoundDriver", "RunParams",
           "json_safe", "short_error", "to_update", "register_driver", "driver_for", "drivers", "mode_of"]

_DRIVERS: Dict[str, Type[RoundDriver]] = {}


def register_driver(cls: Type[RoundDriver]) -> Type[RoundDriver]:
    """Class decorator: make ``cls`` the driver of ``cls.mode``."""
    if not cls.mode:
        raise ValueError(f"{cls.__name__} has no mode name")
    _DRIVERS[cls.mode] = cls
    return cls


def drivers() -> Dict[str, Type[RoundDriver]]:
    return dict(_DRIVERS)


def driver_for(mode: Union[str, Type[RoundDriver]]) -> Type[RoundDriver]:
    if isinstance(mode, type) and issubclass(mode, RoundDriver):
        return mode
    try:
        return _DRIVERS[str(mode)]
    except KeyError:
        raise ValueError(f"no round driver for mode {mode!r} (have: {', '.join(sorted(_DRIVERS))})") from None


def mode_of(strategy: object) -> str:
    """The mode a strategy runs in: its ``driver`` attribute when set, else async for
    asynchronous strategies, hierarchical for ``Hierarchical``, sync otherwise."""
    from fl.strategies import Hierarchical

    named = getattr(strategy, "driver", None)
    if named:
        return str(named)
    if getattr(strategy, "is_async", False):
        return "async"
    return "hierarchical" if isinstance(strategy, Hierarchical) else "sync"


# the built-in modes (imported last: they register themselves)
from .sync import SyncDriver  # noqa: E402
from .asynchronous import AsyncDriver  # noqa: E402
from .hierarchical import HierarchicalDriver  # noqa: E402

__all__ += ["SyncDriver", "AsyncDriver", "HierarchicalDriver"]
