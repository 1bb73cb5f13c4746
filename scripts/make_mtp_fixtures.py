#!/usr/bin/env python3
"""Tiny fixtures with a multi-token-prediction (MTP) layer: fixtures/mtp_qwen3_5_moe, fixtures/mtp_qwen3_next.

Each is the matching fixture of scripts/make_fixtures.py (same config, same main weights, same tokenizer
files) plus random `mtp.*` tensors in a second shard (mtp.safetensors, listed in
model.safetensors.index.json) and an mtp_reference.safetensors with the main model's hidden states / logits
and the MTP layer's outputs over the prompt and for a two-step chained draft (vLLM's Qwen3-Next / Qwen3.5
MTP semantics, see SEMANTICS). Reference computed with transformers' own modules, float32 on CPU, on the
bf16-rounded weights. Run after make_fixtures.py:  python3 scripts/make_mtp_fixtures.py  (deterministic)
"""
import json
import shutil
import sys
import types
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (helpers, fixture table, seeds and init scales)

N = 20  # prompt length
SEED = 20250701
NORM_STD = 0.1  # spread of the zero-centred MTP norm weights, applied as x/rms(x) * (1 + w)
SOURCES = {"mtp_qwen3_5_moe": "qwen3_5_moe", "mtp_qwen3_next": "qwen3_next"}
MAIN_SHARD, MTP_SHARD = "model-00001-of-00002.safetensors", "mtp.safetensors"  # no model.safetensors: the index is the entry point
SEMANTICS = (
    "vLLM Qwen3-Next/Qwen3.5 MTP. hidden = main model final hidden states after the final norm. For MTP "
    "row i: x = fc(cat([pre_fc_norm_embedding(embed(tok_i)), pre_fc_norm_hidden(hid_i)])), embedding first; "
    "h = x + attn(input_layernorm(x)); out = h + moe(post_attention_layernorm(h)); mtp_hidden = norm(out); "
    "mtp_logits = lm_head(mtp_hidden) (main lm_head). Attention: causal over the MTP's own rows (own KV), "
    "rotary of the main full-attention layers at position i (text-only 1-D positions). Prompt rows "
    "i = 0..n-2: tok_i = tokens[i+1], hid_i = hidden[i]. Draft row n-1: tok = g = argmax(logits[n-1]), "
    "hid = hidden[n-1] -> draft 0; row n: tok = argmax(draft.logits[0]), hid = draft.hidden[0] -> draft 1.")


def is_full_moe(layer):
    return layer.block_type == "full_attention" and hasattr(layer.mlp, "experts")


def random_mtp(model, seed):
    """Random MTP modules (bf16-rounded, f32): pre-fc norms, fc, one full-attention MoE decoder layer, norm."""
    cfg, h = model.config, model.config.hidden_size
    idx = next(i for i, l in enumerate(model.model.layers) if is_full_moe(l))  # a full-attention MoE layer
    norm_cls = type(model.model.norm)  # the model's own zero-centred RMSNorm
    mtp = torch.nn.ModuleDict({
        "pre_fc_norm_embedding": norm_cls(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": norm_cls(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "layer": type(model.model.layers[idx])(cfg, layer_idx=idx),  # uses cfg's eager attention / experts
        "norm": norm_cls(h, eps=cfg.rms_norm_eps),
    })
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():  # normal(0, initializer_range) as the fixture's matrices
            std = NORM_STD if name.endswith("norm.weight") else mf.INIT_STD
            p.copy_((torch.randn(p.shape, generator=gen) * std).to(torch.bfloat16))
    return mtp.eval()


def mtp_checkpoint(mtp, fx):
    """The MTP tensors under their HF names, the decoder layer renamed by make_fixtures.to_checkpoint."""
    layer_sd = {"model." + k: v for k, v in mtp["layer"].state_dict().items()}
    shim = types.SimpleNamespace(state_dict=lambda: layer_sd)
    out = mf.to_checkpoint(shim, {**fx, "prefix": "mtp.layers.0.", "extra": {}})
    for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"):
        out[f"mtp.{k}.weight"] = mtp[k].weight.detach().to(torch.bfloat16).clone()
    return dict(sorted(out.items(), key=lambda kv: mf.natural_key(kv[0])))


@torch.no_grad()
def run_mtp(model, mtp, toks, hids, rope_3d):
    """MTP over rows 0..len-1 (row i at rotary position i) in one causal call; returns (hidden, logits)."""
    x = torch.cat([mtp["pre_fc_norm_embedding"](model.model.embed_tokens(toks)),
                   mtp["pre_fc_norm_hidden"](hids)], dim=-1)
    x = mtp["fc"](x)[None]  # [1, L, H]
    n = x.shape[1]
    pos = torch.arange(n)[None]  # text-only positions, as the main model builds them
    pos = pos[None].expand(3, 1, n) if rope_3d else pos  # Qwen3.5: the same position in all 3 mrope rows
    rope = model.model.rotary_emb(x, pos)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]  # additive causal
    out = mtp["layer"](x, position_embeddings=rope, attention_mask=mask)
    hid = mtp["norm"](out)[0]
    return hid, model.lm_head(hid)


def margin(logits):  # top-1 minus top-2 per row, min over rows
    t = logits.topk(2, dim=-1).values
    return (t[..., 0] - t[..., 1]).min().item()


@torch.no_grad()
def reference(model, mtp, tokens, rope_3d):
    """All reference tensors for one prompt, the smallest router gap of the MTP layer and greedy margin."""
    hidden = model.model(tokens[None], use_cache=False).last_hidden_state[0]  # after the final norm
    logits = model(tokens[None], use_cache=False).logits[0]
    assert torch.equal(model.lm_head(hidden), logits)
    gaps = []  # routing-probability gap between the k-th and (k+1)-th expert, every MTP row of every call
    k = model.config.num_experts_per_tok
    hook = mtp["layer"].mlp.gate.register_forward_hook(lambda m, i, o: gaps.append(
        (lambda p: (p[:, k - 1] - p[:, k]).min().item())(o[0].float().softmax(-1).sort(-1, descending=True).values)))
    toks, hids = tokens[1:].clone(), hidden[:-1]
    p_hid, p_log = run_mtp(model, mtp, toks, hids, rope_3d)  # prompt rows 0..n-2
    g = logits[-1].argmax()
    toks, hids = torch.cat([toks, g[None]]), torch.cat([hids, hidden[-1:]])
    h1, l1 = run_mtp(model, mtp, toks, hids, rope_3d)  # + draft row n-1 (rerun: causal, rows above unchanged)
    d1 = l1[-1].argmax()
    toks, hids = torch.cat([toks, d1[None]]), torch.cat([hids, h1[-1:]])
    h2, l2 = run_mtp(model, mtp, toks, hids, rope_3d)  # + draft row n, fed the MTP's own normed output
    hook.remove()
    for a, b in ((p_hid, h1[:-1]), (h1, h2[:-1])):  # the reruns reproduce the earlier rows
        assert (a - b).abs().max().item() < 1e-5
    res = {"prompt0.tokens": tokens, "prompt0.hidden": hidden, "prompt0.logits": logits,
           "prompt0.mtp_hidden": p_hid, "prompt0.mtp_logits": p_log,
           "draft.tokens": torch.stack([g, d1]), "draft.hidden": h2[-2:], "draft.logits": l2[-2:]}
    res = {k: v.contiguous() if v.dtype == torch.int64 else v.float().contiguous() for k, v in res.items()}
    greedy = min(margin(logits[-1:]), margin(p_log), margin(l2[-2:]))
    return res, min(gaps), greedy


def write_config(src, dst):
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)  # Qwen3.5: the MTP keys belong to the text config
    text.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    mf.dump_json(dst / "config.json", cfg)


def make(idx, name):
    src, d = mf.OUT / SOURCES[name], mf.OUT / name
    fx = next(f for f in mf.FIXTURES if f["name"] == SOURCES[name])
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    write_config(src, d)
    for p in sorted(src.iterdir()):  # tokenizer / generation config files, if the source has them
        if p.name.startswith(("tokenizer", "generation_config", "chat_template")):
            shutil.copy(p, d / p.name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **mf.IMPL).eval()
    # Main weights: the source checkpoint's tensors byte for byte, minus its `mtp.*` placeholder (an 8x8
    # `mtp.fc.weight` the text-only loader must ignore); they must equal the loaded model's, renamed.
    src_sd = load_file(str(src / "model.safetensors"))
    main_sd = {k: v for k, v in src_sd.items() if not k.startswith("mtp.")}
    mine = mf.to_checkpoint(model, {**fx, "extra": {}})
    assert set(mine) <= set(main_sd) and all(torch.equal(mine[k], main_sd[k]) for k in mine)
    assert set(main_sd) - set(mine) <= set(fx.get("extra", {})), "only the loader-ignored extras differ"

    vocab, rope_3d = model.config.vocab_size, fx["outer"] is not None
    for attempt in range(mf.MAX_ATTEMPTS):  # re-draw until no MTP routing / greedy decision is a near-tie
        seed = SEED + 1000 * idx + attempt
        tokens = torch.randint(0, vocab, (N,), generator=torch.Generator().manual_seed(seed))
        mtp = random_mtp(model, seed + 1)
        ref, router_gap, greedy = reference(model, mtp, tokens, rope_3d)
        if router_gap >= mf.ROUTER_MARGIN and greedy >= mf.GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed without near-ties in {mf.MAX_ATTEMPTS} attempts")

    mtp_sd = mtp_checkpoint(mtp, fx)
    # The MTP decoder layer has exactly the tensor names / shapes of a main full-attention layer.
    full = next(i for i, l in enumerate(model.model.layers) if is_full_moe(l))
    main_layer = {k[len(f"{fx['prefix']}layers.{full}."):]: v.shape for k, v in main_sd.items()
                  if k.startswith(f"{fx['prefix']}layers.{full}.")}
    assert main_layer == {k[len("mtp.layers.0."):]: v.shape for k, v in mtp_sd.items()
                          if k.startswith("mtp.layers.0.")}
    meta = {"format": "pt"}
    save_file(main_sd, str(d / MAIN_SHARD), metadata=meta)
    save_file(mtp_sd, str(d / MTP_SHARD), metadata=meta)
    everything = {**{k: MAIN_SHARD for k in main_sd}, **{k: MTP_SHARD for k in mtp_sd}}
    total = sum(v.numel() * v.element_size() for v in [*main_sd.values(), *mtp_sd.values()])
    mf.dump_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": dict(
        sorted(everything.items(), key=lambda kv: mf.natural_key(kv[0])))})
    rmeta = {"semantics": SEMANTICS, "source": SOURCES[name], "seed_attempt": str(attempt),
             "min_router_gap": f"{router_gap:.3e}", "min_greedy_margin": f"{greedy:.3e}",
             "transformers": transformers.__version__, "torch": torch.__version__}
    # Not `reference.safetensors`: the main weights are the source fixture's, whose golden tests cover them.
    saved = {k.replace("prompt0.", "mtp_prompt.", 1): v for k, v in ref.items()}
    mf.save_sorted_meta(saved, d / "mtp_reference.safetensors", rmeta)
    return verify(d, src_sd, ref) + (f"\n    seed attempt {attempt}, MTP router gap {router_gap:.1e}, greedy margin "
                                     f"{greedy:.1e}, draft {ref['draft.tokens'].tolist()}, MTP argmax == next "
                                     f"main argmax on {(ref['prompt0.mtp_logits'].argmax(-1) == ref['prompt0.logits'][1:].argmax(-1)).sum()}/{N - 1}")


@torch.no_grad()
def verify(d, src_sd, ref):
    """Reload through the index with transformers: logits must match; main weights equal the source's."""
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True, **mf.IMPL)
    assert not info["missing_keys"], info["missing_keys"]
    diff = (model(ref["prompt0.tokens"][None], use_cache=False).logits[0] - ref["prompt0.logits"]).abs().max().item()
    assert diff < 1e-5, f"{d.name}: reload logits differ by {diff}"
    main = load_file(str(d / MAIN_SHARD))
    assert all(torch.equal(v, src_sd[k]) for k, v in main.items()) and set(src_sd) - set(main) <= {"mtp.fc.weight"}
    mtp = load_file(str(d / MTP_SHARD))
    assert all(k.startswith("mtp.") for k in mtp) and all(v.dtype == torch.bfloat16 for v in mtp.values())
    return f"{d.name}: VERIFIED by reload ({type(model).__name__}), max|dlogit|={diff:.1e}, {len(mtp)} mtp tensors"


def main():
    torch.set_num_threads(4)
    print("\n".join(make(i, name) for i, name in enumerate(SOURCES)))


if __name__ == "__main__":
    main()
