"""Built-in endpoint classes, modelled on real hardware.

Speeds are per worker, relative to one Raspberry Pi Zero 2 W core, per *function kind*:

* ``numeric`` - dense numpy/BLAS work: scales with cores, clock, SIMD width and memory
  bandwidth (Cortex-A53 @ 1 GHz -> A72 @ 1.8 GHz -> A76 @ 2.4 GHz -> laptop x86 -> server
  x86 with AVX-512);
* ``train`` - small-model local training (PyTorch CPU): like numeric, a little less extreme;
* ``io`` - fetch, parse, write small files: dominated by storage and network latency, so fast
  CPUs help little (and an HPC node's shared parallel file system is poor at small files).

Workers follow memory: a Zero 2 W (512 MB) fits one Python worker with numpy; a Pi 4/5 one
per core; a laptop 8; an HPC node 64. Links: rural Wi-Fi/LTE for Pis, broadband for laptops,
a campus network for HPC. Cold start = starting a worker and importing the function's
libraries: slow on SD cards, slow-ish on HPC (container start + imports from a parallel file
system). ``benchmark`` is the CPU score an agent would report at registration (the scheduler's
``speed`` hint): it tracks ``numeric`` and is deliberately wrong for ``io``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

KINDS = ("numeric", "train", "io")


@dataclass(frozen=True)
class HardwareClass:
    name: str
    workers: int
    speed: dict[str, float]
    benchmark: float
    rtt_s: float
    bandwidth_bps: float  # bytes per second
    cold_start_s: float
    memory_mb: int
    warm_slots: int  # functions an endpoint keeps warm at once (LRU)
    gpu: bool = False
    tags: tuple[str, ...] = field(default=())

    def with_overrides(self, over: dict[str, Any]) -> "HardwareClass":
        kw = dict(over)
        if "speed" in kw:
            kw["speed"] = {**self.speed, **kw["speed"]}
        if "tags" in kw:
            kw["tags"] = tuple(kw["tags"])
        return replace(self, **kw)


CATALOG: dict[str, HardwareClass] = {
    "pi-zero-2w": HardwareClass(
        "pi-zero-2w", workers=1, speed={"numeric": 1.0, "train": 1.0, "io": 1.0}, benchmark=1.0,
        rtt_s=0.12, bandwidth_bps=0.25e6, cold_start_s=8.0, memory_mb=512, warm_slots=1,
        tags=("arm", "edge"),
    ),
    "pi4": HardwareClass(
        "pi4", workers=4, speed={"numeric": 3.5, "train": 3.0, "io": 1.6}, benchmark=3.2,
        rtt_s=0.06, bandwidth_bps=2.5e6, cold_start_s=3.0, memory_mb=4096, warm_slots=4,
        tags=("arm", "edge"),
    ),
    "pi5": HardwareClass(
        "pi5", workers=4, speed={"numeric": 8.0, "train": 7.0, "io": 2.0}, benchmark=7.5,
        rtt_s=0.05, bandwidth_bps=6.25e6, cold_start_s=1.5, memory_mb=8192, warm_slots=6,
        tags=("arm", "edge"),
    ),
    "laptop": HardwareClass(
        "laptop", workers=8, speed={"numeric": 14.0, "train": 12.0, "io": 2.5}, benchmark=14.0,
        rtt_s=0.03, bandwidth_bps=12.5e6, cold_start_s=1.0, memory_mb=16384, warm_slots=8,
        tags=("x86",),
    ),
    "hpc": HardwareClass(
        "hpc", workers=64, speed={"numeric": 24.0, "train": 20.0, "io": 2.0}, benchmark=20.0,
        rtt_s=0.04, bandwidth_bps=125e6, cold_start_s=6.0, memory_mb=262144, warm_slots=16,
        tags=("x86", "hpc"),
    ),
}
