"""Execution environment specs: validation, canonical form and id (docs/environments.md).

Part of the wire protocol (``mesh_agent/protocol``), the layer every side imports. Why one pure
module shared by the SDK, the hub and the agent: the spec travels inside the signed
task message, so all three must agree byte for byte on what a spec means and on its id. The SDK
checks it before anything is sent, the hub checks it again (a client is not trusted), and the
agent checks it a third time before building anything (a hub bug must not turn into a shell
argument). Spelled the way Ray's ``runtime_env`` users know it::

    {"pip": ["numpy>=1.26", "scipy"], "env_vars": {"OMP_NUM_THREADS": "1"}}
    {"uv": [...]}                      # Ray's uv spelling: the same as "pip" here (uv builds both)
    {"container": "/images/fl.sif"}    # or container="..." on submit; never with pip (the image's python3 runs)
    {"sandbox": True, "network": False}
    {"sandbox": True, "tenant": "<user id>"}  # set by the hub: sandboxed workers are per submitter

Requirements are plain names with extras and version specifiers only: no URLs, paths or pip
options (``--index-url`` in a requirement would let a submitter pick where an endpoint downloads
code from; the endpoint's operator chooses the index in the agent config). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

__all__ = ["EnvSpecError", "normalize", "env_id", "encode", "decode", "requirement_name", "MAX_REQUIREMENTS"]

MAX_REQUIREMENTS = 100
_MAX_REQ_LEN = 200
_MAX_VARS = 64
_MAX_VALUE = 4096
_MAX_IMAGE = 500
_KEYS = ("pip", "uv", "env_vars", "container", "sandbox", "network", "tenant")
_TENANT = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

# PEP 508 subset: name, optional [extras], optional comma-separated version specifiers, optional
# "; marker" (markers are evaluated by uv). No "@ url", no paths, nothing that starts with "-".
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_SPEC = r"(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_REQ = re.compile(
    rf"^(?P<name>{_NAME})\s*(?:\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\])?\s*"
    rf"(?:{_SPEC}(?:\s*,\s*{_SPEC})*)?\s*(?:;\s*[A-Za-z0-9_ .'\"<>=!~()-]+)?$"
)
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: Variables a spec may not set: they would change how the worker itself starts or how the agent talks to it.
_RESERVED_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "PYTHONEXECUTABLE", "PYTHONPLATLIBDIR",
                  "GCONV_PATH", "MALLOC_CONF", "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "NLSPATH")
#: Prefixes a spec may not set: the dynamic loader's variables (LD_AUDIT, LD_PRELOAD, ...) load a
#: library into whatever program starts next (issue 25: through bubblewrap, before the sandbox).
_RESERVED_PREFIXES = ("MESH_", "LD_", "GLIBC_TUNABLES")


class EnvSpecError(ValueError):
    """The environment spec is malformed; the message names the key and what is wrong."""


def requirement_name(req: str) -> str:
    """The canonical (PEP 503) project name of a requirement string: ``Foo_Bar[x]>=1`` -> ``foo-bar``."""
    m = _REQ.match(req.strip())
    name = m.group("name") if m else req.strip()
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(key: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise EnvSpecError(f"environment.{key} must be a list of requirement strings, got {type(value).__name__}")
    if len(value) > MAX_REQUIREMENTS:
        raise EnvSpecError(f"environment.{key} has {len(value)} requirements; at most {MAX_REQUIREMENTS}")
    out: set[str] = set()
    for i, req in enumerate(value):
        if not isinstance(req, str):
            raise EnvSpecError(f"environment.{key}[{i}] must be a string, got {type(req).__name__}")
        r = " ".join(req.split())
        if not r or len(r) > _MAX_REQ_LEN or not _REQ.match(r) or re.search(r"(^|\s)-", r):  # no "--option" anywhere
            raise EnvSpecError(
                f"environment.{key}[{i}]: {req[:80]!r} is not a requirement this endpoint accepts "
                "(a name with optional [extras] and version specifiers, e.g. 'numpy>=1.26'; no URLs, paths or pip options)")
        out.add(r)
    return sorted(out)


def _env_vars(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise EnvSpecError(f"environment.env_vars must be a map of names to strings, got {type(value).__name__}")
    if len(value) > _MAX_VARS:
        raise EnvSpecError(f"environment.env_vars has {len(value)} variables; at most {_MAX_VARS}")
    out: dict[str, str] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not _VAR.match(name):
            raise EnvSpecError(f"environment.env_vars: {str(name)[:80]!r} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if name in _RESERVED_VARS or name.startswith(_RESERVED_PREFIXES):
            raise EnvSpecError(f"environment.env_vars: {name} is reserved (it changes how the worker starts)")
        if not isinstance(v, str) or len(v) > _MAX_VALUE or "\x00" in v:
            raise EnvSpecError(f"environment.env_vars[{name!r}] must be a string of at most {_MAX_VALUE} characters without NUL")
        out[name] = v
    return dict(sorted(out.items()))


def _image(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_IMAGE or "\x00" in value or value.startswith("-"):
        raise EnvSpecError(f"environment.container must be an image reference or path of at most {_MAX_IMAGE} characters, "
                           f"got {str(value)[:80]!r}")
    return value.strip()


def normalize(spec: Mapping[str, Any] | None, *, container: str | None = None, sandbox: bool | None = None) -> dict[str, Any] | None:
    """The canonical spec, or None for "the agent's own Python, unsandboxed".

    ``container``/``sandbox`` are the submit keywords; they override the same keys in ``spec``.
    Canonical: requirements sorted and de-duplicated, empty parts dropped, booleans only when
    true, so two spellings of the same environment get the same :func:`env_id`.
    """
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise EnvSpecError(f"environment must be a map (e.g. {{'pip': ['numpy']}}), got {type(spec).__name__}")
    unknown = [k for k in spec if k not in _KEYS]
    if unknown:
        raise EnvSpecError(f"unknown environment key {str(unknown[0])[:40]!r} (known: {', '.join(_KEYS)})")
    out: dict[str, Any] = {}
    reqs: list[str] = []
    for key in ("pip", "uv"):
        if spec.get(key) is not None:
            reqs += _requirements(key, spec[key])
    if reqs:
        out["pip"] = sorted(set(reqs))
    if spec.get("env_vars"):
        out["env_vars"] = _env_vars(spec["env_vars"])
    image = container if container is not None else spec.get("container")
    if image is not None:
        out["container"] = _image(image)
        if reqs:  # the worker runs the image's python3: a venv built on the host would not be used there
            raise EnvSpecError(
                f"environment.{'pip' if spec.get('pip') is not None else 'uv'} and container cannot be combined: a container "
                "worker runs the image's own python3, so the endpoint's venv would not be used; install the packages "
                "in the image instead (or drop container and use a pip environment)")
    for key, value in (("sandbox", sandbox if sandbox is not None else spec.get("sandbox")), ("network", spec.get("network"))):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise EnvSpecError(f"environment.{key} must be true or false, got {type(value).__name__}")
        if value:
            out[key] = True
    if out.get("network") and not out.get("sandbox"):
        del out["network"]  # network is a grant inside the sandbox; unsandboxed workers have it anyway
    tenant = spec.get("tenant")
    if tenant is not None:
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise EnvSpecError(f"environment.tenant must be 1-64 of [A-Za-z0-9_.:-], got {str(tenant)[:80]!r}")
        if out.get("sandbox"):  # sandboxed workers are never shared between submitters (set by the hub)
            out["tenant"] = tenant
    return out or None


def encode(spec: Mapping[str, Any]) -> str:
    """Canonical JSON text of a normalized spec (what is stored and hashed)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def env_id(spec: Mapping[str, Any]) -> str:
    """Short id of a normalized spec: 16 hex digits of SHA-256 over its canonical JSON."""
    return hashlib.sha256(encode(spec).encode()).hexdigest()[:16]


def decode(text: str | bytes | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A spec as received (JSON text or a map), checked and normalized again: a hub or a frame
    is not trusted to have done it. Raises :class:`EnvSpecError`."""
    if text is None:
        return None
    if isinstance(text, (str, bytes)):
        try:
            text = json.loads(text)
        except ValueError as exc:
            raise EnvSpecError(f"environment is not JSON: {exc}") from None
    return normalize(text)  # type: ignore[arg-type]
