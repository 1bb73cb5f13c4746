#!/usr/bin/env python3
"""Train the tiny Qwen3.5-MoE model shipped in models/tiny (HF transformers, one GPU).

Input: the folder written by prepare.py (train.bin, heldout.bin: uint16 token ids; tokenizer.json).
Output: a model directory (config.json, model.safetensors in bf16, tokenizer.json,
tokenizer_config.json with a ChatML template, generation_config.json, train_log.txt).

Model: Qwen3_5MoeForCausalLM (text config `qwen3_5_moe_text`), 8 layers in the Qwen3.5 pattern
(Gated DeltaNet x3, gated full attention x1), 8 routed experts top-2 plus a shared expert, tied
embeddings, vocab 4096. Training: random 512-token windows of the training stream, bf16 autocast,
AdamW, linear warm-up then cosine decay, residual dropout (forward hooks on the token mixers and
MoE blocks, training only; the architecture is unchanged), load-balancing loss, gradient clipping.
Every --eval-every steps the held-out loss is measured exactly like perplexity_hf.py (consecutive
512-token windows, NLL of tokens 1..n-1 of each window); the weights with the best held-out loss
are the ones saved.

The number of steps is --steps, or (when --steps is 0) derived from --minutes: after a few timed
steps the script fixes the total so that training ends within the budget, capped at --max-epochs,
and prints `total_steps=N`; rerun with `--steps N` to repeat a run step for step (seeded).

Usage (GPU):  python3 scripts/train_tiny/train.py --data .train --out OUTDIR --minutes 7
CPU smoke test:  python3 scripts/train_tiny/train.py --tiny --steps 4 --device cpu --out /tmp/tiny_smoke
"""
import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

ROOT = Path(__file__).resolve().parents[2]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def layer_types(n):  # full attention iff (i+1) % 4 == 0
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def make_config(specials, tiny=False):
    eot, im_end = specials["<|endoftext|>"], specials["<|im_end|>"]
    c = dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_key_head_dim=32, linear_num_value_heads=8, linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=192,
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, initializer_range=0.02,
        attention_bias=False, attention_dropout=0.0, tie_word_embeddings=True, use_cache=True,
        router_aux_loss_coef=0.001, output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=eot, pad_token_id=eot,
    )
    if tiny:  # CPU smoke test: same structure, small widths
        c.update(hidden_size=64, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
                 linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                 rope_parameters={**c["rope_parameters"], "mrope_section": [1, 1, 0]})
    c["layer_types"] = layer_types(c["num_hidden_layers"])
    return Qwen3_5MoeTextConfig(**c)


def add_dropout_hooks(model, p):
    """Residual dropout on the outputs of every token mixer and MoE block (active in train mode only)."""
    def hook(mod, inp, out):
        if not mod.training or p <= 0:
            return None
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, True),) + tuple(out[1:])
        return F.dropout(out, p, True)
    for layer in model.model.layers:
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        mixer.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def heldout_windows(ids, ctx):
    """Consecutive non-overlapping windows of ctx tokens; the last partial one kept if >= 2 tokens."""
    return [ids[i:i + ctx] for i in range(0, len(ids), ctx) if len(ids[i:i + ctx]) >= 2]


@torch.no_grad()
def heldout_loss(model, windows, device, amp, batch=32):
    model.eval()
    total, count = 0.0, 0
    full = [w for w in windows if len(w) == len(windows[0])]
    rest = [w for w in windows if len(w) != len(windows[0])]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]
    for g in groups:
        x = torch.tensor(np.stack(g).astype(np.int64), device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x, use_cache=False).logits
        logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
        total += nll.sum().item()
        count += nll.numel()
    model.train()
    return total / count, count


def lr_at(step, total, peak, warmup, final_frac):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def write_model_dir(model, out, data, specials, log_lines):
    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to("cpu", dtype=torch.bfloat16)
    m.config.use_cache = True
    m.config.output_router_logits = False
    m.config.architectures = ["Qwen3_5MoeForCausalLM"]
    m.config.dtype = torch.bfloat16
    m.config.save_pretrained(out)
    # Weights written directly (not with save_pretrained, which in transformers 5.x splits the fused
    # expert tensors back into per-expert gate/up/down matrices): names as in the module tree, fused
    # experts `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj`
    # [E, H, I]; the tied lm_head is not stored.
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(data / "tokenizer.json", out / "tokenizer.json")
    eot, im_start, im_end = specials["<|endoftext|>"], specials["<|im_start|>"], specials["<|im_end|>"]
    tok_cfg = {
        "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "model_max_length": 4096, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                          "single_word": False, "special": True}
                                 for s, i in sorted(specials.items(), key=lambda kv: kv[1])},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": None, "eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": True,
               "temperature": 0.8, "top_p": 0.95, "top_k": 40,
               "transformers_version": transformers.__version__}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / ".train"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=0, help="total optimizer steps (0: from --minutes)")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall budget for the training loop")
    ap.add_argument("--max-epochs", type=float, default=40.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", default="auto", help="experts implementation (auto: grouped_mm, else eager)")
    ap.add_argument("--tiny", action="store_true", help="small widths, for a CPU smoke test")
    args = ap.parse_args()

    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    t_start = time.time()
    data, out = Path(args.data), Path(args.out)
    meta = json.loads((data / "meta.json").read_text())
    specials = meta["specials"]
    train_ids = np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64)
    held_ids = np.fromfile(data / "heldout.bin", dtype=np.uint16).astype(np.int64)
    windows = heldout_windows(held_ids, args.ctx)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    config = make_config(specials, tiny=args.tiny)
    model = Qwen3_5MoeForCausalLM(config).to(device)
    model.train()
    add_dropout_hooks(model, args.dropout)
    if args.experts != "auto":
        model.set_experts_implementation(args.experts)
    # Trial forward/backward: the grouped_mm experts path has dtype/hardware conditions; fall back to
    # the eager per-expert loop if it fails here. (Gradients and RNG are reset afterwards.)
    for impl in ([None, "eager"] if args.experts == "auto" else [None]):
        if impl is not None:
            model.set_experts_implementation(impl)
        try:
            xt = torch.zeros((2, 64), dtype=torch.long, device=device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                o = model(input_ids=xt, use_cache=False, output_router_logits=True)
            (o.logits.float().mean() + o.aux_loss.float()).backward()
            break
        except Exception as e:  # noqa: BLE001
            print(f"experts implementation {model.config._experts_implementation} failed: {e!r}", flush=True)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(args.seed)
    log(f"experts implementation in use: {model.config._experts_implementation}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"transformers {transformers.__version__} torch {torch.__version__} device {device} "
        f"{torch.cuda.get_device_name(0) if amp else ''}")
    log(f"params {n_params} ({n_params * 2 / 1e6:.2f} MB in bf16); experts impl "
        f"{getattr(model.config, '_experts_implementation', None)}; attn impl {model.config._attn_implementation}")
    log(f"train tokens {len(train_ids)}, held-out tokens {len(held_ids)} in {len(windows)} windows; args {vars(args)}")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=amp)

    gen = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch * args.ctx
    epoch_steps = int(args.max_epochs * len(train_ids) / tokens_per_step)
    total = args.steps if args.steps > 0 else None
    best = (float("inf"), -1, None)
    budget_s = args.minutes * 60
    t_loop = time.time()
    t_mark, step_mark = None, 0
    step, eval_time = 0, 0.0
    while True:
        if total is not None and step >= total:
            break
        if args.steps == 0 and time.time() - t_loop > budget_s + 20:
            log(f"wall budget exceeded at step {step}; stopping")
            break
        lr = lr_at(step, total or 10**9, args.lr, args.warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.ctx - 1, (args.batch,), generator=gen).numpy()
        batch = np.stack([train_ids[s:s + args.ctx + 1] for s in starts])
        xy = torch.from_numpy(batch).to(device, non_blocking=True)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            outp = model(input_ids=x, use_cache=False, output_router_logits=True)
        ce = F.cross_entropy(outp.logits.float().reshape(-1, outp.logits.shape[-1]), y.reshape(-1))
        loss = ce + config.router_aux_loss_coef * outp.aux_loss.float()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1

        if step == 10:
            if amp:
                torch.cuda.synchronize()
            t_mark, step_mark = time.time(), step
        if total is None and step == 60 and t_mark is not None:
            if amp:
                torch.cuda.synchronize()
            dt = (time.time() - t_mark) / (step - step_mark)
            eval_cost = 0.0
            remaining = budget_s - (time.time() - t_loop)
            time_steps = step + int(0.97 * remaining / (dt * (1 + 0.04)))  # ~4% for evals
            total = max(step + 1, min(time_steps, epoch_steps))
            log(f"step time {dt * 1000:.1f} ms, {tokens_per_step / dt:.0f} tok/s; time allows {time_steps} steps,"
                f" epoch cap {epoch_steps}; total_steps={total} "
                f"({total * tokens_per_step / len(train_ids):.1f} epochs)")
        if step % args.log_every == 0 or step == 1:
            log(f"step {step:5d} lr {lr:.2e} loss {ce.item():.4f} aux {outp.aux_loss.item():.3f} "
                f"gnorm {gnorm.item():.2f} elapsed {time.time() - t_start:.0f}s")
        last = total is not None and step >= total
        if step % args.eval_every == 0 or last:
            te = time.time()
            hl, cnt = heldout_loss(model, windows, device, amp)
            eval_time += time.time() - te
            tag = ""
            if hl < best[0]:
                best = (hl, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
                tag = " *"
            log(f"eval step {step:5d} heldout loss {hl:.4f} ppl {math.exp(hl):.2f} ({cnt} tokens){tag}")

    log(f"training done: {step} steps, {step * tokens_per_step} tokens "
        f"({step * tokens_per_step / len(train_ids):.1f} epochs), loop {time.time() - t_loop:.0f}s; "
        f"best heldout loss {best[0]:.4f} (ppl {math.exp(best[0]):.2f}) at step {best[1]}")
    model.load_state_dict(best[2])
    model.eval()
    m = write_model_dir(model, out, data, specials, log_lines)

    # Check the saved directory: reload with transformers and compare with the in-memory bf16 model.
    # (A fresh f32 instance holding the bf16-rounded weights: casting `m` itself would also round
    # the RoPE inv_freq buffer to bf16.)
    re_m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    m32 = Qwen3_5MoeForCausalLM(config).eval()
    m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    saved = safetensors.torch.load_file(out / "model.safetensors")
    mine = m.state_dict()
    assert all(torch.equal(saved[k], mine[k]) for k in saved), "saved tensors differ"
    log(f"saved tensors: {len(saved)}, all bf16: {all(t.dtype == torch.bfloat16 for t in saved.values())}, "
        f"e.g. {[k for k in saved if 'layers.0.mlp.experts' in k]}")
    x = torch.tensor(held_ids[:256][None])
    with torch.no_grad():
        a, b = m32(input_ids=x).logits, re_m(input_ids=x).logits
    diff = (a - b).abs().max().item()
    log(f"reload check: max |logit diff| {diff}")
    assert diff == 0.0, diff
    hl32, cnt = heldout_loss(re_m, windows, torch.device("cpu"), False, batch=8) if args.tiny else (None, None)
    if hl32 is not None:
        log(f"f32 CPU heldout loss of the saved weights: {hl32:.4f}")

    # Samples (transformers generate, from the saved weights).
    tok = AutoTokenizer.from_pretrained(out)
    gm = re_m.to(device)
    for prompt in ["Once upon a time", "It is a truth universally acknowledged"]:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            g = gm.generate(ids, max_new_tokens=80, do_sample=False)
            torch.manual_seed(args.seed)
            s = gm.generate(ids, max_new_tokens=80, do_sample=True, temperature=0.8, top_p=0.95, top_k=40)
        log(f"[greedy] {tok.decode(g[0], skip_special_tokens=False)!r}")
        log(f"[sample] {tok.decode(s[0], skip_special_tokens=False)!r}")
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    log(f"total wall {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
