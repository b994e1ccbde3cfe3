"""Round drivers (fl.drivers) without a hub: the mode registry. The drivers' rounds run on a
real mesh in tests/integration/test_fl_drivers.py."""

from __future__ import annotations

import pytest

from fl import FedAsync, FedAvg
from fl.drivers import driver_for, drivers, mode_of
from fl.strategies import Hierarchical


def test_builtin_modes_are_registered() -> None:
    assert {"sync", "async", "hierarchical"} <= set(drivers())
    assert mode_of(FedAvg()) == "sync" and mode_of(FedAsync()) == "async" and mode_of(Hierarchical()) == "hierarchical"
    with pytest.raises(ValueError, match="no round driver for mode 'nope'"):
        driver_for("nope")
