#!/usr/bin/env bash
# `make run`: starts a local nats-server when none answers at $NATS_URL, then shows the comm
# protocol end to end with the cyrene CLI: a smoke-test agent, an ask, an event, a probe.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
NATS_URL="${NATS_URL:-nats://127.0.0.1:4222}"
export NATS_URL
cargo build --quiet --bin cyrene
cyrene="$root/target/debug/cyrene"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

if ! "$cyrene" probe --wait 100ms >/dev/null 2>&1; then
  hostport="${NATS_URL#nats://}"
  echo "== no NATS at $NATS_URL: starting $NATS_SERVER_BIN with JetStream"
  mkdir -p .tools/run-data
  "$NATS_SERVER_BIN" -a "${hostport%:*}" -p "${hostport##*:}" -js -sd .tools/run-data \
    >.tools/run-data/nats.log 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do "$cyrene" probe --wait 50ms >/dev/null 2>&1 && break; sleep 0.1; done
fi

echo "== starting agent 'cyrene' (answers every ask)"
"$cyrene" agent --id cyrene --reply "你好，我是昔涟。" > .tools/agent.jsonl &
pids+=($!)
for _ in $(seq 100); do
  "$cyrene" ask --from you --to cyrene --timeout 200ms ping >/dev/null 2>&1 && break
  sleep 0.1
done

echo "== cyrene ask --from you --to cyrene 'who are you?'"
"$cyrene" ask --from you --to cyrene "who are you?"
echo "== cyrene emit --from you --to cyrene task.progress '{\"pct\":50}'"
"$cyrene" emit --from you --to cyrene task.progress '{"pct":50}'
echo "== cyrene ask --from you --to nobody hi   (expected to fail: no responder)"
"$cyrene" ask --from you --to nobody hi || echo "(exit code $?)"
sleep 0.2
echo "== what the agent received (one JSON line each)"
cat .tools/agent.jsonl
echo "== cyrene probe   (micro services on the bus; none until the services land)"
"$cyrene" probe
