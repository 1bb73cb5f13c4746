//! `bench --speculative-tokens N [--acceptance P]`: speculative decoding timed after the plain
//! decode measurements, on the CPU (`bench_cpu`) or on the GPU model the CUDA bench measured,
//! where the verify pass and the drafts are also timed alone.

use std::time::Instant;

use anyhow::{bail, Result};
use deltamoe_engine::Engine;
use deltamoe_model::gpu::{DevFormat, GpuModel};
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid};
use serde_json::{json, Value};

use crate::bench::BenchArgs;

/// Where the CUDA bench measures speculative decoding: the context, a plain batch-1 decode
/// step's seconds there, and the weight format of a synthetic model's random MTP layer.
pub(crate) struct SpecRun {
    pub ctx: usize,
    pub step_s: f64,
    pub format: DevFormat,
}

/// Speculative decoding on the GPU model the CUDA bench measured (its MTP layer from the host
/// model of --model, else random), after a prompt of `run.ctx` tokens.
pub(crate) fn speculative_cuda(
    a: &BenchArgs,
    mut model: GpuModel,
    (cfg, host): (ModelConfig, Option<&Qwen3Hybrid>),
    run: SpecRun,
) -> Result<Value> {
    match host {
        Some(m) => {
            if !model.upload_mtp(m.checkpoint())? {
                bail!("--speculative-tokens: the model has no MTP layer (no mtp.* tensors)");
            }
        }
        None => model.random_mtp(crate::synthetic::SEED + 1, run.format)?,
    }
    let max_ctx = run.ctx + a.gen_len + 16;
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..run.ctx as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let [verify_s, draft_s] = pass_costs(&mut model, a.speculative_tokens, &prompt, max_ctx)?;
    println!(
        "speculative passes at context {}: verify of {} tokens {:.3} ms ({:.2} plain decode steps), {} drafts (MTP passes) {:.3} ms",
        run.ctx,
        a.speculative_tokens + 1,
        verify_s * 1e3,
        verify_s / run.step_s,
        a.speculative_tokens,
        draft_s * 1e3
    );
    let mut engine = Engine::new_cuda_model(cfg, model, max_ctx, 1)?;
    let mut out = speculative(a, &mut engine, &prompt, run.step_s)?;
    out["verify_ms"] = json!(verify_s * 1e3);
    out["verify_cost_in_decode_steps"] = json!(verify_s / run.step_s);
    out["drafts_ms"] = json!(draft_s * 1e3);
    Ok(out)
}

/// Seconds of one verify pass of `n + 1` tokens and of drafting `n` tokens after one pair, after
/// `prompt` (each the mean of 20 after 3 unmeasured; the state advances through them).
fn pass_costs(model: &mut GpuModel, n: usize, prompt: &[u32], ctx: usize) -> Result<[f64; 2]> {
    model.reserve(1, ctx)?;
    model.set_speculative(n)?;
    let mut seq = model.new_seq()?;
    model.prefill(&mut seq, prompt, Logits::Last, prompt.len())?;
    let fed: Vec<u32> = (0..=n as u32).map(|i| i + 1).collect();
    let mean = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        let t = Instant::now();
        for _ in 0..20 {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() / 20.0)
    };
    let verify = mean(&mut || Ok(model.verify(&mut seq, &fed).map(|_| ())?))?;
    let draft = mean(&mut || Ok(model.draft(&mut seq, &fed[..1], n).map(|_| ())?))?;
    model.release(seq);
    Ok([verify, draft])
}

/// Decodes `--gen-len` tokens or more speculatively after the same prompt: tokens a step, tok/s,
/// and a step's cost in plain decode steps (`step_s`, the plain decode's seconds a token).
pub(crate) fn speculative(
    a: &BenchArgs,
    engine: &mut Engine,
    prompt: &[u32],
    step_s: f64,
) -> Result<Value> {
    let n = a.speculative_tokens;
    engine.set_speculative(n)?;
    if let Some(p) = a.acceptance {
        engine.force_acceptance(p)?;
    }
    let id = engine.add_sequence()?;
    engine.prefill(id, prompt, None, Logits::Last)?;
    let (mut tok, mut made, mut steps) = (1u32, 0usize, 0usize);
    let t0 = Instant::now();
    while made < a.gen_len {
        let got = engine.speculate(&[(id, tok)])?.swap_remove(0);
        made += got.len();
        steps += 1;
        tok = got.last().copied().unwrap_or(1);
    }
    let secs = t0.elapsed().as_secs_f64();
    engine.remove_sequence(id);
    let (per_step, tps) = (made as f64 / steps as f64, made as f64 / secs);
    let cost = secs / steps as f64 / step_s;
    let accept = a
        .acceptance
        .map_or("the model's".to_string(), |p| format!("forced {p}"));
    println!(
        "speculative N = {n}, acceptance {accept}: {made} tokens in {steps} steps ({per_step:.2} a step), {secs:.3} s: {tps:.2} tok/s; a step costs {cost:.2} plain decode steps"
    );
    Ok(json!({
        "tokens": n, "acceptance": a.acceptance, "generated": made, "steps": steps,
        "tokens_per_step": per_step, "decode_s": secs, "decode_tok_s": tps,
        "step_cost_in_decode_steps": cost,
    }))
}
