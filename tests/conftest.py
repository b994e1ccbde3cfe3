"""Shared fixtures: a whole local mesh (real Mosquitto, real hub, real agent processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed (./taskw setup installs it)")

_ROOT = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers come from the folder, not from each module (docs/testing.md): ``tests/unit`` is
    ``unit`` (pure logic and in-process code, no system service: ``./taskw test-unit``);
    everything else (integration, security, console, the outsiders' checks) is ``integration``
    (real brokers, databases, sandboxes and processes)."""
    for item in items:
        try:
            top = Path(str(item.fspath)).resolve().relative_to(_ROOT).parts[0]
        except ValueError:
            continue
        item.add_marker(pytest.mark.unit if top == "unit" else pytest.mark.integration)


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    m = LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0)
    m.start()
    try:
        yield m
    finally:
        m.stop()
