#!/usr/bin/env python3
"""flash-linear-attention's chunk_gated_delta_rule at the shapes of
crates/compute/examples/gdn_chunk_bench.rs, for comparison (GPU machine; needs torch, triton,
fla-core and einops).

    python3 scripts/bench_gdn_fla.py [--check DIR] [--bench]

--bench: median ms per call (CUDA events around each of 20 calls after 3 warm-ups) at 16 key
heads, 32 and 64 value heads, head dim 128, T = 4k/16k/64k: bf16 q/k/v, f32 g (log decay),
beta and initial state, output_final_state=True, with and without use_qk_l2norm_in_kernel.
--check DIR: reads the inputs and outputs `gdn_chunk_bench --dump DIR [--only T,HV]` wrote (the
shape in DIR/shape.txt; Hk=16, D=128, raw q/k normalised in the kernels), runs FLA on the same
inputs and an f64 recurrent reference, and prints the max abs / relative errors of both.
"""
import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

HK, D = 16, 128


def time_ms(f, warmup=3, reps=20):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return sorted(ms)[reps // 2]


def bench():
    dev = "cuda"
    for hv in (32, 64):
        for t in (4096, 16384, 65536):
            torch.manual_seed(0)
            q = F.normalize(torch.randn(1, t, HK, D, device=dev), dim=-1).bfloat16()
            k = F.normalize(torch.randn(1, t, HK, D, device=dev), dim=-1).bfloat16()
            v = torch.randn(1, t, hv, D, device=dev).bfloat16()
            g = F.logsigmoid(torch.rand(1, t, hv, device=dev))
            beta = torch.rand(1, t, hv, device=dev).sigmoid()
            h0 = torch.randn(1, hv, D, D, device=dev) * 0.1
            res = {}
            for norm in (False, True):
                def f():
                    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                  output_final_state=True,
                                                  use_qk_l2norm_in_kernel=norm)
                res[norm] = time_ms(f)
            print(f"fla T={t} Hk={HK} Hv={hv} D={D}: {res[False]:.3f} ms "
                  f"(with in-kernel l2norm {res[True]:.3f} ms)", flush=True)
            del q, k, v, g, beta, h0
            torch.cuda.empty_cache()


def reference(q, k, v, g, beta, h0):
    """Recurrent gated delta rule in f64: q, k [T, Hk, D] normalised/scaled, v [T, Hv, D]."""
    t, hv = v.shape[0], v.shape[1]
    rep = hv // q.shape[1]
    q = q.repeat_interleave(rep, dim=1)
    k = k.repeat_interleave(rep, dim=1)
    s = h0.clone()
    out = torch.empty_like(v)
    for i in range(t):
        s *= g[i].exp()[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[i], s)
        delta = beta[i][:, None] * (v[i] - kv)
        s += k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hk,hkv->hv", q[i], s)
    return out, s


def check(dirname):
    with open(os.path.join(dirname, "shape.txt")) as f:
        t, hv = (int(x) for x in f.read().split())
    dev = "cuda"

    def load(name, dtype, shape):
        a = np.fromfile(os.path.join(dirname, name), dtype=dtype)
        x = torch.from_numpy(a.copy()).to(dev)
        if dtype == np.int16:
            x = x.view(torch.bfloat16)
        return x.reshape(shape)

    q = load("q.bin", np.int16, (1, t, HK, D))
    k = load("k.bin", np.int16, (1, t, HK, D))
    v = load("v.bin", np.int16, (1, t, hv, D))
    g = load("g.bin", np.float32, (1, t, hv))
    beta = load("beta.bin", np.float32, (1, t, hv))
    h0 = load("h0.bin", np.float32, (1, hv, D, D))
    ours = load("out.bin", np.float32, (t, hv, D)).double()
    ours_ht = load("ht.bin", np.float32, (hv, D, D)).double()

    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    fla_o, fla_ht = o[0].double(), ht[0].double()

    def nrm(x):
        x = x[0].double()
        return x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()

    ref_o, ref_ht = reference(nrm(q) / D ** 0.5, nrm(k), v[0].double(), g[0].double(),
                              beta[0].double(), h0[0].double())

    def err(name, a, b):
        e = (a - b).abs().max().item()
        m = b.abs().max().item()
        print(f"{name}: max abs err {e:.3e}, relative to max|ref| {m:.3f}: {e / m:.3e}")

    print(f"check T={t} Hk={HK} Hv={hv} D={D} (q/k l2-normalised in the kernels)")
    err("ours vs fla, out", ours, fla_o)
    err("ours vs fla, final state", ours_ht, fla_ht)
    err("ours vs f64 reference, out", ours, ref_o)
    err("fla  vs f64 reference, out", fla_o, ref_o)
    err("ours vs f64 reference, final state", ours_ht, ref_ht)
    err("fla  vs f64 reference, final state", fla_ht, ref_ht)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", metavar="DIR")
    ap.add_argument("--bench", action="store_true")
    a = ap.parse_args()
    print("device:", torch.cuda.get_device_name(0), flush=True)
    if a.check:
        check(a.check)
    if a.bench:
        bench()


if __name__ == "__main__":
    main()
