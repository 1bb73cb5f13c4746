#!/usr/bin/env bash
# Build, here, everything the GPU machine runs (it has no cargo): the release binary and the
# release test executables that hold GPU tests, copied into .gpu/ (git-ignored) to be carried.
# --bin-only: the binary alone (3.4 MB packed instead of 6.7), for a benchmark call that carries
# something else beside it (scripts/llama-cpp-pack.sh's llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
cargo build --release --bin deltamoe
cp target/release/deltamoe .gpu/
if [ "${1:-}" != --bin-only ]; then
# The HTTP load test client, for scripts/loadtest.sh --bin .gpu/deltamoe --client .gpu/loadtest.
cargo build --release -p deltamoe-server --example loadtest
cp target/release/examples/loadtest .gpu/
cargo test --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda_parity", "cuda_matvec", "cuda_fp8", "cuda_gdn_chunk", "cuda_prefill", "cuda_gemm", "cuda_far", "cuda_twin", "cuda_verify", "golden_cuda", "speculative_cuda", "chunked_cuda", "offload_cuda", "gpus_cuda", "http"):
        shutil.copy(m["executable"], ".gpu/" + m["target"]["name"])
'
fi
strip .gpu/*
ls -la .gpu
# One compressed file to copy instead of .gpu/ (the checkout already holds models/tiny, which the
# binary embeds): the binary with the built-in model's bytes zeroed, and every other executable,
# xz-packed into .gpu-pack/; scripts/gpu-unpack.sh there writes the model's bytes back.
rm -rf .gpu-pack && mkdir -p .gpu-pack/files
python3 - <<'P'
model = open("models/tiny/model.safetensors", "rb").read()
binary = bytearray(open(".gpu/deltamoe", "rb").read())
at = binary.find(model[:65536])
assert at >= 0 and binary[at:at + len(model)] == model, "the built-in model is not in .gpu/deltamoe"
binary[at:at + len(model)] = bytes(len(model))
open(".gpu-pack/files/deltamoe", "wb").write(binary)
open(".gpu-pack/model-offset", "w").write(str(at))
P
for f in .gpu/*; do [ "$f" = .gpu/deltamoe ] || cp "$f" .gpu-pack/files/; done
tar -C .gpu-pack/files -cf - . | xz -T0 -9 --lzma2=dict=192MiB > .gpu-pack/gpu.tar.xz
rm -rf .gpu-pack/files
ls -la .gpu-pack
