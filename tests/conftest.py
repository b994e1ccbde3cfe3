"""Shared fixtures: a whole local mesh (real Mosquitto, real hub, real agent processes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed (./taskw setup installs it)")

_ROOT = Path(__file__).resolve().parent


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (what ``./taskw test`` runs): three workers per core, at most 8.

    Why more workers than cores: most integration tests wait (for a broker, a heartbeat, a
    subprocess), so a 2-core machine stays busy with 6. ``MESH_TEST_WORKERS`` overrides it
    (``MESH_TEST_WORKERS=1``: one worker, for a test that must be timed alone)."""
    env = os.environ.get("MESH_TEST_WORKERS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(2, min(8, 3 * cores))


def _module_seconds() -> dict[str, float]:
    try:
        return dict(json.loads((_ROOT / "durations.json").read_text())["modules"])
    except (OSError, ValueError, KeyError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers come from the folder, not from each module (docs/testing.md): ``tests/unit`` is
    ``unit`` (pure logic and in-process code, no system service: ``./taskw test-unit``);
    everything else (integration, security, console, the outsiders' checks) is ``integration``
    (real brokers, databases, sandboxes and processes).

    Modules run slowest first (``tests/durations.json``, measured): with one module per worker
    at a time (``--dist loadfile``), a long module that started last would set the suite's wall
    time. The order within a module is kept; the sort is stable, so every worker collects the
    same order (which xdist requires)."""
    for item in items:
        try:
            top = Path(str(item.fspath)).resolve().relative_to(_ROOT).parts[0]
        except ValueError:
            continue
        item.add_marker(pytest.mark.unit if top == "unit" else pytest.mark.integration)
    seconds = _module_seconds()
    if seconds:
        root = _ROOT.parent

        def weight(item: pytest.Item) -> float:
            try:
                return -seconds.get(Path(str(item.fspath)).resolve().relative_to(root).as_posix(), 0.0)
            except ValueError:
                return 0.0

        items.sort(key=weight)


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
