#!/usr/bin/env bash
# Installs the Debian packages the tests and demo need, when missing and when we may.
set -euo pipefail
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  echo "setup: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  # The Debian package starts a system broker on :1883; ours start their own on free ports.
else
  echo "setup: missing ${need[*]}; install them (e.g. sudo apt-get install ${need[*]})." >&2
  echo "setup: without mosquitto the hub falls back to its embedded broker." >&2
fi
