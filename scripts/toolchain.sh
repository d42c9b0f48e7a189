#!/usr/bin/env bash
# Checks that the cargo (and the rustc it runs) found first is at least the workspace's
# rust-version (Cargo.toml), so an old one fails with one clear line instead of a wall of
# edition errors. Debian's packaged cargo is far older: install rustup instead (README).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cargo="${CARGO:-cargo}"
need="$(sed -n 's/^rust-version = "\([0-9.]*\)"/\1/p' "$root/Cargo.toml" | head -n 1)"
hint="install rustup (https://rustup.rs) and run \`rustup default stable\`, with ~/.cargo/bin first in PATH"

version_of() { # "cargo 1.95.0 (…)" -> 1.95.0
  "$@" --version 2>/dev/null | sed -n 's/^[a-z]* \([0-9][0-9.]*\).*/\1/p'
}
older() { # a b -> 0 when a < b
  [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$1" ]
}

if ! command -v "$cargo" >/dev/null 2>&1; then
  echo "no cargo found: this workspace needs Rust >= $need; $hint" >&2
  exit 1
fi
for tool in "$cargo" "${RUSTC:-rustc}"; do
  have="$(version_of "$tool")"
  if [ -z "$have" ]; then
    echo "cannot tell the version of $tool: this workspace needs Rust >= $need; $hint" >&2
    exit 1
  fi
  if older "$have" "$need"; then
    echo "$(command -v "$tool") is $have, older than this workspace's rust-version $need (Cargo.toml): $hint" >&2
    exit 1
  fi
done
