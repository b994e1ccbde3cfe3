"""The agent's footprint profile: ``metered`` (a device on a paid, slow link) or ``lan``.

Why presets: the settings that decide what an idle device costs (keepalive, heartbeats,
compression, warm workers) only make sense together, and a user deploying a Pi on a prepaid SIM
should not have to know all of them. ``profile:`` in the config picks a preset; any of the single
settings (``mqtt.keepalive``, ``worker_idle_s``, ``compress``, ``heartbeat_min_s``) still wins.

Default when ``profile`` is not set: ``metered`` for MQTT to a broker that is not on this machine
(a real device in a field), ``lan`` otherwise (ZeroMQ, which is for LAN and HPC endpoints, and
anything on loopback: the demo, the tests, a hub on the same box). The numbers are in
docs/protocol.md, "Liveness and idle cost".
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mesh_agent.config import AgentConfig

__all__ = ["Footprint", "resolve", "is_loopback"]

#: Until the hub's welcome says otherwise (the first connection of a metered agent).
PROVISIONAL_KEEPALIVE_S = 60
LAN_KEEPALIVE_S = 30
METERED_WORKER_IDLE_S = 60.0
METERED_BEAT_MIN_S = 30.0


@dataclass(frozen=True)
class Footprint:
    """What the profile decided, after explicit settings were applied."""

    name: Literal["metered", "lan"]
    adaptive: bool  # heartbeats on state change and at the hub's longest interval, not every heartbeat_s
    compress: bool  # zlib for bodies over 1 KiB, to a hub that reads them
    worker_idle_s: float | None  # None: a warm pool from start-up; else on demand, reaped after this
    keepalive: int | None  # set by the user; None: lan 30 s, metered from the hub's welcome
    beat_min_s: float  # adaptive: state changes are reported at most this often


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine (a name is loopback only if it is ``localhost``)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve(cfg: "AgentConfig") -> Footprint:
    name = cfg.profile
    if name is None:
        name = "metered" if cfg.transport == "mqtt" and not is_loopback(cfg.mqtt.host) else "lan"
    metered = name == "metered"
    idle = cfg.worker_idle_s if cfg.worker_idle_s is not None else (METERED_WORKER_IDLE_S if metered else None)
    return Footprint(
        name=name,
        adaptive=metered,
        compress=cfg.compress if cfg.compress is not None else metered,
        worker_idle_s=idle,
        keepalive=cfg.mqtt.keepalive,
        beat_min_s=cfg.heartbeat_min_s if cfg.heartbeat_min_s is not None else (METERED_BEAT_MIN_S if metered else cfg.heartbeat_s),
    )
