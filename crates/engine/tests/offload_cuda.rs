//! Expert offload on CUDA (needs a GPU: `#[ignore]`d here, run by `scripts/gpu-tests.sh`): with
//! the routed experts in pinned host memory behind a tiny device cache, every fixture's logits
//! are bitwise those of the all-resident model — through a chunked prefill (staged experts), a
//! batched decode of staggered sequences (far reads over PCIe, or experts computed by the host)
//! and the cache swaps the residency policy makes between steps.

#[allow(dead_code)]
mod common;

use std::sync::Arc;

use common::{fixtures, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{ExpertCache, GpuModel};
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
    for _ in 0..24 {
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
        let modes = [Host::Off, Host::Measured, Host::Half, Host::All];
        for cache in [ExpertCache::Fraction(0.0), ExpertCache::Fraction(0.25)] {
            for mode in modes {
                let mut gm = GpuModel::upload_with(&model, gpu.clone(), cache).unwrap();
                match mode {
                    Host::Off => gm.set_host_experts(false).unwrap(),
                    Host::Measured => gm.set_host_experts(true).unwrap(),
                    Host::Half => gm.set_host_costs(costs(1.0)).unwrap(),
                    Host::All => gm.set_host_costs(costs(1e-6)).unwrap(),
                }
                gm.reserve(ps.len(), 512).unwrap();
                let got = run(&mut gm, &ps);
                let st = gm.offload_stats().unwrap();
                let name = format!("{} {cache:?} {mode:?}", dir.display());
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
    }
    assert!(checked >= 16, "no MoE fixture found");
}
