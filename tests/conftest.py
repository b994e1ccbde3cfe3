"""Shared fixtures: a whole local mesh (real Mosquitto, real hub, real agent processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed (./taskw setup installs it)")


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
