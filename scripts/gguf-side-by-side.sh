#!/usr/bin/env bash
# gguf-side-by-side.sh prepare|bench WORK [TYPES]: the synthetic Qwen3.6-35B-A3B shape as GGUF
# files (TYPES, default "q4_k_m q4_0"), run by deltamoe and by llama.cpp on the same card in one
# call (docs/benchmarks.md, "the same file in deltamoe and llama.cpp"). On the GPU machine, from
# the repository root, with .gpu/deltamoe unpacked (scripts/gpu-bundle.sh --bin-only) and
# .gl/llama-pack.tar.xz carried (scripts/llama-cpp-pack.sh):
#   prepare: builds llama-bench and llama-batched-bench with CUDA for sm_90 into WORK, writes the
#            files into WORK, and runs deltamoe once on each so that its kernels are compiled and
#            cached ($XDG_CACHE_HOME) before the timed runs;
#   bench:   both tools on every file, one after the other (run it while the machine from
#            `prepare` is still warm: WORK and the kernel cache live on that machine only).
set -euo pipefail
cd "$(dirname "$0")/.."
step=$1
work=$2
types=${3:-q4_k_m q4_0}
bin=$work/lb/bin

prepare() {
  mkdir -p "$work"
  tar -C "$work" -xJf .gl/llama-pack.tar.xz
  (cmake -S "$work/llama.cpp" -B "$work/lb" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$work/cmake.log" 2>&1 &&
    cmake --build "$work/lb" -j "$(nproc)" --target llama-bench llama-batched-bench \
      >>"$work/cmake.log" 2>&1 && echo "llama.cpp built") &
  local build=$!
  for t in $types; do
    python3 scripts/make_synthetic_gguf.py configs/qwen3.6-35b-a3b.json "$work/$t.gguf" \
      --type "$t" --gguf-py "$work/llama.cpp/gguf-py" --threads 8
  done
  for t in $types; do
    .gpu/deltamoe bench --model "$work/$t.gguf" --device cuda --contexts 128 --batch 1 \
      --prompt-len 256 --gen-len 8 --warmup 1
  done
  wait "$build" || { tail -30 "$work/cmake.log"; exit 1; }
}

bench() {
  [ -x "$bin/llama-bench" ] || { echo "no $bin/llama-bench: run prepare on this machine first"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  for t in $types; do
    echo "== $t: deltamoe"
    .gpu/deltamoe bench --model "$work/$t.gguf" --device cuda --contexts 128 --batch 1,8,32 \
      --prompt-len 4096 --gen-len 32 --warmup 3
    echo "== $t: llama.cpp"
    "$bin/llama-bench" -m "$work/$t.gguf" -ngl 99 -fa 1 -p 4096 -n 128 -r 3
    "$bin/llama-batched-bench" -m "$work/$t.gguf" -ngl 99 -fa 1 -c 16384 -b 2048 -ub 512 \
      -npp 128 -ntg 32 -npl 1,8,32 2>&1 | grep -E '^\|'
  done
}

case $step in
  prepare) prepare ;;
  bench) bench ;;
  *) echo "usage: $0 prepare|bench WORK [TYPES]" >&2; exit 2 ;;
esac
