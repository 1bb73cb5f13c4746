#!/usr/bin/env python3
"""A llama.cpp `qwen3next` GGUF with an exact oracle, added to fixtures/gguf_quant/.

A tiny random `qwen3_next` model (Qwen3NextForCausalLM, built like scripts/make_fixtures.py's
qwen3_next fixture: its tokenizer, init, bf16 rounding, perturbed norms / A_log / dt_bias; but 4
layers `linear, linear, linear, full` and no dense-MLP layer, which llama.cpp's converter cannot map)
is saved in the hub layout (per-expert tensors) and converted by llama.cpp's `convert_hf_to_gguf.py`
(class Qwen3NextModel; tiny tokenizer registered as pre-tokenizer `qwen35`, `--no-mtp`) to
`--outtype q8_0` (kept: qwen3_next_q.q8_0.gguf) and to `--outtype f32` (only to check the inverse
mapping).

The oracle: every tensor of the Q8_0 file dequantized to f32 by gguf-py, mapped back to the
transformers layout (undoing the converter: names, `1 + w` norms except the GDN gated norm,
ssm_a = -exp(A_log), conv1d [C, K] -> [C, 1, K], `attn_qkv` (q of all key heads, k of all key heads,
v of all value heads) + `attn_gate` (z) re-packed into in_proj_qkvz's per-key-head [q, k, v, z]
groups, `ssm_ba` = in_proj_ba unchanged, experts split per projection -> gate_up_proj fused), loaded
into transformers in float32 (eager paths) and run over 64 random ids and make_fixtures.py's ChatML
prompt. Value heads stay in HF's grouped order (this converter does not tile them as the qwen35 ones
do): checked on the F32 file against the HF weights. Checks: the F32 GGUF mapped back reproduces the
HF model's logits; llama.cpp's dequantization of the Q8_0 file (llama-quantize --allow-requantize to
F32) equals gguf-py's; llama.cpp's logits (llama-cpp-python's bindings, if they load) are compared
and printed. Weight seeds, then the random ids, are redrawn until no oracle (nor the HF model) has a
routing gap < 1e-4 or a top-1/top-2 logit margin < 1e-3.

Output: OUT_DIR/qwen3_next_q.q8_0.gguf, and in OUT_DIR/reference.safetensors the tensors
qwen3_next.{tokens, logits, chat.tokens, chat.logits} and metadata qwen3_next.* (replaced if present;
every other tensor and metadata entry is kept as it is). Run it after make_gguf_quant_fixtures.py,
which deletes and rewrites OUT_DIR. Deterministic (fixed seeds, CPU). Same requirements as
make_gguf_quant_fixtures.py:

    python3 scripts/make_gguf_qwen3next_fixture.py LLAMA_CPP_DIR [OUT_DIR]
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import make_gguf_quant_fixtures as gq  # noqa: E402  (shim, run, read_gguf, hf_model, forward, llama.cpp helpers)

mf, transformers = gq.mf, gq.transformers

NAME = "qwen3_next_q"  # the HF dir's name: the converter writes it into general.name
KEY = "qwen3_next"  # prefix of the tensors / metadata added to reference.safetensors
SEED = 20250505
T = 64
HK, HV, DK, DV = 2, 4, 16, 24  # GDN key heads, value heads, key / value head dims
R = HV // HK
CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
    decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=80, norm_topk_prob=True,
    tie_word_embeddings=False,
    **{**mf.BASE, "linear_num_key_heads": HK, "linear_num_value_heads": HV,
       "linear_key_head_dim": DK, "linear_value_head_dim": DV},
    **mf.MOE, **mf.rope_hub(10_000.0),
)

# GGUF names (after `blk.{i}.`) -> transformers names (after `model.layers.{i}.`).
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkvz.weight",  # q, k, v rows ...
    "attn_gate.weight": "linear_attn.in_proj_qkvz.weight",  # ... and z rows, re-packed per key head
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",  # gate rows first ...
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",  # ... then up rows
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
PLUS_ONE = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight"}


def pack_qkvz(qkv, z):
    """attn_qkv [HK*DK (q) + HK*DK (k) + HV*DV (v), H] and attn_gate [HV*DV, H] -> in_proj_qkvz
    [HK * (2*DK + 2*R*DV), H]: per key head g, rows [q_g, k_g, v_g (its R value heads), z_g]."""
    h = qkv.shape[1]
    q = qkv[:HK * DK].reshape(HK, DK, h)
    k = qkv[HK * DK:2 * HK * DK].reshape(HK, DK, h)
    v = qkv[2 * HK * DK:].reshape(HK, R * DV, h)  # grouped: value head g*R + j in group g
    z = z.reshape(HK, R * DV, h)
    return torch.cat([q, k, v, z], dim=1).reshape(-1, h).contiguous()


def to_hf(tensors):
    """The transformers state dict (Qwen3NextForCausalLM, untied) of a GGUF's dequantized tensors."""
    sd, parts = {}, {}
    for name, (_, v) in tensors.items():
        if name == "token_embd.weight":
            sd["model.embed_tokens.weight"] = v
            continue
        if name == "output.weight":
            sd["lm_head.weight"] = v
            continue
        if name == "output_norm.weight":
            sd["model.norm.weight"] = v - 1
            continue
        _, i, leaf = name.split(".", 2)
        to = f"model.layers.{i}.{LAYER[leaf]}"  # KeyError: a tensor this mapping does not know
        if leaf in PLUS_ONE:
            v = v - 1
        elif leaf == "ssm_a":
            v = torch.log(-v)
        elif leaf == "ssm_conv1d.weight":
            v = v[:, None, :]  # [C, K] -> nn.Conv1d's [C, 1, K]
        elif leaf == "ffn_gate_inp_shexp.weight":
            v = v.reshape(1, -1)
        elif leaf in ("attn_qkv.weight", "attn_gate.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"):
            parts.setdefault(to, {})[leaf] = v
            continue
        sd[to] = v
    for to, p in parts.items():
        if to.endswith("in_proj_qkvz.weight"):
            sd[to] = pack_qkvz(p["attn_qkv.weight"], p["attn_gate.weight"])
        else:  # [E, I, H] each -> [E, 2I, H], gate rows first
            sd[to] = torch.cat([p["ffn_gate_exps.weight"], p["ffn_up_exps.weight"]], dim=1)
    return sd


def value_head_order(model, f32):
    """Which order the converter wrote the value heads in, checked on the F32 file against the HF
    weights: 'grouped' (value head j of key head g at g*R + j, as HF) or 'tiled' (at j*HK + g)."""
    sd = model.state_dict()
    found = set()
    for i, lt in enumerate(CONFIG["layer_types"]):
        if lt != "linear_attention":
            continue
        w = sd[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].reshape(HK, 2 * DK + 2 * R * DV, -1)
        hf_v = w[:, 2 * DK:2 * DK + R * DV].reshape(HK, R, DV, -1)  # [g, j] = HF value head g*R + j
        hf_z = w[:, 2 * DK + R * DV:].reshape(HK, R, DV, -1)
        v = f32[f"blk.{i}.attn_qkv.weight"][1][2 * HK * DK:].reshape(HV, DV, -1)
        z = f32[f"blk.{i}.attn_gate.weight"][1].reshape(HV, DV, -1)
        grouped = all(torch.equal(v[g * R + j], hf_v[g, j]) and torch.equal(z[g * R + j], hf_z[g, j])
                      for g in range(HK) for j in range(R))
        tiled = all(torch.equal(v[j * HK + g], hf_v[g, j]) and torch.equal(z[j * HK + g], hf_z[g, j])
                    for g in range(HK) for j in range(R))
        ba = torch.equal(f32[f"blk.{i}.ssm_ba.weight"][1], sd[f"model.layers.{i}.linear_attn.in_proj_ba.weight"])
        a = torch.equal(f32[f"blk.{i}.ssm_a"][1], -sd[f"model.layers.{i}.linear_attn.A_log"].exp())
        dt = torch.equal(f32[f"blk.{i}.ssm_dt.bias"][1], sd[f"model.layers.{i}.linear_attn.dt_bias"])
        found.add(("grouped" if grouped and not tiled else "tiled" if tiled and not grouped else "neither")
                  + f"; ssm_ba == in_proj_ba: {ba}; ssm_a == -exp(A_log): {a}; ssm_dt.bias == dt_bias: {dt}")
    assert len(found) == 1, found
    return found.pop()


def make_files(llama, d, tmp, seed):
    """The model of seed `seed` saved to d (hub layout, per-expert tensors) and converted to F32 and
    Q8_0: (model, {key: path}, {key: read_gguf(path)})."""
    model = mf.build_model(d, seed)
    fx = dict(text=CONFIG, prefix="model.", experts="per_expert")
    mf.save_weights(d, mf.to_checkpoint(model, fx), 1)
    files = {}
    for key in ("f32", "q8_0"):
        files[key] = tmp / f"{NAME}.{key}.gguf"
        gq.run([sys.executable, "-c", gq.shim(llama), llama, str(d), "--outtype", key, "--outfile",
                str(files[key]), "--no-mtp"])
    return model, files, {k: gq.read_gguf(p) for k, p in files.items()}


def main():
    llama = os.path.abspath(sys.argv[1])
    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / "fixtures" / "gguf_quant").resolve()
    ref_path = out_dir / "reference.safetensors"
    assert ref_path.exists(), f"{ref_path}: run make_gguf_quant_fixtures.py first"
    sys.path.insert(0, os.path.join(llama, "gguf-py"))  # the converter's own gguf-py
    import gguf
    from gguf import GGUFReader
    from safetensors import safe_open

    torch.set_num_threads(4)
    quantize = os.path.join(llama, "build", "bin", "llama-quantize")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        d = tmp / NAME
        d.mkdir()
        mf.dump_json(d / "config.json", {**CONFIG, "transformers_version": transformers.__version__})
        chat_text, chat = mf.write_tokenizer(d, CONFIG["vocab_size"])
        for w_attempt in range(mf.MAX_ATTEMPTS):
            model, files, gg = make_files(llama, d, tmp, SEED + w_attempt)
            models = {k: gq.hf_model(d, to_hf(t)) for k, t in gg.items()}
            chat_ref = gq.forward(model, chat)
            chat_res = {k: gq.forward(m, chat) for k, m in models.items()}
            chat_gap = min(r[1] for r in [chat_ref, *chat_res.values()])
            chat_margin = min(r[2] for r in [chat_ref, *chat_res.values()])
            if chat_gap >= mf.ROUTER_MARGIN and chat_margin >= mf.GREEDY_MARGIN:
                break
        else:
            raise RuntimeError("no weight seed without near-ties on the chat prompt")
        print(f"gguf-py {gguf.__file__}; weight seed attempt {w_attempt}")
        print(f"value heads in the converter's output: {value_head_order(model, gg['f32'])}")

        gen = torch.Generator().manual_seed(SEED)
        for attempt in range(mf.MAX_ATTEMPTS):
            tokens = torch.randint(0, CONFIG["vocab_size"], (T,), generator=gen)
            ref = gq.forward(model, tokens)
            res = {k: gq.forward(m, tokens) for k, m in models.items()}
            gap = min(chat_gap, *(r[1] for r in [ref, *res.values()]))
            margin = min(chat_margin, *(r[2] for r in [ref, *res.values()]))
            if gap >= mf.ROUTER_MARGIN and margin >= mf.GREEDY_MARGIN:
                break
        else:
            raise RuntimeError("no token draw without near-ties")
        seqs = {"tokens": (tokens, ref, res), "chat": (chat, chat_ref, chat_res)}
        inv = max((r["f32"][0] - hf[0]).abs().max().item() for _, hf, r in seqs.values())
        print(f"tokens: draw {attempt}; over both sequences, the HF model and both oracles: min router gap "
              f"{gap:.1e}, min top-1/top-2 margin {margin:.1e}")
        print(f"inverse mapping: F32 GGUF -> HF vs the HF model: max|dlogit| = {inv:.2e} "
              f"(max|logit| {ref[0].abs().max():.2f})")
        assert inv < 1e-4, inv

        # The Q8_0 file's tensors, as the Rust loader sees them (ggml dims: innermost first).
        reader = GGUFReader(files["q8_0"])
        print(f"q8_0: {files['q8_0'].stat().st_size} bytes, architecture "
              f"{reader.get_field('general.architecture').contents()}, {len(reader.tensors)} tensors:")
        for t in reader.tensors:
            print(f"    {t.name:28s} {str(t.shape.tolist()):16s} {t.tensor_type.name}")
        for f in reader.fields.values():
            if f.name.startswith("qwen3next."):
                print(f"    {f.name} = {f.contents()}")

        # llama.cpp, for the record: its dequantization must equal gguf-py's; its logits are printed.
        deq = tmp / "q8_0.deq.gguf"
        gq.run([quantize, "--allow-requantize", str(files["q8_0"]), str(deq), "F32", "4"])
        mine, theirs = gg["q8_0"], gq.read_gguf(deq)
        assert set(mine) == set(theirs)
        dd = max((mine[n][1] - theirs[n][1]).abs().max().item() for n in mine)
        print(f"q8_0: llama.cpp's dequantization vs gguf-py's: max|d| = {dd:.1e}")
        assert dd == 0, dd
        for k in files:
            print(f"{k}: oracle vs the HF bf16 model: max|d|/max|ref| = "
                  f"{(res[k][0] - ref[0]).abs().max() / ref[0].abs().max():.4f} (random tokens)")
        # llama.cpp's qwen3next loader takes the value head dim to be ssm.state_size (the key head dim),
        # so it refuses this file (DV 24 != DK 16: ssm_norm, attn_qkv, attn_gate, ssm_out shapes).
        Llama = None
        if DV == DK:
            Llama = gq.llama_bindings(llama)
        else:
            print(f"value head dim {DV} != key head dim {DK}: llama.cpp cannot load the file, its logits are skipped")
        if Llama is not None:
            for k, p in [*files.items(), ("q8_0 deq", deq)]:
                for sname, (toks, _, r) in seqs.items():
                    o = r[k.split()[0]][0]
                    try:
                        lc = gq.llama_logits(Llama, p, toks)
                    except Exception as e:  # report, do not hide
                        print(f"    {k} {sname}: llama.cpp failed: {type(e).__name__}: {e}")
                        continue
                    rel = (lc - o).abs().max(-1).values / o.abs().max()
                    agree = (lc.argmax(-1) == o.argmax(-1)).float().mean().item()
                    print(f"    {k:8s} {sname:6s} llama.cpp vs oracle: max|d|/max|oracle| {rel.max():.4f} "
                          f"(median over positions {rel.median():.4f}), argmax agreement {agree * 100:.1f}%")

        # write: the GGUF, and the reference tensors added to reference.safetensors
        shutil.copy(files["q8_0"], out_dir / files["q8_0"].name)
        with safe_open(ref_path, "pt") as f:
            meta = {k: v for k, v in f.metadata().items() if not k.startswith(KEY + ".")}
            # cloned: safe_open maps the file, which is rewritten below
            tensors = {k: f.get_tensor(k).clone() for k in f.keys() if not k.startswith(KEY + ".")}
        old = dict(tensors)
        tensors.update({f"{KEY}.tokens": tokens.to(torch.int64).contiguous(),
                        f"{KEY}.logits": res["q8_0"][0].contiguous(),
                        f"{KEY}.chat.tokens": chat.to(torch.int64).contiguous(),
                        f"{KEY}.chat.logits": chat_res["q8_0"][0].contiguous()})
        assert meta.get("chat.text", chat_text) == chat_text
        meta.update({f"{KEY}.min_router_gap": f"{gap:.3e}", f"{KEY}.min_greedy_margin": f"{margin:.3e}",
                     f"{KEY}.transformers": transformers.__version__})
        mf.save_sorted_meta(tensors, ref_path, meta)
        with safe_open(ref_path, "pt") as f:  # nothing else changed
            assert all(torch.equal(f.get_tensor(k), v) for k, v in old.items())
        for p in (out_dir / files["q8_0"].name, ref_path):
            print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
