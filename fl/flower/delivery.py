"""Delivering a Flower App to the devices: content-addressed, cached per device, never by hand.

The driver turns the app into a FAB (Flower App Bundle: the zip ``flwr build`` writes, built
here with Flower's own builder so the same include/exclude rules apply; a ``.fab`` file is taken
as it is). Its sha256 names it. Each chosen endpoint is first asked, with a small task, whether
it already holds that hash and whether the app's declared dependencies are installed there;
only endpoints that lack it get the FAB, which :class:`AppInstaller` checks (hash, Flower's
``.info/CONTENT`` manifest, no paths outside the folder) and unpacks into the agent's data dir
under ``flower-apps/<sha256>`` (a temporary folder renamed into place, so a crash mid-install
leaves nothing half-installed that would count as present).

Dependencies (:func:`plan_dependencies`, run on the endpoint by the probe): each of the app's
``[project].dependencies`` whose marker holds is either

* **provided by the agent**: the agent's Python has it at a version in range (extras are not
  checked), so nothing is built for it (flwr, numpy, scikit-learn, torch in the usual case);
* **agent-only** (:data:`AGENT_ONLY`: flwr itself, whose wire format the runner speaks with the
  agent's copy, and the multi-GB frameworks: torch, tensorflow, jax, ...) but missing or out of
  range: the device refuses the app with one line naming each such package, and the run leaves
  it out; these are never downloaded for an app;
* **built**: everything else goes into the pip list of an execution environment
  (docs/environments.md) in which the endpoint runs the app's ClientApp: a uv venv, built once
  per resolved set and shared by every app that needs the same, with the agent's own packages
  after the venv's on the worker's path. A package that cannot be installed fails the warm-up
  with the agent's error naming it, and the run leaves that endpoint out.

Runs on the endpoint without torch; flwr is needed only where the app itself needs it.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional

__all__ = ["AppPackage", "AppInstaller", "AppError", "MissingDependencies", "apps_dir", "installed_dir",
           "check_dependencies", "plan_dependencies", "AGENT_ONLY"]

PROTOCOL = 1
_MAX_FAB = 200 * 1024 * 1024


class AppError(ValueError):
    """The app cannot be used: not a Flower App, a bad FAB, not installed."""


class MissingDependencies(RuntimeError):
    """The device lacks packages the app declares."""


def data_dir() -> Path:
    """The agent's data dir (exported to its workers), else a per-user cache outside agents."""
    raw = os.environ.get("MESH_ENDPOINT_DATA_DIR")
    if raw:
        return Path(raw)
    eid = os.environ.get("MESH_ENDPOINT_ID") or "local"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "continuum-mesh" / eid


def apps_dir() -> Path:
    return data_dir() / "flower-apps"


def installed_dir(sha256: str) -> Path:
    if len(sha256) != 64 or any(ch not in "0123456789abcdef" for ch in sha256):
        raise AppError(f"not an app hash: {sha256!r}")
    return apps_dir() / sha256


def check_dependencies(requirements: List[str]) -> List[str]:
    """What of ``requirements`` (PEP 508 strings) this Python lacks: one phrase per package."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    missing: List[str] = []
    for raw in requirements:
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            missing.append(f"{raw!r} (not a valid requirement: {exc})")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req.name}{req.specifier} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{req.name}{req.specifier} (installed: {have})")
    return missing


#: Packages an app gets from the agent's own Python only, never from a venv built for it: flwr
#: (the ClientApp runner and the driver exchange Flower's protobuf messages through the agent's
#: flwr) and heavy frameworks (a PyPI torch is gigabytes, and a CUDA build would replace the
#: device's own). Canonical names (PEP 503).
AGENT_ONLY = frozenset({
    "flwr", "flwr-nightly", "torch", "torchvision", "torchaudio", "tensorflow", "tensorflow-cpu", "tensorflow-gpu",
    "tf-keras", "jax", "jaxlib", "mxnet", "paddlepaddle", "onnxruntime-gpu", "cupy", "triton",
})


def plan_dependencies(requirements: List[str]) -> Dict[str, List[str]]:
    """Split ``requirements`` (PEP 508) for this Python (see the module doc): ``{"provided":
    [...], "build": [...], "refused": [...]}``. ``provided``: satisfied here (``name==version``
    as installed); ``build``: the requirement strings an execution environment must install;
    ``refused``: one phrase per package that can be neither (agent-only and missing or out of
    range, not a valid requirement, not one an environment accepts)."""
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    out: Dict[str, List[str]] = {"provided": [], "build": [], "refused": []}
    for raw in requirements:
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            out["refused"].append(f"{raw!r} (not a valid requirement: {exc})")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        try:
            have: Optional[str] = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and (not req.specifier or req.specifier.contains(have, prereleases=True)):
            out["provided"].append(f"{name}=={have}")
            continue
        if name in AGENT_ONLY:
            why = "not installed" if have is None else f"installed: {have}"
            out["refused"].append(f"{req.name}{req.specifier} ({why}; comes from the agent's Python only, never downloaded)")
            continue
        if req.url:
            out["refused"].append(f"{raw!r} (a URL requirement; execution environments take names and versions only)")
            continue
        out["build"].append(str(req))
    if out["build"]:
        try:
            from mesh_agent.protocol.environment import normalize

            normalize({"pip": list(out["build"])})
        except Exception as exc:  # the rules every environment spec follows (docs/environments.md)
            out["refused"].append(f"{', '.join(out['build'])} ({exc})")
            out["build"] = []
    return out


def _read_toml(data: bytes) -> Dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(data.decode("utf-8"))
    except Exception as exc:
        raise AppError(f"pyproject.toml is not valid TOML: {exc}") from None


@dataclass
class AppPackage:
    """A Flower App as the driver ships it: the FAB bytes, their hash and what pyproject says."""

    fab: bytes
    sha256: str
    name: str
    version: str
    serverapp: str
    clientapp: str
    config: Dict[str, Any] = field(default_factory=dict)  # [tool.flwr.app.config], flattened
    dependencies: List[str] = field(default_factory=list)
    source: str = ""

    @classmethod
    def load(cls, path: "str | os.PathLike[str]") -> "AppPackage":
        """A Flower App directory (built into a FAB like ``flwr build``) or a ``.fab`` file."""
        p = Path(path).expanduser()
        if p.is_dir():
            if not (p / "pyproject.toml").is_file():
                raise AppError(f"{p} is not a Flower App: it has no pyproject.toml")
            from flwr.cli.build import build_fab_from_disk

            try:
                fab = build_fab_from_disk(p)
            except Exception as exc:  # Flower's own validation (components, names, size)
                raise AppError(f"{p}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
        elif p.is_file():
            fab = p.read_bytes()
        else:
            raise AppError(f"no Flower App at {p}")
        return cls.from_fab(fab, source=str(p))

    @classmethod
    def from_fab(cls, fab: bytes, source: str = "") -> "AppPackage":
        if len(fab) > _MAX_FAB:
            raise AppError(f"the FAB is {len(fab)} bytes, more than {_MAX_FAB}")
        try:
            with zipfile.ZipFile(io.BytesIO(fab)) as z:
                toml = z.read("pyproject.toml")
        except (zipfile.BadZipFile, KeyError) as exc:
            raise AppError(f"{source or 'the FAB'} is not a Flower App Bundle: {exc}") from None
        conf = _read_toml(toml)
        app = ((conf.get("tool") or {}).get("flwr") or {}).get("app") or {}
        comps = app.get("components") or {}
        if not isinstance(comps.get("serverapp"), str) or not isinstance(comps.get("clientapp"), str):
            raise AppError(f"{source or 'the app'}: pyproject.toml needs [tool.flwr.app.components] serverapp and clientapp")
        from flwr.common.config import flatten_dict

        project = conf.get("project") or {}
        return cls(fab=fab, sha256=hashlib.sha256(fab).hexdigest(), name=str(project.get("name", "app")),
                   version=str(project.get("version", "")), serverapp=comps["serverapp"], clientapp=comps["clientapp"],
                   config=flatten_dict(app.get("config") or {}), dependencies=[str(d) for d in project.get("dependencies") or []],
                   source=source)

    def run_config(self, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """``[tool.flwr.app.config]`` with ``overrides`` (as ``flwr run --run-config``): an
        unknown key is an error, as in Flower."""
        from flwr.common.config import fuse_dicts

        try:
            return dict(fuse_dicts(dict(self.config), dict(overrides or {})))
        except ValueError as exc:
            raise AppError(f"--run-config: {exc} (known keys: {', '.join(sorted(self.config)) or 'none'})") from None

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256, "fab_bytes": len(self.fab),
                "serverapp": self.serverapp, "clientapp": self.clientapp, "dependencies": list(self.dependencies)}

    def extract_to(self, target: Path) -> Path:
        """Unpack (driver side: the ServerApp is loaded from here)."""
        _safe_extract(self.fab, target)
        return target


def _safe_extract(fab: bytes, target: Path) -> None:
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        names = z.namelist()
        for n in names:
            pp = PurePosixPath(n)
            if pp.is_absolute() or ".." in pp.parts or "\\" in n:
                raise AppError(f"the FAB holds a path outside its folder: {n!r}")
        manifest = {}
        if ".info/CONTENT" in names:
            for line in z.read(".info/CONTENT").decode("utf-8").splitlines():
                parts = line.rsplit(",", 2)
                if len(parts) == 3:
                    manifest[parts[0]] = parts[1]
        for n in names:
            if n.endswith("/"):
                continue
            data = z.read(n)
            if n in manifest and hashlib.sha256(data).hexdigest() != manifest[n]:
                raise AppError(f"the FAB's {n} does not match its .info/CONTENT hash")
            out = target / n
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)


class AppInstaller:
    """The mesh function that installs a Flower App on an endpoint.

    ``{"v": 1, "kind": "probe", "sha256", "name", "dependencies"}`` -> ``{"installed": bool,
    "environment": {"pip": [...]} or None, "provided": [...]}`` (raises
    :class:`MissingDependencies` naming what can be neither provided nor built: see
    :func:`plan_dependencies`); ``{"v": 1, "kind": "install", ..., "fab": bytes}`` -> unpacks it
    unless present (``{"installed": True, "skipped": bool, ...}``). ``environment``: where the
    endpoint must run the app's ClientApp (None: the agent's own Python).
    """

    name = "flower-app-installer"

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        if not isinstance(task, dict) or task.get("v") != PROTOCOL or task.get("kind") not in ("probe", "install"):
            raise AppError("expected a Flower app probe or install task")
        sha = str(task.get("sha256"))
        target = installed_dir(sha)
        plan = plan_dependencies(list(task.get("dependencies") or []))
        if plan["refused"]:
            raise MissingDependencies(f"Flower app {task.get('name')!r} needs {', '.join(plan['refused'])} on this endpoint "
                                      f"({os.environ.get('MESH_ENDPOINT_NAME') or 'here'}); install them in the agent's Python")
        deps = {"environment": {"pip": plan["build"]} if plan["build"] else None, "provided": plan["provided"]}
        present = (target / "pyproject.toml").is_file()
        if task["kind"] == "probe" or present:
            return {"v": PROTOCOL, "kind": "app", "installed": present, "skipped": present, "path": str(target), **deps}
        fab = task.get("fab")
        if not isinstance(fab, (bytes, bytearray)) or hashlib.sha256(fab).hexdigest() != sha:
            raise AppError(f"the FAB sent for {sha[:12]} does not hash to it")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}-", dir=target.parent))
        try:
            _safe_extract(bytes(fab), tmp)
            try:
                os.rename(tmp, target)
            except OSError:  # another worker installed it meanwhile
                if not (target / "pyproject.toml").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"v": PROTOCOL, "kind": "app", "installed": True, "skipped": False, "path": str(target), **deps}
