#!/usr/bin/env bash
# Builds the continuum-mesh wheel (agent code only; dependencies are resolved on the target) into
# OUTDIR, which the balena and Apptainer builds copy from: their build contexts cannot reach the
# repository root.
#   device_images/build-wheel.sh device_images/balena/dist
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$1"
mkdir -p "$out"
rm -f "$out"/continuum_mesh-*.whl
python3 -m pip wheel --no-deps --wheel-dir "$out" "$root"
ls "$out"/continuum_mesh-*.whl
