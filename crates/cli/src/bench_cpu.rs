//! `bench` on the CPU: one prefill of the first `--prompt-len` tokens and `--gen-len` decode
//! steps of a model directory, a config.json or a named shape with random bf16 weights; with
//! `--speculative-tokens N` also the same decode with the MTP layer drafting (`--acceptance P`
//! forcing how often a draft is kept).

use std::time::Instant;

use anyhow::{bail, Result};
use deltamoe_compute::DType;
use deltamoe_engine::Engine;
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid, WeightStore};
use serde_json::{json, Value};

use crate::bench::{synthetic_config, BenchArgs};

pub fn run(a: &BenchArgs) -> Result<Value> {
    if a.zipf.is_some()
        || a.gpu_memory.is_some()
        || a.host_memory.is_some()
        || !a.expert_cache_fraction.is_empty()
    {
        bail!("--zipf, --gpu-memory, --host-memory and --expert-cache-fraction measure expert offload on the GPU; use --device cuda");
    }
    if a.bits.is_some() || a.fp8 || a.gptq {
        bail!("--bits, --fp8, --gptq: synthetic quantized weights are made on the GPU only; use --device cuda, or --model with a quantized checkpoint");
    }
    let (model, name) = match synthetic_config(a)? {
        Some((cfg, name)) => {
            check_host_memory(&cfg, &name)?;
            let t0 = Instant::now();
            let m = Qwen3Hybrid::from_store(cfg, &WeightStore::synthetic(DType::BF16, 1))?;
            eprintln!(
                "synthetic bf16 weights made in {:.1} s",
                t0.elapsed().as_secs_f64()
            );
            (m, name)
        }
        None => {
            let dir = a.model.clone().unwrap_or_default();
            let m = crate::commands::load_dir(&dir)?;
            (m, dir.display().to_string())
        }
    };
    let vocab = model.config().vocab_size as u32;
    let prompt_len = a.prompt_len[0];
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut engine = Engine::new(model);
    let threads = rayon::current_num_threads();
    let id = engine.add_sequence()?;
    let t0 = Instant::now();
    engine.prefill(id, &prompt, None, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tok = 1u32;
    for _ in 0..a.gen_len {
        tok = engine.step(&[(id, tok)])?[0];
    }
    let decode_s = t1.elapsed().as_secs_f64();
    engine.remove_sequence(id);
    let (prefill_tps, decode_tps) = (prompt_len as f64 / prefill_s, a.gen_len as f64 / decode_s);
    println!("model    {name}");
    println!("backend  cpu, {threads} threads");
    println!(
        "prefill  {} tokens in {:.3} s: {:.1} tok/s",
        prompt_len, prefill_s, prefill_tps
    );
    println!(
        "decode   {} tokens at context {}: {:.3} s: {:.2} tok/s",
        a.gen_len, prompt_len, decode_s, decode_tps
    );
    let mut result = json!({
        "model": name, "backend": "cpu", "threads": threads,
        "prompt_len": prompt_len, "prefill_s": prefill_s, "prefill_tok_s": prefill_tps,
        "gen_len": a.gen_len, "decode_s": decode_s, "decode_tok_s": decode_tps,
    });
    if a.speculative_tokens > 0 {
        let step_s = decode_s / a.gen_len as f64;
        result["speculative"] = crate::bench_spec::speculative(a, &mut engine, &prompt, step_s)?;
    }
    Ok(result)
}

/// Refuses, before anything is allocated, a synthetic CPU model whose random bf16 weights (plus
/// the f32 scratch of the largest tensor while it is made) exceed the host's available memory:
/// the kernel would otherwise kill the process mid-way with no message.
fn check_host_memory(cfg: &ModelConfig, name: &str) -> Result<()> {
    let Some(available) = deltamoe_model::host_memory::available() else {
        return Ok(());
    };
    let needed = cfg
        .weight_params()
        .saturating_mul(2)
        .saturating_add(cfg.largest_tensor_params().saturating_mul(4));
    if needed > available as u64 {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!(
            "{name}: needs {:.1} GiB of memory for its weights but {:.1} GiB is available; \
             use a smaller shape (--config FILE), --device cuda, or a machine with more memory",
            gib(needed),
            gib(available as u64)
        );
    }
    Ok(())
}
