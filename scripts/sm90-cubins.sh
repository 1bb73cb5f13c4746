#!/usr/bin/env bash
# sm90-cubins.sh DIR: the sm_90 cubin of every kernel module, compiled here and written to DIR for
# a local cuobjdump (scripts/kernel-regs.sh, scripts/pdl-audit.sh). NVRTC (from the CUDA wheels of
# this machine's Python) compiles the kernels through the `kernels_compile_for_hopper_and_ampere`
# test into a fresh cache, as a GPU machine's first start would (cuda/nvrtc.rs); cuobjdump (the
# Triton wheel's, or CUOBJDUMP) tells the sm_90 ones from the sm_80 ones.
set -euo pipefail
out=$1
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
cuobjdump=${CUOBJDUMP:-$site/triton/backends/nvidia/bin/cuobjdump}
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
# The build's and the test's output only when they fail (a kernel NVRTC rejects says why there).
if ! LD_LIBRARY_PATH="$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME="$cache" \
  cargo test --release -p deltamoe-compute --test cuda_parity kernels_compile -- --ignored --quiet \
  >"$cache/log" 2>&1; then
  cat "$cache/log" >&2
  exit 1
fi
mkdir -p "$out"
for f in "$cache"/deltamoe/kernels/*.cubin; do
  case $("$cuobjdump" -elf "$f" 2>/dev/null | awk 'NR <= 3') in *"sm=90,"*) cp "$f" "$out/" ;; esac
done
