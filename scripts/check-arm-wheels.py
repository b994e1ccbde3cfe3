#!/usr/bin/env python3
"""Does the agent install from binary wheels on a Raspberry Pi? ``./taskw check-arm-wheels``.

The agent's dependency set is pyproject's ``[project].dependencies`` (what ``pip install
continuum-mesh`` puts on a device), plus any ``--extra`` asked for. For each target platform
this asks the configured package index (``pip config list``; this machine reaches only its
PyPI mirror) with ``pip download --only-binary=:all: --platform ... --python-version 3.11``:

* first the whole set in one resolve (the proof: pip found a wheel for every package and every
  transitive dependency, for that platform, together);
* then each top-level requirement alone, to name the wheels and, where the set fails, which
  package has no wheel, and whether an sdist exists (then pip on the device builds it: a C
  compiler and headers on the Pi, minutes to hours; or a piwheels.org wheel on Raspberry Pi OS).

Platforms: ``aarch64`` (64-bit Raspberry Pi OS, Pi 3/4/5/Zero 2 W) and ``armv7l`` (32-bit Pi
OS). Pure-Python wheels (``py3-none-any``) count as binary: nothing is compiled.

Prints one JSON object. Exit status: 0 when every platform in ``--require`` (default aarch64)
installs from wheels alone, 1 otherwise, 2 when the index cannot be reached.

The module's pure parts (:func:`agent_requirements`, :func:`parse_pip_output`,
:func:`wheel_kind`) are unit-tested offline (tests/unit/test_arm_wheels.py).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]

#: pip --platform tags per target. A Pi's glibc (Bookworm: 2.36) accepts every manylinux tag up
#: to its own version; these are the ones wheels are published under.
PLATFORMS: dict[str, list[str]] = {
    "aarch64": ["manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64", "manylinux_2_31_aarch64",
                "manylinux_2_34_aarch64", "linux_aarch64"],
    "armv7l": ["manylinux2014_armv7l", "manylinux_2_17_armv7l", "manylinux_2_31_armv7l", "manylinux_2_35_armv7l",
               "linux_armv7l"],
}


def agent_requirements(pyproject_text: str, extras: list[str] | None = None) -> list[str]:
    """``[project].dependencies`` plus the named optional extras (no self-references)."""
    data = tomllib.loads(pyproject_text)
    proj = data.get("project", {})
    name = str(proj.get("name", ""))
    reqs = list(proj.get("dependencies", []))
    opt = proj.get("optional-dependencies", {})
    for e in extras or []:
        if e not in opt:
            raise ValueError(f"no optional extra {e!r} in pyproject (known: {', '.join(sorted(opt))})")
        reqs += [r for r in opt[e] if not r.startswith(name + "[") and r != name]
    return list(dict.fromkeys(reqs))


def req_name(req: str) -> str:
    """Project name of a requirement string, normalized (PEP 503)."""
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def wheel_kind(filename: str) -> str:
    """``pure`` for a py3-none-any wheel, ``binary`` for a platform wheel, ``sdist`` otherwise."""
    if not filename.endswith(".whl"):
        return "sdist"
    parts = filename[:-4].split("-")
    return "pure" if len(parts) >= 3 and parts[-1] == "any" else "binary"


def parse_pip_output(text: str) -> dict[str, Any]:
    """Files pip saved (or found already saved) and the requirement it could not satisfy."""
    files = re.findall(r"(?:Saved|File was already downloaded)\s+(\S+)", text)
    missing = re.findall(r"No matching distribution found for ([^\s]+)", text)
    index = re.findall(r"Looking in indexes:\s*(.+)", text)
    return {"files": [Path(f).name for f in files], "missing": [req_name(m) for m in missing],
            "indexes": index[0].strip() if index else None}


def _pip(args: list[str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pip", "download", "-v", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"pip download timed out after {timeout:.0f}s"
    return r.returncode, r.stdout + r.stderr


def _platform_args(tags: list[str], py: str) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp"]
    for t in tags:
        out += ["--platform", t]
    return out


def check_platform(target: str, reqs: list[str], py: str, work: Path, timeout: float) -> dict[str, Any]:
    tags = PLATFORMS[target]
    dest = work / target
    rc, text = _pip([*_platform_args(tags, py), "-d", str(dest), *reqs], timeout)
    whole = parse_pip_output(text)
    res: dict[str, Any] = {"platform_tags": tags, "all_from_wheels": rc == 0, "indexes": whole["indexes"]}
    if rc not in (0, 1):
        res["error"] = text.strip().splitlines()[-1:] if text.strip() else [f"pip exit {rc}"]
    wheels: dict[str, str] = {f.split("-")[0].lower().replace("_", "-"): f for f in whole["files"]}
    no_wheel: list[dict[str, Any]] = []
    for req in reqs if rc != 0 else []:  # the set failed: per requirement, which wheels, and who lacks one
        rc1, t1 = _pip([*_platform_args(tags, py), "-d", str(dest), req], timeout)
        p = parse_pip_output(t1)
        for f in p["files"]:
            wheels[f.split("-")[0].lower().replace("_", "-")] = f
        for miss in p["missing"] if rc1 else []:
            if any(m["package"] == miss for m in no_wheel):
                continue
            rc2, t2 = _pip(["--no-deps", "--no-binary=:all:", "-d", str(work / "sdist"), miss], timeout)
            sd = parse_pip_output(t2)
            has_sdist = rc2 == 0 and bool(sd["files"])
            no_wheel.append({
                "package": miss, "needed_by": req_name(req), "sdist": sd["files"][0] if has_sdist else None,
                "meaning": ("pip builds it from the sdist on the device (needs a compiler and headers there; slow on a Pi), "
                            "or use piwheels.org (Raspberry Pi OS's default extra index) for a prebuilt armhf wheel"
                            if has_sdist else "no sdist either: cannot be installed from this index on this platform"),
            })
    res["wheels"] = [{"file": f, "kind": wheel_kind(f)} for _, f in sorted(wheels.items())]
    res["binary_wheels"] = sum(1 for f in wheels.values() if wheel_kind(f) == "binary")
    res["pure_wheels"] = sum(1 for f in wheels.values() if wheel_kind(f) == "pure")
    res["no_binary_wheel"] = no_wheel
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.11", help="target CPython (default 3.11: Raspberry Pi OS Bookworm)")
    ap.add_argument("--platforms", default="aarch64,armv7l", help=f"comma-separated, of: {', '.join(PLATFORMS)}")
    ap.add_argument("--require", default="aarch64", help="platforms that must install from wheels alone for exit 0")
    ap.add_argument("--extra", action="append", default=[], help="also check an optional extra (e.g. fl: numpy, torch)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pip call")
    args = ap.parse_args(argv)
    targets = [p for p in args.platforms.split(",") if p]
    bad = [p for p in targets if p not in PLATFORMS]
    if bad:
        print(f"error: unknown platform {bad[0]!r} (known: {', '.join(PLATFORMS)})", file=sys.stderr)
        return 2
    try:
        reqs = agent_requirements((REPO / "pyproject.toml").read_text(), args.extra)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout.strip().splitlines()
    out: dict[str, Any] = {"check": "arm-wheels", "python_version": args.python_version, "requirements": reqs,
                           "extras": args.extra, "pip_config": cfg, "platforms": {}}
    with tempfile.TemporaryDirectory(prefix="arm-wheels-") as tmp:
        for target in targets:
            print(f"[check-arm-wheels] {target}: resolving {len(reqs)} requirements", file=sys.stderr, flush=True)
            out["platforms"][target] = check_platform(target, reqs, args.python_version, Path(tmp), args.timeout)
    out["runtime_s"] = round(time.monotonic() - t0, 1)
    unreachable = all(r.get("error") and not r["wheels"] for r in out["platforms"].values())
    required = [p for p in args.require.split(",") if p in out["platforms"]]
    out["ok"] = all(out["platforms"][p]["all_from_wheels"] for p in required)
    out["required"] = required
    print(json.dumps(out, indent=2))
    return 2 if unreachable else (0 if out["ok"] else 1)


if __name__ == "__main__":
    raise SystemExit(main())
