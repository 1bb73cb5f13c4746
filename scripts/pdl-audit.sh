#!/usr/bin/env bash
# The global loads each kernel issues before its griddepcontrol.wait (SASS ACQBULK), for sm_90:
# what a kernel reads there must not come from a kernel of the same step (common.cuh,
# pdl_entry). Weights, what the host writes between steps (slots, positions, the host split
# table), a kernel's own recurrent state and the attention cache rows of earlier steps
# (attn_partial's LDGSTS) are expected; an activation or a routed id is a race. The kernels'
# cubins from scripts/sm90-cubins.sh; cuobjdump from the Triton wheel (CUOBJDUMP to choose
# another).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
cuobjdump=${CUOBJDUMP:-$site/triton/backends/nvidia/bin/cuobjdump}
cubins=$(mktemp -d)
trap 'rm -rf "$cubins"' EXIT
scripts/sm90-cubins.sh "$cubins"
for f in "$cubins"/*.cubin; do
  "$cuobjdump" -sass "$f" 2>/dev/null
done | awk '
  /Function : / { name = $3; waited = 0; next }
  /ACQBULK/ { waited = 1 }
  !waited && name != "" && /(LDG|UBLKCP|LDGSTS)/ {
    sub(/^[ \t]*\/\*[0-9a-f]+\*\/[ \t]*/, ""); sub(/[ \t]*;.*$/, "")
    printf "%-32s %s\n", name, $0
  }' | sort -s -k1,1
