#!/usr/bin/env python3
"""Quantization fixtures for deltamoe, made with mlx / mlx-lm (CPU) and HF transformers.

1. fixtures/quant/mlx_quantize.safetensors: random matrices (odd row counts, special rows) in
   bf16/f16/f32 and what `mlx.core.quantize` makes of them for bits 2/3/4/5/6/8 and group sizes
   32/64/128 (words, scales, biases). deltamoe's `quantize` must reproduce them bit for bit.
2. fixtures/mlx_<fixture>_q<bits>/: the committed fixtures quantized by mlx-lm's own converter
   (`mlx_lm.convert`), each with a reference.safetensors computed by transformers (float32, eager)
   on the *dequantized* weights of that checkpoint (mlx-lm layout mapped back to HF: switch_mlp ->
   fused experts, norms - 1, conv1d [C,K,1] -> [C,1,K]), for the prompts of the source fixture.
3. --check DIR...: load each directory with mlx_lm (`load_model`) and run a CPU forward (used to
   check that `deltamoe convert` output loads in mlx-lm); with --against MLXDIR also compare the
   tensors with an mlx-lm-converted directory.

Run after scripts/make_fixtures.py (which deletes every fixture directory):
    pip install "mlx[cpu]" mlx-lm   # Linux x86-64 wheels
    python3 scripts/make_quant_fixtures.py
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import torch
import transformers
from mlx_lm.convert import convert
from mlx.utils import tree_map
from mlx_lm.utils import load_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))
import make_fixtures as mf  # noqa: E402  (reference(), IMPL, save_sorted_meta)

# (source fixture, bits, group size)
CHECKPOINTS = [("qwen3_5_moe", 4, 32), ("qwen3_next", 4, 32), ("qwen3_5_moe", 8, 64)]
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


# ---------------------------------------------------------------------------------------------
# 1. mx.quantize parity cases
# ---------------------------------------------------------------------------------------------
def special_rows(rng, rows, cols):
    """Random rows plus the cases where the algorithm branches: constant, zero, outlier, tiny
    (below the 1e-7 scale floor), all negative, |min| == |max|."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    for r in range(rows):
        kind = r % 7
        if kind == 1:
            w[r] = 0.3125
        elif kind == 2:
            w[r] = 0.0
        elif kind == 3:
            w[r, rng.integers(cols)] = 3.0
        elif kind == 4:
            w[r] *= 1e-6
        elif kind == 5:
            w[r] = -np.abs(w[r])
        elif kind == 6:
            w[r, ::32] = 0.125
            w[r, 1::32] = -0.125
    return w


def make_parity():
    out = FIX / "quant"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20250601)
    arrays, cases = {}, []
    dtypes = [mx.bfloat16, mx.float16, mx.float32]
    i = 0
    for dt in dtypes:
        for bits in (2, 3, 4, 5, 6, 8):
            for gs in (32, 64, 128):
                rows, cols = (7, 9)[i % 2], (128, 256)[i % 3 // 2]
                w = mx.array(special_rows(rng, rows, cols)).astype(dt)
                wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
                arrays.update({f"{i}.w": w, f"{i}.words": wq, f"{i}.scales": s, f"{i}.biases": b})
                cases.append({"bits": bits, "group_size": gs, "dtype": str(dt).split(".")[-1]})
                i += 1
    meta = {"cases": json.dumps(cases), "mlx": mx.__version__}
    mx.save_safetensors(str(out / "mlx_quantize.safetensors"), arrays, metadata=meta)
    print(f"quant/mlx_quantize.safetensors: {len(cases)} cases, mlx {mx.__version__}")


# ---------------------------------------------------------------------------------------------
# 2. mlx-lm checkpoints and transformers references
# ---------------------------------------------------------------------------------------------
def quant_params(cfg, module):
    q = cfg["quantization"]
    o = q.get(module)
    if isinstance(o, dict):
        return o["group_size"], o["bits"]
    return q["group_size"], q["bits"]


def dequantized_hf_state_dict(d, cfg):
    """The checkpoint's weights as f32 in transformers' in-memory layout."""
    w = {}
    for f in sorted(d.glob("model*.safetensors")):
        w.update(mx.load(str(f)))
    sd = {}
    for k, v in w.items():
        if k.endswith((".scales", ".biases")):
            continue
        mod = k[: -len(".weight")] if k.endswith(".weight") else None
        if mod is not None and f"{mod}.scales" in w:
            gs, bits = quant_params(cfg, mod)
            v = mx.dequantize(v, w[f"{mod}.scales"].astype(mx.float32), w[f"{mod}.biases"].astype(mx.float32),
                              group_size=gs, bits=bits)
        t = torch.from_numpy(np.array(v.astype(mx.float32)))
        k = k.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head.")
        if k.endswith(ZERO_CENTRED):
            t = t - 1.0  # mlx stores 1 + w; the subtraction is exact in f32
        if k.endswith("conv1d.weight"):
            t = t.permute(0, 2, 1)  # [C, K, 1] -> [C, 1, K]
        sd[k] = t.contiguous()
    for k in sorted({k.rsplit(".switch_mlp.", 1)[0] for k in sd if ".switch_mlp." in k}):
        g = sd.pop(f"{k}.switch_mlp.gate_proj.weight")
        u = sd.pop(f"{k}.switch_mlp.up_proj.weight")
        sd[f"{k}.experts.gate_up_proj"] = torch.cat([g, u], dim=1).contiguous()
        sd[f"{k}.experts.down_proj"] = sd.pop(f"{k}.switch_mlp.down_proj.weight")
    return sd


def make_checkpoint(src_name, bits, gs):
    src, d = FIX / src_name, FIX / f"mlx_{src_name}_q{bits}"
    if d.exists():
        shutil.rmtree(d)
    convert(str(src), str(d), quantize=True, q_group_size=gs, q_bits=bits)
    # mlx-lm adds a README and, for a source without a tokenizer, a placeholder one: drop them.
    (d / "README.md").unlink(missing_ok=True)
    if not (src / "tokenizer.json").exists():
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (d / f).unlink(missing_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    sd = dequantized_hf_state_dict(d, cfg)
    tcfg = transformers.AutoConfig.from_pretrained(src).get_text_config()
    model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.float32, **mf.IMPL).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    # The source fixture's prompts first; when quantization made a routing or greedy decision a
    # near-tie for them, random prompts of the same lengths (seeded) until none is.
    src_ref = load_file(str(src / "reference.safetensors"))
    vocab = tcfg.vocab_size
    gen = torch.Generator().manual_seed(mf.SEED + bits * 100 + gs)
    for attempt in range(mf.MAX_ATTEMPTS):
        tensors, margins = {}, []
        for i in range(2):
            toks = src_ref[f"prompt{i}.tokens"]
            if attempt > 0:
                toks = torch.randint(0, vocab, (len(toks),), generator=gen)
            res, router_margin, greedy_margin = mf.reference(model, toks, hidden=False)
            margins.append((router_margin, greedy_margin))
            tensors.update({f"prompt{i}.{k}": v for k, v in res.items()})
        rm, gm = min(m[0] for m in margins), min(m[1] for m in margins)
        if rm >= mf.ROUTER_MARGIN and gm >= mf.GREEDY_MARGIN:
            break
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "source": src_name, "bits": str(bits), "group_size": str(gs),
            "min_router_gap": f"{rm:.3e}", "min_greedy_margin": f"{gm:.3e}",
            "prompts": "source fixture" if attempt == 0 else f"random, attempt {attempt}"}
    mf.save_sorted_meta(tensors, d / "reference.safetensors", meta)

    # mlx-lm's own forward against the reference, for the record: once as loaded (bf16 scales and
    # activations), once with every float parameter cast to f32 (still quantized: mlx's quantized
    # kernels then see the same q·scale + bias values the reference was built from).
    toks = mx.array(tensors["prompt0.tokens"].numpy()[None])
    ref = tensors["prompt0.logits"].numpy()
    errs = []
    for f32 in (False, True):
        m, _ = load_model(d)
        if f32:
            m.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                              m.parameters()))
        try:
            lg = np.array(m(toks)[0].astype(mx.float32))
            errs.append(f"{np.abs(lg - ref).max() / np.abs(ref).max():.1e} (argmax {(lg.argmax(-1) == ref.argmax(-1)).mean():.2f})")
        except RuntimeError as e:  # mlx's CPU gather_mm only takes f32: bf16 unquantized experts fail
            errs.append(f"fails: {e}")
    size = sum(f.stat().st_size for f in d.iterdir())
    flag = "" if rm >= mf.ROUTER_MARGIN and gm >= mf.GREEDY_MARGIN else "  WARNING: near-tie"
    print(f"{d.name}: {size / 1024:.0f} KiB, prompt attempt {attempt}, min router gap {rm:.1e}, min greedy margin {gm:.1e}{flag}\n"
          f"    mlx-lm forward vs reference, max err / max|ref|: as loaded {errs[0]}; f32 parameters {errs[1]}")


# ---------------------------------------------------------------------------------------------
# 3. check that a directory (e.g. `deltamoe convert` output) loads and runs in mlx-lm
# ---------------------------------------------------------------------------------------------
def load_f32(d):
    """mlx-lm's model of d with float parameters cast to f32 (quantized weights stay packed): mlx's
    CPU gather_mm takes f32 only, so bf16 experts that mlx-lm left unquantized fail otherwise."""
    m, cfg = load_model(d)
    m.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                      m.parameters()))
    return m, cfg


def check(dirs, against):
    for d in map(Path, dirs):
        m, cfg = load_f32(d)
        toks = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
        lg = np.array(m(toks)[0].astype(mx.float32))
        line = f"{d}: mlx_lm.load_model ok, forward {lg.shape} finite={np.isfinite(lg).all()}"
        if against:
            a = {}
            for f in sorted(Path(against).glob("model*.safetensors")):
                a.update(mx.load(str(f)))
            b = {}
            for f in sorted(d.glob("model*.safetensors")):
                b.update(mx.load(str(f)))
            same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                                 and mx.array_equal(a[k], b[k]).item() for k in a)
            qa = json.loads((Path(against) / "config.json").read_text())["quantization"]
            line += f"; tensors identical to {against}: {same}; quantization block equal: {qa == cfg['quantization']}"
            ma, _ = load_f32(Path(against))
            la = np.array(ma(toks)[0].astype(mx.float32))
            line += f"; logits max diff {np.abs(la - lg).max():.2e}"
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", nargs="+", help="directories to load with mlx-lm and run")
    ap.add_argument("--against", help="with --check: an mlx-lm-converted directory to compare tensors with")
    a = ap.parse_args()
    if a.check:
        check(a.check, a.against)
        return
    torch.set_num_threads(4)
    make_parity()
    for name, bits, gs in CHECKPOINTS:
        make_checkpoint(name, bits, gs)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, mlx {mx.__version__}, "
          f"mlx-lm {mlx_lm.__version__}")


if __name__ == "__main__":
    main()
