#!/usr/bin/env bash
# Makes sure the PostgreSQL the tests use answers at 127.0.0.1:5432 (user postgres, trust auth,
# database `test`). Does nothing when one answers already (CI machines run one) or when
# CYRENE_TEST_POSTGRES_URL points the tests elsewhere. Otherwise, on a Debian machine as root (or
# with sudo), installs Debian's postgresql, trusts local TCP connections and starts it.
set -euo pipefail
answers() { timeout 1 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5432' 2>/dev/null; }
if [ -n "${CYRENE_TEST_POSTGRES_URL:-}" ] || answers; then
  exit 0
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || {
    echo "no PostgreSQL at 127.0.0.1:5432 and no apt-get to install one;" \
      "start one (trust auth, database test) or set CYRENE_TEST_POSTGRES_URL" >&2
    exit 1
  }
  echo "installing PostgreSQL (Debian package) for the SQL tests" >&2
  $SUDO apt-get update -qq >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
version="$(ls /etc/postgresql | sort -V | tail -n 1)"
[ -d "/etc/postgresql/$version/main" ] || $SUDO pg_createcluster "$version" main >&2
hba="/etc/postgresql/$version/main/pg_hba.conf"
if ! $SUDO grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
  # First matching line wins: put the trust lines before the defaults.
  $SUDO sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
fi
$SUDO pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null ||
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$version" main reload
for _ in $(seq 50); do answers && break; sleep 0.2; done
answers || { echo "PostgreSQL did not come up at 127.0.0.1:5432" >&2; exit 1; }
if [ "$(psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" 2>/dev/null)" != "1" ]; then
  psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >&2
fi
