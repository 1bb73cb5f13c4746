#!/usr/bin/env python3
"""GGUF fixtures quantized by llama.cpp's own tools, with exact references: fixtures/gguf_quant/.

A tiny random `qwen3_5_moe` text model (hidden 256, so every matrix whose row length is 256 can
take llama.cpp's 256-value K-quant / IQ4_XS blocks, while the expert down projections, rows of
32, fall back to 32-value blocks) is built like scripts/make_fixtures.py builds its fixtures (same
tokenizer, init, bf16 rounding, perturbed norms / A_log / dt_bias), converted by llama.cpp's
`convert_hf_to_gguf.py` to an F32 GGUF (tokenizer registered as pre-tokenizer `qwen35`, as in
scripts/make_gguf_fixtures.py; `--no-mtp`), and quantized by `llama-quantize` (no imatrix).

Three quantized files (see QUANTS) are kept; for each, the exact oracle is computed: every tensor
dequantized to f32 by gguf-py, mapped back to the transformers layout (undoing the converter:
names, `1 + w` norms, value heads tiled -> grouped, ssm_a = -exp(A_log), conv1d [C, K] -> [C, 1, K],
gate/up experts fused), loaded into transformers' Qwen3_5MoeForCausalLM in float32 (eager paths),
run over 64 random ids and make_fixtures.py's ChatML prompt. Weight seeds, then the random ids, are
redrawn until no oracle has a routing or top-1 near-tie. Checks (asserted or printed): the F32 GGUF
mapped back reproduces the HF model's logits; llama.cpp's own dequantization (llama-quantize
--allow-requantize to F32) equals gguf-py's, and llama.cpp's logits on it match the oracle.
llama.cpp's logits on the quantized files (llama-cpp-python's ctypes bindings, if they load; they
need `diskcache`) are only compared and printed. A short text is tokenized by `llama-tokenize` and
by the HF tokenizer. Deterministic (fixed seeds, CPU); OUT_DIR is deleted and rewritten.

Needs torch, transformers, safetensors, numpy and a llama.cpp tree with a CPU build in build/bin
(llama-quantize, llama-tokenize, libllama.so): llama-cpp-python's sdist vendors one under
vendor/llama.cpp (its gguf-py is used, so reader and converter match); the bindings are found at
LLAMA_CPP_DIR/../.. (the sdist root) if present.

    python3 scripts/make_gguf_quant_fixtures.py LLAMA_CPP_DIR [OUT_DIR]
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import make_fixtures as mf  # noqa: E402  (torch, transformers, the tiny tokenizer and init)

torch, transformers = mf.torch, mf.transformers

NAME = "qwen3_5_moe_q"  # the HF dir's name: the converter writes it into general.name
SEED = 20250404
# (file key, llama-quantize ftype, extra llama-quantize arguments). Three files keep the directory
# under ~3.5 MB and hold all ten block types between them: Q4_K_M and IQ4_XS as llama-quantize makes
# them (Q4_K, Q5_K, Q6_K, IQ4_XS and their fallbacks Q5_0, Q8_0, IQ4_NL for rows of 32), and Q6_K
# with per-tensor overrides (--tensor-type) for the 32-value types no plain ftype gives here without
# an imatrix (Q4_0 ftype: Q4_0 + Q6_K + Q8_0 only; Q5_K_M: Q5_K + Q5_1 + Q6_K + Q8_0; Q4_1 never).
QUANTS = [
    ("q4_k_m", "Q4_K_M", []),
    ("iq4_xs", "IQ4_XS", []),
    ("q6_k_mix", "Q6_K", ["--tensor-type", "ffn_up_exps=q4_0", "--tensor-type", "ffn_down_exps=q4_1",
                          "--tensor-type", "ffn_down_shexp=q5_1"]),
]
T = 64  # random tokens
TEXT = "Hello, world! 42 apples cost $3.50 (or 7)...\n<|im_start|>user\ncafé naïve über"
HK, HV, DK, DV = 2, 4, 64, 64  # GDN key heads, value heads, key / value head dims
CONFIG = dict(
    architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
    vocab_size=512, hidden_size=256, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
    linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=mf.INIT_STD, attention_bias=False, attention_dropout=0.0, use_cache=True,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
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
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
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
# Norms the converter stores as 1 + w (all RMSNorms but the GDN gated norm).
PLUS_ONE = {"attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight"}


def shim(llama):  # as in make_gguf_fixtures.py: the converter's main with the tokenizer registered
    return ("import sys, runpy\nsys.path.insert(0, sys.argv[1])\nsys.path.insert(1, sys.argv[1] + '/gguf-py')\n"
            "import conversion.base as base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'\n"
            "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


# ---------------------------------------------------------------------------------------------
# GGUF -> transformers state dict
# ---------------------------------------------------------------------------------------------
def grouped(t, dim, block):
    """Value heads along `dim` (HV blocks of `block`) from the converter's tiled order (value head j
    of key head k at j*HK + k) back to HF's grouped order (at k*(HV/HK) + j)."""
    shape = list(t.shape)
    r = HV // HK
    t = t.reshape(shape[:dim] + [r, HK, block] + shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def read_gguf(path):
    """{gguf name: (ggml type name, f32 torch tensor in torch (outermost-first) order)}."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(path).tensors:
        a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape([int(n) for n in reversed(t.shape.tolist())])
        out[t.name] = (t.tensor_type.name, torch.from_numpy(a.copy()))
    return out


def to_hf(tensors):
    """The transformers state dict (Qwen3_5MoeForCausalLM, tied) of a GGUF's dequantized tensors."""
    sd, gate_up = {}, {}
    qk = 2 * HK * DK
    for name, (_, v) in tensors.items():
        if name == "token_embd.weight":
            sd["model.embed_tokens.weight"] = sd["lm_head.weight"] = v
            continue
        if name == "output_norm.weight":
            sd["model.norm.weight"] = v - 1
            continue
        _, i, leaf = name.split(".", 2)
        to = f"model.layers.{i}.{LAYER[leaf]}"  # KeyError: a tensor this mapping does not know
        if leaf in PLUS_ONE:
            v = v - 1
        elif leaf == "ssm_a":
            v = grouped(torch.log(-v), 0, 1)
        elif leaf in ("ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight"):
            v = grouped(v, 0, 1)
        elif leaf == "attn_gate.weight":
            v = grouped(v, 0, DV)
        elif leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            v = torch.cat([v[:qk], grouped(v[qk:], 0, DV)])
            if leaf == "ssm_conv1d.weight":
                v = v[:, None, :]  # [C, K] -> nn.Conv1d's [C, 1, K]
        elif leaf == "ssm_out.weight":
            v = grouped(v, 1, DV)
        elif leaf == "ffn_gate_inp_shexp.weight":
            v = v.reshape(1, -1)
        elif leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            gate_up.setdefault(to, {})[leaf] = v
            continue
        sd[to] = v
    for to, p in gate_up.items():  # [E, I, H] each -> [E, 2I, H], gate rows first
        sd[to] = torch.cat([p["ffn_gate_exps.weight"], p["ffn_up_exps.weight"]], dim=1)
    return sd


def hf_model(d, sd):
    cfg = transformers.AutoConfig.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **mf.IMPL).eval()
    own = model.state_dict()
    assert set(sd) == set(own), (sorted(set(sd) ^ set(own)))
    for k, v in sd.items():
        assert tuple(v.shape) == tuple(own[k].shape), (k, tuple(v.shape), tuple(own[k].shape))
    model.load_state_dict(sd, strict=True)
    return model


@torch.no_grad()
def forward(model, tokens):
    """f32 logits [T, V], the smallest router gap (k-th minus (k+1)-th routing probability) and the
    smallest top-1 minus top-2 logit over all tokens."""
    out = model(tokens[None], use_cache=False, output_router_logits=True)
    logits = out.logits[0].float().contiguous()
    k = model.config.num_experts_per_tok
    gap = min((p := rl.float().softmax(-1).sort(-1, descending=True).values)[:, k - 1].sub(p[:, k]).min().item()
              for rl in out.router_logits)
    top2 = logits.topk(2, -1).values
    return logits, gap, (top2[:, 0] - top2[:, 1]).min().item()


# ---------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------
def llama_bindings(llama):
    """llama-cpp-python's Llama class loaded against LLAMA_DIR/build/bin, or None (reason printed)."""
    sdist = Path(llama).resolve().parent.parent
    if not (sdist / "llama_cpp" / "llama.py").exists():
        print(f"no llama-cpp-python bindings at {sdist}: llama.cpp logits skipped")
        return None
    os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(llama) / "build" / "bin")
    sys.path.insert(0, str(sdist))
    try:
        from llama_cpp import Llama
        return Llama
    except Exception as e:  # report, do not hide
        print(f"llama-cpp-python bindings do not load ({type(e).__name__}: {e}): llama.cpp logits skipped")
        return None


def llama_logits(Llama, path, tokens):
    llm = Llama(model_path=str(path), logits_all=True, n_ctx=256, n_batch=256, n_ubatch=256,
                n_threads=4, seed=0, verbose=False)
    llm.eval(tokens.tolist())
    out = torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))
    del llm
    return out


def llama_tokenize(llama, path, text, tmp):
    f = Path(tmp) / "text.txt"
    f.write_bytes(text.encode())
    r = run([str(Path(llama) / "build" / "bin" / "llama-tokenize"), "-m", str(path), "-f", str(f),
             "--ids", "--no-bos", "--no-escape", "--log-disable"])
    return json.loads(r.stdout.strip().splitlines()[-1])


def make_files(llama, quantize, d, tmp, seed):
    """b. The model of seed `seed` saved to d, converted to F32 and quantized: (model, {key: path},
    {key: read_gguf(path)})."""
    model = mf.build_model(d, seed)
    fx = dict(text=CONFIG, prefix="model.", experts="fused")
    mf.save_weights(d, mf.to_checkpoint(model, fx), 1)
    f32 = tmp / f"{NAME}.f32.gguf"
    run([sys.executable, "-c", shim(llama), llama, str(d), "--outtype", "f32", "--outfile", str(f32), "--no-mtp"])
    files = {"f32": f32}
    for key, ty, extra in QUANTS:
        dst = tmp / f"{NAME}.{key}.gguf"
        r = subprocess.run([quantize, *extra, str(f32), str(dst), ty, "4"], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"llama-quantize refused {ty} {extra}:\n{r.stderr[-2000:]}")
            continue
        files[key] = dst
    return model, files, {k: read_gguf(p) for k, p in files.items()}


# ---------------------------------------------------------------------------------------------
def main():
    llama = os.path.abspath(sys.argv[1])
    out_dir = Path(sys.argv[2] if len(sys.argv) > 2 else ROOT / "fixtures" / "gguf_quant").resolve()
    sys.path.insert(0, os.path.join(llama, "gguf-py"))  # the converter's own gguf-py
    import gguf

    torch.set_num_threads(4)
    quantize = os.path.join(llama, "build", "bin", "llama-quantize")
    sdist_ver = Path(llama).resolve().parent.parent.name
    toml = Path(llama, "gguf-py", "pyproject.toml").read_text()
    gguf_ver = next(l.split('"')[1] for l in toml.splitlines() if l.startswith("version"))
    with tempfile.TemporaryDirectory() as tmp:
        # a. the HF model
        d = Path(tmp) / NAME
        d.mkdir()
        mf.dump_json(d / "config.json", {**CONFIG, "transformers_version": transformers.__version__})
        chat_text, chat = mf.write_tokenizer(d, CONFIG["vocab_size"])  # the ChatML prompt of make_fixtures
        # Re-draw the weights (seeds SEED, SEED+1, ...) until the chat prompt has no near-tie (routing
        # gap < 1e-4 or top-1/top-2 logit margin < 1e-3) in the HF model or any oracle; then the
        # random tokens are re-drawn until they have none either.
        for w_attempt in range(mf.MAX_ATTEMPTS):
            model, files, gg = make_files(llama, quantize, d, Path(tmp), SEED + w_attempt)
            # c. oracles: each file dequantized, mapped back, run by transformers in f32
            models = {k: hf_model(d, to_hf(t)) for k, t in gg.items()}
            chat_ref = forward(model, chat)
            chat_res = {k: forward(m, chat) for k, m in models.items()}
            chat_gap = min(r[1] for r in [chat_ref, *chat_res.values()])
            chat_margin = min(r[2] for r in [chat_ref, *chat_res.values()])
            if chat_gap >= mf.ROUTER_MARGIN and chat_margin >= mf.GREEDY_MARGIN:
                break
        else:
            raise RuntimeError("no weight seed without near-ties on the chat prompt")
        print(f"gguf-py {gguf.__file__}; weight seed attempt {w_attempt}")
        for k, t in gg.items():
            counts = {}
            for name, (ty, _) in t.items():
                counts.setdefault(ty, []).append(name)
            print(f"{k}: {files[k].stat().st_size} bytes; " +
                  "; ".join(f"{ty} x{len(n)}" for ty, n in sorted(counts.items())))
            if k != "f32":
                for ty, n in sorted(counts.items()):
                    if ty != "F32":
                        print(f"    {ty}: {', '.join(n)}")

        gen = torch.Generator().manual_seed(SEED)
        for attempt in range(mf.MAX_ATTEMPTS):  # redraw the tokens until no oracle has a near-tie
            tokens = torch.randint(0, CONFIG["vocab_size"], (T,), generator=gen)
            ref = forward(model, tokens)
            res = {k: forward(m, tokens) for k, m in models.items()}
            gap = min(chat_gap, *(r[1] for r in [ref, *res.values()]))
            margin = min(chat_margin, *(r[2] for r in [ref, *res.values()]))
            if gap >= mf.ROUTER_MARGIN and margin >= mf.GREEDY_MARGIN:
                break
        else:
            raise RuntimeError("no token draw without near-ties")
        seqs = {"tokens": (tokens, ref, res), "chat": (chat, chat_ref, chat_res)}
        inv = max((r["f32"][0] - hf[0]).abs().max().item() for _, hf, r in seqs.values())
        print(f"tokens: draw {attempt}; over both sequences and all oracles: min router gap {gap:.1e}, "
              f"min top-1/top-2 margin {margin:.1e}")
        print(f"inverse mapping: F32 GGUF -> HF vs the HF model: max|dlogit| = {inv:.2e} "
              f"(max|logit| {ref[0].abs().max():.2f})")
        assert inv < 1e-4, inv

        # d. llama.cpp's own logits, for the record. Its CPU matmuls quantize the activations (to
        # Q8_0 / Q8_K) for quantized weights, so they differ from the oracle; to check the oracle
        # itself, each file is also dequantized by llama.cpp (llama-quantize --allow-requantize to
        # F32): those tensors must equal gguf-py's, and llama.cpp's logits on that F32 file the oracle.
        Llama = llama_bindings(llama)
        for k, p in files.items():
            print(f"{k}: oracle vs the HF bf16 model: max|d|/max|ref| = "
                  f"{(res[k][0] - ref[0]).abs().max() / ref[0].abs().max():.3f} (random tokens)")
            deq = p
            if k != "f32":
                deq = Path(tmp) / f"{k}.deq.gguf"
                run([quantize, "--allow-requantize", str(p), str(deq), "F32", "4"])
                mine, theirs = gg[k], read_gguf(deq)
                assert set(mine) == set(theirs)
                dd = max((mine[n][1] - theirs[n][1]).abs().max().item() for n in mine)
                print(f"    llama.cpp's dequantization vs gguf-py's: max|d| = {dd:.1e}")
            if Llama is None:
                continue
            for sname, (toks, _, r) in seqs.items():
                o = r[k][0]
                scale = o.abs().max()
                lc = llama_logits(Llama, p, toks)
                rel = (lc - o).abs().max(-1).values / scale
                agree = (lc.argmax(-1) == o.argmax(-1)).float().mean().item()
                line = (f"    {sname:6s} llama.cpp vs oracle: max|d|/max|oracle| {rel.max():.4f} "
                        f"(median over positions {rel.median():.4f}), argmax agreement {agree * 100:.1f}%")
                if k != "f32":
                    lc = llama_logits(Llama, deq, toks)
                    line += (f"; on its F32 dequantization: {(lc - o).abs().max() / scale:.1e}, "
                             f"{(lc.argmax(-1) == o.argmax(-1)).float().mean().item() * 100:.1f}%")
                print(line)

        # e. tokenizer
        ids = llama_tokenize(llama, files["q4_k_m"], TEXT, tmp)
        hf_tok = transformers.AutoTokenizer.from_pretrained(d)
        hf_ids = hf_tok(TEXT, add_special_tokens=False)["input_ids"]
        print(f"text ids (llama.cpp): {ids}\ntext ids (HF):        {hf_ids}\nequal: {ids == hf_ids}")
        chat_ids = llama_tokenize(llama, files["q4_k_m"], chat_text, tmp)
        print(f"chat prompt: llama-tokenize ids equal to HF's: {chat_ids == chat.tolist()}")
        if Llama is not None:
            llm = Llama(model_path=str(files["q4_k_m"]), vocab_only=True, verbose=False)
            b_ids = llm.tokenize(TEXT.encode(), add_bos=False, special=True)
            print(f"bindings' tokenize equal to llama-tokenize: {b_ids == ids}")

        # f. write
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        for k, p in files.items():
            if k != "f32" or p.stat().st_size < 1_200_000:
                shutil.copy(p, out_dir / p.name)
        tensors = {"tokens": tokens.to(torch.int64).contiguous(),
                   "chat.tokens": chat.to(torch.int64).contiguous(),
                   "text.ids": torch.tensor(ids, dtype=torch.int64),
                   "text.hf_ids": torch.tensor(hf_ids, dtype=torch.int64)}
        for k in files:
            if k != "f32":
                tensors[f"{k}.logits"] = res[k][0].contiguous()
                tensors[f"{k}.chat.logits"] = chat_res[k][0].contiguous()
        meta = {"text": TEXT, "chat.text": chat_text, "transformers": transformers.__version__,
                "torch": torch.__version__, "llama.cpp": f"{sdist_ver} vendor/llama.cpp, gguf-py {gguf_ver}",
                "min_router_gap": f"{gap:.3e}", "min_greedy_margin": f"{margin:.3e}"}
        mf.save_sorted_meta(tensors, out_dir / "reference.safetensors", meta)
        total = 0
        for p in sorted(out_dir.iterdir()):
            total += p.stat().st_size
            print(f"{p}: {p.stat().st_size} bytes")
        print(f"total {total} bytes; transformers {transformers.__version__}, torch {torch.__version__}")

if __name__ == "__main__":
    main()
