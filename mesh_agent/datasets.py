"""Datasets an endpoint declares in its config, and how its workers learn about them.

Why: in federated learning the data must stay on the device. The device's owner names its
datasets in the agent config (``datasets: {digits: "fl.datasets:digits", scans: /srv/scans.npz}``)
and a task asks for one by name (``fl.datasets.load("digits")``); the task never carries data
or a path. The agent only passes the declarations to its workers, through environment
variables set before the workers are spawned (spawned workers inherit the environment). Nothing
is imported or read here: the agent stays light, and a loader (which may import torch or
scikit-learn) runs only inside the task that asks for it.

A declaration is one of:

* ``"module:function"`` -- call ``function()`` (with the task's keyword arguments, if any);
* a path (``.npz`` with arrays ``x``/``X`` and ``y``, or ``.csv`` with the label in the last
  column); relative paths are relative to the agent's ``data_dir``;
* a mapping ``{loader: "module:function", kwargs: {...}}`` or ``{path: ..., kwargs: {...}}``;
  ``kwargs`` are fixed by the device (e.g. which partition of a shared demo dataset it holds).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Dict, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator


__all__ = [
    "DatasetSpec",
    "DatasetDecl",
    "DatasetName",
    "ENV_DATASETS",
    "ENV_ENDPOINT_ID",
    "ENV_ENDPOINT_NAME",
    "ENV_DATA_DIR",
    "normalize",
    "export_worker_env",
    "worker_env",
    "check_name",
]

ENV_DATASETS = "MESH_DATASETS"
ENV_ENDPOINT_ID = "MESH_ENDPOINT_ID"
ENV_ENDPOINT_NAME = "MESH_ENDPOINT_NAME"
#: the agent's data_dir, where device-side state of FL runs lives (secure-aggregation keys)
ENV_DATA_DIR = "MESH_ENDPOINT_DATA_DIR"

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LOADER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"dataset name {name!r} must match {_NAME.pattern}")
    return name


class DatasetSpec(BaseModel):
    """One declared dataset: exactly one of ``loader`` or ``path``, plus fixed ``kwargs``."""

    model_config = ConfigDict(extra="forbid")
    loader: str | None = Field(None, description="module:function returning the dataset")
    path: str | None = Field(None, description=".npz or .csv file on this device")
    kwargs: Dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetSpec":
        if (self.loader is None) == (self.path is None):
            raise ValueError("give exactly one of 'loader' (module:function) or 'path'")
        if self.loader is not None and not _LOADER.match(self.loader):
            raise ValueError(f"loader {self.loader!r} must look like 'package.module:function'")
        if self.path is not None and not self.path.strip():
            raise ValueError("path must not be empty")
        try:
            json.dumps(self.kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kwargs must be plain YAML/JSON values: {exc}") from None
        return self


#: What the config file may hold for one dataset: a string or a mapping.
DatasetDecl = Union[Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)], DatasetSpec]
#: A dataset's name, the key a task asks for.
DatasetName = Annotated[str, StringConstraints(pattern=_NAME.pattern)]


def normalize(decl: DatasetDecl) -> DatasetSpec:
    """A string is a loader when it looks like ``module:function``, else a path."""
    if isinstance(decl, DatasetSpec):
        return decl
    if isinstance(decl, dict):
        return DatasetSpec.model_validate(decl)
    s = str(decl).strip()
    if not s:
        raise ValueError("empty dataset declaration")
    if _LOADER.match(s):
        return DatasetSpec(loader=s)
    return DatasetSpec(path=s)


def export_worker_env(endpoint_id: str, name: str, datasets: Dict[str, DatasetDecl], data_dir: Path) -> None:
    """Put the endpoint's identity and dataset declarations where its workers will see them.

    Call before the worker pool starts. Relative paths are resolved against ``data_dir`` here,
    so a worker's own working directory does not matter.
    """
    os.environ.update(worker_env(endpoint_id, name, datasets, data_dir))


def worker_env(endpoint_id: str, name: str, datasets: Dict[str, DatasetDecl], data_dir: Path) -> Dict[str, str]:
    """The environment variables of :func:`export_worker_env`, without setting them: ``mesh-agent
    start`` computes them with the dataset models at hand and hands them to the light runner."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, decl in datasets.items():
        spec = normalize(decl)
        if spec.path is not None:
            p = Path(spec.path).expanduser()
            spec = spec.model_copy(update={"path": str(p if p.is_absolute() else (Path(data_dir) / p).resolve())})
        out[check_name(key)] = spec.model_dump(exclude_none=True)
    return {ENV_ENDPOINT_ID: endpoint_id, ENV_ENDPOINT_NAME: name, ENV_DATASETS: json.dumps(out, separators=(",", ":")),
            ENV_DATA_DIR: str(Path(data_dir).expanduser().resolve())}
