#!/usr/bin/env bash
# Soak on this machine (loopback only): `deltamoe serve` (the built-in model unless serve flags
# say otherwise) under streaming clients for a fixed time, then the load test's table (its
# "failed" column counts failed requests) and the server's resident memory sampled every 5 s.
#
#   scripts/soak.sh [--seconds 180] [--clients 16] [--port N] [-- SERVE ARGS]
#
# Needs target/release/deltamoe and target/release/examples/loadtest
# (cargo build --release --bin deltamoe && cargo build --release -p deltamoe-server --example loadtest).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=180
clients=16
port=8097
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (serve flags go after --)" >&2; exit 2 ;;
  esac
done
bin=target/release/deltamoe
client=target/release/examples/loadtest
for f in "$bin" "$client"; do
  [[ -x "$f" ]] || { echo "$f: not found or not executable" >&2; exit 2; }
done
"$bin" serve --host 127.0.0.1 --port "$port" --log-format off "$@" &
server=$!
rss_log=$(mktemp)
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$rss_log"' EXIT
rss() { awk '/VmRSS/ {print $2}' "/proc/$server/status" 2>/dev/null || echo 0; }
(
  while kill -0 "$server" 2>/dev/null; do
    rss >>"$rss_log"
    sleep 5
  done
) &
sampler=$!
"$client" --url "http://127.0.0.1:$port" --concurrency "$clients" --requests 1000000 \
  --level-timeout-s "$seconds" --max-tokens 64
kill "$sampler" 2>/dev/null || true
echo "server RSS (MB): first $(head -1 "$rss_log" | awk '{printf "%.0f", $1/1024}')," \
  "max $(sort -n "$rss_log" | tail -1 | awk '{printf "%.0f", $1/1024}')," \
  "last $(rss | awk '{printf "%.0f", $1/1024}') over $(wc -l <"$rss_log") samples"
