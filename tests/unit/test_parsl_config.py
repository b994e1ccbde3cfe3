"""engine: parsl settings: validated in the agent config, turned into the right Parsl objects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from mesh_agent.config import AgentConfig, ConfigError, Credentials, ParslSettings, load_config

parsl = pytest.importorskip("parsl")
from mesh_agent.engine.parsl_engine import build_parsl_config  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _base(tmp_path: Path) -> dict:
    return {"endpoint_id": "ep-1", "name": "login1", "hub_url": "https://hub", "data_dir": str(tmp_path / "q"),
            "credentials_file": str(tmp_path / "c.json")}


def test_documented_examples_are_valid_configs(tmp_path: Path) -> None:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S) if "engine: parsl" in b]
    assert len(blocks) >= 3
    providers = set()
    for block in blocks:
        cfg = AgentConfig.model_validate({**_base(tmp_path), **yaml.safe_load(block)})
        providers.add(cfg.parsl.provider)
        build_parsl_config(cfg.parsl, tmp_path / "run", cfg.workers)  # constructible, submits nothing
    assert providers == {"slurm", "pbspro", "local"}


def test_slurm_and_pbs_settings_reach_the_provider(tmp_path: Path) -> None:
    from parsl.launchers import MpiExecLauncher, SrunLauncher
    from parsl.providers import PBSProProvider, SlurmProvider

    s = ParslSettings(provider="slurm", partition="gpu", account="p1", walltime="00:30:00", min_blocks=1, init_blocks=1,
                      max_blocks=5, launcher="srun", worker_init="module load x", max_idletime=60)
    c = build_parsl_config(s, tmp_path, workers=8)
    (ex,) = c.executors
    assert isinstance(ex.provider, SlurmProvider) and isinstance(ex.provider.launcher, SrunLauncher)
    assert (ex.provider.partition, ex.provider.account, ex.provider.walltime) == ("gpu", "p1", "00:30:00")
    assert (ex.provider.min_blocks, ex.provider.max_blocks, ex.max_workers_per_node) == (1, 5, 8)
    assert c.strategy == "htex_auto_scale" and c.max_idletime == 60 and c.retries == 0 and c.usage_tracking == 0
    p = build_parsl_config(ParslSettings(provider="pbspro", queue="workq", launcher="mpiexec", nodes_per_block=2), tmp_path)
    assert isinstance(p.executors[0].provider, PBSProProvider) and isinstance(p.executors[0].provider.launcher, MpiExecLauncher)
    assert p.executors[0].provider.queue == "workq" and p.executors[0].provider.nodes_per_block == 2
    local = build_parsl_config(ParslSettings(), tmp_path)
    assert local.executors[0].address == "127.0.0.1", "local workers connect over loopback only"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_blocks": 2, "init_blocks": 1, "max_blocks": 3}, "min_blocks <= init_blocks <= max_blocks"),
        ({"init_blocks": 4, "max_blocks": 3}, "min_blocks <= init_blocks <= max_blocks"),
        ({"provider": "pbspro", "partition": "x"}, "partition and qos apply to provider 'slurm' only"),
        ({"provider": "slurm", "queue": "x"}, "queue applies to provider 'pbspro' only"),
        ({"provider": "lsf"}, "provider"),
        ({"walltime": "1h"}, "walltime"),
    ],
)
def test_bad_parsl_settings_are_refused_with_the_reason(tmp_path: Path, settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        ParslSettings.model_validate(settings)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({**_base(tmp_path), "engine": "parsl", "parsl": settings}))
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="parsl"):
        load_config(path)
