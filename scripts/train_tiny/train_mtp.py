#!/usr/bin/env python3
"""Train the multi-token-prediction (MTP) layer of the tiny built-in model (models/tiny), base frozen.

The MTP layer is Qwen3.5's (vLLM's semantics, as scripts/make_mtp_fixtures.py documents): row i takes
the token at i + 1 and the main model's final hidden state at i (after the final norm),
x = fc([pre_fc_norm_embedding(embed(token)) ; pre_fc_norm_hidden(hidden)]), one full-attention MoE
decoder layer (causal over the MTP's own rows, rotary position i), norm, then the main (tied) lm_head;
it is trained to predict the token at i + 2 (cross-entropy on the training stream of prepare.py).
The decoder layer starts as a copy of the model's last full-attention layer, fc as [0 | I] (the
normed hidden state), the norms at 0 (zero-centred: scale 1). Everything of the main model is frozen.

Every --eval-every steps, on consecutive --ctx windows of the held-out split: the MTP's loss and top-1
accuracy against the true token at i + 2, and how often its argmax equals the main model's argmax for
that position (the chance that a greedy draft is accepted); the best weights by held-out loss are kept.

Output: a copy of the model directory with the `mtp.*` tensors added to model.safetensors (bf16,
fused experts as the main layers store them) and `mtp_num_hidden_layers: 1` in config.json, plus
train_mtp_log.txt.

Usage (GPU):  python3 scripts/train_tiny/train_mtp.py --data .train --out OUTDIR --steps 600
CPU smoke test:  python3 scripts/train_tiny/train_mtp.py --data .train --out /tmp/mtp_smoke --steps 2 --batch 2 --ctx 64 --device cpu
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

from train import lr_at

ROOT = Path(__file__).resolve().parents[2]
LAST_FULL = 7  # the model's last full-attention layer, the MTP layer's starting point


def build_mtp(model):
    """The MTP modules, initialised from the model's last full-attention layer."""
    cfg, h = model.config, model.config.hidden_size
    norm_cls = type(model.model.norm)
    mtp = torch.nn.ModuleDict({
        "pre_fc_norm_embedding": norm_cls(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": norm_cls(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "layer": type(model.model.layers[LAST_FULL])(cfg, layer_idx=LAST_FULL),
        "norm": norm_cls(h, eps=cfg.rms_norm_eps),
    })
    with torch.no_grad():
        mtp["layer"].load_state_dict(model.model.layers[LAST_FULL].state_dict())
        mtp["fc"].weight.zero_()
        mtp["fc"].weight[:, h:] = torch.eye(h)
        for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[k].weight.zero_()
    return mtp


def run_mtp(model, mtp, toks, hids):
    """MTP logits [B, L, V] for rows (toks[:, i], hids[:, i]) at positions 0..L-1."""
    x = torch.cat([mtp["pre_fc_norm_embedding"](model.model.embed_tokens(toks)),
                   mtp["pre_fc_norm_hidden"](hids)], dim=-1)
    x = mtp["fc"](x)
    b, n = x.shape[:2]
    pos = torch.arange(n, device=x.device)[None].expand(b, n)
    rope = model.model.rotary_emb(x, pos[None].expand(3, b, n))  # mrope: one position in all 3 rows
    mask = torch.full((n, n), torch.finfo(x.dtype).min, device=x.device).triu(1)[None, None]
    out = mtp["layer"](x, position_embeddings=rope, attention_mask=mask)
    out = out[0] if isinstance(out, tuple) else out
    return model.lm_head(mtp["norm"](out))


def mtp_loss(model, mtp, xy, amp):
    """Cross-entropy of the MTP's prediction of token i + 2, its top-1 hits, its agreement with the
    main model's argmax, and the row count, over windows xy [B, L + 1]."""
    x = xy[:, :-1]
    with torch.autocast(device_type=xy.device.type, dtype=torch.bfloat16, enabled=amp):
        with torch.no_grad():
            out = model.model(input_ids=x, use_cache=False)
            hidden = out.last_hidden_state
            main_next = model.lm_head(hidden[:, 1:]).argmax(-1)  # main model's pick for token i + 2
        logits = run_mtp(model, mtp, x[:, 1:], hidden[:, :-1]).float()
    target = xy[:, 2:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    pick = logits.argmax(-1)
    return loss, (pick == target).sum().item(), (pick == main_next).sum().item(), target.numel()


@torch.no_grad()
def evaluate(model, mtp, windows, device, amp, batch=32):
    mtp.eval()
    tot = [0.0, 0, 0, 0]
    for i in range(0, len(windows), batch):
        xy = torch.tensor(np.stack(windows[i:i + batch]), device=device)
        loss, hit, agree, n = mtp_loss(model, mtp, xy, amp)
        tot = [tot[0] + loss.item() * n, tot[1] + hit, tot[2] + agree, tot[3] + n]
    mtp.train()
    return tot[0] / tot[3], tot[1] / tot[3], tot[2] / tot[3]


def write(model_dir, out, mtp, log_lines):
    out.mkdir(parents=True, exist_ok=True)
    for p in model_dir.iterdir():
        if p.is_file() and p.name not in ("model.safetensors", "config.json"):
            shutil.copy(p, out / p.name)
    sd = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    for k, v in mtp.state_dict().items():
        name = k.replace("layer.", "layers.0.", 1) if k.startswith("layer.") else k
        sd["mtp." + name] = v.detach().to("cpu", torch.bfloat16).contiguous()
    safetensors.torch.save_file(dict(sorted(sd.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "train_mtp_log.txt").write_text("\n".join(log_lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT / ".train"))
    ap.add_argument("--model", default=str(ROOT / "models/tiny"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    data, model_dir, device = Path(args.data), Path(args.model), torch.device(args.device)
    amp = device.type == "cuda"
    torch.manual_seed(args.seed)
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if amp:
        model.set_experts_implementation("grouped_mm")
    model.to(device).eval().requires_grad_(False)
    mtp = build_mtp(model).to(device).train()
    train_ids = np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64)
    held_ids = np.fromfile(data / "heldout.bin", dtype=np.uint16).astype(np.int64)
    windows = [held_ids[i:i + args.ctx + 1] for i in range(0, len(held_ids) - args.ctx, args.ctx)]
    n_params = sum(p.numel() for p in mtp.parameters())
    log(f"transformers {transformers.__version__} torch {torch.__version__} device {device} "
        f"{torch.cuda.get_device_name(0) if amp else ''}; MTP params {n_params}; "
        f"experts impl {model.config._experts_implementation}; args {vars(args)}")
    log(f"train tokens {len(train_ids)}, held-out windows {len(windows)} of {args.ctx + 1}")

    decay = [p for n, p in mtp.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in mtp.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    loss0, acc0, agree0 = evaluate(model, mtp, windows, device, amp)
    log(f"step 0: held-out loss {loss0:.4f}, top-1 {acc0:.4f}, agrees with the model {agree0:.4f}")
    best = (loss0, 0, {k: v.clone() for k, v in mtp.state_dict().items()})
    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, args.steps, args.lr, args.warmup, 0.05)
        starts = torch.randint(0, len(train_ids) - args.ctx - 1, (args.batch,), generator=gen).numpy()
        xy = torch.from_numpy(np.stack([train_ids[s:s + args.ctx + 1] for s in starts])).to(device)
        loss, _, _, _ = mtp_loss(model, mtp, xy, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, mtp, windows, device, amp)
            log(f"step {step}: train loss {loss.item():.4f}; held-out loss {ev[0]:.4f}, top-1 {ev[1]:.4f}, "
                f"agrees with the model {ev[2]:.4f}; {time.time() - t0:.0f} s")
            if ev[0] < best[0]:
                best = (ev[0], step, {k: v.clone() for k, v in mtp.state_dict().items()})
    mtp.load_state_dict(best[2])
    log(f"kept step {best[1]} (held-out loss {best[0]:.4f})")
    write(model_dir, Path(args.out), mtp, log_lines)


if __name__ == "__main__":
    main()
