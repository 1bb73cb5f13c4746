#!/usr/bin/env bash
# Soak on this machine (loopback only): `deltamoe serve` (the built-in model unless serve flags
# say otherwise) under streaming clients for a fixed time, then the load test's table (its
# "failed" column counts failed requests) and the server's resident memory sampled every 5 s.
# Fails (exit 1) when a request failed or when the largest RSS sample exceeds the bound: by
# default the first sample plus the prompt cache's budget (serve's --prompt-cache-mb, 1024
# unless the serve flags say otherwise) plus 512 MiB for everything else (--max-rss-mb N sets
# it).
#
#   scripts/soak.sh [--seconds 180] [--clients 16] [--port N] [--max-rss-mb N] [-- SERVE ARGS]
#
# Needs target/release/deltamoe and target/release/examples/loadtest
# (cargo build --release --bin deltamoe && cargo build --release -p deltamoe-server --example loadtest).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=180
clients=16
port=8097
max_rss_mb=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --max-rss-mb) max_rss_mb="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (serve flags go after --)" >&2; exit 2 ;;
  esac
done
bin=target/release/deltamoe
client=target/release/examples/loadtest
for f in "$bin" "$client"; do
  [[ -x "$f" ]] || { echo "$f: not found or not executable" >&2; exit 2; }
done
cache_mb=1024
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
  [[ "${args[i]}" == --prompt-cache-mb ]] && cache_mb="${args[i + 1]}"
done
"$bin" serve --host 127.0.0.1 --port "$port" --log-format off "$@" &
server=$!
rss_log=$(mktemp)
result=$(mktemp)
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$rss_log" "$result"' EXIT
rss() { awk '/VmRSS/ {print $2}' "/proc/$server/status" 2>/dev/null || echo 0; }
# The memory samples start once the server answers /health (its model loaded).
healthy() {
  exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
  printf 'GET /health HTTP/1.0\r\n\r\n' >&3
  local line
  read -r line <&3
  exec 3>&-
  [[ "$line" == *" 200"* ]]
}
for _ in $(seq 1200); do
  healthy 2>/dev/null && break
  kill -0 "$server" 2>/dev/null || { echo "the server exited" >&2; exit 1; }
  sleep 0.5
done
(
  while kill -0 "$server" 2>/dev/null; do
    rss >>"$rss_log"
    sleep 5
  done
) &
sampler=$!
"$client" --url "http://127.0.0.1:$port" --concurrency "$clients" --requests 1000000 \
  --level-timeout-s "$seconds" --max-tokens 64 --json "$result"
kill "$sampler" 2>/dev/null || true
first_mb=$(awk 'NR == 1 {printf "%.0f", $1/1024}' "$rss_log")
max_mb=$(sort -n "$rss_log" | tail -1 | awk '{printf "%.0f", $1/1024}')
bound_mb=${max_rss_mb:-$((first_mb + cache_mb + 512))}
echo "server RSS (MB): first $first_mb, max $max_mb, last $(rss | awk '{printf "%.0f", $1/1024}')" \
  "over $(wc -l <"$rss_log") samples; bound $bound_mb"
failed=$(python3 -c 'import json, sys; print(sum(l["failed"] for l in json.load(open(sys.argv[1]))["levels"]))' "$result")
status=0
if [[ "$failed" != 0 ]]; then echo "FAIL: $failed requests failed" >&2; status=1; fi
if ((max_mb > bound_mb)); then echo "FAIL: RSS $max_mb MB above the bound $bound_mb MB" >&2; status=1; fi
exit $status
