"""The FL part of an emulation workload: a real :class:`fl.Federation` run (FedAvg, the demo's
MLP on non-IID digits) driven through the SDK against the emulated agents, while the task
workload runs on the same agents and workers.

Each FL client agent declares its own Dirichlet share of scikit-learn's digits in its config
(:func:`declare`), as a real device would; the run is checked at the end: it must finish with
every round done and every round aggregating at least ``min_clients`` updates.
"""

from __future__ import annotations

import time
from typing import Any

from cloud_hub.localmesh import AgentProcess

from .scenario import FLSpec

__all__ = ["declare", "run_fl"]


def declare(agent: AgentProcess, index: int, num_clients: int, spec: FLSpec, seed: int) -> None:
    """Write the agent's ``digits`` partition into its (not yet started) config."""
    from fl.localmesh import declare_datasets

    kwargs = {"index": index, "num_clients": num_clients, "scheme": "dirichlet", "alpha": spec.alpha, "seed": seed}
    declare_datasets(agent, {"digits": {"loader": "fl.datasets:digits", "kwargs": kwargs}})


def run_fl(url: str, token: str, endpoints: list[str], spec: FLSpec, seed: int, name: str) -> dict[str, Any]:
    """Run the federation to the end (bounded by its deadlines) and summarise it; never raises:
    a failure is reported as ``ok: False`` with the error."""
    t0 = time.time()
    out: dict[str, Any] = {"clients": len(endpoints), "rounds_planned": spec.rounds, "ok": False}
    min_clients = spec.min_clients or len(endpoints)
    try:
        import torch  # the driver evaluates the global model; the agents import torch in their workers

        from cloud_hub.client import Client
        from fl import FedAvg, Federation
        from fl.data import load_test_data
        from fl.models import MLP

        torch.manual_seed(seed)
        client = Client(url, token, timeout=60)
        try:
            fed = Federation(client, endpoints)
            hist = fed.fit(MLP(), "digits", rounds=spec.rounds, strategy=FedAvg(), local_epochs=spec.local_epochs,
                           deadline_s=spec.deadline_s, min_clients=min_clients, max_extensions=2,
                           trainer={"threads": 1, "lr": 0.05}, eval_data=load_test_data(), name=name, seed=seed,
                           warmup_s=max(120.0, spec.deadline_s))
            run = client.fl_run(fed.run_id)  # type: ignore[arg-type]
        finally:
            client.close()
        recs = list(hist)
        out.update(
            run_id=fed.run_id, status=run.get("status"), rounds_done=len(recs),
            participants=[len(r.participants) for r in recs],
            stragglers=sum(len(r.stragglers) for r in recs),
            accuracy=[None if r.accuracy is None else round(r.accuracy, 4) for r in recs],
            round_time_s=[None if r.round_time_s is None else round(r.round_time_s, 2) for r in recs],
        )
        out["ok"] = (run.get("status") == "finished" and len(recs) == spec.rounds
                     and all(len(r.participants) >= min_clients for r in recs))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["wall_s"] = round(time.time() - t0, 1)
    return out
