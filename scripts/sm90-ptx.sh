#!/usr/bin/env bash
# sm90-ptx.sh DIR: the sm_90 PTX of every kernel module, compiled here and written to DIR for a
# local ptxas (scripts/kernel-regs.sh, scripts/pdl-audit.sh). NVRTC (from the CUDA wheels of this
# machine's Python) compiles the kernels through the `kernels_compile_for_hopper_and_ampere` test
# into a fresh cache. The PTX ISA version NVRTC writes may be newer than the local ptxas reads (it
# says which it reads); the kernels use nothing newer, so each file is relabelled to that version.
# PTXAS: path to ptxas (default: the one in the Triton wheel).
set -euo pipefail
out=$1
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
ptxas=${PTXAS:-$site/triton/backends/nvidia/bin/ptxas}
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
for f in "$cache"/deltamoe/kernels/*.ptx; do
  grep -q '^\.target sm_90' "$f" || continue
  dst="$out/$(basename "$f")"
  cp "$f" "$dst"
  have=$("$ptxas" -arch=sm_90 "$dst" -o /dev/null 2>&1 \
    | sed -nE "s/.*current version is '([0-9.]+)'.*/\1/p" | head -1 || true)
  [ -n "$have" ] && sed -i -E "s/^\.version [0-9.]+/.version $have/" "$dst"
done
