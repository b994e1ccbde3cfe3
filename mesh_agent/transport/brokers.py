"""A list of MQTT brokers (the nodes of one cluster) and which of them to use next.

Why: one Mosquitto is a single point of failure and a ceiling; a clustered broker (a NATS
cluster with MQTT, docs/operations.md "Clustered broker") gives several addresses that all carry
the same sessions. A client connects to one at a time and, when that connection is lost or cannot
be made, moves on to the next one (the caller keeps its own backoff and jitter), so a killed node
costs a reconnect, not an outage. A working broker is kept: nothing moves while it answers.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["BrokerList", "parse_hostport"]

_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+))(?::(?P<port>\d{1,5}))?$")


def parse_hostport(text: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port); ValueError with one line naming the entry.

    A URL (``mqtt://...``) is refused rather than guessed at: TLS and WebSockets are the
    ``mqtt.tls`` / ``mqtt.transport`` settings, which apply to every broker in the list."""
    s = str(text).strip()
    if "://" in s:
        raise ValueError(f"broker {text!r}: give host:port, not a URL (TLS and WebSockets are set by mqtt.tls and mqtt.transport)")
    m = _HOSTPORT.match(s)
    if m is None:
        raise ValueError(f"broker {text!r} is not host:port")
    port = int(m["port"]) if m["port"] else default_port
    if not 1 <= port <= 65535:
        raise ValueError(f"broker {text!r}: port {port} is out of range 1-65535")
    return (m["v6"] or m["host"]), port


class BrokerList:
    """Brokers in the order given, and the one in use; :meth:`failed` moves to the next.

    Shared by every connection a client makes over its lifetime (each connection is a new link
    object), so the position survives reconnects."""

    def __init__(self, brokers: Iterable[tuple[str, int]]) -> None:
        self.brokers = list(brokers)
        if not self.brokers:
            raise ValueError("an empty broker list")
        self._i = 0
        self.failovers = 0  # how many times a lost or refused connection moved us on

    @property
    def current(self) -> tuple[str, int]:
        return self.brokers[self._i]

    def failed(self, broker: tuple[str, int]) -> None:
        """The connection to ``broker`` was lost or refused: the next connection tries the next one.

        Only when ``broker`` is still the current one, so two reports of the same loss (a failed
        send and the end of the message stream) move the position once."""
        if len(self.brokers) > 1 and self.current == broker:
            self._i = (self._i + 1) % len(self.brokers)
            self.failovers += 1

    def __len__(self) -> int:
        return len(self.brokers)

    def __repr__(self) -> str:
        return f"BrokerList({', '.join(f'{h}:{p}' for h, p in self.brokers)}; current {self.current[0]}:{self.current[1]})"
