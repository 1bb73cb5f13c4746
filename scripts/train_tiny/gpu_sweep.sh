#!/usr/bin/env bash
# Train several regularisation variants of the tiny model at once on one GPU (the model is so small
# that a single run leaves the GPU mostly idle), keep the one with the lowest held-out loss, and
# pack it as a tar split into 10 MB parts (the device tool returns files of at most 16 MiB).
#
# Usage (repo root, after prepare.py):  bash scripts/train_tiny/gpu_sweep.sh OUTDIR
# Unpack:  cat OUTDIR/best.tar.part_* | tar xf - -C models/tiny
set -euo pipefail
out=${1:?usage: gpu_sweep.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
T=scripts/train_tiny/train.py
common=(--data .train --minutes 6.0 --eval-every 50 --seed 1234)
declare -A variants=(
  [c]="--dropout 0.2 --max-epochs 8"
  [d]="--dropout 0.3 --max-epochs 10"
  [e]="--dropout 0.3 --max-epochs 14 --wd 0.2"
  [f]="--dropout 0.4 --max-epochs 16 --wd 0.2"
)
for v in "${!variants[@]}"; do
  # shellcheck disable=SC2086
  python3 "$T" "${common[@]}" ${variants[$v]} --out "/tmp/model_$v" > "$out/$v.log" 2>&1 &
done
wait
best=$(for v in "${!variants[@]}"; do
  l=$(grep -o 'best heldout loss [0-9.]*' "$out/$v.log" | awk '{print $4}')
  [ -n "$l" ] && echo "$l $v"
done | sort -n | head -1 | awk '{print $2}')
echo "best variant: $best (${variants[$best]})"
for v in "${!variants[@]}"; do grep -H 'training done\|total_steps' "$out/$v.log" || true; done
tar cf - -C "/tmp/model_$best" . | split -b 10m - "$out/best.tar.part_"
echo "$best ${variants[$best]}" > "$out/best.txt"
