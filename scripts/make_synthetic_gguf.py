#!/usr/bin/env python3
"""A synthetic llama.cpp `qwen35moe` GGUF (Qwen3.5/3.6 MoE) of an HF config's shape, random weights.

    python3 scripts/make_synthetic_gguf.py CONFIG.json OUT.gguf --type {q4_k_m,q4_0,q8_0,iq4_xs}
        [--layers N] [--seed S] [--threads T] [--gguf-py DIR] [--dry-run]

For benchmarking llama.cpp (`llama-bench -m OUT.gguf`) and deltamoe (`deltamoe bench --model
OUT.gguf`) on the same file without downloading a checkpoint. The file is what llama.cpp's
converter (conversion/qwen.py, Qwen3_5MoeTextModel, `--no-mtp`) followed by `llama-quantize` would
write for that config, except that the weights are random:

- metadata: every `qwen35moe.*` key the converter derives from the config (text config nested
  under `text_config` is merged in as the converter does); `attention.recurrent_layers` from
  `layer_types`, else from `full_attention_interval` (the converter writes it when the config has
  `layer_types`, which the real Qwen3.5/3.6 configs do); no `nextn_predict_layers` (no MTP layer);
  `general.file_type` of the llama-quantize ftype, `general.quantization_version` 2.
- tokenizer: `gpt2` / pre `qwen35`, exactly `vocab_size` tokens: the 256 byte-level tokens (GPT-2's
  bytes_to_unicode order), the results of a few merges (`tokenizer.ggml.merges`), filler NORMAL
  tokens `<|tokN|>`, and `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as the last three ids
  (CONTROL); eos = `<|im_end|>`, pad = `<|endoftext|>`, no BOS; a minimal ChatML template.
- tensors: names, ggml dims and order as llama-quantize writes them (sorted by layer, then name);
  tied embeddings (no `output.weight`) when the config says `tie_word_embeddings`.
- tensor types: llama-quantize's rules (src/llama-quant.cpp) for the ftype, no imatrix, see
  `quant_type`. Unquantized: norms, ssm_a, ssm_dt.bias, ssm_conv1d, ffn_gate_inp,
  ffn_gate_inp_shexp (F32). IQ4_XS: attn_qkv and attn_v Q5_K when n_head / n_head_kv >= 4 (Q8_0
  with 8 experts, as attn_k; attn_output Q5_K with 8 experts), ffn_down (routed and shared) Q5_K in
  the first n_layer / 8 layers, output (or tied token_embd) Q6_K; a row length that is not a
  multiple of 256 takes IQ4_NL (32 values a block), Q5_K takes Q5_1, Q6_K takes Q8_0, and F16
  when not even 32 divides it.

Quantized blocks are random bytes (numpy SFC64, per tensor chunk, several threads) whose f16 scale
fields are rewritten to finite positive/negative normals and whose K-quant and IQ4_XS sub-block
scales are narrowed, so that dequantized weights have an RMS of ~0.01-0.03 (activations stay O(1):
nothing overflows in f16 on a GPU); Q4_K/Q5_K sub-blocks are centred (`fix_blocks`), so that a
batch's rows route to as many distinct experts as uniform routing gives, in every layer. F32 tensors get plausible values (norms ~1, ssm_a in
[-16, -0.5], dt bias ~1, conv ~U(-0.5, 0.5), routers N(0, 0.02)). The data is written streaming:
header, KV, tensor infos (via gguf-py's GGUFWriter), then each tensor chunk by chunk (alignment 32).

Needs numpy and gguf-py (`--gguf-py DIR`, e.g. llama-cpp-python's vendored copy; default the
installed `gguf` package).
`--layers N` keeps the first N layers (block_count N; llama.cpp needs one of them to be full attention,
so N >= full_attention_interval). `--dry-run` prints the tensor list, types
and the exact file size without writing anything.
"""
import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ALIGN = 32
CHUNK_BYTES = 32 << 20
FTYPES = {"q4_k_m": 15, "q4_0": 2, "q8_0": 7, "iq4_xs": 30}  # LLAMA_FTYPE_MOSTLY_*
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "e r", "Ġt he", "Ġ s", "Ġ w"]

gguf = None  # imported in main() from --gguf-py
T = None  # gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# config -> hparams (as conversion/base.py TextModel + conversion/qwen.py Qwen3NextModel do)
# ---------------------------------------------------------------------------------------------
def load_hparams(path, layers):
    cfg = json.loads(Path(path).read_text())
    hp = {**cfg, **cfg.get("text_config", {})}
    n_layer = hp["num_hidden_layers"]
    if layers is not None:
        if not 0 < layers <= n_layer:
            sys.exit(f"--layers {layers}: the config has {n_layer} layers")
        n_layer = layers
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "rope_theta" not in rope and hp.get("rope_theta") is not None:
        rope["rope_theta"] = hp["rope_theta"]
    if "partial_rotary_factor" not in rope and hp.get("partial_rotary_factor") is not None:
        rope["partial_rotary_factor"] = hp["partial_rotary_factor"]
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    sections = list(rope.get("mrope_section", [11, 11, 10, 0]))
    sections += [0] * (4 - len(sections))
    interval = hp.get("full_attention_interval", 4)
    if hp.get("layer_types") is not None:
        if len(hp["layer_types"]) != hp["num_hidden_layers"]:
            sys.exit("layer_types does not have num_hidden_layers entries")
        recurrent = [t == "linear_attention" for t in hp["layer_types"][:n_layer]]
    else:
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    if hp["linear_key_head_dim"] != hp["linear_value_head_dim"]:
        sys.exit("llama.cpp's qwen35moe needs linear_key_head_dim == linear_value_head_dim")
    return dict(
        n_layer=n_layer, n_layer_cfg=hp["num_hidden_layers"], n_embd=hp["hidden_size"],
        n_ctx=hp.get("max_position_embeddings"), n_ff=hp.get("intermediate_size"),
        n_head=hp["num_attention_heads"], n_head_kv=hp["num_key_value_heads"], head_dim=head_dim,
        has_head_dim="head_dim" in hp, rope_theta=rope.get("rope_theta"), rope_sections=sections[:4],
        rope_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        eps=hp.get("rms_norm_eps", 1e-6), n_expert=hp["num_experts"], n_expert_used=hp["num_experts_per_tok"],
        n_ff_exp=hp["moe_intermediate_size"], n_ff_shexp=hp.get("shared_expert_intermediate_size"),
        d_conv=hp["linear_conv_kernel_dim"], d_state=hp["linear_key_head_dim"], n_group=hp["linear_num_key_heads"],
        dt_rank=hp["linear_num_value_heads"], d_inner=hp["linear_value_head_dim"] * hp["linear_num_value_heads"],
        recurrent=recurrent, interval=interval, vocab=hp["vocab_size"],
        tied=bool(hp.get("tie_word_embeddings", False)), name=Path(path).stem,
    )


# ---------------------------------------------------------------------------------------------
# tensors: (name, numpy-order shape) as llama.cpp's qwen35moe loader wants them
# ---------------------------------------------------------------------------------------------
def tensor_list(h):
    E, V = h["n_embd"], h["vocab"]
    out = [("token_embd.weight", (V, E)), ("output_norm.weight", (E,))]
    if not h["tied"]:
        out.append(("output.weight", (V, E)))
    key_dim = h["d_state"] * h["n_group"]
    value_dim = h["d_state"] * h["dt_rank"]
    q_dim = h["head_dim"] * h["n_head"]
    kv_dim = h["head_dim"] * h["n_head_kv"]
    X, F, S = h["n_expert"], h["n_ff_exp"], h["n_ff_shexp"]
    for i in range(h["n_layer"]):
        b = f"blk.{i}."
        layer = [("attn_norm.weight", (E,)), ("post_attention_norm.weight", (E,))]
        if h["recurrent"][i]:
            layer += [
                ("attn_qkv.weight", (key_dim * 2 + value_dim, E)),
                ("attn_gate.weight", (value_dim, E)),
                ("ssm_conv1d.weight", (key_dim * 2 + value_dim, h["d_conv"])),
                ("ssm_dt.bias", (h["dt_rank"],)),
                ("ssm_a", (h["dt_rank"],)),
                ("ssm_beta.weight", (h["dt_rank"], E)),
                ("ssm_alpha.weight", (h["dt_rank"], E)),
                ("ssm_norm.weight", (h["d_state"],)),
                ("ssm_out.weight", (E, value_dim)),
            ]
        else:
            layer += [
                ("attn_q.weight", (q_dim * 2, E)),  # query and its output gate
                ("attn_k.weight", (kv_dim, E)),
                ("attn_v.weight", (kv_dim, E)),
                ("attn_output.weight", (E, q_dim)),
                ("attn_q_norm.weight", (h["head_dim"],)),
                ("attn_k_norm.weight", (h["head_dim"],)),
            ]
        layer += [
            ("ffn_gate_inp.weight", (X, E)),
            ("ffn_gate_exps.weight", (X, F, E)),
            ("ffn_up_exps.weight", (X, F, E)),
            ("ffn_down_exps.weight", (X, E, F)),
        ]
        if S:
            layer += [
                ("ffn_gate_inp_shexp.weight", (E,)),
                ("ffn_gate_shexp.weight", (S, E)),
                ("ffn_up_shexp.weight", (S, E)),
                ("ffn_down_shexp.weight", (E, S)),
            ]
        out += [(b + n, s) for n, s in layer]

    def key(t):  # llama_model_loader's weight_name_comparer: layer number, then name
        name = t[0]
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        return (layer, name)

    return sorted(out, key=key)


# ---------------------------------------------------------------------------------------------
# tensor types: llama-quantize (src/llama-quant.cpp) for ftypes Q4_K_M, Q4_0, Q8_0, IQ4_XS
# ---------------------------------------------------------------------------------------------
def use_more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def f32_tensor(name, shape):
    """The converter writes these F32 and llama-quantize leaves them (tensor_allows_quantization)."""
    return (len(shape) < 2 or name.endswith("_norm.weight") or not name.endswith("weight")
            or "ffn_gate_inp.weight" in name or "ffn_gate_inp_shexp" in name or "ssm_conv1d" in name)


def fallback(t, ncols):
    """tensor_type_fallback: a 256-block type whose rows don't divide takes its 32-block twin;
    F16 when even that does not divide."""
    blck = gguf.GGML_QUANT_SIZES[t][0]
    if ncols % blck == 0:
        return t
    t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}.get(t, t)
    return t if ncols % gguf.GGML_QUANT_SIZES[t][0] == 0 else T.F16


def quant_type(name, shape, h, ftype, counters):
    """The ggml type llama-quantize gives `name` (`counters` walks i_attention_wv in file order)."""
    if f32_tensor(name, shape):
        return T.F32
    default = {"q4_k_m": T.Q4_K, "q4_0": T.Q4_0, "q8_0": T.Q8_0, "iq4_xs": T.IQ4_XS}[ftype]
    ncols = shape[-1]
    n_expert, n_layer = h["n_expert"], h["n_layer"]
    n_gqa = h["n_head"] // h["n_head_kv"] if h["n_head_kv"] else 0  # of layer 0, as llama-quantize asks
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    t = default
    if name == "output.weight" or (h["tied"] and name == "token_embd.weight"):
        if ncols % gguf.GGML_QUANT_SIZES[default][0] != 0:
            t = T.Q8_0
        elif default != T.Q8_0:
            t = T.Q6_K
    elif name == "token_embd.weight":
        t = default
    elif "attn_qkv.weight" in name or "attn_v.weight" in name:  # category_is_attn_v
        if ftype == "iq4_xs" and n_gqa >= 4:
            t = T.Q5_K
        elif ftype == "q4_k_m" and use_more_bits(counters["wv"], counters["n_wv"]):
            t = T.Q6_K
        if n_expert == 8:
            t = T.Q8_0
        counters["wv"] += 1
    elif "attn_k.weight" in name:
        if n_expert == 8:
            t = T.Q8_0
    elif "ffn_down" in name:  # routed and shared experts alike; n_layer counts no MTP layer here
        if ftype == "q4_k_m" and use_more_bits(layer, n_layer):
            t = T.Q6_K
        elif ftype == "iq4_xs" and layer < n_layer // 8:
            t = T.Q5_K
    elif "attn_output.weight" in name:
        if n_expert == 8 and ftype in ("q4_k_m", "iq4_xs"):
            t = T.Q5_K
    return fallback(t, ncols)


def plan(h, ftype):
    tensors = tensor_list(h)
    counters = {"wv": 0, "n_wv": sum(1 for n, _ in tensors if "attn_qkv.weight" in n or "attn_v.weight" in n)}
    out = []
    for name, shape in tensors:
        t = quant_type(name, shape, h, ftype, counters)
        blck, size = gguf.GGML_QUANT_SIZES[t]
        nbytes = math.prod(shape[:-1]) * (shape[-1] // blck) * size
        out.append((name, shape, t, nbytes))
    return out


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
# Per block type: block bytes are random; (offset of an f16 scale, exponent field e0, signed) rewrite
# that scale to a normal f16 of magnitude [2^(e0-15), 2^(e0-13)); e0 chosen for a weight RMS of
# about 0.01-0.03 given the quant and sub-scale ranges (K-quant sub-scales narrowed below).
SCALES = {
    "Q4_0": [(0, 6, True)],  # d*(q-8), |q-8| ~ 4.6
    "Q5_0": [(0, 5, True)],
    "Q5_1": [(0, 5, True), (2, 5, True)],
    "Q8_0": [(0, 2, True)],  # d*q, |q| ~ 74
    # d*sc*q - dmin*m with dmin = d and centred groups (fix_blocks), sc in 0..7 (Q5_K 0..3)
    "Q4_K": [(0, 4, True)],
    "Q5_K": [(0, 4, True)],
    "Q6_K": [(208, 1, True)],  # d*sc*(q-32), sc int8 in -16..15
    "IQ4_NL": [(0, 2, True)],  # d*kvalues[q], RMS of the 16 kvalues ~67
    "IQ4_XS": [(0, 1, True)],  # d*(ls-32)*kvalues[q], ls-32 in 1..4 (narrowed below)
}


def fix_blocks(buf, tname):
    """Rewrite the scale fields of the blocks in `buf` (uint8 [nblocks, block_bytes]) in place."""
    for off, e0, signed in SCALES[tname]:
        f = buf[:, off:off + 2].view(np.uint16)
        keep = np.uint16(0x83FF if signed else 0x03FF)
        f[...] = (f & keep) | (((f >> 10) & 1) + e0).astype(np.uint16) << 10
    if tname in ("Q4_K", "Q5_K"):
        # Centred groups, as a quantizer makes them from trained weights: dmin = d and each
        # sub-block's min m = round(sc * (2^bits - 1) / 2), so that its weights d*sc*q - d*m have a
        # mean of at most d/2. Random mins (the mean about -3.75 d) gave every projection a
        # component along the sum of its input, common to every row, under which a batch's rows
        # picked fewer distinct experts the deeper the layer (40 of 256 by layer 7, against 150-166
        # for Q4_0, 32 rows), unlike a trained model's. 6-bit scales and mins packed as
        # get_scale_min_k4 reads them (sc < 16, so their top bits are 0).
        buf[:, 2:4] = buf[:, 0:2]
        sc = buf[:, 4:12] & (7 if tname == "Q4_K" else 3)
        m = np.rint(sc * (7.5 if tname == "Q4_K" else 15.5)).astype(np.uint8)
        buf[:, 4:8] = sc[:, 0:4]
        buf[:, 8:12] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
        buf[:, 12:16] = sc[:, 4:8] | ((m[:, 4:8] & 0x0F) << 4)
    elif tname == "Q6_K":
        s = buf[:, 192:208]
        s[...] = ((s & 0x1F).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    elif tname == "IQ4_XS":
        # 6-bit sub-block scale ls = low nibble (scales_l, bytes 4..8) | 2 high bits (scales_h, bytes
        # 2..4) << 4: every high pair 0b10 and every low nibble in 1..4 give ls - 32 in 1..4
        buf[:, 2:4] = 0xAA
        buf[:, 4:8] = (buf[:, 4:8] & 0x33) + 0x11


def quant_chunk(seed, tname, nblocks, bsize):
    bg = np.random.SFC64(seed)
    raw = bg.random_raw((nblocks * bsize + 7) // 8).view(np.uint8)[: nblocks * bsize]
    buf = raw.reshape(nblocks, bsize)
    fix_blocks(buf, tname)
    return raw


def float_tensor(name, shape, t, rng):
    n = math.prod(shape)
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if leaf.endswith("norm.weight"):
        a = 1.0 + rng.normal(0, 0.02, n)
    elif leaf == "ssm_a":
        a = -rng.uniform(0.5, 16.0, n)
    elif leaf == "ssm_dt.bias":
        a = 1.0 + rng.normal(0, 0.1, n)
    elif leaf == "ssm_conv1d.weight":
        a = rng.uniform(-0.5, 0.5, n)
    else:  # routers, shared-expert gate, F16 fallbacks
        a = rng.normal(0, 0.02, n)
    return a.astype(np.float32 if t == T.F32 else np.float16)


def write(path, h, ftype, tensors, seed, threads):
    w = gguf.GGUFWriter(path, "qwen35moe")
    add_metadata(w, h, ftype, tensors)
    for name, shape, t, nbytes in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    rng = np.random.default_rng(seed)
    total = sum(nb for *_, nb in tensors)
    done, t0 = 0, time.time()
    with ThreadPoolExecutor(threads) as ex:
        for ti, (name, shape, t, nbytes) in enumerate(tensors):
            w.write_padding(fout, fout.tell())
            if t in (T.F32, T.F16):
                fout.write(float_tensor(name, shape, t, rng).tobytes())
            else:
                blck, bsize = gguf.GGML_QUANT_SIZES[t]
                nblocks = nbytes // bsize
                per = max(1, CHUNK_BYTES // bsize)
                jobs = [(i, min(per, nblocks - i)) for i in range(0, nblocks, per)]
                pending = []
                for ci, (_, nb) in enumerate(jobs):
                    pending.append(ex.submit(quant_chunk, [seed, ti, ci], t.name, nb, bsize))
                    if len(pending) > 2 * threads:
                        fout.write(pending.pop(0).result())
                for f in pending:
                    fout.write(f.result())
            done += nbytes
            if sys.stderr.isatty() or ti == len(tensors) - 1 or done * 10 // total != (done - nbytes) * 10 // total:
                dt = time.time() - t0
                print(f"\r{done / 2**30:7.2f} / {total / 2**30:.2f} GiB  {dt:6.1f} s  "
                      f"{done / max(dt, 1e-9) / 2**30:5.2f} GiB/s", end="", file=sys.stderr, flush=True)
        w.write_padding(fout, fout.tell())
    print(file=sys.stderr)
    w.close()


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]  # in GPT-2's vocab order


def vocab(n):
    tokens = bytes_to_unicode()
    tokens += [m.replace(" ", "") for m in MERGES]
    if n < len(tokens) + len(SPECIALS):
        sys.exit(f"vocab_size {n} is too small")
    types = [1] * len(tokens)  # NORMAL
    filler = n - len(tokens) - len(SPECIALS)
    tokens += [f"<|tok{i}|>" for i in range(len(tokens), len(tokens) + filler)]
    types += [1] * filler
    tokens += SPECIALS
    types += [3] * len(SPECIALS)  # CONTROL
    assert len(tokens) == n and len(set(tokens)) == n
    return tokens, types


def add_metadata(w, h, ftype, tensors):
    w.add_type("model")
    w.add_name(f"Synthetic {h['name']}")
    total = shared = expert = 0
    for name, shape, *_ in tensors:
        size = math.prod(shape)
        total += size
        if "_exps." in name:
            expert += size // shape[-3]
        else:
            shared += size
    w.add_size_label(gguf.size_label(total, shared, expert, h["n_expert"]))
    w.add_block_count(h["n_layer"])
    if h["n_ctx"] is not None:
        w.add_context_length(h["n_ctx"])
    w.add_embedding_length(h["n_embd"])
    if h["n_ff"] is not None:
        w.add_feed_forward_length(h["n_ff"])
    w.add_head_count(h["n_head"])
    w.add_head_count_kv(h["n_head_kv"])
    w.add_rope_dimension_sections(h["rope_sections"])
    if h["rope_theta"] is not None:
        w.add_rope_freq_base(h["rope_theta"])
    w.add_layer_norm_rms_eps(h["eps"])
    w.add_expert_count(h["n_expert"])
    w.add_expert_used_count(h["n_expert_used"])
    if h["has_head_dim"]:
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
    w.add_file_type(FTYPES[ftype])
    w.add_expert_feed_forward_length(h["n_ff_exp"])
    if h["n_ff_shexp"] is not None:
        w.add_expert_shared_feed_forward_length(h["n_ff_shexp"])
    w.add_ssm_conv_kernel(h["d_conv"])
    w.add_ssm_state_size(h["d_state"])
    w.add_ssm_group_count(h["n_group"])
    w.add_ssm_time_step_rank(h["dt_rank"])
    w.add_ssm_inner_size(h["d_inner"])
    w.add_recurrent_layers(h["recurrent"])
    w.add_full_attention_interval(h["interval"])
    w.add_rope_dimension_count(h["rope_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = vocab(h["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def main():
    global gguf, T
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--type", choices=sorted(FTYPES), required=True)
    ap.add_argument("--layers", type=int, help="keep only the first N layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--gguf-py", help="a gguf-py directory (llama.cpp's); default: the installed gguf package")
    ap.add_argument("--dry-run", action="store_true", help="print the tensors and the size, write nothing")
    a = ap.parse_args()
    if a.gguf_py:
        sys.path.insert(0, a.gguf_py)
    import gguf as _gguf
    gguf, T = _gguf, _gguf.GGMLQuantizationType

    h = load_hparams(a.config, a.layers)
    if all(h["recurrent"]):
        print(f"warning: none of the {h['n_layer']} layers is full attention; llama.cpp then allocates a "
              "zero-size KV cache and aborts (GGML_ASSERT(buffer)): keep --layers >= "
              f"{h['interval']}", file=sys.stderr)
    tensors = plan(h, a.type)
    data = sum(gguf.GGUFWriter.ggml_pad(nb, ALIGN) for *_, nb in tensors)
    counts = {}
    for _, _, t, nb in tensors:
        c = counts.setdefault(t.name, [0, 0])
        c[0] += 1
        c[1] += nb
    summary = ", ".join(f"{k} x{n} {b / 2**30:.2f} GiB" for k, (n, b) in sorted(counts.items(), key=lambda x: -x[1][1]))
    if a.dry_run:
        for name, shape, t, nb in tensors:
            print(f"{name:36s} {t.name:6s} {list(reversed(shape))} {nb}")
    print(f"{len(tensors)} tensors, data {data} bytes ({data / 2**30:.2f} GiB): {summary}", file=sys.stderr)
    if a.dry_run:
        return
    t0 = time.time()
    write(a.out, h, a.type, tensors, a.seed, max(1, a.threads))
    size = os.path.getsize(a.out)
    print(f"wrote {a.out}: {size} bytes ({size / 2**30:.2f} GiB) in {time.time() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
