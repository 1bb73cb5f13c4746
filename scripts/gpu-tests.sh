#!/usr/bin/env bash
# Run on the GPU machine from the repository root, after scripts/gpu-bundle.sh built .gpu/ here:
# every CUDA kernel against its CPU twin, then every fixture end to end on CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
for t in cuda_parity cuda_matvec cuda_fp8 cuda_far cuda_twin cuda_verify cuda_gdn_chunk cuda_prefill cuda_gemm golden_cuda speculative_cuda chunked_cuda offload_cuda; do
  echo "== $t"
  .gpu/$t --ignored --test-threads=1 --nocapture || status=1
done
echo "== generate on cuda"
.gpu/deltamoe generate --model fixtures/qwen3_5_moe --prompt "Once upon a time" --chat --max-tokens 16 --temperature 0 --device cuda || status=1
echo "== perplexity of the built-in model on cuda against the cpu's 40.3405 (within 0.5%)"
ppl=$(.gpu/deltamoe perplexity --device cuda --text models/tiny/heldout-excerpt.txt | sed -n 's/.*ppl=\([0-9.]*\).*/\1/p')
python3 -c "import sys; p = float('${ppl:-nan}'); print('cuda ppl', p, 'ratio', p / 40.3405); sys.exit(not abs(p / 40.3405 - 1) <= 0.005)" || status=1
echo "== the built-in model in FP8 (convert --fp8): perplexity on cuda against the cpu's (within 0.5%)"
fp8=$(mktemp -d)/tiny-fp8
.gpu/deltamoe convert --model models/tiny --out "$fp8" --fp8 2>/dev/null
p8=()
for d in cuda cpu; do p8+=("$(.gpu/deltamoe perplexity --model "$fp8" --device $d --text models/tiny/heldout-excerpt.txt | sed -n 's/.*ppl=\([0-9.]*\).*/\1/p')"); done
python3 -c "import sys; c, h = float('${p8[0]:-nan}'), float('${p8[1]:-nan}'); print('fp8 ppl cuda', c, 'cpu', h, 'ratio', c / h); sys.exit(not abs(c / h - 1) <= 0.005)" || status=1
echo "== the built-in model in GPTQ int4 (convert --gptq --group-size 32): perplexity on cuda against the cpu's (within 0.5%)"
gq=$(mktemp -d)/tiny-gptq
.gpu/deltamoe convert --model models/tiny --out "$gq" --gptq --group-size 32 2>/dev/null
pg=()
for d in cuda cpu; do pg+=("$(.gpu/deltamoe perplexity --model "$gq" --device $d --text models/tiny/heldout-excerpt.txt | sed -n 's/.*ppl=\([0-9.]*\).*/\1/p')"); done
python3 -c "import sys; c, h = float('${pg[0]:-nan}'), float('${pg[1]:-nan}'); print('gptq ppl cuda', c, 'cpu', h, 'ratio', c / h); sys.exit(not abs(c / h - 1) <= 0.005)" || status=1
echo "== the built-in model in MLX 3-, 5- and 6-bit (8-bit codes on cuda): perplexity on cuda against the cpu's (within 0.5%)"
for b in 3 5 6; do
  m=$(mktemp -d)/tiny-$b
  .gpu/deltamoe convert --model models/tiny --out "$m" --bits $b 2>/dev/null
  pb=()
  for d in cuda cpu; do pb+=("$(.gpu/deltamoe perplexity --model "$m" --device $d --text models/tiny/heldout-excerpt.txt | sed -n 's/.*ppl=\([0-9.]*\).*/\1/p')"); done
  python3 -c "import sys; c, h = float('${pb[0]:-nan}'), float('${pb[1]:-nan}'); print('$b-bit ppl cuda', c, 'cpu', h, 'ratio', c / h); sys.exit(not abs(c / h - 1) <= 0.005)" || status=1
done
echo "== greedy continuation of the built-in model: cuda (bf16 prefill) equals cpu"
prompt=$(head -c 600 models/tiny/heldout-excerpt.txt)
a=$(.gpu/deltamoe generate --prompt "$prompt" --max-tokens 64 --temperature 0 --device cuda 2>/dev/null)
b=$(.gpu/deltamoe generate --prompt "$prompt" --max-tokens 64 --temperature 0 --device cpu 2>/dev/null)
if [ -n "$a" ] && [ "$a" == "$b" ]; then echo "identical"; else echo "differs: cuda [$a] cpu [$b]"; status=1; fi
echo "== the built-in model in MLX 8-bit on cuda: greedy with --speculative-tokens 2 equals without"
q8=$(mktemp -d)/tiny-q8
.gpu/deltamoe convert --model models/tiny --out "$q8" --bits 8 2>/dev/null
a=$(.gpu/deltamoe generate --model "$q8" --prompt "$prompt" --max-tokens 64 --temperature 0 --device cuda 2>/dev/null)
b=$(.gpu/deltamoe generate --model "$q8" --prompt "$prompt" --max-tokens 64 --temperature 0 --device cuda --speculative-tokens 2 2>/dev/null)
if [ -n "$a" ] && [ "$a" == "$b" ]; then echo "identical"; else echo "differs: plain [$a] speculative [$b]"; status=1; fi
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  bash scripts/gpu-tests-multi.sh || status=1
fi
exit $status
