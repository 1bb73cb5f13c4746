//! Shared by the speculative-decoding tests (CPU and CUDA): the MTP fixtures, a generation run,
//! and rounds of requests under the scheduler.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::scheduler::{Event, Request, Scheduler};
use deltamoe_engine::{generate, Engine, GenerateRequest, GenerateStats, SchedulerConfig};

/// The fixtures with an MTP layer.
pub const FIXTURES: [&str; 2] = ["mtp_qwen3_5_moe", "mtp_qwen3_next"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// `max_tokens` tokens after `prompt` (prefilled in parts of 5), and the run's statistics.
pub fn run_stats(
    e: &mut Engine,
    prompt: &[u32],
    max_tokens: usize,
    sampling: &SamplingParams,
) -> (Vec<u32>, GenerateStats) {
    let req = GenerateRequest {
        prompt,
        max_tokens,
        sampling: sampling.clone(),
        eos: &[],
        prefill_chunk: Some(5),
    };
    generate(e, &req, |_| Ok(true)).unwrap()
}

/// A scheduler over `e` of 3 sequences at most, prompts in parts of 4, a prompt cache.
pub fn scheduler(e: Engine) -> Scheduler {
    let cfg = SchedulerConfig {
        max_seqs: 3,
        prefill_chunk: 4,
        checkpoint_every: 4,
        cache_bytes: 1 << 28,
        max_context: e.max_context(),
    };
    Scheduler::new(e, cfg)
}

/// Submits every prompt and steps the scheduler until idle: each request's tokens, in order.
pub fn round(
    s: &mut Scheduler,
    prompts: &[Vec<u32>],
    sampling: &SamplingParams,
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    for p in prompts {
        s.submit(Request {
            prompt: p.clone(),
            sampling: sampling.clone(),
            max_tokens,
            stop_ids: Vec::new(),
        });
    }
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    while !s.is_idle() {
        for (id, ev) in s.step() {
            if let Event::Token(t) = ev {
                out.entry(id.0).or_default().push(t);
            }
            assert!(!matches!(ev, Event::Failed(_)), "{ev:?}");
        }
    }
    out.into_values().collect()
}
