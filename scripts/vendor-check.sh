#!/usr/bin/env bash
# Checks that vendor/async-nats is the crates.io release of async-nats 0.51.0 plus
# vendor/async-nats.patch, nothing more (vendor/async-nats/CYRENE-PATCH.md describes the patch).
#
#   scripts/vendor-check.sh          check (make vendor-check); exit 1 with the difference if not
#   scripts/vendor-check.sh --write  rewrite vendor/async-nats.patch from the tree (after a change
#                                    to the vendored sources; then describe it in CYRENE-PATCH.md)
#
# The release is the .crate in cargo's download cache, checked against its crates.io checksum;
# when the cache has none, cargo fetches it (the only step that needs the registry).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cargo="${CARGO:-cargo}"
crate=async-nats
version=0.51.0
# The checksum crates.io publishes for async-nats 0.51.0 (its Cargo.lock entry).
sha256=a4f92759f418774b78c36ef07885849150ce950c67d9bcdeff8a9c253f57d9a1
vendored="$root/vendor/$crate"
patch_file="$root/vendor/$crate.patch"
# Release files the vendored copy leaves out (CYRENE-PATCH.md, "Packaging changes").
removed=(tests examples benches .cargo-feature-check.sh .cargo-hack-check.sh)
# Ours, not the crate's: the description of the patch.
ours=(CYRENE-PATCH.md)
# The patch, file by file: the first change, the second change, then packaging.
patched=(src/connection.rs src/service/mod.rs Cargo.toml Cargo.lock LICENSE)

find_crate() {
  local f
  for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate-$version.crate"; do
    [ -f "$f" ] && [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$sha256" ] && { echo "$f"; return 0; }
  done
  return 1
}

if ! release_crate="$(find_crate)"; then
  echo "fetching $crate $version with cargo (not in cargo's cache yet)" >&2
  fetch="$root/target/vendor-check/fetch"
  mkdir -p "$fetch/src"
  : >"$fetch/src/lib.rs"
  cat >"$fetch/Cargo.toml" <<EOF
[package]
name = "vendor-check-fetch"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
$crate = { version = "=$version", default-features = false }

[workspace]
EOF
  host="$("$cargo" -vV | sed -n 's/^host: //p')"
  "$cargo" fetch --quiet --manifest-path "$fetch/Cargo.toml" --target "$host"
  release_crate="$(find_crate)" || {
    echo "vendor-check: cargo fetched no $crate-$version.crate with checksum $sha256" >&2
    exit 1
  }
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/a"
tar -xzf "$release_crate" -C "$work/a" --strip-components 1
for f in "${removed[@]}"; do rm -rf "${work:?}/a/$f"; done

if [ "${1:-}" = "--write" ]; then
  mkdir "$work/b"
  (cd "$vendored" && tar --exclude ./target -cf - .) | tar -xf - -C "$work/b"
  for f in "${ours[@]}"; do rm -f "$work/b/$f"; done
  {
    cat <<'EOF'
async-nats 0.51.0 (crates.io) -> vendor/async-nats. Apply in the unpacked crate with
`git apply` (or `patch -p1`) after deleting tests/, examples/, benches/, .cargo-feature-check.sh
and .cargo-hack-check.sh. Written by `scripts/vendor-check.sh --write`, checked by
`make vendor-check`; what each part does: vendor/async-nats/CYRENE-PATCH.md.
  1. src/connection.rs    first change: malformed header blocks and non-UTF-8 subjects no longer
                          cost the connection
  2. src/service/mod.rs   second change: Request::respond_error_with_payload and
                          Request::endpoint_name (API Cyrene calls)
  3. Cargo.toml, Cargo.lock, LICENSE   packaging only

EOF
    for f in "${patched[@]}"; do
      a="a/$f"
      [ -e "$work/$a" ] || a=/dev/null
      (cd "$work" && git -c core.quotepath=false diff --no-index --no-color --no-ext-diff \
        --no-prefix "$a" "b/$f") | sed "s|^diff --git b/$f |diff --git a/$f |" || true
    done
  } >"$patch_file"
  # Whatever the list above missed would make the check fail: run it.
  exec "$0"
fi

(cd "$work/a" && git apply --whitespace=nowarn "$patch_file")
for f in "${ours[@]}"; do cp "$vendored/$f" "$work/a/$f"; done
if ! diff -r --exclude target "$work/a" "$vendored" >"$work/diff"; then
  echo "vendor-check: vendor/$crate is not the crates.io $crate $version plus vendor/$crate.patch:" >&2
  head -n 60 "$work/diff" >&2
  echo "(after an intended change: scripts/vendor-check.sh --write, and say what in CYRENE-PATCH.md)" >&2
  exit 1
fi
echo "vendor-check: vendor/$crate = crates.io $crate $version + vendor/$crate.patch"
