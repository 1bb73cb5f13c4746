#!/usr/bin/env bash
# Build, here, everything the GPU machine runs (it has no cargo): the release binary and the
# release test executables that hold GPU tests, copied into .gpu/ (git-ignored) to be carried.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
cargo build --release --bin deltamoe
cp target/release/deltamoe .gpu/
# The HTTP load test client, for scripts/loadtest.sh --bin .gpu/deltamoe --client .gpu/loadtest.
cargo build --release -p deltamoe-server --example loadtest
cp target/release/examples/loadtest .gpu/
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_parity", "cuda_matvec", "cuda_fp8", "cuda_gdn_chunk", "cuda_prefill", "cuda_gemm", "cuda_far", "cuda_twin", "golden_cuda", "chunked_cuda", "offload_cuda", "http"):
        shutil.copy(m["executable"], ".gpu/" + m["target"]["name"])
'
strip .gpu/*
ls -la .gpu
