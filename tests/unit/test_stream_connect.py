"""The SDK's stream reader must survive whatever a restarting hub does to a handshake.

A hub SIGKILLed and started again resets connections mid-handshake. Depending on when the reset
lands, websockets raises ``ConnectionResetError``, ``InvalidMessage`` (no HTTP answer: it was
taken for "this hub has no stream", and the Executor read over REST for the rest of its life) or
``ConnectionClosedError`` (a race between its reader and the request being sent; it escaped
``HubStream._connect`` and killed the Executor's result thread, so every later future waited
forever: tests/integration/test_sdk_hub_restart.py, 1 run in 5 under load). Every one of them
must mean "try again". A real TCP peer on loopback that resets the connection reproduces the
first two; the third is caught by the same clause and, should anything else slip through,
``HubStream.run`` keeps its thread alive and retries."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from cloud_hub.client import Client
from cloud_hub.client._stream import HubStream
from cloud_hub.client._client import HubUnreachable


def _resetting_server(n: int, read_first: bool) -> tuple[int, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(10)

    def serve() -> None:
        with srv:
            for _ in range(n):
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                conn.settimeout(5)
                if read_first:
                    try:
                        conn.recv(4096)  # the HTTP upgrade request
                    except OSError:
                        pass
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST, as a process killed mid-handshake leaves it

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv.getsockname()[1], t


@pytest.mark.parametrize("read_first", [False, True], ids=["reset-at-accept", "reset-after-request"])
def test_a_handshake_reset_is_hub_unreachable_not_a_crash(read_first: bool) -> None:
    """Both resets mean "try again", never "this hub has no stream" (which would drop to REST for
    good) and never an exception the reader thread does not expect."""
    port, t = _resetting_server(1, read_first)
    client = Client(f"http://127.0.0.1:{port}", "cm_" + "x" * 40)
    try:
        with pytest.raises(HubUnreachable, match="cannot open the stream"):
            HubStream(client)._connect(0)
    finally:
        client.close()
        t.join(10)
