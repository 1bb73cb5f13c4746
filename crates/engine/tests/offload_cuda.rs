//! Expert offload on CUDA (needs a GPU: `#[ignore]`d here, run by `scripts/gpu-tests.sh`): with
//! the routed experts in pinned host memory behind a tiny device cache, every fixture's logits
//! are bitwise those of the all-resident model — through a chunked prefill (staged experts), a
//! batched decode of staggered sequences (far reads over PCIe, or experts computed by the host),
//! the cache swaps the residency policy makes between steps (with clean host copies of the
//! cached experts, and with none: evicted experts written back), and a resize of the cache
//! mid-run.

#[allow(dead_code)]
mod common;

use std::sync::Arc;

use common::{fixtures, prompts};
use deltamoe_compute::cuda::ops::AffineParams;
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{DevFormat, ExpertCache, GpuModel};
use deltamoe_model::host_split::Costs;
use deltamoe_model::{Logits, Qwen3Hybrid};

/// Who computes the experts outside the cache: the GPU alone, the split measured on this
/// machine, or a split forced by costs (the host as fast as the link, or far faster).
#[derive(Clone, Copy, Debug)]
enum Host {
    Off,
    Measured,
    Half,
    All,
}

/// Split costs with the host taking `each` s per expert against the link's 1 s.
fn costs(each: f64) -> Costs {
    Costs {
        link: 1.0,
        fixed: 0.0,
        each,
    }
}

/// Prefill each prompt in passes of 5 tokens, then decode 24 greedy steps of all prompts as
/// one batch; every logit row of every step, in order.
fn run(gm: &mut GpuModel, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    run_resized(gm, prompts, None)
}

/// As [`run`], the expert cache resized to `resize` (when set) after 12 decode steps.
fn run_resized(
    gm: &mut GpuModel,
    prompts: &[Vec<u32>],
    resize: Option<ExpertCache>,
) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    let mut seqs = Vec::new();
    let mut toks = Vec::new();
    for p in prompts {
        let mut s = gm.new_seq().unwrap();
        let l = gm.prefill(&mut s, p, Logits::All, 5).unwrap();
        out.push(l);
        seqs.push(s);
        toks.push(p[p.len() - 1]);
    }
    for step in 0..24 {
        if let (12, Some(cache)) = (step, resize) {
            gm.set_expert_cache(cache).unwrap();
        }
        let mut rows: Vec<_> = seqs.iter_mut().zip(toks.iter().copied()).collect();
        toks = gm.step_batch(&mut rows).unwrap();
        for r in 0..seqs.len() {
            out.push(gm.logits(r).unwrap());
        }
    }
    for s in seqs {
        gm.release(s);
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offloaded_experts_give_bitwise_identical_logits() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let mut checked = 0;
    for dir in fixtures() {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        if model.config().num_experts == 0 {
            continue;
        }
        let ps: Vec<Vec<u32>> = prompts(&dir)
            .iter()
            .map(|p| p.tokens.clone())
            .chain([prompts(&dir)[0].tokens[..7].to_vec()])
            .collect();
        let mut all = GpuModel::upload(&model, gpu.clone()).unwrap();
        all.reserve(ps.len(), 512).unwrap();
        let want = run(&mut all, &ps);
        drop(all);
        // The host has no FP8 expert kernels: such models keep far experts on the GPU.
        let fp8 = model.checkpoint().layers.iter().any(|l| match &l.ffn {
            deltamoe_model::checkpoint::Ffn::Moe(m) => m.experts[0].gate.weight.as_fp8().is_some(),
            _ => false,
        });
        let modes: &[Host] = match fp8 {
            true => &[Host::Off],
            false => &[Host::Off, Host::Measured, Host::Half, Host::All],
        };
        if fp8 {
            let mut gm =
                GpuModel::upload_with(&model, gpu.clone(), ExpertCache::Fraction(0.0)).unwrap();
            let e = gm.set_host_costs(costs(1.0)).unwrap_err().to_string();
            assert!(e.contains("not FP8"), "{e}");
            let e = gm.set_host_experts(true).unwrap_err().to_string();
            assert!(e.contains("not FP8"), "{e}");
        }
        for cache in [ExpertCache::Fraction(0.0), ExpertCache::Fraction(0.25)] {
            for &mode in modes {
                let mut gm = GpuModel::upload_with(&model, gpu.clone(), cache).unwrap();
                // Host memory for no clean copies: every eviction writes the expert back.
                let tight = matches!(mode, Host::Off | Host::Half);
                if tight {
                    gm.set_host_memory(Some(0));
                    gm.set_expert_cache(cache).unwrap();
                }
                match mode {
                    Host::Off => gm.set_host_experts(false).unwrap(),
                    Host::Measured => gm.set_host_experts(true).unwrap(),
                    Host::Half => gm.set_host_costs(costs(1.0)).unwrap(),
                    Host::All => gm.set_host_costs(costs(1e-6)).unwrap(),
                }
                gm.reserve(ps.len(), 512).unwrap();
                let got = run(&mut gm, &ps);
                let st = gm.offload_stats().unwrap();
                let name = format!("{} {cache:?} {mode:?} tight {tight}", dir.display());
                assert_eq!(got.len(), want.len(), "{name}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name}: logit row block {i} differs");
                }
                assert!(
                    st.misses > 0,
                    "{name}: no expert was read from the host: {st:?}"
                );
                assert!(
                    st.staged_host_bytes > 0,
                    "{name}: prefill staged nothing: {st:?}"
                );
                if cache == ExpertCache::Fraction(0.25) {
                    assert!(st.admitted > 0, "{name}: the cache never swapped: {st:?}");
                    assert!(st.hits > 0, "{name}: no cache hit: {st:?}");
                    let back = st.written_back > 0;
                    assert_eq!(back, tight, "{name}: written back: {st:?}");
                }
                match mode {
                    Host::Off => assert_eq!(st.host, 0, "{name}"),
                    Host::Half => {
                        assert!(st.host > 0 && st.far_bytes > 0, "{name}: {st:?}")
                    }
                    Host::All => assert!(st.host > 0, "{name}: {st:?}"),
                    Host::Measured => {}
                }
                eprintln!("{name}: bitwise equal; {st:?}");
                checked += 1;
            }
        }
        // Resizing mid-run gathers every expert from wherever the swaps left it and places
        // them again: from every expert cached, and from a cache the policy has reordered.
        let resizes = [(1.0, 0.25), (0.25, 0.5)];
        let second = if fp8 { Host::Off } else { Host::Measured };
        for ((from, to), mode) in resizes.into_iter().zip([Host::Off, second]) {
            let cache = ExpertCache::Fraction(from);
            let mut gm = GpuModel::upload_with(&model, gpu.clone(), cache).unwrap();
            gm.set_host_experts(matches!(mode, Host::Measured)).unwrap();
            gm.reserve(ps.len(), 512).unwrap();
            let got = run_resized(&mut gm, &ps, Some(ExpertCache::Fraction(to)));
            let name = format!("{} {from} → {to} {mode:?}", dir.display());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}: logit row block {i} differs");
            }
            let st = gm.offload_stats().unwrap();
            assert!(
                st.misses > 0,
                "{name}: no expert was read from the host: {st:?}"
            );
            eprintln!("{name}: bitwise equal; {st:?}");
            checked += 1;
        }
    }
    assert!(checked >= 20, "no MoE fixture found");
}

/// Greedy decode of `steps` tokens from token 1 in one sequence; every step's logits.
fn decode(gm: &mut GpuModel, steps: usize) -> Vec<Vec<f32>> {
    let mut s = gm.new_seq().unwrap();
    let (mut tok, mut out) = (1u32, Vec::new());
    for _ in 0..steps {
        tok = gm.step_batch(&mut [(&mut s, tok)]).unwrap()[0];
        out.push(gm.logits(0).unwrap());
    }
    gm.release(s);
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn synthetic_experts_placed_anywhere_are_the_same_model() {
    // A fixture's shape with the shared expert the routed ones' size: stacked with them, as in
    // the real Qwen3.5/3.6 MoE shapes (the fixtures' shared experts are larger).
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("qwen3_5_moe"))
        .expect("the qwen3_5_moe fixture");
    let mut c = Qwen3Hybrid::load(&dir).unwrap().config().clone();
    c.shared_expert_intermediate_size = c.moe_intermediate_size;
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let formats = [
        DevFormat::Bf16,
        DevFormat::Affine {
            bits: 4,
            group: 32,
            params: AffineParams::Bf16,
        },
        DevFormat::Affine {
            bits: 4,
            group: 32,
            params: AffineParams::F16Zero,
        },
        DevFormat::Fp8 { group: 128 },
    ];
    for quant in formats {
        let mut all = GpuModel::synthetic(&c, gpu.clone(), 9, quant, ExpertCache::All).unwrap();
        all.reserve(1, 64).unwrap();
        let want = decode(&mut all, 8);
        drop(all);
        for cache in [0.0, 0.5, 1.0].map(ExpertCache::Fraction) {
            let mut gm = GpuModel::synthetic(&c, gpu.clone(), 9, quant, cache).unwrap();
            gm.reserve(1, 64).unwrap();
            let mut got = decode(&mut gm, 8);
            // The second half with no clean host copies.
            gm.set_host_memory(Some(0));
            gm.set_expert_cache(ExpertCache::Fraction(0.25)).unwrap();
            got.extend(decode(&mut gm, 8));
            let name = format!("{quant:?} {cache:?}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // Each half is a fresh sequence from token 1: both are the all-resident run.
            for (i, g) in got.iter().enumerate() {
                assert_eq!(bits(g), bits(&want[i % 8]), "{name}: step {i} differs");
                assert!(g.iter().all(|x| x.is_finite()), "{name}: step {i}");
            }
            eprintln!("{name}: bitwise equal; {:?}", gm.offload_stats());
        }
    }
}
