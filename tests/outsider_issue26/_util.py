"""Helpers for the outsider checks of issue 26 (bounded subprocesses, the repository's paths)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def run(args: list[str], timeout: float = 60, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(cwd or ROOT))


def py_files(pkg: str) -> Iterator[Path]:
    for p in sorted((ROOT / pkg).rglob("*.py")):
        if "__pycache__" not in p.parts:
            yield p


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_names(path: Path) -> list[tuple[int, str]]:
    """Every module a file names for import: import/from (relative resolved, at any depth, inside
    functions and TYPE_CHECKING blocks too), importlib.import_module("x") and __import__("x")."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out.extend((node.lineno, f"{name}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env
