"""Write tests/durations.json (seconds per test module) from a JUnit XML report of a whole run.

Why: tests/conftest.py runs the slowest modules first, so a long module never starts last and
sets the suite's wall time. Usage::

    ./taskw test -- --junitxml=/tmp/run.xml
    .venv/bin/python scripts/test_durations.py /tmp/run.xml
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def module_seconds(report: Path) -> dict[str, int]:
    """Seconds per test module (setup, call and teardown), modules of 5 s or more, slowest first."""
    total: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        for i, part in enumerate(parts):
            if part.startswith("test_"):
                total["/".join(parts[: i + 1]) + ".py"] += float(case.get("time") or 0)
                break
    return {m: round(s) for m, s in total.most_common() if s >= 5}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print("usage: scripts/test_durations.py REPORT.xml (a JUnit XML report of the whole suite)", file=sys.stderr)
        return 2
    modules = module_seconds(Path(argv[0]))
    OUT.write_text(json.dumps({"_": "seconds per test module, from a parallel run of the whole suite (tests/conftest.py runs the "
                                     "slowest first); regenerate with scripts/test_durations.py (docs/testing.md)",
                               "modules": modules}, indent=1) + "\n")
    print(f"{OUT}: {len(modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
