#!/bin/sh
# Container entry point. First boot enrolls from the device variables MESH_HUB_URL and
# MESH_ENROLL_TOKEN (set by `mesh-hub fleet push-tokens` or the dashboard).
#
# The agent runs as root *in this container* (which is not privileged: docker-compose.yml lists the
# few capabilities it keeps). balenaOS turns unprivileged user namespaces off, so only a root agent
# can start the bubblewrap sandboxes that other users' tasks run in; each sandbox drops to uid 65534
# with no capability before any of their code runs.
#
# MESH_AGENT_USER=mesh (a device or fleet variable) runs the agent as the unprivileged `mesh` user
# instead, as this image did before: then tasks of users the owner shared the endpoint with fail with
# "sandbox (bubblewrap) cannot start on this endpoint: ..." and never run unsandboxed.
set -eu
mkdir -p /data
case "${MESH_AGENT_USER:-root}" in
  root)
    chown -R root:root /data
    chmod 0700 /data
    exec mesh-agent "$@"
    ;;
  mesh)
    chown -R mesh:mesh /data
    chmod 0700 /data
    exec setpriv --reuid=mesh --regid=mesh --init-groups --inh-caps=-all --bounding-set=-all -- mesh-agent "$@"
    ;;
  *)
    echo "mesh-entrypoint: MESH_AGENT_USER must be root or mesh, not ${MESH_AGENT_USER}" >&2
    exit 2
    ;;
esac
