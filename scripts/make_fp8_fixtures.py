#!/usr/bin/env python3
"""Qwen fine-grained FP8 fixtures for deltamoe (the format of Qwen's official `*-FP8` repos).

1. fixtures/fp8_<name>/: tiny random models (new dims, so that every quantized matrix has partial
   128-blocks and most have full ones too) whose linear layers are stored as FP8 E4M3 with per-block
   `weight_scale_inv`, plus a reference.safetensors computed by transformers (float32, eager, the
   plain code paths of make_fixtures.py) on the weights dequantized by THIS script's own f32 code
   (transformers' FP8 dequantizer is not used: it mishandles partial edge blocks).
2. fixtures/quant/fp8_cases.safetensors: the e4m3 byte -> f32 table and a few matrices with what
   this script's quantizer makes of them, for bit-exact decode / dequantization tests.

Format (quantization_config {quant_method "fp8", fmt "e4m3", activation_scheme "dynamic",
weight_block_size [128, 128], modules_to_not_convert [full module paths]}): a quantized linear
`{m}.weight` is F8_E4M3 [out, in] and `{m}.weight_scale_inv` is [ceil(out/128), ceil(in/128)]
with w[i, j] = fp8[i, j] * s[i // 128, j // 128] (edge blocks partial). Routed experts are stored
per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight` + `weight_scale_inv`), as in the official
Qwen3.5/3.6 and Qwen3-Next FP8 checkpoints.

Run from anywhere (CPU, a minute or two); it only touches the paths it writes:
    python3 scripts/make_fp8_fixtures.py
"""
import json
import math
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import safetensors
import safetensors.torch
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))
import make_fixtures as mf  # noqa: E402  (build_model, to_checkpoint, reference, save helpers; never main())

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
SEED = mf.SEED + 7000

# New dims: hidden 160 (= 128 + 32); attention 6 q / 2 kv heads x 32 (q_proj 384 x 160 with the
# output gate, k/v 64 x 160, o_proj 160 x 192); GDN 2 key heads x 32, 4 value heads x 48 (in_proj_qkv
# 320 x 160, in_proj_z 192 x 160, out_proj 160 x 192; Next: in_proj_qkvz 512 x 160, in_proj_ba 8 x 160);
# experts 48 x 160 / 160 x 48, shared expert 144 x 160 / 160 x 144, dense MLP 200 x 160 / 160 x 200.
BASE = dict(mf.BASE, hidden_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=144)

FIXTURES = [
    dict(name="fp8_qwen3_5_moe", source="qwen3_5_moe", outer="qwen3_5_moe", arch="Qwen3_5MoeForConditionalGeneration",
         text=dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, layer_types=mf.layer_types(4),
                   tie_word_embeddings=False, **BASE, **MOE, **mf.rope_v5(10_000_000.0)),
         prefix="model.language_model.", experts="per_expert", shards=1, scale_dtype=torch.float32,
         extra={"model.visual.blocks.0.attn.qkv.weight": (8, 8), "mtp.fc.weight": (8, 8)}),
    # 8 layers of MoE do not fit one file under 2 MB: two shards + index, as the real repos are sharded.
    dict(name="fp8_qwen3_next", source="qwen3_next", outer=None, arch="Qwen3NextForCausalLM",
         text=dict(model_type="qwen3_next", num_hidden_layers=8, layer_types=mf.layer_types(8),
                   decoder_sparse_step=1, mlp_only_layers=[1], intermediate_size=200, norm_topk_prob=True,
                   tie_word_embeddings=False, **BASE, **MOE, **mf.rope_hub(10_000.0)),
         prefix="model.", experts="per_expert", shards=2, scale_dtype=torch.float32),
    dict(name="fp8_qwen3_5_dense", source="qwen3_5_dense", outer="qwen3_5", arch="Qwen3_5ForConditionalGeneration",
         text=dict(model_type="qwen3_5_text", num_hidden_layers=4, layer_types=mf.layer_types(4),
                   full_attention_interval=4, intermediate_size=200, tie_word_embeddings=True,
                   **BASE, **mf.rope_v5(100_000.0)),
         prefix="model.language_model.", experts=None, shards=1, scale_dtype=torch.bfloat16),
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---------------------------------------------------------------------------------------------
# Block-wise FP8 quantization (the field's recipe) and this script's own dequantization
# ---------------------------------------------------------------------------------------------
def expand(s, shape):
    """Per-block scales [ceil(out/128), ceil(in/128)] -> [out, in] (edge blocks partial)."""
    return s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]


def quantize(w, scale_dtype=torch.float32):
    """w f32 [out, in] -> (fp8 [out, in], weight_scale_inv [ceil(out/128), ceil(in/128)] in scale_dtype).
    s = amax(|block|) / 448 (1 for an all-zero block); with bf16 scales, s is rounded to bf16 FIRST and
    the weight divided by the rounded value. fp8 = clamp(w / s, +-448) cast with torch's round-to-nearest-even."""
    w = w.float()
    out, inn = w.shape
    ro, ri = math.ceil(out / BLOCK), math.ceil(inn / BLOCK)
    padded = torch.zeros(ro * BLOCK, ri * BLOCK)
    padded[:out, :inn] = w.abs()
    amax = padded.reshape(ro, BLOCK, ri, BLOCK).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = s.to(scale_dtype).float()
    q = (w / expand(s, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.to(scale_dtype)


def dequantize(q, s):
    """fp8 [out, in] and any-float scales -> f32 [out, in]: q.f32 * s.f32 of its block."""
    return q.float() * expand(s, q.shape)


# ---------------------------------------------------------------------------------------------
# Checkpoint layout
# ---------------------------------------------------------------------------------------------
def not_converted(fx):
    """modules_to_not_convert as Qwen's FP8 configs spell it: full module paths, layer by layer
    (Qwen3-Next-80B-A3B-Instruct-FP8: lm_head, embed_tokens, per layer input/post_attention_layernorm,
    mlp.gate, mlp.shared_expert_gate, linear_attn.{A_log,conv1d,dt_bias,in_proj_ba,norm},
    self_attn.{k_norm,q_norm}, mtp.*; Qwen3.5 repos: the same with the model.language_model. prefix,
    in_proj_a / in_proj_b, and the vision / mtp modules)."""
    t, p = fx["text"], fx["prefix"]
    names = ["lm_head", f"{p}embed_tokens"]
    moe = t.get("num_experts", 0) > 0
    for i, kind in enumerate(t["layer_types"]):
        lp = f"{p}layers.{i}."
        names += [lp + "input_layernorm", lp + "post_attention_layernorm"]
        if moe and i not in t.get("mlp_only_layers", []):
            names += [lp + "mlp.gate", lp + "mlp.shared_expert_gate"]
        if kind == "linear_attention":
            ab = ["in_proj_ba"] if fx["outer"] is None else ["in_proj_a", "in_proj_b"]
            names += [lp + "linear_attn." + m for m in ["A_log", "conv1d", "dt_bias", *ab, "norm"]]
        else:
            names += [lp + "self_attn.k_norm", lp + "self_attn.q_norm"]
    names += [k[: -len(".weight")] for k in fx.get("extra", {})]
    return names


def quant_config(fx):
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "modules_to_not_convert": not_converted(fx), "weight_block_size": [BLOCK, BLOCK]}


def quantize_checkpoint(bf16_sd, fx):
    """On-disk bf16 state dict -> FP8 checkpoint: every 2-D `.weight` whose module is not in
    modules_to_not_convert becomes F8_E4M3 + `weight_scale_inv`."""
    skip, out = set(not_converted(fx)), {}
    for k, v in bf16_sd.items():
        if k.endswith(".weight") and v.ndim == 2 and k[: -len(".weight")] not in skip:
            out[k], out[k + "_scale_inv"] = quantize(v.float(), fx["scale_dtype"])
        else:
            out[k] = v
    return dict(sorted(out.items(), key=lambda kv: mf.natural_key(kv[0])))


def hf_layout(sd, fx):
    """f32 state dict under on-disk names -> transformers' in-memory layout: prefix mapped back, per-expert
    tensors fused (gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I])."""
    out, experts = {}, {}
    for k, t in sd.items():
        if k.startswith(fx["prefix"]):
            k = "model." + k[len(fx["prefix"]):]
        if ".mlp.experts." in k:
            base, rest = k.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(base, {})[(int(e), proj)] = t
            continue
        out[k] = t.contiguous()
    for base, ex in experts.items():
        n = 1 + max(e for e, _ in ex)
        out[f"{base}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ex[(e, "gate_proj")], ex[(e, "up_proj")]], 0) for e in range(n)]).contiguous()
        out[f"{base}.mlp.experts.down_proj"] = torch.stack([ex[(e, "down_proj")] for e in range(n)]).contiguous()
    return out


def hf_state_dict(ckpt, fx):
    """FP8 checkpoint (on-disk names) -> f32 state dict in transformers' in-memory layout (`hf_layout`):
    weights dequantized by `dequantize`, extra tensors dropped."""
    sd = {}
    for k, v in ckpt.items():
        if k.endswith("_scale_inv") or k in fx.get("extra", {}):
            continue
        sd[k] = dequantize(v, ckpt[k + "_scale_inv"]) if k + "_scale_inv" in ckpt else v.float()
    return hf_layout(sd, fx)


def load_into(model, sd, fx):
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed = {"lm_head.weight"} if fx["text"]["tie_word_embeddings"] else set()
    assert set(missing) <= allowed and not unexpected, (missing, unexpected)
    if allowed:
        model.tie_weights()
    return model.eval()


def text_config(d):
    cfg = transformers.AutoConfig.from_pretrained(d).get_text_config()
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the reference model is a plain float32 model
    return cfg


def build(fx, seed):
    """make_fixtures.build_model on a bf16 copy of the config (no quantization_config)."""
    with tempfile.TemporaryDirectory() as tmp:
        mf.dump_json(Path(tmp) / "config.json", mf.full_config(fx))
        return mf.build_model(Path(tmp), seed)


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def write_fixture(fx, seed, quant_cfg, prepare, to_hf, meta):
    """What every quantized fixture shares (this script's and make_gptq_fixtures.py's): fixtures/<name>/ with
    config.json (+ quant_cfg as its quantization_config), the tokenizer files of fx["source"], the checkpoint
    and reference.safetensors (meta: the format's metadata, next to the versions and the seed facts), weights
    re-drawn from `seed + attempt` until no routing or greedy decision of the DEQUANTIZED model is a near-tie,
    and check 1 (a fresh model loaded from the written files gives bit-identical logits).
    The format's steps: prepare(gen), called once after the prompts are drawn from gen, returns
    quantize(model) -> (ckpt, info): the on-disk checkpoint of the float model and what to_hf needs besides;
    to_hf(ckpt, info) -> f32 state dict in transformers' layout.
    Returns the facts the format's own checks and report use."""
    d = FIX / fx["name"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    config = {**mf.full_config(fx), "quantization_config": quant_cfg}
    vocab = fx["text"]["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in mf.PROMPT_LENS]
    quantize = prepare(gen)
    # Re-draw the weights until no routing or greedy decision of the DEQUANTIZED model is a near-tie.
    for attempt in range(mf.MAX_ATTEMPTS):
        model = build(fx, seed + attempt)
        plain = [model(p[None], use_cache=False).logits[0].clone() for p in prompts]  # unquantized weights
        ckpt, info = quantize(model)
        load_into(model, to_hf(ckpt, info), fx)
        out = [mf.reference(model, p, hidden=False) for p in prompts]
        rm, gm = min(o[1] for o in out), min(o[2] for o in out)
        if rm >= mf.ROUTER_MARGIN and gm >= mf.GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"{fx['name']}: no seed without near-ties in {mf.MAX_ATTEMPTS} attempts")
    refs = [o[0] for o in out]

    mf.dump_json(d / "config.json", config)
    src = FIX / fx["source"]
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    mf.save_weights(d, ckpt, fx["shards"])
    tensors = {f"prompt{i}.{k}": v for i, r in enumerate(refs) for k, v in r.items()}
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
            "seed_attempt": str(attempt), "min_router_gap": f"{rm:.3e}", "min_greedy_margin": f"{gm:.3e}", **meta}
    mf.save_sorted_meta(tensors, d / "reference.safetensors", meta)

    # Check 1: reload the written files into a fresh model and require bit-identical logits.
    files = sorted(d.glob("model*.safetensors"))
    disk = {}
    for f in files:
        disk.update(load_file(str(f)))
    assert disk.keys() == ckpt.keys()
    fresh = AutoModelForCausalLM.from_config(text_config(d), dtype=torch.float32, **mf.IMPL)
    load_into(fresh, to_hf(disk, info), fx)
    same = all(torch.equal(fresh(p[None], use_cache=False).logits[0], r["logits"]) for p, r in zip(prompts, refs))
    assert same, f"{fx['name']}: reloaded logits differ from the reference"
    # Check 3: quantization changed the model (reference vs the same weights unquantized).
    dq = max((a - r["logits"]).abs().max().item() for a, r in zip(plain, refs))
    agree = (plain[0].argmax(-1) == refs[0]["logits"].argmax(-1)).float().mean().item()
    return SimpleNamespace(d=d, files=files, disk=disk, info=info, refs=refs, attempt=attempt, rm=rm, gm=gm,
                           dq=dq, agree=agree)


def fixture_report(fx, r, what, more=""):
    """The fixture's report lines: `what` (the format's matrices) in the first, `more` (whole lines) after it."""
    size = sum(f.stat().st_size for f in r.d.iterdir())
    lg = r.refs[0]["logits"]
    return (f"{fx['name']}: {size / 1024:.0f} KiB in {len(r.files)} weight file(s), {what}, seed attempt {r.attempt}, "
            f"min router gap {r.rm:.1e}, min greedy margin {r.gm:.1e}\n{more}"
            f"    max|logit|={lg.abs().max():.2f} greedy0={r.refs[0]['greedy'].tolist()} greedy1={r.refs[1]['greedy'].tolist()}\n"
            f"    reload from files: logits bit-identical; unquantized vs reference: max|dlogit|={r.dq:.3f}, "
            f"prompt0 argmax agreement {r.agree:.2f}")


@torch.no_grad()
def make_fixture(idx, fx):
    def prepare(gen):
        return lambda model: (quantize_checkpoint(mf.to_checkpoint(model, fx), fx), None)

    meta = {"weight_block_size": "[128, 128]", "scale_dtype": str(fx["scale_dtype"]).split(".")[-1],
            "reference": "transformers float32 eager on weights dequantized by scripts/make_fp8_fixtures.py"}
    # write_fixture's check 1 reloads the F8_E4M3 files via safetensors+torch and dequantizes them with `dequantize`.
    r = write_fixture(fx, SEED + 1000 * idx, quant_config(fx), prepare, lambda ckpt, _: hf_state_dict(ckpt, fx), meta)
    # Check 2: the on-disk dtypes and scale shapes.
    header = {k: v for f in r.files for k, v in read_header(f).items() if k != "__metadata__"}
    sdt = {torch.float32: "F32", torch.bfloat16: "BF16"}[fx["scale_dtype"]]
    nq = 0
    for k, h in header.items():
        if k.endswith("_scale_inv"):
            w = header[k[: -len("_scale_inv")]]
            assert w["dtype"] == "F8_E4M3" and h["dtype"] == sdt, (k, w, h)
            assert h["shape"] == [math.ceil(w["shape"][0] / BLOCK), math.ceil(w["shape"][1] / BLOCK)], (k, w, h)
            nq += 1
    assert sum(h["dtype"] == "F8_E4M3" for h in header.values()) == nq
    # Check 2b: every FP8 matrix's dequantization against the bit-field decoder, element by element.
    bits = torch.tensor([e4m3_bits(b) for b in range(256)])
    disk = r.disk
    for k, v in disk.items():
        if k + "_scale_inv" in disk:
            s = disk[k + "_scale_inv"].float()
            rows = torch.arange(v.shape[0])[:, None] // BLOCK
            cols = torch.arange(v.shape[1])[None, :] // BLOCK
            assert torch.equal(bits[v.view(torch.uint8).long()] * s[rows, cols], dequantize(v, disk[k + "_scale_inv"])), k
    return fixture_report(fx, r, f"{nq} FP8 matrices (scales {sdt})")


# ---------------------------------------------------------------------------------------------
# Decode / dequantization cases
# ---------------------------------------------------------------------------------------------
def e4m3_bits(b):
    """float8_e4m3fn byte -> value from its bit fields (1 sign, 4 exponent bias 7, 3 mantissa; no inf;
    S.1111.111 is NaN)."""
    sign, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def make_cases():
    gen = torch.Generator().manual_seed(SEED + 99)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    cases = []
    # 0: partial blocks both ways, outliers, an all-zero block, -0.0 entries
    w = randn(130, 300) * 0.05
    w[5, 7], w[129, 299], w[64, 200] = 3.0, -2.5, 7.0
    w[0:128, 128:256] = 0.0
    w[1, 1], w[130 - 1, 0] = -0.0, -0.0
    cases.append((w, torch.float32, "130x300: outliers, zero block [0:128,128:256], -0.0 entries"))
    # 1: 257 rows (a 1-row edge block), tiny block (fp8 subnormals after scaling), constant block
    w = randn(257, 128) * 0.02
    w[128:256] *= 1e-4
    w[256, :] = 0.3125
    cases.append((w, torch.float32, "257x128: tiny block rows 128..255, constant last row (1-row edge block)"))
    # 2: a single partial block
    cases.append((torch.rand(64, 64, generator=gen) * 2 - 1, torch.float32, "64x64: one partial block, uniform"))
    # 3: scale exactly 1 (amax 448): round-to-nearest-even ties and fp8 subnormals
    w = torch.zeros(16, 32)
    w[0, 0] = 448.0
    sub = 2.0 ** -9  # smallest fp8 subnormal
    vals = [1.0625, 1.1875, 17.0, 19.0, 432.0, 440.0, sub * 0.5, sub * 1.5, sub * 0.75, -sub * 0.5, sub * 0.25, 240.0, 0.015625 * 1.0625, -3.25, 104.0, 1e-9]
    w[1, : len(vals)] = torch.tensor(vals)
    w[2:] = (randn(14, 32) * 100).clamp(-448, 448)
    cases.append((w, torch.float32, "16x32: scale exactly 1; ties-to-even midpoints, subnormals, values that flush to 0"))
    # 4: bf16-rounded scales (stored here as f32 values); a rounded-down scale saturates the max entry
    w = randn(200, 160) * 0.03
    w[3, 3] = 0.9
    cases.append((w, torch.bfloat16, "200x160: scales rounded to bf16 before quantizing (stored as exact f32)"))
    # 5: exact multiples of 128
    cases.append((randn(128, 256) * 0.1, torch.float32, "128x256: whole blocks only"))

    tensors = {"e4m3.table": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()}
    meta_cases = []
    for i, (w, sdt, note) in enumerate(cases):
        q, s = quantize(w, sdt)
        s32 = s.float()
        deq = dequantize(q, s32)
        assert torch.equal(dequantize(q, s), deq)
        tensors.update({f"{i}.w": w.contiguous(), f"{i}.fp8": q.view(torch.uint8).contiguous(),
                        f"{i}.scale_inv": s32.contiguous(), f"{i}.deq": deq.contiguous()})
        meta_cases.append({"shape": list(w.shape), "scale": "bf16-rounded" if sdt == torch.bfloat16 else "f32",
                           "note": note})
    t = tensors["e4m3.table"]
    assert t[0x7F].isnan() and t[0xFF].isnan() and t[0x7E] == 448 and t[0x01] == 2.0 ** -9 and t[0x80] == 0
    assert t.isnan().sum() == 2
    # Independent check: e4m3 decoded from the bit fields, and each case dequantized element by element
    # with the block index i // 128, j // 128 (not through `expand`).
    bits = torch.tensor([e4m3_bits(b) for b in range(256)])
    assert torch.equal(bits.isnan(), t.isnan()) and torch.equal(bits[~bits.isnan()], t[~t.isnan()])
    for i in range(len(cases)):
        q, s, deq = tensors[f"{i}.fp8"].long(), tensors[f"{i}.scale_inv"], tensors[f"{i}.deq"]
        rows = torch.arange(q.shape[0])[:, None] // BLOCK
        cols = torch.arange(q.shape[1])[None, :] // BLOCK
        assert torch.equal(bits[q] * s[rows, cols], deq), i
    meta = {"torch": torch.__version__, "cases": json.dumps(meta_cases), "block": "128",
            "recipe": "s = amax(|block|)/448 (1 if amax == 0; bf16 cases round s to bf16 first); "
                      "fp8 = clamp(w / s, -448, 448).to(float8_e4m3fn); deq = fp8.f32 * s"}
    save_cases(tensors, "fp8_cases.safetensors", meta)
    return f"quant/fp8_cases.safetensors: {len(cases)} cases + e4m3.table"


def save_cases(tensors, name, meta):
    """fixtures/quant/<name>, metadata keys sorted."""
    out = FIX / "quant"
    out.mkdir(exist_ok=True)
    mf.save_sorted_meta(tensors, out / name, meta)


def run(make_cases, make_fixture, fixtures, versions=""):
    """Cases, then every fixture; prints the library versions (`versions`: the format's, appended) and the reports."""
    torch.set_num_threads(2)
    report = [make_cases()] + [make_fixture(i, fx) for i, fx in enumerate(fixtures)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, tokenizers {tokenizers.__version__}, "
          f"safetensors {safetensors.__version__}{versions}")
    print("\n".join(report))


def main():
    run(make_cases, make_fixture, FIXTURES)


if __name__ == "__main__":
    main()
