//! Speculative decoding with the MTP layer on the CPU backend: greedy output equals plain
//! greedy token for token (one prompt; under the scheduler, through the prompt cache; with the
//! routed experts read from the files), and sampled output follows the same distribution as
//! plain sampling (a two-sample chi-square test per position). The fixtures' MTP layers are
//! random, so their drafts agree with the model now and then: the rule's every branch runs.

mod speculative_common;

use std::collections::BTreeMap;

use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::Engine;
use deltamoe_model::Qwen3Hybrid;
use speculative_common::{fixture, round, run_stats, scheduler, FIXTURES};

fn engine(name: &str, drafts: usize) -> Engine {
    let mut e = Engine::new(Qwen3Hybrid::load(&fixture(name)).unwrap());
    e.set_speculative(drafts).unwrap();
    e
}

fn run(e: &mut Engine, prompt: &[u32], max_tokens: usize, sampling: &SamplingParams) -> Vec<u32> {
    run_stats(e, prompt, max_tokens, sampling).0
}

const PROMPT: [u32; 9] = [5, 17, 300, 2, 44, 44, 9, 128, 77];

#[test]
fn greedy_output_is_plain_greedy_output() {
    let greedy = SamplingParams::default();
    for name in FIXTURES {
        let plain = run(&mut engine(name, 0), &PROMPT, 40, &greedy);
        for n in 1..=3 {
            let mut e = engine(name, n);
            assert_eq!(run(&mut e, &PROMPT, 40, &greedy), plain, "{name}, N = {n}");
            // A repetition penalty reads the drafts as history.
            let pen = SamplingParams {
                repetition_penalty: 1.3,
                ..greedy.clone()
            };
            let want = run(&mut engine(name, 0), &PROMPT, 30, &pen);
            assert_eq!(
                run(&mut e, &PROMPT, 30, &pen),
                want,
                "{name}, N = {n}, penalty"
            );
        }
    }
}

#[test]
fn the_scheduler_batches_speculative_sequences_exactly() {
    let name = FIXTURES[0];
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| PROMPT.iter().map(|&t| (t + 31 * i) % 512).collect())
        .collect();
    let greedy = SamplingParams::default();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&mut engine(name, 0), p, 24, &greedy))
        .collect();
    let mut s = scheduler(engine(name, 2));
    // Twice: the second round starts from the prompt cache's snapshots.
    for round_no in 0..2 {
        let got = round(&mut s, &prompts, &greedy, 24);
        assert_eq!(got, want, "round {round_no}");
    }
    assert!(s.stats().cache_hits > 0);
}

/// Two-sample chi-square statistic of counts `a` and `b` (same totals) over the ids seen at
/// least 10 times in all, and its degrees of freedom.
fn chi2(a: &BTreeMap<u32, usize>, b: &BTreeMap<u32, usize>) -> (f64, usize) {
    let ids: Vec<u32> = a.keys().chain(b.keys()).copied().collect();
    let (mut stat, mut bins, mut rest) = (0.0, 0usize, (0usize, 0usize));
    for id in ids.into_iter().collect::<std::collections::BTreeSet<_>>() {
        let (x, y) = (
            a.get(&id).copied().unwrap_or(0),
            b.get(&id).copied().unwrap_or(0),
        );
        if x + y < 10 {
            rest = (rest.0 + x, rest.1 + y);
            continue;
        }
        stat += (x as f64 - y as f64).powi(2) / (x + y) as f64;
        bins += 1;
    }
    if rest.0 + rest.1 > 0 {
        stat += (rest.0 as f64 - rest.1 as f64).powi(2) / (rest.0 + rest.1) as f64;
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

/// The chi-square distribution's upper 0.1% point (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let d = df.max(1) as f64;
    let c = 2.0 / (9.0 * d);
    d * (1.0 - c + 3.09 * c.sqrt()).powi(3)
}

#[test]
fn sampled_tokens_follow_the_plain_distribution() {
    let name = FIXTURES[1];
    let (runs, len) = (1500u64, 3);
    let mut counts = vec![[BTreeMap::<u32, usize>::new(), BTreeMap::new()]; len];
    let (mut plain, mut spec) = (engine(name, 0), engine(name, 2));
    let (mut steps, mut tokens) = (0, 0);
    for seed in 0..runs {
        let p = SamplingParams {
            temperature: 1.5,
            seed,
            ..SamplingParams::default()
        };
        for (k, e) in [&mut plain, &mut spec].into_iter().enumerate() {
            // Distinct seeds for the two engines: the samples must be independent.
            let p = SamplingParams {
                seed: seed + k as u64 * runs,
                ..p.clone()
            };
            let (out, stats) = run_stats(e, &PROMPT, len, &p);
            if k == 1 {
                (steps, tokens) = (steps + stats.decode_steps + 1, tokens + out.len());
            }
            for (i, t) in out.into_iter().enumerate() {
                *counts[i][k].entry(t).or_default() += 1;
            }
        }
    }
    // The drafts are kept often enough for the rule's acceptance branch to matter.
    let per_step = tokens as f64 / steps as f64;
    assert!(per_step > 1.2, "{per_step} tokens per step");
    for (i, [a, b]) in counts.iter().enumerate() {
        let (stat, df) = chi2(a, b);
        assert!(
            stat < critical(df),
            "token {i}: chi2 {stat:.1} over {df} degrees of freedom (0.1% point {:.1})",
            critical(df)
        );
    }
}

#[test]
fn forced_acceptance_keeps_that_share_of_drafts() {
    let name = FIXTURES[0];
    let greedy = SamplingParams::default();
    let plain = run(&mut engine(name, 0), &PROMPT, 20, &greedy);
    // Keeping no draft is plain decoding; keeping every draft gives N + 1 tokens a step.
    for (p, per_step) in [(0.0, 1.0), (1.0, 3.0)] {
        let mut e = engine(name, 2);
        e.force_acceptance(p).unwrap();
        let (out, stats) = run_stats(&mut e, &PROMPT, 21, &greedy);
        assert_eq!(stats.tokens_per_step(), per_step, "p = {p}");
        if p == 0.0 {
            assert_eq!(out[..20], plain[..], "p = 0");
        }
    }
    assert!(engine(name, 2).force_acceptance(1.5).is_err());
}

#[test]
fn offloaded_experts_decode_speculatively_as_resident_ones() {
    let greedy = SamplingParams::default();
    for name in FIXTURES {
        let want = run(&mut engine(name, 0), &PROMPT, 24, &greedy);
        let dir = fixture(name);
        let mut model = Qwen3Hybrid::load(&dir).unwrap();
        model.offload_experts(&dir, 1).unwrap();
        let mut e = Engine::new(model);
        e.set_speculative(3).unwrap();
        assert_eq!(run(&mut e, &PROMPT, 24, &greedy), want, "{name}");
        assert!(e.expert_stats().is_some_and(|s| s.misses > 0), "{name}");
    }
}
