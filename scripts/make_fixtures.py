#!/usr/bin/env python3
"""Generate golden-test fixtures for deltamoe (tiny random-weight Qwen3-Next / Qwen3.5 models).

Every fixture directory under fixtures/<name>/ looks like a model directory from the HF hub
(config.json, safetensors weights, optional tokenizer / generation config) plus a
reference.safetensors file with reference outputs computed by HF transformers, which is the
reference implementation. Run from anywhere:  python3 scripts/make_fixtures.py
Deterministic (fixed seeds, CPU, float32 reference on bf16-rounded weights).
"""
import json
import math
import shutil
import struct
from pathlib import Path

import safetensors.torch
import tokenizers
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures"
SEED = 20250101
INIT_STD = 0.08  # large enough that logits spread (max|logit| > 1) and routing is non-trivial
PERTURB_STD = 0.3  # noise added to every norm weight, A_log, dt_bias and bias
PROMPT_LENS = (150, 9)  # 150 > 2 chunks of 64 (exercises the chunked GDN path); 9 < one chunk
NEW_TOKENS = 12
# Plain torch reference code paths: eager attention and the per-expert loop (no grouped_mm / sdpa).
IMPL = dict(attn_implementation="eager", experts_implementation="eager")
ROUTER_MARGIN, GREEDY_MARGIN, MAX_ATTEMPTS = 1e-4, 1e-3, 50  # see make_fixture

# ---------------------------------------------------------------------------------------------
# Config fragments. Each fixture's text config is written to config.json verbatim, so the
# spelling (hub vs transformers-5) is exactly what is given here.
# ---------------------------------------------------------------------------------------------
BASE = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
    linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=INIT_STD, attention_bias=False, attention_dropout=0.0, use_cache=True,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
SMALL = dict(vocab_size=256, hidden_size=32, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12,
             attention_bias=True, initializer_range=0.1)
MOE_SMALL = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def layer_types(n):  # full attention iff (i+1) % 4 == 0
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def rope_v5(theta):  # transformers-5 spelling (as in Qwen3.5 hub configs re-saved by transformers 5)
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}


def rope_hub(theta):  # original hub spelling: flat keys at the top level of the (text) config
    return {"rope_theta": theta, "partial_rotary_factor": 0.25, "rope_scaling": None}


# Tiny vision config, present in real multimodal configs; a text-only loader must ignore it.
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64)

FIXTURES = [
    dict(name="qwen3_5_moe", outer="qwen3_5_moe", arch="Qwen3_5MoeForConditionalGeneration",
         text=dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, layer_types=layer_types(4),
                   tie_word_embeddings=False, **BASE, **MOE, **rope_v5(10_000_000.0)),
         prefix="model.language_model.", experts="fused", shards=1, tokenizer=True,
         extra={"model.visual.blocks.0.attn.qkv.weight": (8, 8), "mtp.fc.weight": (8, 8)}),
    dict(name="qwen3_5_moe_text", outer=None, arch="Qwen3_5MoeForCausalLM",
         text=dict(model_type="qwen3_5_moe_text", num_hidden_layers=4, full_attention_interval=4,
                   norm_topk_prob=True, tie_word_embeddings=False, **BASE, **MOE, **rope_hub(1_000_000.0)),
         prefix="model.", experts="per_expert", shards=2),
    dict(name="qwen3_next", outer=None, arch="Qwen3NextForCausalLM",
         text=dict(model_type="qwen3_next", num_hidden_layers=8, layer_types=layer_types(8),
                   decoder_sparse_step=1, mlp_only_layers=[1], intermediate_size=80, norm_topk_prob=True,
                   tie_word_embeddings=False, **BASE, **MOE, **rope_hub(10_000.0)),
         prefix="model.", experts="per_expert", shards=1),
    dict(name="qwen3_5_dense", outer="qwen3_5", arch="Qwen3_5ForConditionalGeneration",
         text=dict(model_type="qwen3_5_text", num_hidden_layers=4, layer_types=layer_types(4),
                   full_attention_interval=4, intermediate_size=96, tie_word_embeddings=True,
                   **BASE, **rope_v5(100_000.0)),
         prefix="model.language_model.", experts=None, shards=1),
    # Extra variant: un-normalised top-k weights, q/k/v/o biases, top-3 routing and different (smaller)
    # dims, so nothing in the engine can silently hard-code the sizes of the other fixtures.
    dict(name="qwen3_5_next_norm_false", outer=None, arch="Qwen3NextForCausalLM",
         text=dict(model_type="qwen3_next", num_hidden_layers=4, full_attention_interval=4,
                   decoder_sparse_step=1, mlp_only_layers=[], intermediate_size=48, norm_topk_prob=False,
                   tie_word_embeddings=False, **{**BASE, **SMALL}, **MOE_SMALL, **rope_hub(10_000.0)),
         prefix="model.", experts="per_expert", shards=1),
]

# ---------------------------------------------------------------------------------------------
# Tokenizer (fixture qwen3_5_moe): tiny byte-level BPE with the Qwen3.5 pre-tokenizer pipeline.
# ---------------------------------------------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."}]
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still tell a long story.
You are a helpful assistant. The user asks a question and the assistant answers it.
What is the capital of France? The capital of France is Paris. Paris is a city on the river.
Once upon a time there was a little robot who wanted to learn how to read and write.
Every morning the robot walked to the library, opened a book, and read the first page again.
Numbers like 1, 2, 3, 10 and 2025 appear in text; so do symbols such as (), [], {}, and -> arrows.
The weather today is sunny with a chance of rain in the evening. Bring an umbrella, just in case.
Machine learning models predict the next token. Greedy decoding picks the most likely one.
She said: "Hello, world!" and he replied: "Good morning, how are you doing today?"
Mixture of experts routes each token to a few experts; the shared expert sees every token.
Linear attention keeps a recurrent state, while full attention keeps a cache of keys and values.
""" * 4


def build_tokenizer(vocab_size):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # Leave room for the 3 special tokens, which (as on the hub) get the ids after the BPE vocab.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 16, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() <= vocab_size
    return tok


def write_tokenizer(d, vocab_size):
    tok = build_tokenizer(vocab_size)
    tok.save(str(d / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    tok_cfg = {
        "tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": False, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "model_max_length": 4096, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                          "single_word": False, "special": True} for s, i in ids.items()},
    }
    dump_json(d / "tokenizer_config.json", tok_cfg)
    dump_json(d / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
        "top_k": 20, "transformers_version": transformers.__version__})
    # Render the chat prompt with transformers and check both tokenizer stacks agree on the ids.
    hf_tok = AutoTokenizer.from_pretrained(d)
    text = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids_tk = tok.encode(text).ids
    ids_hf = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ids_tk == ids_hf, (ids_tk, ids_hf)
    assert tok.decode(ids_tk, skip_special_tokens=False) == text
    return text, torch.tensor(ids_tk, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Model construction, weight layout and reference outputs
# ---------------------------------------------------------------------------------------------
def dump_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def full_config(fx):
    """The config.json dict: the text config itself, or wrapped in a multimodal outer config."""
    text = dict(fx["text"])
    if fx["outer"] is None:
        return {"architectures": [fx["arch"]], **text, "transformers_version": transformers.__version__}
    vision = {"model_type": fx["outer"] + "_vision", **VISION}
    return {"architectures": [fx["arch"]], "model_type": fx["outer"], "text_config": text,
            "vision_config": vision, "tie_word_embeddings": text["tie_word_embeddings"],
            "transformers_version": transformers.__version__}


def build_model(d, seed):
    """Random model built from the config.json just written to d (parsed by transformers), bf16-rounded."""
    cfg = transformers.AutoConfig.from_pretrained(d).get_text_config()  # outer config -> its text_config
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **IMPL)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # The default init draws A in [0.01, 16], so most heads decay to ~0 within one token and
                # the recurrent state (and the chunk-boundary carry) barely shows in the outputs. Use
                # log-uniform A in [0.005, 0.6]: per-token decay exp(-A*softplus(a+dt_bias)) ~0.5-0.995.
                p.uniform_(math.log(0.005), math.log(0.6), generator=gen)
            # Move every norm weight (zero-centred (1+w) norms AND the plain-w gated GDN norm),
            # A_log, dt_bias and bias away from its init so a wrong formula shows in the logits.
            if name.endswith(("norm.weight", "A_log", "dt_bias", ".bias")):
                p.add_(torch.randn(p.shape, generator=gen) * PERTURB_STD)
        for p in model.parameters():  # the reference runs in f32 on bf16-rounded values; buffers
            p.copy_(p.to(torch.bfloat16))  # (rotary inv_freq) stay f32 as from_pretrained recomputes them
    return model.eval()


def to_checkpoint(model, fx):
    """Rename the in-memory state dict into the on-disk layout required for this fixture."""
    sd, out = model.state_dict(), {}
    tied = fx["text"]["tie_word_embeddings"]
    for k, v in sd.items():
        if tied and k == "lm_head.weight":
            continue  # tied: the hub checkpoint has no lm_head tensor
        k = fx["prefix"] + k[len("model."):] if k.startswith("model.") else k
        v = v.to(torch.bfloat16).contiguous()
        if fx["experts"] == "per_expert" and k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2  # [E, 2I, H], gate rows first
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif fx["experts"] == "per_expert" and k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):  # [E, H, I]
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e].clone()
        else:
            out[k] = v.clone()
    gen = torch.Generator().manual_seed(7)
    for k, shape in fx.get("extra", {}).items():  # tensors a text-only loader must ignore
        out[k] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return dict(sorted(out.items(), key=lambda kv: natural_key(kv[0])))


def natural_key(k):
    return [int(t) if t.isdigit() else t for t in k.split(".")]


def save_sorted_meta(tensors, path, metadata):
    """safetensors.torch.save, but with the metadata keys in sorted order: the library writes them in
    hash-map order, which varies from run to run and would make regenerated files differ byte-wise."""
    data = safetensors.torch.save(tensors, metadata=metadata)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(h) <= n
    path.write_bytes(data[:8] + h.ljust(n, b" ") + data[8 + n:])  # same length: offsets unchanged


def save_weights(d, sd, shards):
    meta = {"format": "pt"}
    if shards == 1:
        save_file(sd, str(d / "model.safetensors"), metadata=meta)
        return
    total = sum(v.numel() * v.element_size() for v in sd.values())
    names, weight_map, groups, acc = list(sd), {}, [[] for _ in range(shards)], 0
    for k in names:  # contiguous split into roughly equal byte sizes
        groups[min(shards - 1, acc * shards // total)].append(k)
        acc += sd[k].numel() * sd[k].element_size()
    for i, keys in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in keys}, str(d / fname), metadata=meta)
        weight_map.update({k: fname for k in keys})
    dump_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


@torch.no_grad()
def reference(model, tokens, hidden):
    """Full-prompt logits, optional hidden states, a 12-token greedy continuation, and the smallest
    decision margins (router top-k boundary, greedy top-1 vs top-2) seen along the way."""
    out = model(tokens[None], use_cache=False, output_hidden_states=hidden)
    res = {"tokens": tokens, "logits": out.logits[0].float().contiguous()}
    if hidden:  # hidden.0 = embeddings, hidden.i = output of layer i-1, hidden.L = after the final norm
        for i, h in enumerate(out.hidden_states):
            res[f"hidden.{i}"] = h[0].float().contiguous()
    # eos_token_id=None: never stop early, always exactly NEW_TOKENS tokens (uses the KV/conv/recurrent cache)
    gcfg = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    seq = model.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]), generation_config=gcfg)[0]
    greedy = seq[len(tokens):]
    assert len(greedy) == NEW_TOKENS, greedy
    res["greedy"] = greedy.to(torch.int64).contiguous()
    # Cross-check the cached decode path against an uncached forward over the whole sequence.
    moe = getattr(model.config, "num_experts", 0) > 0
    full = model(seq[None], use_cache=False, **({"output_router_logits": True} if moe else {}))
    step_logits = full.logits[0, len(tokens) - 1:-1]
    assert torch.equal(step_logits.argmax(-1), greedy), (step_logits.argmax(-1), greedy)
    top2 = step_logits.topk(2, dim=-1).values
    greedy_margin = (top2[:, 0] - top2[:, 1]).min().item()
    router_margin = float("inf")
    if moe:  # gap between the k-th and (k+1)-th routing probability, over all MoE layers and tokens
        k = model.config.num_experts_per_tok
        for rl in full.router_logits:
            p = rl.float().softmax(-1).sort(-1, descending=True).values
            router_margin = min(router_margin, (p[:, k - 1] - p[:, k]).min().item())
    return res, router_margin, greedy_margin


@torch.no_grad()
def verify_reload(d, prompts, refs):
    """Reload the saved directory with transformers and compare logits to the in-memory reference."""
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True, **IMPL)
    assert not info["missing_keys"], info["missing_keys"]
    diff = max((model(t[None], use_cache=False).logits[0] - r["logits"]).abs().max().item()
               for t, r in zip(prompts, refs))
    assert diff < 1e-5, f"reload logits differ by {diff}"
    return f"{type(model).__name__}, max|dlogit|={diff:.1e}, unexpected keys: {sorted(info['unexpected_keys'])}"


def make_fixture(idx, fx):
    d = OUT / fx["name"]
    d.mkdir(parents=True)
    dump_json(d / "config.json", full_config(fx))
    vocab = fx["text"]["vocab_size"]
    gen = torch.Generator().manual_seed(SEED + 1000 * idx)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in PROMPT_LENS]
    meta = {"transformers": transformers.__version__, "torch": torch.__version__}
    if fx.get("tokenizer"):
        meta["prompt1.text"], prompts[1] = write_tokenizer(d, vocab)
    # Re-draw the weights (deterministically) until no routing or greedy decision is a near-tie, so a
    # correct engine with slightly different float rounding cannot legitimately pick another expert/token.
    for attempt in range(MAX_ATTEMPTS):
        model = build_model(d, SEED + 1000 * idx + attempt)
        out = [reference(model, p, hidden=(i == 0)) for i, p in enumerate(prompts)]
        router_margin, greedy_margin = min(o[1] for o in out), min(o[2] for o in out)
        if router_margin >= ROUTER_MARGIN and greedy_margin >= GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"{fx['name']}: no seed without near-ties in {MAX_ATTEMPTS} attempts")
    refs = [o[0] for o in out]
    tensors = {f"prompt{i}.{k}": v for i, r in enumerate(refs) for k, v in r.items()}
    save_sorted_meta(tensors, d / "reference.safetensors", meta)
    save_weights(d, to_checkpoint(model, fx), fx["shards"])

    lg = refs[0]["logits"]
    stats = (f"seed attempt {attempt}, min router gap {router_margin:.1e}, min greedy margin {greedy_margin:.1e}\n"
             f"    max|logit|={lg.abs().max():.2f} std={lg.std():.2f} distinct argmax="
             f"{lg.argmax(-1).unique().numel()}/{len(lg)} greedy0={refs[0]['greedy'].tolist()} "
             f"greedy1={refs[1]['greedy'].tolist()}")
    try:
        verified = "VERIFIED by reload: " + verify_reload(d, prompts, refs)
    except Exception as e:  # report, do not hide: a fixture that does not reload is a bug to look at
        verified = f"NOT verified by reload: {type(e).__name__}: {e}"
    return f"{fx['name']}: {stats}\n    {verified}"


def main():
    torch.set_num_threads(4)
    if OUT.exists():  # regenerate from scratch, keeping the README
        for p in OUT.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
    OUT.mkdir(exist_ok=True)
    report = [make_fixture(i, fx) for i, fx in enumerate(FIXTURES)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, tokenizers {tokenizers.__version__}")
    print("\n".join(report))
    failed = [r for r in report if "NOT verified" in r]
    if failed:
        raise SystemExit(f"{len(failed)} fixture(s) failed the reload check")


if __name__ == "__main__":
    main()
