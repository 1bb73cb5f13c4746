#!/usr/bin/env bash
# The global loads each kernel issues before its griddepcontrol.wait (SASS ACQBULK), for sm_90:
# what a kernel reads there must not come from a kernel of the same step (common.cuh,
# pdl_entry). Weights, what the host writes between steps (slots, positions, the host split
# table), a kernel's own recurrent state and the attention cache rows of earlier steps
# (attn_partial's LDGSTS) are expected; an activation or a routed id is a race. The kernels'
# PTX from scripts/sm90-ptx.sh; ptxas and cuobjdump from the Triton wheel (PTXAS, CUOBJDUMP to
# choose others).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
ptxas=${PTXAS:-$site/triton/backends/nvidia/bin/ptxas}
cuobjdump=${CUOBJDUMP:-$site/triton/backends/nvidia/bin/cuobjdump}
ptx=$(mktemp -d)
trap 'rm -rf "$ptx"' EXIT
scripts/sm90-ptx.sh "$ptx"
for f in "$ptx"/*.ptx; do
  "$ptxas" -arch=sm_90 "$f" -o "${f%.ptx}.cubin"
  "$cuobjdump" -sass "${f%.ptx}.cubin" 2>/dev/null
done | awk '
  /Function : / { name = $3; waited = 0; next }
  /ACQBULK/ { waited = 1 }
  !waited && name != "" && /(LDG|UBLKCP|LDGSTS)/ {
    sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, ""); sub(/[ \t]*;.*$/, "")
    printf "%-32s %s\n", name, $0
  }' | sort -s -k1,1
