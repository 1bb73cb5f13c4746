//! Generation loop: prefill the prompt, then sample and decode one token at a time until
//! `max_tokens`, an end-of-sequence id, or the sequence's context is full (as llama.cpp stops
//! there, rather than failing after text was already streamed). Times prefill and decode
//! separately.

use std::time::Instant;

use deltamoe_model::Logits;

use crate::engine::Engine;
use crate::error::Result;
use crate::sampler::SamplingParams;

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
    /// Decode steps after the first token (each one forward pass; with speculative decoding
    /// one draft and verify pass, giving one token or more).
    pub decode_steps: usize,
    pub hit_eos: bool,
    /// Generation stopped because the context was full (prompt plus tokens fed).
    pub hit_context: bool,
}

impl GenerateStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode rate over the steps after the first token (each step is one forward pass).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }

    /// Tokens a step gave on average, the prompt's last one included (1 without speculative
    /// decoding).
    pub fn tokens_per_step(&self) -> f64 {
        self.generated as f64 / (self.decode_steps + 1) as f64
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
    engine.set_sampling(id, &req.sampling)?;
    let Some((&last, head)) = req.prompt.split_last() else {
        return Err(crate::EngineError::Input(
            "the prompt is empty: give at least one token".into(),
        ));
    };
    let t0 = Instant::now();
    if !head.is_empty() {
        engine.prefill(id, head, req.prefill_chunk, Logits::Last)?;
    }
    // Each step returns the drafts it kept (speculative decoding) and the next token.
    let mut got = first_row(engine.speculate(&[(id, last)])?);
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::new();
    'steps: while out.len() < req.max_tokens {
        for &tok in &got {
            if req.eos.contains(&tok) {
                stats.hit_eos = true;
                break 'steps;
            }
            out.push(tok);
            if !on_token(tok)? || out.len() == req.max_tokens {
                break 'steps;
            }
        }
        // The last token must be fed to sample another; with the context full, stop.
        let fed = engine.sequence(id).map_or(0, |s| s.tokens.len());
        if fed >= engine.max_context() {
            stats.hit_context = true;
            break;
        }
        let next = got.last().copied().unwrap_or_default();
        got = first_row(engine.speculate(&[(id, next)])?);
        stats.decode_steps += 1;
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    stats.generated = out.len();
    Ok((out, stats))
}

/// The tokens a one-row step returned.
fn first_row(mut rows: Vec<Vec<u32>>) -> Vec<u32> {
    rows.swap_remove(0)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use deltamoe_compute::DType;
    use deltamoe_model::{ModelConfig, Qwen3Hybrid, WeightStore};

    use super::*;

    #[test]
    fn generation_stops_at_a_full_context() {
        // The built-in model's shape with random weights and an 8-token context.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
        let mut cfg = ModelConfig::from_dir(&dir).unwrap();
        cfg.max_position_embeddings = 8;
        let model = Qwen3Hybrid::from_store(cfg, &WeightStore::synthetic(DType::F32, 1)).unwrap();
        let mut engine = Engine::new(model);
        let req = GenerateRequest {
            prompt: &[1, 2, 3],
            max_tokens: 100,
            sampling: SamplingParams::default(),
            eos: &[],
            prefill_chunk: None,
        };
        let (out, stats) = generate(&mut engine, &req, |_| Ok(true)).unwrap();
        // 3 prompt tokens and 5 generated ones fill the 8 positions; the 6th generated token is
        // sampled from the last position and never fed.
        assert_eq!(out.len(), 6);
        assert!(stats.hit_context && !stats.hit_eos);
    }
}
