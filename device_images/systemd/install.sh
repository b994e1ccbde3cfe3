#!/usr/bin/env bash
# Installs the Continuum Mesh agent as a systemd service on Raspberry Pi OS / Debian / Ubuntu.
#
#   sudo device_images/systemd/install.sh --hub https://hub.example.org --token ce_... [--name pi-7]
#        [--transport mqtt|zmq] [--source PIP_SPEC] [--no-start]
#
# What it does: a system user `continuum-mesh`; a virtualenv in /opt/continuum-mesh/venv with the
# agent (from this checkout unless --source names a wheel or requirement); enrollment settings in
# /etc/continuum-mesh/agent.env (0640 root:continuum-mesh); the unit; `systemctl enable --now`.
# The agent enrolls on its first start and keeps config + queue in /var/lib/continuum-mesh.
# Running it again upgrades the agent in place and keeps the enrollment.
set -euo pipefail

unit_name=continuum-mesh-agent.service
user=continuum-mesh
prefix=/opt/continuum-mesh
etc=/etc/continuum-mesh
state=/var/lib/continuum-mesh
here="$(cd "$(dirname "$0")" && pwd)"
hub="" token="" name="" transport="mqtt" source="" start=1

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "install.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --hub) hub="${2:-}"; shift 2 ;;
    --token) token="${2:-}"; shift 2 ;;
    --name) name="${2:-}"; shift 2 ;;
    --transport) transport="${2:-}"; shift 2 ;;
    --source) source="${2:-}"; shift 2 ;;
    --no-start) start=0; shift ;;
    -h|--help) usage 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ "$(id -u)" = "0" ] || die "run as root (sudo)"
command -v systemctl >/dev/null || die "systemd not found; run 'mesh-agent start' under your own supervisor"
case "$transport" in mqtt|zmq) ;; *) die "--transport must be mqtt or zmq" ;; esac
if [ ! -f "$state/agent.yaml" ]; then
  [ -n "$hub" ] || die "--hub is required for a device that is not enrolled yet"
  [ -n "$token" ] || die "--token is required for a device that is not enrolled yet"
  case "$hub" in http://*|https://*) ;; *) die "--hub must be an http(s) URL" ;; esac
fi
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "python3 >= 3.10 is required"
python3 -c 'import venv, ensurepip' 2>/dev/null || die "python3-venv is missing: apt-get install python3-venv"

if ! id "$user" >/dev/null 2>&1; then
  useradd --system --home-dir "$state" --no-create-home --shell /usr/sbin/nologin "$user"
fi

# The sandbox for tasks of users this endpoint is shared with: bubblewrap >= 0.8 (bookworm), started
# by the agent's user from an unprivileged user namespace. Without it those tasks fail with a clear
# error (never unsandboxed); the agent itself runs either way. docs/operations.md, "Sandbox under
# systemd, balena and Apptainer".
if ! command -v bwrap >/dev/null && command -v apt-get >/dev/null; then
  apt-get install -y --no-install-recommends bubblewrap >/dev/null || true
fi
if ! command -v bwrap >/dev/null; then
  echo "install.sh: warning: bubblewrap is not installed (apt-get install bubblewrap): tasks of users you share this endpoint with will fail" >&2
elif ! why="$(setpriv --reuid="$(id -u "$user")" --regid="$(id -g "$user")" --clear-groups -- bwrap --unshare-user --disable-userns \
    --unshare-pid --unshare-net --ro-bind / / --proc /proc --dev /dev true 2>&1)"; then
  echo "install.sh: warning: user $user cannot start a bubblewrap sandbox on this machine: $why" >&2
  echo "  needs bubblewrap >= 0.8 and unprivileged user namespaces: sysctl user.max_user_namespaces > 0," >&2
  echo "  kernel.unprivileged_userns_clone=1 (Debian kernels), and on Ubuntu >= 23.10 an AppArmor profile" >&2
  echo "  for bwrap or kernel.apparmor_restrict_unprivileged_userns=0" >&2
fi

[ -x "$prefix/venv/bin/python" ] || python3 -m venv "$prefix/venv"
"$prefix/venv/bin/pip" install --quiet --upgrade pip
"$prefix/venv/bin/pip" install --quiet --upgrade "${source:-$here/../..}"
mkdir -p "$prefix/docs"
[ -f "$here/../../docs/operations.md" ] && cp "$here/../../docs/operations.md" "$prefix/docs/"

install -d -m 0750 -o root -g "$user" "$etc"
if [ -n "$hub" ]; then
  umask 027
  tmp="$(mktemp "$etc/agent.env.XXXXXX")"
  {
    echo "MESH_HUB_URL=$hub"
    echo "MESH_ENROLL_TOKEN=$token"
    echo "MESH_TRANSPORT=$transport"
    [ -z "$name" ] || echo "MESH_AGENT_NAME=$name"
  } >"$tmp"
  chown root:"$user" "$tmp"
  chmod 0640 "$tmp"
  mv "$tmp" "$etc/agent.env"
fi

install -m 0644 "$here/$unit_name" "/etc/systemd/system/$unit_name"
systemctl daemon-reload
if [ "$start" = 1 ]; then
  systemctl enable --now "$unit_name"
  echo "started; follow it with: journalctl -u $unit_name -f"
else
  systemctl enable "$unit_name"
  echo "installed; start it with: systemctl start $unit_name"
fi
