#!/usr/bin/env bash
# The global loads each kernel issues before its griddepcontrol.wait (SASS ACQBULK), for sm_90:
# what a kernel reads there must not come from a kernel of the same step (common.cuh,
# pdl_entry). Weights, slots, positions and a kernel's own recurrent state are expected; an
# activation or a routed id is a race. Compiled as scripts/kernel-regs.sh does (NVRTC from this
# machine's Python CUDA wheels, ptxas and cuobjdump from the Triton wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
bin=${CUDA_BIN:-$site/triton/backends/nvidia/bin}
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
LD_LIBRARY_PATH="$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME="$cache" \
  cargo test --release -p deltamoe-compute --test cuda_parity kernels_compile -- --ignored --quiet >/dev/null 2>&1
for f in "$cache"/deltamoe/kernels/*.ptx; do
  grep -q '^\.target sm_90' "$f" || continue
  cp "$f" "$cache/x.ptx"
  have=$("$bin/ptxas" -arch=sm_90 "$cache/x.ptx" -o /dev/null 2>&1 \
    | sed -nE "s/.*current version is '([0-9.]+)'.*/\1/p" | head -1 || true)
  [ -n "$have" ] && sed -i -E "s/^\.version [0-9.]+/.version $have/" "$cache/x.ptx"
  "$bin/ptxas" -arch=sm_90 "$cache/x.ptx" -o "$cache/x.cubin"
  "$bin/cuobjdump" -sass "$cache/x.cubin" 2>/dev/null
done | awk '
  /Function : / { name = $3; waited = 0; next }
  /ACQBULK/ { waited = 1 }
  !waited && name != "" && /(LDG|UBLKCP|LDGSTS)/ {
    sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, ""); sub(/[ \t]*;.*$/, "")
    printf "%-32s %s\n", name, $0
  }' | sort -s -k1,1
