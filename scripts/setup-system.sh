#!/usr/bin/env bash
# Installs the Debian packages the tests and demo need, when missing and when we may, and starts
# the PostgreSQL server the PostgreSQL store tests use (127.0.0.1:5432, trust auth, database test).
set -euo pipefail
root=0
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then root=1; fi

need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v pg_ctlcluster >/dev/null 2>&1 || need+=(postgresql)
# The clustered-broker test (tests/integration/test_broker_cluster.py) starts 3 NATS nodes on free ports.
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need+=(nats-server)
# cloud_hub.client.multiprocessing keeps shared state in Redis; its tests start their own redis-server on free ports.
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || need+=(redis-server)
# Sandboxed functions (mesh_agent environments, sandbox=True) run their workers under bubblewrap.
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# The alerting test starts its own Prometheus and Alertmanager on free loopback ports; promtool checks the shipped rules.
command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || [ -x /usr/bin/prometheus-alertmanager ] || need+=(prometheus-alertmanager)
# The console tests drive Debian's Chromium headless (never a browser downloaded by playwright).
[ -x /usr/bin/chromium ] || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$root" = 1 ]; then
    echo "setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    # The Debian mosquitto package starts a system broker on :1883 (nats-server one on :4222); ours start their own on free ports.
  else
    echo "setup: missing ${need[*]}; install them (e.g. sudo apt-get install ${need[*]})." >&2
    echo "setup: without mosquitto the hub falls back to its embedded broker; without chromium the console tests fail;" >&2
    echo "setup: without nats-server the clustered-broker test skips; without redis-server the multiprocessing tests fail." >&2
  fi
fi

# A Redis on 127.0.0.1:6379 for `from cloud_hub.client import multiprocessing` programs that set
# MESH_REDIS_URL=redis://127.0.0.1:6379/0 (unset, the proxies use the hub's embedded store instead;
# docs/multiprocessing.md): started here where none answers and the package's service did not start one.
# The tests need only the binary: they start their own redis-server on free loopback ports.
if [ "$root" = 1 ] && command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
   && ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "setup: starting redis-server on 127.0.0.1:6379"
  redis-server --bind 127.0.0.1 --port 6379 --save '' --appendonly no --daemonize yes >/dev/null || true
fi

pg_up() { command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h 127.0.0.1 -p 5432; }
if ! pg_up && [ "$root" = 1 ] && command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  echo "setup: starting PostgreSQL"
  for v in $(ls /etc/postgresql); do
    hba="/etc/postgresql/$v/main/pg_hba.conf"
    # Test machines only: loopback connections without a password, as the tests expect.
    if [ -f "$hba" ] && ! grep -q "continuum-mesh tests" "$hba"; then
      sed -i '1i host all all 127.0.0.1/32 trust  # continuum-mesh tests' "$hba"
    fi
    pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
  done
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
fi
if pg_up; then
  psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" 2>/dev/null | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE test" 2>/dev/null || true
else
  echo "setup: PostgreSQL is not running on 127.0.0.1:5432: the PostgreSQL store tests will skip (fail under CI)." >&2
fi
