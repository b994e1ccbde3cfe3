"""GPUs in the agent's hello: nvidia-smi's answer parsed, never torch; and FL training on CUDA
where the endpoint has it (skipped without a GPU)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mesh_agent.gpu import detect_gpus, parse_query

H100 = "0, NVIDIA H100 80GB HBM3, 81559, GPU-6f1c2d3e-aaaa-bbbb-cccc-0123456789ab, 550.54.15\n" \
       "1, NVIDIA H100 80GB HBM3, 81559, GPU-7f1c2d3e-aaaa-bbbb-cccc-0123456789ab, 550.54.15\n"


def _fake_smi(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return d


def test_parse_query_rows() -> None:
    gpus = parse_query(H100 + "garbage line\n\n")
    assert gpus == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559, "uuid": "GPU-6f1c2d3e-aaaa-bbbb-cccc-0123456789ab", "driver": "550.54.15"},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559, "uuid": "GPU-7f1c2d3e-aaaa-bbbb-cccc-0123456789ab", "driver": "550.54.15"},
    ]
    assert parse_query("0, Tesla T4, [N/A]\n") == [{"index": 0, "name": "Tesla T4", "memory_mb": None}]


def test_detect_uses_nvidia_smi_and_reports_none_when_it_is_missing_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_NO_GPU_PROBE", raising=False)
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path, f"printf '{H100}'\n")) + os.pathsep + os.environ["PATH"])
    assert [g["index"] for g in detect_gpus()] == [0, 1]
    monkeypatch.setenv("MESH_NO_GPU_PROBE", "1")
    assert detect_gpus() == []
    monkeypatch.delenv("MESH_NO_GPU_PROBE")
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")) + os.pathsep + "/usr/bin:/bin")
    assert detect_gpus() == []
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path, "sleep 5\n")) + os.pathsep + "/usr/bin:/bin")
    assert detect_gpus(timeout_s=0.3) == []
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert detect_gpus() == []


def test_gpu_probe_never_imports_torch() -> None:
    code = "import sys, mesh_agent.gpu as g; g.detect_gpus(); assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_real_nvidia_smi_when_present() -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi on this machine")
    gpus = detect_gpus()
    assert gpus and all(g["name"] and (g["memory_mb"] or 0) > 0 for g in gpus)


def test_torch_client_app_trains_on_cuda_where_the_endpoint_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    from fl import datasets
    from fl.client import TorchClientApp, TrainerConfig
    from fl.models import MLP
    from fl.wire import decode_weights, encode_weights
    from mesh_agent.datasets import export_worker_env

    for k in ("MESH_DATASETS", "MESH_ENDPOINT_ID", "MESH_ENDPOINT_NAME", "MESH_ENDPOINT_DATA_DIR"):
        monkeypatch.setenv(k, "")
    datasets.clear_cache()
    export_worker_env("ep-g", "gpu-node", {"digits": {"loader": "fl.datasets:digits", "kwargs": {"index": 0, "num_clients": 2}}}, tmp_path)
    try:
        torch.manual_seed(0)
        app = TorchClientApp(MLP(), TrainerConfig(threads=1))  # device "auto"
        w0 = app.initial_weights()
        task = {"v": 1, "kind": "warmup", "client_id": "ep-g", "dataset": "digits"}
        assert app(task)["device"].startswith("cuda")
        out = app({"v": 1, "kind": "train", "run_id": "flr-g", "round": 1, "client_id": "ep-g", "base_version": 0,
                   "weights": encode_weights(w0), "dataset": "digits", "config": {"local_epochs": 1}})
        assert out["device"].startswith("cuda")
        w1 = decode_weights(out["weights"])
        assert all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(w0, w1)) and not np.allclose(w0[0], w1[0])
        loss, m = app.evaluate(w1, (np.zeros((8, 64), np.float32), np.zeros(8, np.int64)))
        assert loss > 0 and 0 <= m["accuracy"] <= 1
    finally:
        datasets.clear_cache()
