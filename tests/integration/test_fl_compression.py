"""Compressed FL updates on a real mesh: top-k with error feedback, whose residual lives in each
device's durable store, survives a power cut (agent and workers SIGKILLed, agent restarted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh
from fl import FedAvg, Federation
from fl.data import load_test_data
from fl.localmesh import add_digits_agents

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration


def test_topk_residual_survives_an_agent_sigkill_and_restart(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    from fl.models import MLP

    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0) as mesh:
        agents = add_digits_agents(mesh, 3, scheme="dirichlet", alpha=0.5, seed=0)
        mesh.wait_online(timeout=120)
        ids = [a.endpoint_id for a in agents]
        victim = agents[1]
        store = Path(victim.cfg.data_dir) / "fl-state"
        seen_before_kill: list = []

        def power_cut_after_round_2(rec: Any, _w: Any) -> None:
            if rec.round == 2:
                seen_before_kill.extend(p.name for p in store.glob("ef-*.bin"))
                victim.kill()  # agent and workers, SIGKILL: nothing gets to clean up
                victim.start()
                mesh.wait_online(victim, timeout=60)

        torch.manual_seed(0)
        fed = Federation(mesh.client, ids)
        hist = fed.fit(MLP(), "digits", rounds=4, strategy=FedAvg(), local_epochs=1, deadline_s=40, min_clients=2,
                       trainer={"threads": 1, "lr": 0.05, "batch_size": 32}, eval_data=load_test_data(),
                       compression="topk:0.2+q8", on_round=power_cut_after_round_2)
    assert len(seen_before_kill) == 1, "the residual was on disk before the power cut"
    assert [r.round for r in hist] == [1, 2, 3, 4]
    assert hist[0].extra["error_feedback"] == {c: None for c in ids}
    assert hist[1].extra["error_feedback"] == {c: 1 for c in ids}
    # after the restart the victim's next update started from the residual round 2 left on its disk
    after = [r for r in hist[2:] if victim.endpoint_id in r.extra.get("error_feedback", {})]
    assert after, [(r.round, r.participants, r.stragglers, r.dropped) for r in hist]
    assert after[0].extra["error_feedback"][victim.endpoint_id] == 2, after[0].extra["error_feedback"]
    assert victim.endpoint_id in after[0].participants
    # and the updates really were small: about a tenth of the global weights sent down
    t = hist.traffic()
    assert t["up_per_update"] < t["down_per_client"] / 6, t
    assert hist[-1].accuracy > 0.6, [r.accuracy for r in hist]
