#!/usr/bin/env python3
"""KL divergence of GGUF-quantized versions of the built-in tiny model against the bf16 model,
for deltamoe and for llama.cpp, on the same GGUF files.

1. models/tiny (bf16 safetensors, MTP layer kept) is converted by llama.cpp's convert_hf_to_gguf.py
   to a BF16 GGUF (the quantization base; the tiny tokenizer registered as pre-tokenizer `qwen35`
   through a shim, as in scripts/make_gguf_quant_fixtures.py) and to an F32 GGUF (a sanity row),
   then `llama-quantize` (no imatrix) makes Q8_0, Q4_K_M and IQ4_XS from the BF16 file.
2. models/tiny/heldout-excerpt.txt is tokenized by the HF tokenizer (`tokenizers`,
   add_special_tokens=False) and cut into consecutive windows of --ctx tokens (the first --windows).
   Reference distribution at each position: `deltamoe score --model models/tiny --device cpu` on the
   window (bf16 weights, f32 compute). Cross-check: transformers (eager, f32 compute on the bf16
   weights upcast to f32) on window 0, max |logit diff| printed.
3. Each GGUF: deltamoe's logits (`deltamoe score --model FILE.gguf --device cpu`, one call per
   window) and llama.cpp's (llama-cpp-python's ctypes bindings on LLAMA_CPP_DIR/build/bin, a fresh
   Llama (context, memory) per window, n_ctx = n_batch = n_ubatch = ctx, logits_all, 2 threads).
   Both are fed the same token ids. (For information, llama-tokenize's ids of the whole text are
   compared with the HF tokenizer's.)
4. Per position: KL(P_bf16 || P_quant) in float64 from log-softmax of the logits; mean, 99th
   percentile, top-1 agreement with the bf16 model; perplexity over the next tokens (ctx - 1 per
   window). A markdown table is printed and written to OUT/table.md. The logits are written under
   OUT/logits/ and recomputed on every run unless --reuse is given (a rebuilt binary would
   otherwise be scored by stale logits); the GGUF files in OUT are reused if present.

Needs numpy, tokenizers, torch + transformers (the cross-check), a CPU build of llama.cpp (the
vendored tree of llama-cpp-python's sdist: LLAMA_CPP_DIR = <sdist>/vendor/llama.cpp, whose
<sdist>/llama_cpp bindings are used) and target/release/deltamoe (not built here).

    python3 scripts/gguf_kl.py LLAMA_CPP_DIR [--out DIR] [--windows N] [--ctx N] [--reuse]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny"
TEXT = MODEL / "heldout-excerpt.txt"
DELTAMOE = ROOT / "target" / "release" / "deltamoe"
QUANTS = ["Q8_0", "Q4_K_M", "IQ4_XS"]
THREADS = 2

SHIM = ("import sys, runpy\nsys.path.insert(0, sys.argv[1])\nsys.path.insert(1, sys.argv[1] + '/gguf-py')\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'\n"
        "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def make_files(llama, out):
    """{name: (type, path)}: the BF16 and F32 conversions and the quantizations of the BF16 one."""
    files = {}
    for ty in ["BF16", "F32"]:
        p = out / f"tiny.{ty.lower()}.gguf"
        if not p.exists():
            run([sys.executable, "-c", SHIM, llama, MODEL, "--outtype", ty.lower(), "--outfile", p])
        files[p.name] = (ty, p)
    quantize = Path(llama) / "build" / "bin" / "llama-quantize"
    for ty in QUANTS:
        p = out / f"tiny.{ty.lower()}.gguf"
        if not p.exists():
            run([quantize, out / "tiny.bf16.gguf", p, ty, str(THREADS)])
        files[p.name] = (ty, p)
    return files


def deltamoe_logits(model, windows, cache):
    if cache.exists():
        return np.load(cache)
    outs = []
    tmp = cache.with_suffix(".tmp.npy")
    for w in windows:
        run([DELTAMOE, "score", "--model", model, "--device", "cpu", "--threads", str(THREADS),
             "--tokens", ",".join(map(str, w)), "--logits-out", tmp])
        outs.append(np.load(tmp))
    tmp.unlink()
    a = np.stack(outs).astype(np.float32)
    np.save(cache, a)
    return a


def llama_class(llama):
    sdist = Path(llama).resolve().parent.parent
    os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(llama) / "build" / "bin")
    sys.path.insert(0, str(sdist))
    from llama_cpp import Llama
    return Llama


def llama_logits(Llama, path, windows, ctx, cache):
    if cache.exists():
        return np.load(cache)
    outs = []
    for w in windows:  # a fresh context (and recurrent / KV memory) per window
        llm = Llama(model_path=str(path), logits_all=True, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx,
                    n_threads=THREADS, n_threads_batch=THREADS, seed=0, verbose=False)
        llm.eval(w.tolist())
        outs.append(np.array(llm.scores[: len(w)], dtype=np.float32))
        llm.close()
        del llm
    a = np.stack(outs)
    np.save(cache, a)
    return a


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def stats(ref_lp, logits, windows):
    """(mean KL, p99 KL, top-1 agreement %, perplexity) of logits [W, T, V] against ref_lp."""
    lp = log_softmax(logits)
    kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(-1).ravel()
    top1 = (lp.argmax(-1) == ref_lp.argmax(-1)).mean() * 100
    return kl.mean(), np.percentile(kl, 99), top1, ppl(lp, windows)


def ppl(lp, windows):
    nxt = windows[:, 1:]
    nll = -np.take_along_axis(lp[:, :-1], nxt[..., None], -1)[..., 0]
    return float(np.exp(nll.mean()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("llama", help="llama.cpp tree with a CPU build in build/bin")
    ap.add_argument("--out", default="/tmp/gguf_kl")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--reuse", action="store_true", help="reuse the logits of an earlier run")
    args = ap.parse_args()
    llama = os.path.abspath(args.llama)
    out = Path(args.out).resolve()
    (out / "logits").mkdir(parents=True, exist_ok=True)
    cache = out / "logits" / f"w{args.windows}x{args.ctx}"
    cache.mkdir(exist_ok=True)
    if not args.reuse:
        for f in cache.glob("*.npy"):
            f.unlink()

    from tokenizers import Tokenizer
    text = TEXT.read_text(encoding="utf-8")
    ids = Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    n = min(args.windows, len(ids) // args.ctx)
    windows = np.array(ids[: n * args.ctx], dtype=np.int64).reshape(n, args.ctx)
    print(f"{TEXT.name}: {len(ids)} tokens; {n} windows of {args.ctx} ({n * args.ctx} positions)")

    t0 = time.time()
    files = make_files(llama, out)
    print(f"GGUF files ready ({time.time() - t0:.1f} s)")

    # llama-tokenize on the whole text vs the HF tokenizer (information only: both are fed HF's ids)
    r = run([Path(llama) / "build" / "bin" / "llama-tokenize", "-m", out / "tiny.q8_0.gguf", "-f", TEXT,
             "--ids", "--no-bos", "--no-escape", "--log-disable"])
    lids = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"llama-tokenize ids == HF tokenizer ids on the whole text: {lids == ids} "
          f"({len(lids)} vs {len(ids)} tokens)")

    t0 = time.time()
    ref = deltamoe_logits(MODEL, windows, cache / "bf16_dir.deltamoe.npy")
    print(f"reference (deltamoe, models/tiny): {time.time() - t0:.1f} s")
    ref_lp = log_softmax(ref)
    bf16_ppl = ppl(ref_lp, windows)

    # transformers cross-check on window 0
    import torch
    import transformers
    torch.set_num_threads(THREADS)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        hf = model(torch.from_numpy(windows[0])[None], use_cache=False).logits[0].float().numpy()
    d = np.abs(hf - ref[0])
    hf_lp = log_softmax(hf)
    kl0 = (np.exp(ref_lp[0]) * (ref_lp[0] - hf_lp)).sum(-1)
    print(f"transformers {transformers.__version__} (f32 compute on bf16 weights) vs deltamoe, window 0: "
          f"max|dlogit| {d.max():.3e} (max|logit| {np.abs(ref[0]).max():.2f}), mean KL {kl0.mean():.2e}, "
          f"top-1 agreement {(hf.argmax(-1) == ref[0].argmax(-1)).mean() * 100:.2f}%")
    del model

    Llama = llama_class(llama)
    rows = []
    for name, (ty, path) in files.items():
        t0 = time.time()
        dm = deltamoe_logits(path, windows, cache / f"{name}.deltamoe.npy")
        t1 = time.time()
        lc = llama_logits(Llama, path, windows, args.ctx, cache / f"{name}.llama.npy")
        t2 = time.time()
        s_dm, s_lc = stats(ref_lp, dm, windows), stats(ref_lp, lc, windows)
        x = log_softmax(dm)
        kl_dm_lc = (np.exp(x) * (x - log_softmax(lc))).sum(-1).mean()
        print(f"{name}: deltamoe {t1 - t0:.1f} s, llama.cpp {t2 - t1:.1f} s; "
              f"deltamoe KL mean {s_dm[0]:.3e} p99 {s_dm[1]:.3e}; llama.cpp KL mean {s_lc[0]:.3e} "
              f"p99 {s_lc[1]:.3e}; KL(deltamoe || llama.cpp) mean {kl_dm_lc:.3e}; "
              f"max|dlogit| deltamoe-llama.cpp {np.abs(dm - lc).max():.3e}")
        rows.append((name, ty, path.stat().st_size / 1e6, s_dm, s_lc))

    hdr = ("| file | type | size MB | deltamoe mean KL | llama.cpp mean KL | deltamoe p99 KL | "
           "llama.cpp p99 KL | deltamoe top-1 % | llama.cpp top-1 % | ppl deltamoe | ppl llama.cpp | bf16 ppl |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for name, ty, mb, a, b in rows:
        lines.append(f"| {name} | {ty} | {mb:.2f} | {a[0]:.3e} | {b[0]:.3e} | {a[1]:.3e} | {b[1]:.3e} | "
                     f"{a[2]:.2f} | {b[2]:.2f} | {a[3]:.4f} | {b[3]:.4f} | {bf16_ppl:.4f} |")
    table = "\n".join(lines) + (
        f"\n\nReference: `deltamoe score` on models/tiny (bf16 safetensors), {n} windows x {args.ctx} tokens "
        f"of {TEXT.name} ({n * args.ctx} positions; perplexity over {n * (args.ctx - 1)} next tokens). "
        "Quantizations by llama-quantize from the BF16 GGUF, no imatrix.\n")
    print("\n" + table)
    (out / "table.md").write_text(table)


if __name__ == "__main__":
    main()
