#!/usr/bin/env bash
# Build the agent wheel into dist/ and push this folder to a balena fleet (needs balena-cli and
# `balena login`). Usage: device_images/balena/push.sh my-org/field-pis
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: $0 FLEET" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
"$here/../build-wheel.sh" "$here/dist"
exec balena push "$1" --source "$here"
