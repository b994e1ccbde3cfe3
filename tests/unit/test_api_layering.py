"""The API's modules import their shared parts (deps, schemas, the service layer) and never
``cloud_hub.api.app``, which imports them all: no circle, even one hidden in a function body."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "cloud_hub" / "api"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_api_module_imports_the_app() -> None:
    offenders = {p.name for p in API.glob("*.py") if p.name != "app.py" and "cloud_hub.api.app" in _imports(p)}
    assert not offenders, f"these import cloud_hub.api.app back (move what they need to a shared module): {sorted(offenders)}"


def test_console_takes_the_hub_from_the_api_not_the_app() -> None:
    console = API.parent / "console"
    offenders = {str(p.relative_to(console)) for p in console.rglob("*.py") if "cloud_hub.api.app" in _imports(p)}
    assert not offenders, sorted(offenders)
