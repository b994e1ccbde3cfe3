"""The GPUs of this machine, for the agent's hello: asked of ``nvidia-smi`` when it is on PATH.

The agent never imports torch (or CUDA bindings) to find out: one ``nvidia-smi --query-gpu``
call at start-up, bounded by a timeout; no ``nvidia-smi``, a failing one or output that does not
parse means no GPUs reported (and says why in the log). Training functions pick the device
themselves (``fl.torch_support.select_device("auto")``: CUDA where the endpoint has it).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional

__all__ = ["detect_gpus", "parse_query"]

log = logging.getLogger("mesh_agent.gpu")

QUERY = "index,name,memory.total,uuid,driver_version"


def parse_query(text: str) -> List[Dict[str, Any]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,uuid,driver_version
    --format=csv,noheader,nounits`` as ``{"index", "name", "memory_mb", "uuid", "driver"}``."""
    out: List[Dict[str, Any]] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        try:
            mem: Optional[int] = int(float(parts[2]))
        except ValueError:
            mem = None
        gpu: Dict[str, Any] = {"index": int(parts[0]), "name": parts[1][:120], "memory_mb": mem}
        if len(parts) > 3 and parts[3]:
            gpu["uuid"] = parts[3][:80]
        if len(parts) > 4 and parts[4]:
            gpu["driver"] = parts[4][:40]
        out.append(gpu)
    return out[:64]


def detect_gpus(timeout_s: float = 5.0) -> List[Dict[str, Any]]:
    """This machine's NVIDIA GPUs (empty when there are none, or nvidia-smi is missing or
    fails). ``MESH_NO_GPU_PROBE=1`` skips the probe."""
    if os.environ.get("MESH_NO_GPU_PROBE") == "1":
        return []
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi did not answer (%s): reporting no GPUs", exc)
        return []
    if proc.returncode != 0:
        log.warning("nvidia-smi exited %s (%s): reporting no GPUs", proc.returncode, (proc.stderr or proc.stdout).strip()[:200])
        return []
    return parse_query(proc.stdout)
