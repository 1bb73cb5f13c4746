#!/usr/bin/env bash
# Registers, stack (spills included) and shared memory of every kernel for sm_90, checked here
# before a GPU run: the kernels' cubins from scripts/sm90-cubins.sh, read by a local cuobjdump. A
# kernel launched with T threads per block needs registers · T ≤ 65536.
# CUOBJDUMP: path to cuobjdump (default: the one in the Triton wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
cuobjdump=${CUOBJDUMP:-$site/triton/backends/nvidia/bin/cuobjdump}
cubins=$(mktemp -d)
trap 'rm -rf "$cubins"' EXIT
scripts/sm90-cubins.sh "$cubins"
for f in "$cubins"/*.cubin; do
  "$cuobjdump" -res-usage "$f" 2>/dev/null \
    | awk '/Function / { name = $2; sub(/:$/, "", name) }
           /REG:/ { printf "%-36s %s %s %s\n", name, $1, $2, $3 }'
done | sort
