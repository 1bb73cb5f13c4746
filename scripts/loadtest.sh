#!/usr/bin/env bash
# Load test on this machine (loopback only): starts `deltamoe serve`, waits for /health, runs the
# loadtest client at each concurrency level (default 1, 8, 32 and 128), stops the server.
#
#   scripts/loadtest.sh [--bin PATH] [--client PATH] [--port N] [--concurrency LIST]
#                       [--client-args "ARGS"] [-- SERVE ARGS]
#
#   --bin          deltamoe binary (default target/release/deltamoe)
#   --client       loadtest client (default target/release/examples/loadtest; build it with
#                  cargo build --release -p deltamoe-server --example loadtest)
#   --port         port on 127.0.0.1 (default 8089)
#   --concurrency  concurrent clients per level, comma-separated (default 1,8,32,128)
#   --client-args  extra loadtest flags, e.g. "--requests 32 --max-tokens 64 --json out.json" or
#                  "--prompt-tokens 512,4096" (prompts of exactly that many bytes)
#   after --        `deltamoe serve` flags, e.g. --model DIR --device cuda --max-seqs 32, or
#                  --synthetic qwen3.6-35b-a3b --bits 4 --ctx 8192 --max-queue 256
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/deltamoe
client=target/release/examples/loadtest
port=8089
concurrency=1,8,32,128
client_args=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --client) client="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --client-args) client_args="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1 (serve flags go after --)" >&2; exit 2 ;;
  esac
done
for f in "$bin" "$client"; do
  [[ -x "$f" ]] || { echo "$f: not found or not executable" >&2; exit 2; }
done
"$bin" serve --host 127.0.0.1 --port "$port" "$@" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
echo "serve flags: $*"
# shellcheck disable=SC2086
"$client" --url "http://127.0.0.1:$port" --concurrency "$concurrency" $client_args
