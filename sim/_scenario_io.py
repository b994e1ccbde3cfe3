"""Reading scenario files: shared by the discrete-event (``sim.des``) and emulation
(``sim.emulate``) modes, so both report an unreadable or malformed file the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["ScenarioError", "format_errors", "read_mapping"]


class ScenarioError(ValueError):
    """A scenario file that cannot be used, with a message that says where and why."""


def read_mapping(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The scenario's top-level mapping and a name for it in messages (the path, or ``<dict>``)."""
    where = "<dict>"
    if isinstance(source, (str, Path)):
        where = str(source)
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ScenarioError(f"{where}: cannot read scenario: {exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"{where}: not valid YAML: {exc}") from None
    else:
        data = source
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: a scenario must be a mapping at the top level")
    return data, where


def format_errors(err: ValidationError, fields_in: str) -> str:
    """One line per problem, with its path; an unknown field points at the module that lists the fields."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (check the spelling; see {fields_in} for the fields)"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)
