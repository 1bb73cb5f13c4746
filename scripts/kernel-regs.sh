#!/usr/bin/env bash
# Registers, spills and shared memory of every kernel for sm_90, checked here before a GPU run:
# NVRTC (from the CUDA wheels of this machine's Python) compiles the kernels through the
# `kernels_compile_for_hopper_and_ampere` test into a fresh cache, then a local ptxas reports on
# each PTX. A kernel launched with T threads per block needs registers · T ≤ 65536.
# PTXAS: path to ptxas (default: the one in the Triton wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
ptxas=${PTXAS:-$site/triton/backends/nvidia/bin/ptxas}
cache=$(mktemp -d)
LD_LIBRARY_PATH="$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME="$cache" \
  cargo test --release -p deltamoe-compute --test cuda_parity kernels_compile -- --ignored --quiet >/dev/null
# The PTX ISA version NVRTC writes may be newer than this ptxas reads (it says which it reads);
# the kernels use nothing newer, so the file is relabelled to that version.
for f in "$cache"/deltamoe/kernels/*.ptx; do
  grep -q '^\.target sm_90' "$f" || continue
  cp "$f" "$cache/x.ptx"
  have=$("$ptxas" -arch=sm_90 "$cache/x.ptx" -o /dev/null 2>&1 \
    | sed -nE "s/.*current version is '([0-9.]+)'.*/\1/p" | head -1 || true)
  [ -n "$have" ] && sed -i -E "s/^\.version [0-9.]+/.version $have/" "$cache/x.ptx"
  "$ptxas" -arch=sm_90 -v "$cache/x.ptx" -o /dev/null 2>&1 \
    | awk '/Compiling entry function/ { gsub(/\x27/, "", $7); name = $7 }
           /Used [0-9]+ registers/ { printf "%-28s %s\n", name, substr($0, index($0, "Used")) }'
done | sort
rm -rf "$cache"
