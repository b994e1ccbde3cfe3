#!/usr/bin/env bash
# Hunt timing-dependent test failures (issue 20). Not for CI: it takes an hour or more.
#   scripts/flaky-hunt.sh [SUITE_RUNS] [TEST_RUNS] [OUT]
# Runs the integration suite SUITE_RUNS times in a row (default 3), then each timing-dependent
# test (failover, leases, outages, reconnects: the list below) TEST_RUNS times (default 20), and
# writes one JSON line per run to OUT (default bench/results/flaky-hunt.jsonl) plus a summary of
# failure rates per test. Run it on an idle machine; the load average at each run is recorded.
set -uo pipefail
cd "$(dirname "$0")/.."
SUITE_RUNS=${1:-3}
TEST_RUNS=${2:-20}
OUT=${3:-bench/results/flaky-hunt.jsonl}
PY=${PY:-.venv/bin/python}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
# HUNT_TESTS="a.py b.py" replaces the list below (e.g. to hunt one test after a fix).
TIMING_TESTS=(
  tests/integration/test_hub_replicas.py
  tests/integration/test_durability.py
  tests/integration/test_local_faults.py
  tests/integration/test_credit_resync.py
  tests/integration/test_end_to_end.py
  tests/integration/test_fl_mesh.py
  tests/integration/test_sim_scenarios.py
  tests/integration/test_first_boot.py
)
if [ -n "${HUNT_TESTS:-}" ]; then read -r -a TIMING_TESTS <<< "$HUNT_TESTS"; fi
run() {  # label, pytest args...
  local label=$1; shift
  local junit; junit=$(mktemp --suffix=.xml)
  local load; load=$(cut -d' ' -f1 /proc/loadavg)
  local t0; t0=$(date +%s)
  timeout 1800 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$junit" "$@" >/tmp/flaky-hunt-last.log 2>&1
  local rc=$?
  "$PY" - "$junit" "$label" "$rc" "$load" "$(( $(date +%s) - t0 ))" >>"$OUT" <<'PY'
import json, sys, xml.etree.ElementTree as ET
junit, label, rc, load, secs = sys.argv[1:]
failed = []
try:
    for case in ET.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
except Exception as exc:  # pytest died before writing the report
    failed.append(f"(no junit report: {exc})")
print(json.dumps({"run": label, "rc": int(rc), "load1": float(load), "seconds": int(secs), "failed": failed}))
PY
  rm -f "$junit"
  if [ "$rc" != 0 ]; then  # keep the failing run's output for the post-mortem
    mkdir -p "$OUT.logs"; cp /tmp/flaky-hunt-last.log "$OUT.logs/${label//\//_}.log"
  fi
  tail -1 "$OUT"
}
for i in $(seq 1 "$SUITE_RUNS"); do run "integration-suite#$i" tests/integration; done
for t in "${TIMING_TESTS[@]}"; do
  for i in $(seq 1 "$TEST_RUNS"); do run "$t#$i" "$t"; done
done
"$PY" - "$OUT" <<'PY'
import collections, json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
per = collections.defaultdict(lambda: [0, 0])
for r in runs:
    key = r["run"].rsplit("#", 1)[0]
    per[key][0] += 1
    per[key][1] += r["rc"] != 0
fails = collections.Counter(f for r in runs for f in r["failed"])
print(json.dumps({"runs": {k: {"runs": n, "failed": f} for k, (n, f) in per.items()},
                  "failing_tests": dict(fails.most_common())}, indent=1))
PY
