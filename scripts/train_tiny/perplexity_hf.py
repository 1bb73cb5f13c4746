#!/usr/bin/env python3
"""Held-out perplexity of a model directory with HF transformers (the reference for `deltamoe perplexity`).

Definition (the Rust command implements the same):
  1. tokenize the whole text file with the model's tokenizer.json, no special tokens added;
  2. split the ids into consecutive non-overlapping windows of --ctx tokens (default 512); the last,
     partial window is kept if it has at least 2 tokens;
  3. run every window from an empty state (no cache carried between windows);
  4. for each window, the NLL of tokens 1..n-1 given the preceding tokens of that window, from f32
     logits through log-softmax;
  5. ppl = exp(sum NLL / count), count = the number of scored tokens.
Prints `ppl=<value> tokens=<count>`.

The weights are evaluated in float32 on the CPU by default (bf16 checkpoints are upcast exactly), with
the plain PyTorch code paths (eager attention, eager expert loop).

Usage:  python3 scripts/train_tiny/perplexity_hf.py --model models/tiny --file models/tiny/heldout.txt
"""
import argparse
import math

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--file", default="models/tiny/heldout.txt")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text, add_special_tokens=False).ids
    windows = [ids[i:i + args.ctx] for i in range(0, len(ids), args.ctx)]
    windows = [w for w in windows if len(w) >= 2]

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), attn_implementation="eager",
        experts_implementation="eager").to(args.device).eval()

    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w], dtype=torch.long, device=args.device)
            logits = model(input_ids=x, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll = -logp.gather(-1, x[0, 1:, None]).squeeze(-1)
            total += nll.double().sum().item()
            count += nll.numel()
    print(f"ppl={math.exp(total / count):.4f} tokens={count}")


if __name__ == "__main__":
    main()
