#!/usr/bin/env python3
"""GPTQ and AWQ int4 checkpoint fixtures for deltamoe (the layouts of AutoGPTQ / GPTQModel and AutoAWQ).

1. fixtures/{gptq_qwen3_5_moe, gptq_qwen3_next, awq_qwen3_5_dense}/: tiny random models whose linear
   layers are stored as packed int4 (`{m}.qweight`, `{m}.qzeros`, `{m}.scales`, and for GPTQ `{m}.g_idx`;
   no `{m}.weight`), plus a reference.safetensors computed by transformers (float32, eager, the plain
   code paths of make_fixtures.py) on the weights dequantized in f32 by the field's own unpacking code.
2. fixtures/quant/gptq_cases.safetensors: small packed matrices (GPTQ v1 sym / asym, 8-bit, v2, AWQ GEMM)
   with their dequantization, for bit-exact unpacking tests.

Tools (run in a venv that sees the system torch / transformers; CPU only, no CUDA extension needed):
    python3 -m venv --system-site-packages /tmp/qenv
    /tmp/qenv/bin/pip install gptqmodel==7.7.0
    /tmp/qenv/bin/pip install --no-deps autoawq==0.2.9     # archived; its pins predate transformers 5
    /tmp/qenv/bin/python scripts/make_gptq_fixtures.py     # a few minutes; touches only the paths it writes
Made with GPTQModel 7.7.0, AutoAWQ 0.2.9, transformers 5.23.0, torch 2.15.0, safetensors 0.8.0. Run it after
make_fixtures.py (which deletes every fixture directory); it copies the tokenizer files from qwen3_5_moe.

What comes from the field's code (nothing of it is copied here; it is imported and called):
- GPTQ weights: GPTQModel's `GPTQ` (Hessian-based GPTQ, the `hf_quantize` entry point optimum uses),
  per module, on calibration activations captured from the float model (8 x 64 random tokens; routed
  experts see exactly the tokens the router sends them). Packed by GPTQModel's `TorchLinear.pack_original`
  (cross-checked against `pack_block`), which stores v2 zero points (as is); the v1 files are then made by
  GPTQModel's own `convert_gptq_v2_to_v1_format_module` (subtracts 0x11111111 from each qzeros word).
- AWQ weights: round-to-nearest with AWQ's zero-point rule (GPTQModel/AutoAWQ `pseudo_quantize_tensor`:
  s = (max - min) / 15, z = clamp(-round(min / s), 0, 15) per group; no activation-aware scale search,
  which would also rescale the preceding norms), written by this script; packed by GPTQModel's
  `AwqTorchLinear.pack` and cross-checked against AutoAWQ's `WQLinear_GEMM.from_linear`.
- Oracle dequantization: GPTQModel's `TorchLinear.dequantize_weight` (after the loader's
  `convert_gptq_v1_to_v2_format_module` for v1) and, for AWQ, GPTQModel's `dequantize_gemm` and AutoAWQ's
  `unpack_awq` + `reverse_awq_order`. Both compute in f16 when given the checkpoint's f16 scales (the
  f16 product s * (q - z) rounds: it needs up to 11 + bits significant bits), so the oracle is called
  with the scales upcast to f32: the integer unpacking is the field's, the product is exact in f32.
  This script's own unpackers (from the format spec) must agree with it bit for bit; the f16 result of
  the field's code is reported for information only.

Format (w is [out, in], k an input index, n an output index, pf = 32 / bits):
- GPTQ: qweight i32 [in / pf, out], value k of column n at bits (k % pf) * bits of row k / pf, LSB first;
  qzeros i32 [in / group, out / pf] packed along the output dim the same way; scales f16 [in / group, out];
  g_idx i32 [in] = k // group (desc_act false). w[n, k] = (q[k, n] - z[g, n]) * s[g, n] with g = g_idx[k],
  z = stored + 1 for checkpoint_format "gptq" (v1: the stored word is real - 0x11111111, so the inverse is a
  word add of 0x11111111 mod 2^32; per nibble "+1" gives the same iff no real zero point is 0, which this
  script asserts for the model fixtures), z = stored for "gptq_v2". Words are bit patterns: a value >= 8 in
  the top nibble makes the int32 negative.
- AWQ GEMM: qweight i32 [in, out / 8], qzeros i32 [in / group, out / 8], both packed along the output dim
  with nibble i of word c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales f16 [in / group, out];
  w[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n], no offset.
"""
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # pure-Python packers, no JIT C++ build

import torch
import torch.nn as nn

import awq  # AutoAWQ 0.2.9
import gptqmodel
from awq.modules.linear.gemm import WQLinear_GEMM
from awq.utils.packing_utils import reverse_awq_order as autoawq_reverse_order
from awq.utils.packing_utils import unpack_awq as autoawq_unpack
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm as gptqmodel_awq_dequantize
from gptqmodel.quantization.config import META_FIELD_QUANTIZER, META_FIELD_URI, META_VALUE_URI, QuantizeConfig
from gptqmodel.quantization.gptq import GPTQ
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (build_model, to_checkpoint, reference, save helpers; never main())
# The quantized-fixture skeleton (re-drawn weights, prompts, files, reference, reload check) and its helpers.
from make_fp8_fixtures import fixture_report, hf_layout, read_header, run, save_cases, write_fixture  # noqa: E402

SEED = mf.SEED + 9000
CALIB = (8, 64)  # calibration sequences x tokens

# Dims (every quantized matrix: out % 32 == 0, in % group == 0): hidden 128; attention 4 q / 2 kv heads x 32
# (q_proj 256 x 128 with the output gate, k/v 64 x 128, o_proj 128 x 128); GDN 2 key heads x 32, 4 value
# heads x 32 (in_proj_qkv 256 x 128, in_proj_z 128 x 128, out_proj 128 x 128; Next in_proj_qkvz 384 x 128,
# in_proj_ba 8 x 128).
BASE = dict(mf.BASE, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)

# The `dynamic` map of Qwen's own Qwen3.5 GPTQ-Int4 repos (Qwen3.5-27B / -35B-A3B / -122B-A10B-GPTQ-Int4, as
# quoted in sglang / vLLM tests and notes): every attention (`.*attn.*` = self_attn and linear_attn), the
# shared expert, MTP and vision stay bf16; with GPTQModel's module tree (router `mlp.gate` never
# quantized) only the routed experts (MoE) or the dense MLP are int4.
QWEN_DYNAMIC = {"lm_head": {}, "model.language_model.embed_tokens": {}, "-:.*attn.*": {},
                "-:.*shared_expert.*": {}, "-:.*mtp.*": {}, "-:.*visual.*": {}}
# Modules GPTQModel's qwen3_5 / qwen3_5_moe / qwen3_next definitions mark as never quantized (`:!`).
NEVER = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
         "linear_attn.in_proj_ba")

FIXTURES = [
    dict(name="gptq_qwen3_5_moe", source="qwen3_5_moe", outer="qwen3_5_moe", arch="Qwen3_5MoeForConditionalGeneration",
         text=dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, layer_types=mf.layer_types(4),
                   tie_word_embeddings=False, **BASE, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=256, shared_expert_intermediate_size=128, **mf.rope_v5(10_000_000.0)),
         prefix="model.language_model.", experts="per_expert", shards=1,
         extra={"model.visual.blocks.0.attn.qkv.weight": (8, 8), "mtp.fc.weight": (8, 8),
                "mtp.layers.0.mlp.experts.0.down_proj.weight": (8, 8)},
         method="gptq", bits=4, group=128, sym=True, fmt="gptq", dynamic=QWEN_DYNAMIC),
    # 8 layers, two shards + index like fp8_qwen3_next; everything GPTQModel's qwen3_next tree quantizes.
    dict(name="gptq_qwen3_next", source="qwen3_next", outer=None, arch="Qwen3NextForCausalLM",
         text=dict(model_type="qwen3_next", num_hidden_layers=8, layer_types=mf.layer_types(8),
                   decoder_sparse_step=1, mlp_only_layers=[1], intermediate_size=384, norm_topk_prob=True,
                   tie_word_embeddings=False, **BASE, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=128, shared_expert_intermediate_size=192, **mf.rope_hub(10_000.0)),
         prefix="model.", experts="per_expert", shards=2,
         method="gptq", bits=4, group=64, sym=False, fmt="gptq", dynamic_lists_never=True,
         dynamic={r"-:.*\.mlp\.gate$": {}, r"-:.*\.mlp\.shared_expert_gate$": {}, r"-:.*\.linear_attn\.in_proj_ba$": {}}),
    dict(name="awq_qwen3_5_dense", source="qwen3_5_dense", outer="qwen3_5", arch="Qwen3_5ForConditionalGeneration",
         text=dict(model_type="qwen3_5_text", num_hidden_layers=4, layer_types=mf.layer_types(4),
                   full_attention_interval=4, intermediate_size=384, tie_word_embeddings=True,
                   **BASE, **mf.rope_v5(100_000.0)),
         prefix="model.language_model.", experts=None, shards=1,
         method="awq", bits=4, group=32, not_convert=["linear_attn.in_proj_a", "linear_attn.in_proj_b", "visual", "mtp"]),
]
QSUFFIX = (".qweight", ".qzeros", ".scales", ".g_idx")


# ---------------------------------------------------------------------------------------------
# This script's own unpackers (from the format spec; the cross-check of the field's code)
# ---------------------------------------------------------------------------------------------
def u32(t):
    """int32 words -> their unsigned bit patterns as int64."""
    return t.to(torch.int64) & 0xFFFFFFFF


def nibbles_down(words, bits, n):
    """[R, C] words packed along dim 0 -> [R * pf, C][:n] values, value j of a word at bit j * bits."""
    pf, w = 32 // bits, u32(words)
    v = (w[:, None, :] >> (torch.arange(pf) * bits)[None, :, None]) & ((1 << bits) - 1)
    return v.reshape(-1, w.shape[1])[:n]


def nibbles_across(words, bits, n):
    """[R, C] words packed along dim 1 -> [R, C * pf][:, :n]."""
    pf, w = 32 // bits, u32(words)
    v = (w[:, :, None] >> (torch.arange(pf) * bits)[None, None, :]) & ((1 << bits) - 1)
    return v.reshape(w.shape[0], -1)[:, :n]


def own_gptq_ints(qweight, qzeros, bits, fmt, shape):
    """-> q [in, out], real zero points z [groups, out] (int64). v1: stored words + 0x11111111 (mod 2^32)."""
    out, inn = shape
    if fmt == "gptq":
        ones = sum(1 << (j * bits) for j in range(32 // bits))
        qzeros = (u32(qzeros) + ones) & 0xFFFFFFFF
    return nibbles_down(qweight, bits, inn), nibbles_across(qzeros, bits, out)


def own_gptq_dequant(t, bits, fmt, shape):
    q, z = own_gptq_ints(t["qweight"], t["qzeros"], bits, fmt, shape)
    g = t["g_idx"].long()
    return ((q - z[g]).float() * t["scales"].float()[g]).T.contiguous()  # [out, in]


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]


def awq_unscramble(nib):
    """[R, 8C] in nibble order -> [R, 8C] in column order."""
    out = torch.empty_like(nib)
    for i, col in enumerate(AWQ_ORDER):
        out[:, col::8] = nib[:, i::8]
    return out


def own_awq_dequant(t, group, shape):
    out, _ = shape
    q = awq_unscramble(nibbles_across(t["qweight"], 4, out))  # [in, out]
    z = awq_unscramble(nibbles_across(t["qzeros"], 4, out))  # [groups, out]
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * t["scales"].float()[g]).T.contiguous()


# ---------------------------------------------------------------------------------------------
# The field's packers and unpackers
# ---------------------------------------------------------------------------------------------
def linear_of(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.float().clone()
    return lin


def gptq_module(bits, group, sym, shape):
    out, inn = shape
    return TorchLinear(bits=bits, group_size=group, sym=sym, desc_act=False, in_features=inn, out_features=out,
                       bias=False, pack_dtype=torch.int32, register_buffers=True)


def field_gptq_pack(w, scales, zeros, g_idx, bits, group, sym, fmt):
    """GPTQModel TorchLinear.pack_original (v2 zero points), then its v2 -> v1 export conversion for v1.
    w [out, in] (the fake-quantized weight), scales/zeros [out, groups] as GPTQ returns them."""
    m = gptq_module(bits, group, sym, w.shape)
    m.pack_original(linear_of(w), scales.clone(), zeros.clone(), g_idx.clone())
    if w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0:  # pack_block's precondition
        b = gptq_module(bits, group, sym, w.shape)
        b.pack_block(linear_of(w), scales.clone(), zeros.clone(), g_idx.clone())
        assert torch.equal(b.qweight, m.qweight) and torch.equal(b.qzeros, m.qzeros), "pack_block != pack_original"
    if fmt == "gptq":
        export = QuantizeConfig(bits=bits, group_size=group, sym=sym, offload_to_disk=False)
        convert_gptq_v2_to_v1_format_module(m, export)
    return {"qweight": m.qweight.to(torch.int32).contiguous(), "qzeros": m.qzeros.to(torch.int32).contiguous(),
            "scales": m.scales.to(torch.float16).contiguous(), "g_idx": m.g_idx.to(torch.int32).contiguous()}


def field_gptq_dequant(t, bits, group, sym, fmt, shape, f16=False):
    """GPTQModel's load path: buffers into TorchLinear, v1 -> v2 (word add) for v1, dequantize_weight.
    With f16=False the scales are upcast to f32 first, so its (q - z) * s is computed in f32."""
    m = gptq_module(bits, group, sym, shape)
    m.qweight, m.qzeros, m.g_idx = t["qweight"].clone(), t["qzeros"].clone(), t["g_idx"].clone()
    m.scales = t["scales"].clone() if f16 else t["scales"].float()
    if fmt == "gptq":
        convert_gptq_v1_to_v2_format_module(m, bits, torch.int32)
    with torch.no_grad():
        return m.dequantize_weight().T.float().contiguous()  # [out, in]


def field_awq_pack(w, scales, zeros, group):
    """GPTQModel AwqTorchLinear.pack; AutoAWQ WQLinear_GEMM.from_linear must give the same words (it needs
    out % 32 == 0). w [out, in] fake-quantized, scales/zeros [out, groups]."""
    out, inn = w.shape
    m = AwqTorchLinear(bits=4, group_size=group, sym=False, desc_act=False, in_features=inn, out_features=out)
    m.pack(linear_of(w), scales.clone(), zeros.clone())
    t = {"qweight": m.qweight.to(torch.int32).contiguous(), "qzeros": m.qzeros.to(torch.int32).contiguous(),
         "scales": m.scales.to(torch.float16).contiguous()}
    if out % 32 == 0:
        a = WQLinear_GEMM.from_linear(linear_of(w), 4, group, scales=scales.T.contiguous(), zeros=zeros.T.contiguous())
        assert torch.equal(a.qweight, t["qweight"]) and torch.equal(a.qzeros, t["qzeros"]), "AutoAWQ pack differs"
        assert torch.equal(a.scales, t["scales"])
    return t


def field_awq_dequant(t, group, shape, f16=False):
    """GPTQModel's dequantize_gemm (f32 scales unless f16); AutoAWQ's unpack + reverse order must give the
    same integers."""
    s = t["scales"] if f16 else t["scales"].float()
    w = gptqmodel_awq_dequantize(t["qweight"], t["qzeros"], s, 4, group).float().T.contiguous()
    iw, iz = autoawq_unpack(t["qweight"], t["qzeros"], 4)
    iw, iz = autoawq_reverse_order(iw, iz, 4)
    iw, iz = iw & 15, iz & 15
    g = torch.arange(iw.shape[0]) // group
    w2 = ((iw - iz[g]).float() * t["scales"].float()[g]).T.contiguous()
    if not f16:
        assert torch.equal(w, w2), "GPTQModel and AutoAWQ AWQ unpacking disagree"
    return w


STATS = {}  # label -> {matrices, own_vs_field_max_abs, f16_vs_f32_max_abs, f16_vs_f32_rel}


def dequant_checked(t, q, label):
    """The oracle (field's unpacking, f32 product) and this script's unpacker, which must be identical."""
    shape = q["shape"]
    if q["method"] == "gptq":
        ref = field_gptq_dequant(t, q["bits"], q["group"], q["sym"], q["fmt"], shape)
        own = own_gptq_dequant(t, q["bits"], q["fmt"], shape)
        f16 = field_gptq_dequant(t, q["bits"], q["group"], q["sym"], q["fmt"], shape, f16=True)
    else:
        ref = field_awq_dequant(t, q["group"], shape)
        own = own_awq_dequant(t, q["group"], shape)
        f16 = field_awq_dequant(t, q["group"], shape, f16=True)
    diff = (ref - own).abs().max().item()
    st = STATS.setdefault(label, {"matrices": 0, "own": 0.0, "f16": 0.0, "f16_rel": 0.0})
    st["matrices"] += 1
    st["own"] = max(st["own"], diff)
    d16 = (ref - f16).abs().max().item()
    st["f16"] = max(st["f16"], d16)
    st["f16_rel"] = max(st["f16_rel"], d16 / max(ref.abs().max().item(), 1e-30))
    assert diff == 0 and torch.equal(ref, own), f"own unpacker differs from the field's by {diff}"
    return ref


# ---------------------------------------------------------------------------------------------
# Quantization of a model
# ---------------------------------------------------------------------------------------------
def gptq_qcfg(fx):
    return QuantizeConfig(bits=fx["bits"], group_size=fx["group"], sym=fx["sym"], desc_act=False,
                          act_group_aware=False, offload_to_disk=False, dynamic=dict(fx["dynamic"]))


def quantized_names(fx, ckpt):
    """On-disk module names to quantize: 2-D `.weight`s of the decoder layers, minus the modules GPTQModel's
    module tree never quantizes, minus GPTQ `dynamic` negative matches (GPTQModel's own dynamic_get) or
    AWQ `modules_to_not_convert` substrings (AutoAWQ / transformers semantics)."""
    qcfg = gptq_qcfg(fx) if fx["method"] == "gptq" else None
    names = []
    for k, v in ckpt.items():
        if not (k.startswith(fx["prefix"] + "layers.") and k.endswith(".weight") and v.ndim == 2):
            continue
        m = k[: -len(".weight")]
        if m.endswith(NEVER):
            if fx.get("dynamic_lists_never"):  # the written negative rules really cover these modules
                assert qcfg.dynamic_get(layer_name=m) is False, m
            continue
        if qcfg is not None and qcfg.dynamic_get(layer_name=m) is False:
            continue
        if qcfg is None and any(s in m for s in fx["not_convert"]):
            continue
        assert v.shape[0] % 32 == 0 and v.shape[1] % fx["group"] == 0, (m, v.shape)
        names.append(m)
    return names


@torch.no_grad()
def capture_calibration(model, fx, tokens):
    """Inputs of every nn.Linear in the decoder layers and, per routed expert, the tokens routed to it,
    from a forward of the float model: {on-disk module name: [N, in] f32}."""
    prefix, store, handles = fx["prefix"], {}, []
    disk = lambda n: prefix + n[len("model."):]  # noqa: E731

    def lin_hook(name):
        def hook(mod, args, out):
            store.setdefault(disk(name), []).append(args[0].reshape(-1, args[0].shape[-1]).float())
        return hook

    def experts_hook(name):
        def hook(mod, args):
            hidden, top_k_index = args[0], args[1]
            act = mod.act_fn
            for e in range(mod.num_experts):
                rows = (top_k_index == e).any(-1).nonzero()[:, 0]
                x = hidden[rows].float()
                gate, up = nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
                base = f"{disk(name)}.{e}"
                store.setdefault(f"{base}.gate_proj", []).append(x)
                store.setdefault(f"{base}.up_proj", []).append(x)
                store.setdefault(f"{base}.down_proj", []).append(act(gate) * up)
        return hook

    for name, mod in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(lin_hook(name)))
        elif name.endswith("mlp.experts"):
            handles.append(mod.register_forward_pre_hook(experts_hook(name)))
    for t in tokens:
        model(t[None], use_cache=False)
    for h in handles:
        h.remove()
    return {k: torch.cat(v) for k, v in store.items()}


def awq_pseudo_quantize(w, group):
    """AWQ's zero-point round-to-nearest (GPTQModel / AutoAWQ pseudo_quantize_tensor, zero_point=True):
    -> fake-quantized w [out, in], scales [out, groups], zeros [out, groups] (f32)."""
    out, inn = w.shape
    g = w.reshape(-1, group)
    mx, mn = g.amax(dim=1, keepdim=True), g.amin(dim=1, keepdim=True)
    s = (mx - mn).clamp(min=1e-5) / 15
    z = (-torch.round(mn / s)).clamp(0, 15)
    fq = ((torch.clamp(torch.round(g / s) + z, 0, 15) - z) * s).reshape(out, inn)
    return fq, s.reshape(out, -1), z.reshape(out, -1)


def quantize_checkpoint(bf16_sd, fx, calib):
    """On-disk bf16 state dict -> quantized checkpoint; returns (ckpt, {module: quant params})."""
    out, qinfo = dict(bf16_sd), {}
    qcfg = gptq_qcfg(fx) if fx["method"] == "gptq" else None
    for m in quantized_names(fx, bf16_sd):
        w = out.pop(m + ".weight").float()
        info = dict(method=fx["method"], bits=fx["bits"], group=fx["group"], sym=fx.get("sym", False),
                    fmt=fx.get("fmt"), shape=tuple(w.shape))
        if fx["method"] == "gptq":
            x = calib[m]
            assert x.shape[0] > 0, f"{m}: no calibration tokens"
            lin = linear_of(w)
            gq = GPTQ(lin, qcfg)
            gq.quantizer.configure(perchannel=True)
            gq.add_batch(x[None], lin(x[None]))
            scale, zero, g_idx, *_ = gq.hf_quantize(blocksize=128, percdamp=qcfg.damp_percent,
                                                    damp_auto_increment=qcfg.damp_auto_increment,
                                                    group_size=fx["group"], actorder=False, static_groups=False,
                                                    act_group_aware=False)
            if fx["fmt"] == "gptq" and not fx["sym"]:
                assert zero.min() >= 1, f"{m}: a real zero point of 0 would borrow in the v1 word"
            t = field_gptq_pack(lin.weight.data, scale, zero, g_idx, fx["bits"], fx["group"], fx["sym"], fx["fmt"])
            assert torch.equal(t["g_idx"], torch.arange(w.shape[1], dtype=torch.int32) // fx["group"])
        else:
            fq, s, z = awq_pseudo_quantize(w, fx["group"])
            t = field_awq_pack(fq, s, z, fx["group"])
        for k, v in t.items():
            out[f"{m}.{k}"] = v
        qinfo[m] = info
    return dict(sorted(out.items(), key=lambda kv: mf.natural_key(kv[0]))), qinfo


def hf_state_dict(ckpt, fx, qinfo):
    """Quantized checkpoint (on-disk names) -> f32 state dict in transformers' in-memory layout: weights
    dequantized by the oracle (checked against this script's unpacker), extra tensors dropped, then make_fp8_fixtures'
    `hf_layout` (prefix mapped back, per-expert tensors fused)."""
    sd = {}
    for k, v in ckpt.items():
        if k in fx.get("extra", {}) or k.endswith(QSUFFIX):
            continue
        sd[k] = v.float()
    for m, q in qinfo.items():
        t = {s: ckpt[f"{m}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if f"{m}.{s}" in ckpt}
        sd[m + ".weight"] = dequant_checked(t, q, fx["name"])
    return hf_layout(sd, fx)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def sorted_except_dynamic(d):
    """transformers writes config.json with sorted keys; GPTQModel's writer then puts `dynamic` back in its
    own (first-match) order."""
    if not isinstance(d, dict):
        return d
    return {k: (v if k == "dynamic" else sorted_except_dynamic(v)) for k, v in sorted(d.items())}


def quant_config(fx):
    if fx["method"] == "awq":  # AutoAWQ's AwqConfig.to_transformers_dict(), keys in its order
        return {"quant_method": "awq", "zero_point": True, "group_size": fx["group"], "bits": fx["bits"],
                "version": "gemm", "modules_to_not_convert": list(fx["not_convert"])}
    # GPTQModel's QuantizeConfig.to_dict() with the meta fields its writer sets (save_quantized).
    q = gptq_qcfg(fx)
    q.meta_set_versionable(key=META_FIELD_QUANTIZER, value=[f"gptqmodel:{gptqmodel.__version__}"])
    q.meta_set(key=META_FIELD_URI, value=META_VALUE_URI)
    for k in ("damp_percent", "damp_auto_increment", "static_groups", "mse", "act_group_aware"):
        q.meta_set(key=k, value=getattr(q, k))
    q.meta_set(key="true_sequential", value=False)  # calibration inputs come from the float model
    d = q.to_dict()
    assert d["checkpoint_format"] == fx["fmt"] and d["sym"] == fx["sym"] and d["group_size"] == fx["group"]
    return sorted_except_dynamic(d)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def make_fixture(idx, fx):
    def prepare(gen):
        calib_tokens = torch.randint(0, fx["text"]["vocab_size"], CALIB, generator=gen)

        def quantize(model):
            calib = capture_calibration(model, fx, calib_tokens)
            return quantize_checkpoint(mf.to_checkpoint(model, fx), fx, calib)  # (ckpt, qinfo)
        return quantize

    meta = {"gptqmodel": gptqmodel.__version__, "autoawq": awq.__version__,
            "reference": "transformers float32 eager on weights dequantized in f32 by the field's unpacking "
                         "(scripts/make_gptq_fixtures.py)"}
    r = write_fixture(fx, SEED + 1000 * idx, quant_config(fx), prepare,
                      lambda ckpt, qinfo: hf_state_dict(ckpt, fx, qinfo), meta)
    files, disk, qinfo = r.files, r.disk, r.info
    for f in files:
        f.chmod(0o644)  # safetensors writes 0600
    # Check 2: on-disk dtypes and shapes; no `.weight` next to a `.qweight`.
    header = {k: v for f in files for k, v in read_header(f).items() if k != "__metadata__"}
    pf, gs = 32 // fx["bits"], fx["group"]
    for m, q in qinfo.items():
        out_f, in_f = q["shape"]
        assert m + ".weight" not in header
        if fx["method"] == "gptq":
            want = {"qweight": ("I32", [in_f // pf, out_f]), "qzeros": ("I32", [in_f // gs, out_f // pf]),
                    "scales": ("F16", [in_f // gs, out_f]), "g_idx": ("I32", [in_f])}
        else:
            want = {"qweight": ("I32", [in_f, out_f // pf]), "qzeros": ("I32", [in_f // gs, out_f // pf]),
                    "scales": ("F16", [in_f // gs, out_f])}
        for s, (dt, shape) in want.items():
            h = header[f"{m}.{s}"]
            assert h["dtype"] == dt and h["shape"] == shape, (m, s, h)
    assert sum(k.endswith(".qweight") for k in header) == len(qinfo)
    unq = sorted({k.rsplit(".", 1)[0] for k, h in header.items() if h["dtype"] == "BF16" and len(h["shape"]) == 2})
    negs = sum(int((disk[f"{m}.qweight"] < 0).sum()) for m in qinfo)
    leaf = sorted({re.sub(r"^.*layers\.\d+\.", "", re.sub(r"experts\.\d+", "experts.E", m)) for m in qinfo})
    return fixture_report(fx, r, f"{len(qinfo)} int{fx['bits']} matrices ({', '.join(leaf)}), {negs} negative qweight words",
                  f"    unquantized 2-D: {len(unq)} ({', '.join(sorted({re.sub(r'layers.[0-9]+.', 'layers.N.', u) for u in unq}))})\n")


# ---------------------------------------------------------------------------------------------
# Unpacking cases
# ---------------------------------------------------------------------------------------------
CASES = [
    dict(name="gptq_v1_sym_g128", method="gptq", fmt="gptq", bits=4, group=128, sym=True, out=48, inn=256,
         note="v1 sym: every real zero 8, stored 7 (0x77777777)"),
    dict(name="gptq_v1_asym_g32", method="gptq", fmt="gptq", bits=4, group=32, sym=False, out=24, inn=96,
         note="v1 asym: real zeros 1..15 (stored 0..14); out 24 = 3 qzeros words"),
    dict(name="gptq_v1_asym_8bit_g64", method="gptq", fmt="gptq", bits=8, group=64, sym=False, out=16, inn=128,
         note="v1 asym 8-bit: 4 values a word, real zeros 1..255"),
    dict(name="gptq_v2_asym_g64", method="gptq", fmt="gptq_v2", bits=4, group=64, sym=False, out=16, inn=128,
         note="v2: zeros stored as is, 0..15 including 0 and 15"),
    dict(name="awq_g64", method="awq", fmt=None, bits=4, group=64, sym=False, out=40, inn=128,
         note="AWQ GEMM: interleaved order [0,2,4,6,1,3,5,7]; out 40 = 5 words; zeros 0..15"),
    dict(name="gptq_v1_asym_zero0_g32", method="gptq", fmt="gptq", bits=4, group=32, sym=False, out=32, inn=64,
         note="v1 asym with some real zeros 0: GPTQModel's word subtraction borrows into the next nibble, "
              "its loader's word addition undoes it; a per-nibble (stored + 1) reader gets other zeros. "
              "Only GPTQModel's reading is stored in .dequant"),
]


def case_ints(c, gen):
    """Chosen integers: q [out, in] over the full range (top nibble 15 in many words), real zeros
    [out, groups], and f16-representable scales [out, groups] (a few tiny, subnormal and large ones)."""
    out, inn, bits, groups = c["out"], c["inn"], c["bits"], c["inn"] // c["group"]
    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (out, inn), generator=gen)
    q[0, :] = maxq  # all-max row: every word's top value is maxq (negative int32)
    q[1, :] = 0
    q[2, :: 2] = maxq
    if c["sym"]:
        z = torch.full((out, groups), 1 << (bits - 1))
    elif c["fmt"] == "gptq" and "zero0" not in c["name"]:
        z = torch.randint(1, maxq + 1, (out, groups), generator=gen)
        z[0, 0], z[-1, -1] = 1, maxq
    else:
        z = torch.randint(0, maxq + 1, (out, groups), generator=gen)
        z[0, 0], z[-1, -1], z[3 % out, :] = 0, maxq, 0
    s = (torch.rand(out, groups, generator=gen) * 0.05 + 1e-3).half()
    s[1, 0], s[2, 0] = 2.0 ** -14, 2.0 ** -20  # smallest normal, a subnormal f16
    s[3 % out, -1] = 1000.0 if bits == 4 else 200.0  # |w| stays below f16's 65504 for the field's f16 path
    return q, z, s.float()


def make_cases():
    gen = torch.Generator().manual_seed(SEED + 99)
    tensors, meta_cases = {}, {}
    for c in CASES:
        q, z, s = case_ints(c, gen)
        g = torch.arange(c["inn"]) // c["group"]
        w = (q - z[:, g]).float() * s[:, g]  # [out, in], exact in f32; the packers re-derive q from it
        shape = (c["out"], c["inn"])
        if c["method"] == "gptq":
            t = field_gptq_pack(w, s, z.float(), g.int(), c["bits"], c["group"], c["sym"], c["fmt"])
            qi, zi = own_gptq_ints(t["qweight"], t["qzeros"], c["bits"], c["fmt"], shape)
        else:
            t = field_awq_pack(w, s, z.float(), c["group"])
            qi = awq_unscramble(nibbles_across(t["qweight"], 4, c["out"]))
            zi = awq_unscramble(nibbles_across(t["qzeros"], 4, c["out"]))
        assert torch.equal(qi.T, q) and torch.equal(zi.T, z), c["name"]  # the packers stored what was chosen
        info = dict(method=c["method"], bits=c["bits"], group=c["group"], sym=c["sym"], fmt=c["fmt"], shape=shape)
        deq = dequant_checked(t, info, "quant/gptq_cases")
        assert torch.equal(deq, w), c["name"]
        if "zero0" in c["name"]:  # document the ambiguity: a per-nibble reader disagrees
            nib = nibbles_across(t["qzeros"], 4, c["out"]) + 1
            assert not torch.equal(nib, z.T), "expected the v1 borrow to show"
        for k, v in t.items():
            tensors[f"{c['name']}.{k}"] = v
        tensors[f"{c['name']}.dequant"] = deq
        tensors[f"ints.{c['name']}.q"] = q.to(torch.int32).contiguous()
        tensors[f"ints.{c['name']}.zero"] = z.T.to(torch.int32).contiguous()  # [groups, out], real zero points
        # A quantization_config for the case (as the checkpoint's config.json would have it) plus facts.
        if c["method"] == "gptq":
            entry = {"quant_method": "gptq", "bits": c["bits"], "group_size": c["group"], "sym": c["sym"],
                     "desc_act": False, "checkpoint_format": c["fmt"]}
        else:
            entry = {"quant_method": "awq", "bits": c["bits"], "group_size": c["group"], "zero_point": True,
                     "version": "gemm"}
        entry.update(out_features=c["out"], in_features=c["inn"], note=c["note"],
                     negative_qweight_words=int((t["qweight"] < 0).sum()),
                     v1_zero_borrow="zero0" in c["name"])
        meta_cases[c["name"]] = entry
    meta = {"torch": torch.__version__, "gptqmodel": gptqmodel.__version__, "autoawq": awq.__version__,
            "cases": json.dumps(meta_cases),
            "keys": "{c}.qweight/.qzeros/.scales(/.g_idx) as in a checkpoint; {c}.dequant f32 [out, in]; "
                    "ints.{c}.q i32 [out, in] and ints.{c}.zero i32 [groups, out] = the real integers; "
                    "metadata cases = {c: its quantization_config + out/in_features, note, v1_zero_borrow}",
            "dequant": "(q - z) * f32(scale), exact in f32; v1 (checkpoint_format gptq): z = stored + 1 "
                       "(word add of 0x11111111 / 0x01010101); v2 and AWQ: z = stored"}
    save_cases(tensors, "gptq_cases.safetensors", meta)
    return f"quant/gptq_cases.safetensors: {len(CASES)} cases ({', '.join(c['name'] for c in CASES)})"


def main():
    run(make_cases, make_fixture, FIXTURES, f", gptqmodel {gptqmodel.__version__}, autoawq {awq.__version__}")
    for label, st in STATS.items():  # every dequantization, including those of rejected seeds and the reload
        print(f"{label}: {st['matrices']} dequantizations, own unpacker vs the field's (f32 product) max|diff| = "
              f"{st['own']}; the field's f16 product vs f32: max|diff| = {st['f16']:.3e} "
              f"({st['f16_rel']:.2e} of the matrix's max|w|)")


if __name__ == "__main__":
    main()
