"""The offline parts of scripts/check-arm-wheels.py: which requirements make up the agent's
dependency set, and how pip's output is read. (The network check itself is ``./taskw
check-arm-wheels``, not a test.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_arm_wheels", REPO / "scripts" / "check-arm-wheels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cw = _script()

PYPROJECT = """
[project]
name = "continuum-mesh"
dependencies = ["pydantic>=2.6", "pyzmq>=26", "PyYAML>=6"]
[project.optional-dependencies]
fl = ["numpy>=1.24", "torch>=2.2", "continuum-mesh[hub]"]
"""


def test_agent_set_is_the_project_dependencies_plus_asked_extras() -> None:
    assert cw.agent_requirements(PYPROJECT) == ["pydantic>=2.6", "pyzmq>=26", "PyYAML>=6"]
    assert cw.agent_requirements(PYPROJECT, ["fl"])[-2:] == ["numpy>=1.24", "torch>=2.2"]  # no self-reference
    with pytest.raises(ValueError, match="no optional extra 'gpu'"):
        cw.agent_requirements(PYPROJECT, ["gpu"])


def test_the_real_pyproject_has_the_agent_dependencies() -> None:
    names = {cw.req_name(r) for r in cw.agent_requirements((REPO / "pyproject.toml").read_text())}
    assert {"pydantic", "pyzmq", "aiomqtt", "msgpack", "psutil", "pyyaml"} <= names
    assert "torch" not in names  # the agent never needs torch


def test_names_are_normalized_and_wheels_classified() -> None:
    assert cw.req_name("PyYAML>=6") == "pyyaml" and cw.req_name("paho_mqtt[x]>=2") == "paho-mqtt"
    assert cw.wheel_kind("pyzmq-26.4.0-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl") == "binary"
    assert cw.wheel_kind("dill-0.3.9-py3-none-any.whl") == "pure"
    assert cw.wheel_kind("msgpack-1.1.0.tar.gz") == "sdist"


def test_pip_output_is_parsed() -> None:
    text = """Looking in indexes: https://pypi.org/simple, file:///opt/pypi/simple
Saved /tmp/x/pydantic_core-2.27.2-cp311-cp311-manylinux_2_17_armv7l.manylinux2014_armv7l.whl
File was already downloaded /tmp/x/typing_extensions-4.12.2-py3-none-any.whl
ERROR: Could not find a version that satisfies the requirement msgpack>=1.0 (from versions: none)
ERROR: No matching distribution found for msgpack>=1.0
"""
    p = cw.parse_pip_output(text)
    assert p["files"] == ["pydantic_core-2.27.2-cp311-cp311-manylinux_2_17_armv7l.manylinux2014_armv7l.whl",
                          "typing_extensions-4.12.2-py3-none-any.whl"]
    assert p["missing"] == ["msgpack"] and p["indexes"].startswith("https://pypi.org/simple")
