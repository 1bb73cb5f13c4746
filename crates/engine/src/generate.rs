//! Generation loop: prefill the prompt, then sample and decode one token at a time until
//! `max_tokens` or an end-of-sequence id. Times prefill and decode separately.

use std::time::Instant;

use deltamoe_model::Logits;

use crate::engine::Engine;
use crate::error::Result;
use crate::sampler::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateRequest<'a> {
    pub prompt: &'a [u32],
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Ids that end generation (not emitted).
    pub eos: &'a [u32],
    /// Prefill in passes of at most this many tokens.
    pub prefill_chunk: Option<usize>,
}

#[derive(Clone, Debug, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    /// Seconds for the prompt's forward pass (ending with the first token's logits).
    pub prefill_secs: f64,
    /// Seconds for the decode steps after the first token.
    pub decode_secs: f64,
    pub hit_eos: bool,
}

impl GenerateStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode rate over the steps after the first token (each step is one forward pass).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Run a request on a fresh sequence. `on_token` sees each generated id as it is sampled and
/// may stop generation by returning `false`. Returns the generated ids.
pub fn generate(
    engine: &mut Engine,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    let id = engine.add_sequence()?;
    let result = run(engine, id, req, &mut on_token);
    engine.remove_sequence(id);
    result
}

fn run(
    engine: &mut Engine,
    id: crate::SeqId,
    req: &GenerateRequest,
    on_token: &mut impl FnMut(u32) -> Result<bool>,
) -> Result<(Vec<u32>, GenerateStats)> {
    let mut stats = GenerateStats {
        prompt_tokens: req.prompt.len(),
        ..Default::default()
    };
    let mut sampler = Sampler::new(req.sampling.clone());
    let mut history = req.prompt.to_vec();
    let mut out = Vec::new();
    // Where the backend can choose tokens itself (CUDA: greedy or sampled on the GPU; the CPU:
    // greedy), only token ids cross; a repetition penalty needs the history, so the host samples.
    let no_penalty = req.sampling.repetition_penalty == 1.0;
    let on_device = no_penalty && engine.set_device_sampling(id, &req.sampling)?;
    let backend_picks = on_device || (no_penalty && req.sampling.is_greedy());
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let mut next: Option<u32> = None;
    match req.prompt.split_last() {
        Some((&last, head)) if on_device => {
            if !head.is_empty() {
                engine.prefill(id, head, req.prefill_chunk, Logits::Last)?;
            }
            next = Some(engine.decode_next(id, last)?);
        }
        _ => logits = engine.prefill(id, req.prompt, req.prefill_chunk, Logits::Last)?,
    }
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    while out.len() < req.max_tokens {
        let tok = match next.take() {
            Some(t) => t,
            None => sampler.sample(&logits, &history),
        };
        if req.eos.contains(&tok) {
            stats.hit_eos = true;
            break;
        }
        out.push(tok);
        history.push(tok);
        if !on_token(tok)? || out.len() == req.max_tokens {
            break;
        }
        if backend_picks {
            next = Some(engine.decode_next(id, tok)?);
        } else {
            logits = engine.decode(&[(id, tok)])?.pop().unwrap_or_default();
        }
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.generated = out.len();
    Ok((out, stats))
}
