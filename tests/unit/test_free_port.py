"""free_port: ports for the servers tests and LocalMesh start, outside the kernel's ephemeral range
(where outgoing connections take their source ports and could take ours before the server binds)."""

from __future__ import annotations

import socket

import pytest

from cloud_hub import broker
from cloud_hub.broker import free_port


def test_ports_lie_below_the_ephemeral_range_are_bindable_and_never_repeat() -> None:
    lo = broker._ephemeral_start()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(broker._PORT_FLOOR <= p < lo for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = [taken] * 3  # the first three draws hit the listener
        real = broker._port_rng.randrange
        monkeypatch.setattr(broker._port_rng, "randrange", lambda a, b: draws.pop() if draws else real(a, b))
        monkeypatch.setattr(broker, "_ephemeral_start", lambda: taken + 2000)
        got = free_port()
    assert draws == [] and got != taken


def test_seeding_the_global_generator_does_not_fix_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes that seed ``random`` alike (simulations do) must not draw the same ports.
    Each draw here starts with an empty memory of handed-out ports, as a fresh process would."""
    import collections
    import random

    def draws() -> list[int]:
        monkeypatch.setattr(broker, "_handed_out", collections.deque(maxlen=4096))
        random.seed(1)
        return [free_port() for _ in range(3)]

    assert draws() != draws()


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker, "_ephemeral_start", lambda: 10_500)
    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
