"""Prometheus alert rules shipped with the hub (``rules.yml``, Prometheus rule format).

Why a package: the rules travel inside the wheel next to the code that exports the metrics they
name, so a rule can never refer to a metric this version does not have. ``mesh-hub`` prints the
path (``RULES_PATH``) for a Prometheus config's ``rule_files``; the compose file mounts it.
The metrics are described in ``cloud_hub/metrics.py`` and docs/operations.md ("Monitoring").
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RULES_PATH"]

#: The rules file: one group, ``continuum-mesh``, with the alerts of docs/operations.md.
RULES_PATH: Path = Path(__file__).with_name("rules.yml")
