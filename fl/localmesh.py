"""FL on a ``LocalMesh``: agents that each declare their own share of a dataset.

Used by the demo, the tests and the benchmark; also a template for a real fleet, where each
device's ``agent.yaml`` gets the same ``datasets:`` entry with its own ``index``.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Sequence

from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.datasets import DatasetDecl

__all__ = ["declare_datasets", "add_digits_agents", "add_digits_site", "DigitsMesh", "digits_mesh"]


def declare_datasets(agent: AgentProcess, datasets: Dict[str, DatasetDecl]) -> None:
    """Write ``datasets`` into a (not yet started, or to be restarted) agent's config file."""
    raw = json.loads(agent.cfg.model_dump_json())
    raw["datasets"] = {**raw.get("datasets", {}), **{k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in datasets.items()}}
    agent.cfg = type(agent.cfg).model_validate(raw)  # validated before it is written
    agent.cfg.save(agent.config_path)


def add_digits_agents(mesh: LocalMesh, num_clients: int, *, scheme: str = "dirichlet", alpha: float = 0.5,
                      seed: int = 0, prefix: str = "fl-client", transport: "str | Sequence[str]" = "mqtt", workers: int = 1,
                      start: bool = True, extra: Dict[str, Any] | None = None) -> List[AgentProcess]:
    """``num_clients`` agents; agent k declares ``digits`` = partition k of ``num_clients``.
    ``transport``: one for all, or one per agent (``["mqtt", "mqtt", "zmq"]``)."""
    transports = [transport] * num_clients if isinstance(transport, str) else list(transport)
    if len(transports) != num_clients:
        raise ValueError(f"{len(transports)} transports for {num_clients} agents")
    agents = []
    for k in range(num_clients):
        a = mesh.add_agent(f"{prefix}-{k}", transports[k], workers=workers, prefetch=4, start=False)
        kwargs = {"index": k, "num_clients": num_clients, "scheme": scheme, "alpha": alpha, "seed": seed}
        declare_datasets(a, {"digits": {"loader": "fl.datasets:digits", "kwargs": kwargs}, **(extra or {})})
        if start:
            a.start()
        agents.append(a)
    return agents


def add_digits_site(mesh: LocalMesh, gateway: Any, num_clients: int, *, scheme: str = "dirichlet", alpha: float = 0.5,
                    seed: int = 0, prefix: str = "fl-site", offset: int = 0, total: int | None = None,
                    start: bool = True, **settings: Any) -> List[AgentProcess]:
    """``num_clients`` devices behind the site ``gateway`` (they dial its site broker, docs/sites.md);
    device k declares ``digits`` = partition ``offset + k`` of ``total`` (default ``num_clients``)."""
    total = num_clients if total is None else total
    agents = []
    for k in range(num_clients):
        a = mesh.add_site_device(f"{prefix}-{offset + k}", gateway, start=False, **settings)
        kwargs = {"index": offset + k, "num_clients": total, "scheme": scheme, "alpha": alpha, "seed": seed}
        declare_datasets(a, {"digits": {"loader": "fl.datasets:digits", "kwargs": kwargs}})
        if start:
            a.start()
        agents.append(a)
    return agents


@dataclass
class DigitsMesh:
    """A running mesh with digits clients (``clients``) and any other agents (``others``, by name)."""

    mesh: LocalMesh
    clients: List[AgentProcess]
    others: Dict[str, AgentProcess] = field(default_factory=dict)

    @property
    def ids(self) -> List[str]:
        return [a.endpoint_id for a in self.clients]


@contextmanager
def digits_mesh(workdir: Path, num_clients: int, *, others: Mapping[str, str] | None = None,
                heartbeat_s: float = 0.5, lost_after_s: float = 2.5, lease_s: float = 4.0,
                **agents: Any) -> Iterator[DigitsMesh]:
    """Mosquitto, the hub and ``num_clients`` digits agents (:func:`add_digits_agents` with
    ``agents`` as its options), plus ``others`` (name -> transport: one-worker agents without
    data, e.g. a gateway), all online; stopped on exit. The FL tests' mesh: fast heartbeats so an
    agent's loss is noticed in seconds."""
    from cloud_hub.broker import find_mosquitto

    if find_mosquitto() is None:
        raise RuntimeError("mosquitto is required for FL on a local mesh: run ./taskw setup (apt-get install mosquitto)")
    m = LocalMesh(Path(workdir), heartbeat_s=heartbeat_s, lost_after_s=lost_after_s, lease_s=lease_s)
    m.start()
    try:
        clients = add_digits_agents(m, num_clients, **agents)
        extra = {name: m.add_agent(name, transport, workers=1, prefetch=4) for name, transport in (others or {}).items()}
        m.wait_online(timeout=120)
        yield DigitsMesh(m, clients, extra)
    finally:
        m.stop()
