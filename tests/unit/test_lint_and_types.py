"""Lint and types are part of the test command (issue 26 item 5, docs/testing.md "Lint and types").

- ``ruff check`` over the whole repository with pyproject.toml's ``[tool.ruff]``: pyflakes (unused
  imports and variables, redefinitions, undefined names) and syntax errors;
- ``mypy`` with pyproject.toml's ``[tool.mypy]`` (the pydantic plugin) on ``scheduler``,
  ``mesh_agent`` and ``cloud_hub/store``.

Both run as subprocesses of this interpreter, so they check the code with the versions the test
venv installs (the ``dev`` extra). The baseline is clean: any finding fails the test with the
tool's own output. Skipped, saying so, only where the tool is not installed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed in this interpreter ({sys.executable}): pip install -e '.[dev]'")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


def _fail(tool: str, proc: subprocess.CompletedProcess[str]) -> None:
    pytest.fail(f"{tool} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_ruff_finds_nothing() -> None:
    proc = _run("ruff", "check", "--output-format", "concise")
    if proc.returncode != 0 or proc.stderr.strip():
        _fail("ruff check", proc)


def test_mypy_finds_nothing() -> None:
    proc = _run("mypy")
    lines = proc.stdout.strip().splitlines()
    # a clean run prints only its one-line summary: errors fail it, and so do notes
    if proc.returncode != 0 or len(lines) != 1 or not lines[0].startswith("Success:") or proc.stderr.strip():
        _fail("mypy", proc)
