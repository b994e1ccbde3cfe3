"""User code travels (issue 18 item 3): an FL driver whose model class exists only in the driver
script (``python driver.py``, so it really is ``__main__``) trains on three agents. Before, each
client failed with "Can't get attribute 'Tiny' on <module '__main__'>" and every round waited out
its deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.localmesh import LocalMesh

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

DRIVER = '''
import json, sys
import torch
from torch import nn
from cloud_hub.client import Client
from fl import FedAvg, Federation
from fl.data import load_test_data


class Tiny(nn.Module):  # defined here, in __main__, and nowhere on the devices
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
fed = Federation(Client(), sys.argv[1].split(","))
hist = fed.fit(Tiny(), "digits", rounds=2, strategy=FedAvg(), local_epochs=1, deadline_s=60, min_clients=3,
               trainer={"threads": 1, "lr": 0.05, "batch_size": 32}, eval_data=load_test_data(), name="tiny-in-main")
print(json.dumps([{"round": r.round, "participants": sorted(r.participants), "accuracy": r.accuracy} for r in hist]))
'''


def test_fl_model_class_defined_in_the_driver_script_trains_on_three_agents(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests")
    from fl.localmesh import add_digits_agents

    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=3.0, lease_s=5.0) as m:
        agents = add_digits_agents(m, 3, scheme="iid", seed=0, transport="zmq")
        m.wait_online(timeout=120)
        ids = [a.endpoint_id for a in agents]
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        env.update(MESH_HUB_URL=m.url, MESH_TOKEN=m.token, MESH_CONFIG=str(tmp_path / "none.yaml"))
        out = subprocess.run([sys.executable, str(script), ",".join(ids)], capture_output=True, text=True, env=env, timeout=500,
                             cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    hist = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["round"] for r in hist] == [1, 2]
    assert all(r["participants"] == sorted(ids) for r in hist), hist  # no client excluded
    assert hist[-1]["accuracy"] > 0.5, hist  # it trained (10 classes: chance is 0.1)
