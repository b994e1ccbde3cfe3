"""Hostile packages, built offline in the test.

``build_hostile_sdist``: a source distribution whose in-tree PEP 517 build backend runs code the
moment any frontend (uv, pip) imports it, to learn metadata or to build a wheel.

What the backend does on import, wherever it runs: it appends one JSON line to ``marker`` (a host
path the agent's user can write) saying who it ran as and whether it could read ``key_file`` (the
agent's credentials). Then it builds a real wheel whose module ``<name>.BUILD_SAW`` holds what it saw,
so a task importing it reports where its build ran. Run inside a sandbox, the marker write fails
(the host path is hidden or read-only) and the key is not readable; run by the agent, both work.
No build requirements (``requires = []``, ``backend-path = ["."]``): uv needs no index to build it.

``compile_audit_library`` + ``build_binary_wheel``: a plain wheel (nothing runs at install) that
carries a shared library; installed into a tenant's venv on the host, it is a file the tenant chose
at a path the tenant can work out, ready for a loader variable such as ``LD_AUDIT``.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

__all__ = ["build_binary_wheel", "build_hostile_sdist", "compile_audit_library"]

_BACKEND = r'''
import base64, hashlib, json, os, zipfile

NAME = {name!r}
VERSION = {version!r}
MARKER = {marker!r}
KEY_FILE = {key_file!r}


def _observe():
    seen = {{"uid": os.getuid(), "pid": os.getpid(), "cwd": os.getcwd()}}
    try:
        with open(KEY_FILE) as f:
            seen["key"] = f.read()[:4096]
    except OSError as exc:
        seen["key"] = None
        seen["key_error"] = f"{{type(exc).__name__}}: {{exc}}"
    try:
        with open(MARKER, "a") as f:
            f.write(json.dumps(seen) + "\n")
        seen["marker_written"] = True
    except OSError as exc:
        seen["marker_written"] = False
        seen["marker_error"] = f"{{type(exc).__name__}}: {{exc}}"
    return seen


SEEN = _observe()  # on import: what a frontend does first


def _metadata():
    return f"Metadata-Version: 2.1\nName: {{NAME}}\nVersion: {{VERSION}}\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist = f"{{NAME}}-{{VERSION}}.dist-info"
    os.makedirs(os.path.join(metadata_directory, dist), exist_ok=True)
    with open(os.path.join(metadata_directory, dist, "METADATA"), "w") as f:
        f.write(_metadata())
    return dist


def _hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = f"{{NAME}}-{{VERSION}}.dist-info"
    files = {{
        f"{{NAME}}/__init__.py": ("BUILD_SAW = " + repr(SEEN) + "\n").encode(),
        f"{{dist}}/METADATA": _metadata().encode(),
        f"{{dist}}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hostile\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }}
    record = "".join(f"{{p}},{{_hash(d)}},{{len(d)}}\n" for p, d in files.items()) + f"{{dist}}/RECORD,,\n"
    whl = f"{{NAME}}-{{VERSION}}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, whl), "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{{dist}}/RECORD", record)
    return whl


def build_sdist(sdist_directory, config_settings=None):
    raise RuntimeError("not needed")
'''


def build_hostile_sdist(out_dir: Path, name: str, version: str, *, marker: Path, key_file: Path) -> Path:
    """Write ``<name>-<version>.tar.gz`` (no wheel of it exists anywhere) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    root = f"{name}-{version}"
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "pyproject.toml": (f'[build-system]\nrequires = []\nbuild-backend = "hostile_backend"\nbackend-path = ["."]\n\n'
                           f'[project]\nname = "{name}"\nversion = "{version}"\n'),
        "hostile_backend.py": _BACKEND.format(name=name, version=version, marker=str(marker), key_file=str(key_file)),
    }
    path = out_dir / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


_AUDIT_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Runs wherever the dynamic loader loads this file: as an LD_AUDIT library of whatever program a
 * tenant's variables reach. Outside the sandbox it can write MARKER and read KEY; inside it cannot. */
static void note_inside(const char *exe) {
    /* Inside a sandbox: say in its own /tmp who loaded us, with which privileges. */
    FILE *t = fopen("/tmp/mesh-sec-audit.log", "a");
    if (!t)
        return;
    fprintf(t, "exe=%s uid=%d", exe, (int)getuid());
    FILE *st = fopen("/proc/self/status", "r");
    if (st) {
        char line[256];
        while (fgets(line, sizeof line, st)) {
            if (!strncmp(line, "CapEff:", 7) || !strncmp(line, "NoNewPrivs:", 11) || !strncmp(line, "Seccomp:", 8)) {
                line[strcspn(line, "\n")] = 0;
                fprintf(t, " %s", line);
            }
        }
        fclose(st);
    }
    fputc('\n', t);
    fclose(t);
}

__attribute__((constructor)) static void mesh_sec_loaded(void) {
    char exe[512] = "?";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0)
        exe[n] = 0;
    FILE *m = fopen(MARKER, "a");
    if (!m) {
        note_inside(exe);
        return;
    }
    fprintf(m, "loaded into %s, pid %d, uid %d\n", exe, (int)getpid(), (int)getuid());
    FILE *k = fopen(KEY, "r");
    if (k) {
        char buf[4096];
        size_t r = fread(buf, 1, sizeof buf, k);
        fwrite(buf, 1, r, m);
        fclose(k);
    }
    fclose(m);
}

unsigned int la_version(unsigned int v) { return v; }
"""


def compile_audit_library(out: Path, *, marker: Path, key_file: Path) -> bytes | None:
    """A shared library that reports, on load, where it was loaded (None: no C compiler here)."""
    import shutil
    import subprocess

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    src, so = out / "mesh_sec_audit.c", out / "mesh_sec_audit.so"
    src.write_text(_AUDIT_C)
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", f'-DMARKER="{marker}"', f'-DKEY="{key_file}"', "-o", str(so), str(src)],
                   check=True, capture_output=True)
    return so.read_bytes()


def build_binary_wheel(out_dir: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """Like tests/fixtures/wheels.py ``build_wheel``, for files that are bytes (a shared library)."""
    import base64
    import hashlib
    import zipfile

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    out_dir.mkdir(parents=True, exist_ok=True)
    pkg = name.replace("-", "_")
    dist = f"{pkg}-{version}.dist-info"
    entries = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
               f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: mesh-sec\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},{digest(d)},{len(d)}\n" for p, d in entries.items()) + f"{dist}/RECORD,,\n"
    path = out_dir / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in entries.items():
            z.writestr(p, d)
        z.writestr(f"{dist}/RECORD", record)
    return path
