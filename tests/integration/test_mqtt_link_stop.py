"""Regression (found by the flaky-test hunt, issue 20): the hub's MQTT link must stop even when
leaving the connection fails. When the broker drops the connection while the client says
DISCONNECT, aiomqtt's ``__aexit__`` raises ``MqttError`` ("Unexpected disconnection") in place of
the cancellation ``stop()`` delivered; the link's reconnect loop caught that as an ordinary lost
link, reconnected, and the hub's shutdown (``HubThread.stop``) waited on it forever: about one hub
restart in ten on a loaded machine (test_durability's hub-restart test). The race itself cannot be
timed from a test, so its outcome is produced at the library boundary: the real ``__aexit__`` runs
against a real Mosquitto, then raises as it does in that race."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiomqtt
import pytest

from cloud_hub.broker import MosquittoBroker
from mesh_agent.transport.mqtt import MqttHubLink

pytestmark = pytest.mark.integration


async def _noop(endpoint: str, frame: bytes, link: object) -> None:
    return None


async def test_hub_link_stops_when_leaving_the_connection_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_exit = aiomqtt.Client.__aexit__
    exits = []

    async def exit_as_in_the_race(self: aiomqtt.Client, *exc: object) -> None:
        await real_exit(self, *exc)
        exits.append(exc[0])
        raise aiomqtt.MqttError("Unexpected disconnection")

    with MosquittoBroker(tmp_path / "broker") as broker:
        # set before connecting: `async with` looks its __aexit__ up when the block is entered
        monkeypatch.setattr(aiomqtt.Client, "__aexit__", exit_as_in_the_race)
        link = MqttHubLink("127.0.0.1", broker.port, identifier="hub-stop-test")
        await link.start(_noop)
        assert link.connected
        await asyncio.wait_for(link.stop(), 30)  # before the fix: reconnected and never returned
        assert exits and exits[0] is asyncio.CancelledError, "the cancellation did reach the client's exit"
        assert link._task is not None and link._task.done()
