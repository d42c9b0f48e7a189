#!/usr/bin/env bash
# `make run`: start a local nats-server when none answers at $NATS_URL, run every Cyrene service
# in one process (`cyrene up`: SQLite + the offline scripted demo unless CYRENE_GATEWAY_MODELS names real
# providers), then `cyrene chat` on a terminal — or, without one, `cyrene demo`: a short scripted
# conversation showing a tool call, a steered message and the checkpoints. The web chat is served
# too (docs/web.md): the nats-server started here takes WebSocket connections on
# $CYRENE_WEB_WS_PORT (4280), and `cyrene up` serves the page on $CYRENE_WEB_ADDR (127.0.0.1:8090).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NATS_URL="${NATS_URL:-nats://127.0.0.1:4222}"
export NATS_URL
cargo build --quiet --bin cyrene
cyrene="$root/target/debug/cyrene"
run_dir="$root/.tools/run"
mkdir -p "$run_dir"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# A server that answers is not enough: it needs JetStream and version 2.10 or newer (read from
# the INFO line it greets every client with).
js_ok() {
  local info
  info="$(timeout 3 bash -c "exec 3<>/dev/tcp/${1%:*}/${1##*:}; head -n 1 <&3" 2>/dev/null)" || return 1
  grep -q '"jetstream":true' <<<"$info" || return 1
  grep -Eq '"version":"(2\.(1[0-9]|[2-9][0-9])|[3-9])' <<<"$info"
}
hostport="${NATS_URL#nats://}"
ws_port="${CYRENE_WEB_WS_PORT:-4280}"
export CYRENE_WEB_NATS_WS_URL="${CYRENE_WEB_NATS_WS_URL:-ws://127.0.0.1:$ws_port}"
web_addr="${CYRENE_WEB_ADDR:-127.0.0.1:8090}"
# The web chat also needs the server's WebSocket listener (docs/web.md).
ws_ok() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$ws_port" 2>/dev/null; }
if ! { js_ok "$hostport" && ws_ok; }; then
  if timeout 1 bash -c "exec 3<>/dev/tcp/${hostport%:*}/${hostport##*:}" 2>/dev/null; then
    echo "== $NATS_URL answers but lacks JetStream, is older than 2.10 or takes no WebSocket" \
      "clients on $ws_port; using 127.0.0.1:4333" >&2
    hostport="127.0.0.1:4333"; NATS_URL="nats://$hostport"; export NATS_URL
  fi
  if ! js_ok "$hostport"; then
    echo "== starting $NATS_SERVER_BIN on $hostport with JetStream (store in $run_dir/nats)"
    # no TLS, no users: a local bus on loopback (docs/web.md for production)
    printf 'websocket {\n  host: "127.0.0.1"\n  port: %s\n  no_tls: true\n}\n' "$ws_port" \
      >"$run_dir/nats.conf"
    "$NATS_SERVER_BIN" -c "$run_dir/nats.conf" -a "${hostport%:*}" -p "${hostport##*:}" -js \
      -sd "$run_dir/nats" >"$run_dir/nats.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do js_ok "$hostport" && break; sleep 0.1; done
  fi
fi

echo "== cyrene up (logs: $run_dir/up.log)"
RUST_LOG="${RUST_LOG:-warn}" "$cyrene" up --data-dir "$run_dir/data" --web-addr "$web_addr" \
  >"$run_dir/up.log" 2>&1 &
pids+=($!)
if ws_ok; then
  echo "== open http://$web_addr/ for the web chat (log in as any person, e.g. alice; no password)"
else
  echo "== nothing takes WebSocket connections on 127.0.0.1:$ws_port: the web chat cannot reach" \
    "NATS (docs/web.md)" >&2
fi

if [ -t 0 ] && [ -t 1 ]; then
  for _ in $(seq 150); do # until the four services answer
    n="$("$cyrene" probe --wait 200ms 2>/dev/null | grep -cE '^cyrene-(model-gateway|checkpoint-store|orchestrator|loop-worker) ' || true)"
    [ "$n" -ge 4 ] && break
  done
  echo "== cyrene chat — try: 'search my notes', then type while she searches; 'what time is it?'"
  "$cyrene" chat
else
  "$cyrene" demo
  echo "== cyrene probe"
  "$cyrene" probe
fi
