#!/usr/bin/env bash
# Prints the path of a promtool (Prometheus' rule checker) for the alert-rule test
# (tests/observability.rs): installed once under .tools/prometheus from Debian's `prometheus`
# package, unpacked rather than installed, so no Prometheus server is set up or started.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/.tools/prometheus"
if [ -x "$dir/promtool" ]; then echo "$dir/promtool"; exit 0; fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
apt-get download prometheus >/dev/null 2>&1 || {
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  apt-get download prometheus >&2
}
dpkg-deb -x prometheus_*.deb unpacked
mkdir -p "$dir"
cp unpacked/usr/bin/promtool "$dir/promtool.tmp"
mv "$dir/promtool.tmp" "$dir/promtool"
echo "$dir/promtool"
