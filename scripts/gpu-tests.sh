#!/usr/bin/env bash
# Run on the GPU machine from the repository root, after scripts/gpu-bundle.sh built .gpu/ here:
# every CUDA kernel against its CPU twin, then every fixture end to end on CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
for t in cuda_parity cuda_matvec cuda_far cuda_twin cuda_gdn_chunk cuda_prefill golden_cuda chunked_cuda offload_cuda; do
  echo "== $t"
  .gpu/$t --ignored --test-threads=1 --nocapture || status=1
done
echo "== generate on cuda"
.gpu/deltamoe generate --model fixtures/qwen3_5_moe --prompt "Once upon a time" --chat --max-tokens 16 --temperature 0 --device cuda || status=1
exit $status
