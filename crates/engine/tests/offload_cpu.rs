//! Expert offload on the CPU: with the routed experts read from the checkpoint files behind a
//! cache of 0, 1 or half the experts per layer, every MoE fixture's logits (bf16 per-expert and
//! fused, MLX 4- and 8-bit stacked) are bitwise those of the all-resident model, through a
//! chunked prefill, a single-token prompt and greedy decode steps while the residency policy
//! swaps experts into the cache.

#[allow(dead_code)]
mod common;

use common::{fixtures, prompts};
use deltamoe_model::{Logits, Qwen3Hybrid};

/// Each prompt prefilled in passes of 16 tokens, then 6 greedy decode steps; every logit row.
fn run(model: &Qwen3Hybrid, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab_size;
    let mut out = Vec::new();
    for p in prompts {
        let mut st = model.new_state();
        for part in p.chunks(16) {
            out.push(model.forward(part, &mut st, Logits::All).unwrap());
        }
        let last = &out[out.len() - 1];
        let mut tok = argmax(&last[last.len() - vocab..]);
        for _ in 0..6 {
            let l = model.forward(&[tok], &mut st, Logits::Last).unwrap();
            tok = argmax(&l);
            out.push(l);
        }
    }
    out
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn offloaded_experts_give_bitwise_identical_logits() {
    let mut checked = 0;
    for dir in fixtures() {
        let resident = Qwen3Hybrid::load(&dir).unwrap();
        let experts = resident.config().num_experts;
        if experts == 0 {
            continue;
        }
        let ps: Vec<Vec<u32>> = prompts(&dir)
            .iter()
            .map(|p| p.tokens.clone())
            .chain([vec![prompts(&dir)[0].tokens[3]]])
            .collect();
        assert!(resident.expert_stats().is_none());
        let want = run(&resident, &ps);
        for slots in [0, 1, experts / 2] {
            let mut model = Qwen3Hybrid::load(&dir).unwrap();
            model.offload_experts(&dir, slots).unwrap();
            assert_eq!(model.expert_cache_slots(), Some(slots));
            let got = run(&model, &ps);
            let st = model.expert_stats().unwrap();
            let name = format!("{} slots {slots}", dir.display());
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same =
                    g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}: logits of pass {i} differ");
            }
            assert!(
                st.misses > 0 && st.bytes_read > 0,
                "{name}: nothing read: {st:?}"
            );
            if slots == 0 {
                assert!(st.hits == 0 && st.admitted == 0, "{name}: {st:?}");
            } else {
                assert!(st.hits > 0, "{name}: no cache hit: {st:?}");
            }
            if slots == experts / 2 {
                assert!(st.admitted > 0, "{name}: the cache never swapped: {st:?}");
            }
            eprintln!("{name}: bitwise equal; {st:?}");
            checked += 1;
        }
    }
    assert!(
        checked >= 12,
        "expected the MoE fixtures, checked {checked} cases"
    );
}
