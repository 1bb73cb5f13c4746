#!/usr/bin/env bash
# Registers, spills and shared memory of every kernel for sm_90, checked here before a GPU run:
# the kernels' PTX from scripts/sm90-ptx.sh, reported on by a local ptxas. A kernel launched with
# T threads per block needs registers · T ≤ 65536.
# PTXAS: path to ptxas (default: the one in the Triton wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
ptxas=${PTXAS:-$site/triton/backends/nvidia/bin/ptxas}
ptx=$(mktemp -d)
trap 'rm -rf "$ptx"' EXIT
scripts/sm90-ptx.sh "$ptx"
for f in "$ptx"/*.ptx; do
  "$ptxas" -arch=sm_90 -v "$f" -o /dev/null 2>&1 \
    | awk '/Compiling entry function/ { gsub(/\x27/, "", $7); name = $7 }
           /Used [0-9]+ registers/ { printf "%-28s %s\n", name, substr($0, index($0, "Used")) }'
done | sort
