#!/bin/sh
# Container entry point: fix ownership of the named volume (root-owned on first mount), then run
# the agent as the unprivileged `mesh` user. First boot enrolls from the device variables
# MESH_HUB_URL and MESH_ENROLL_TOKEN (set by `mesh-hub fleet push-tokens` or the dashboard).
set -eu
mkdir -p /data
chown -R mesh:mesh /data
chmod 0700 /data
exec setpriv --reuid=mesh --regid=mesh --init-groups --inh-caps=-all -- mesh-agent "$@"
