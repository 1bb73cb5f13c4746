#!/usr/bin/env bash
# Run on a machine with two or more GPUs from the repository root, after scripts/gpu-bundle.sh
# built .gpu/ (scripts/gpu-tests.sh calls it there): the fixtures on two GPUs (expert parallel
# over NCCL, with the mixers' heads divided too, with offloaded experts) against transformers
# and against one GPU, the built-in model's perplexity on two GPUs against one (within 0.1%;
# with and without --tensor-parallel), and greedy output on two GPUs equal to one's.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/nccl-env.sh
status=0
echo "== two GPUs: fixtures against transformers and against one GPU"
.gpu/gpus_cuda --ignored --test-threads=1 --nocapture || status=1
echo "== perplexity of the built-in model on two GPUs (experts; experts and heads) against one (within 0.1%)"
pp=()
for g in "0" "0,1" "0,1 --tensor-parallel"; do pp+=("$(.gpu/deltamoe perplexity --device cuda --gpus $g --text models/tiny/heldout-excerpt.txt | sed -n 's/.*ppl=\([0-9.]*\).*/\1/p')"); done
python3 -c "import sys; a, b, c = (float(v or 'nan') for v in '${pp[0]:-} ${pp[1]:-} ${pp[2]:-}'.split(' ')); print('ppl 1 gpu', a, '2 gpus', b, 'with heads', c, 'ratios', b / a, c / a); sys.exit(not (abs(b / a - 1) <= 0.001 and abs(c / a - 1) <= 0.001))" || status=1
echo "== greedy continuation of the built-in model: two GPUs equal one"
prompt=$(head -c 600 models/tiny/heldout-excerpt.txt)
a=$(.gpu/deltamoe generate --prompt "$prompt" --max-tokens 64 --temperature 0 --device cuda 2>/dev/null)
b=$(.gpu/deltamoe generate --prompt "$prompt" --max-tokens 64 --temperature 0 --device cuda --gpus 0,1 2>/dev/null)
if [ -n "$a" ] && [ "$a" == "$b" ]; then echo "identical"; else echo "differs: 1 gpu [$a] 2 gpus [$b]"; status=1; fi
exit $status
