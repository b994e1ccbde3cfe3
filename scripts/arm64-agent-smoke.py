#!/usr/bin/env python3
"""Run the agent on an arm64 Debian root (qemu-user-static + binfmt_misc) against a local hub.

Prerequisites (root; see docs/simulator.md, "ARM"): ``apt-get install qemu-user-static
debootstrap``; the qemu-aarch64 binfmt handler registered (``cat
/usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register`` where systemd does
not do it); an arm64 root made with ``debootstrap --arch=arm64 --variant=minbase
--include=python3,python3-venv,python3-pip,ca-certificates bookworm ROOT``; and in it a venv
``/opt/mesh`` holding this project and its dependencies, installed from aarch64 wheels only
(``pip download --only-binary=:all: --platform manylinux2014_aarch64 ...`` on the host, then
``pip install --no-index --find-links``).

What it does: starts Mosquitto and a hub process on this machine (loopback), enrolls an agent
(on the host: enrollment is one HTTP call), puts its config and credentials at the same paths
inside the root, starts ``/opt/mesh/bin/python -m mesh_agent.cli start`` under ``chroot`` (an
aarch64 Python, every instruction emulated by qemu), waits for the hub to list it online, runs
a function on it that reports ``platform.machine()``, and prints one JSON object.

    python scripts/arm64-agent-smoke.py --root /var/tmp/arm64-root
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def where_am_i() -> dict[str, str]:
    import platform
    import sys as _s

    return {"machine": platform.machine(), "python": _s.version.split()[0], "executable": _s.executable}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/arm64-root"))
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for online and for the task")
    args = ap.parse_args()
    root = args.root.resolve()
    py = root / "opt/mesh/bin/python"
    if not py.exists():
        print(json.dumps({"ok": False, "error": f"{py} missing: build the arm64 root first (see this script's docstring)"}))
        return 2
    from cloud_hub.client import Executor
    from cloud_hub.localmesh import LocalMesh

    tmp = Path(tempfile.mkdtemp(prefix="arm64-smoke-"))
    out: dict[str, object] = {"root": str(root), "ok": False}
    proc = None
    mounted = []  # /proc (psutil) and /dev/shm (multiprocessing) inside the root, if not there yet
    for fstype, target in (("proc", root / "proc"), ("tmpfs", root / "dev/shm")):
        target.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mountpoint", "-q", str(target)]).returncode != 0:
            subprocess.run(["mount", "-t", fstype, fstype, str(target)], check=True)
            mounted.append(target)
    try:
        with LocalMesh(tmp / "mesh", hub_process=True) as mesh:
            agent = mesh.add_agent("pi-arm64", "mqtt", workers=1, start=False)
            for f in (agent.config_path, Path(agent.cfg.credentials_file)):
                dst = root / str(f).lstrip("/")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst)
            (root / str(agent.cfg.data_dir).lstrip("/")).mkdir(parents=True, exist_ok=True)
            log = open(tmp / "agent.log", "wb")
            t0 = time.monotonic()
            proc = subprocess.Popen(["chroot", str(root), "/opt/mesh/bin/python", "-m", "mesh_agent.cli", "start",
                                     "--config", str(agent.config_path)], stdout=log, stderr=subprocess.STDOUT)
            try:
                mesh.wait_online(agent, timeout=args.timeout)
                out["start_to_online_s"] = round(time.monotonic() - t0, 2)
            except TimeoutError:
                out["error"] = "agent not online"
                out["agent_log"] = (tmp / "agent.log").read_text(errors="replace")[-2000:]
                return 1
            with Executor(mesh.client, agent.endpoint_id) as ex:
                t1 = time.monotonic()
                out["remote"] = ex.submit(where_am_i).result(timeout=args.timeout)
                out["first_task_s"] = round(time.monotonic() - t1, 2)
                t2 = time.monotonic()
                out["second_task_s"] = (ex.submit(where_am_i).result(timeout=args.timeout), round(time.monotonic() - t2, 2))[1]
            out["host_machine"] = where_am_i()["machine"]
            out["ok"] = out["remote"]["machine"] == "aarch64"  # type: ignore[index]
            return 0 if out["ok"] else 1
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
