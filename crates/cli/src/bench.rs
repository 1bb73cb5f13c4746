//! `bench`: prefill and decode throughput on the CPU for a model directory or for a config.json
//! with synthetic random weights (no files needed), optionally written as JSON.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_compute::DType;
use deltamoe_engine::Engine;
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid, WeightStore};

use crate::{Device, ModelArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory (real weights).
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    model: Option<PathBuf>,
    /// A config.json to instantiate with random bf16 weights in memory.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens decoded for the decode measurement.
    #[arg(long, default_value_t = 32)]
    gen_len: usize,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn load(a: &BenchArgs) -> Result<(Qwen3Hybrid, String)> {
    if let Some(dir) = &a.model {
        let m = crate::commands::load_model(&ModelArgs {
            model: dir.clone(),
            device: a.device,
        })?;
        return Ok((m, dir.display().to_string()));
    }
    if a.device == Device::Cuda {
        bail!("--device cuda: this build has no CUDA backend; use --device cpu (or auto)");
    }
    let path = a.config.clone().unwrap_or_default();
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("--config {}", path.display()))?;
    let cfg = ModelConfig::from_json_str(&text, &path)?;
    let t0 = Instant::now();
    let m = Qwen3Hybrid::from_store(cfg, &WeightStore::synthetic(DType::BF16, 1))?;
    eprintln!(
        "synthetic bf16 weights for {} made in {:.1} s",
        path.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok((m, format!("{} (synthetic bf16)", path.display())))
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_len == 0 || a.gen_len == 0 {
        bail!("--prompt-len and --gen-len must be at least 1");
    }
    let (model, name) = load(&a)?;
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut engine = Engine::new(model);
    let threads = rayon::current_num_threads();

    let id = engine.add_sequence();
    let t0 = Instant::now();
    engine.prefill(id, &prompt, None, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tok = 1u32;
    for _ in 0..a.gen_len {
        let logits = engine.decode(&[(id, tok)])?.pop().unwrap_or_default();
        tok = deltamoe_engine::sampler::argmax(&logits) as u32;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let prefill_tps = a.prompt_len as f64 / prefill_s;
    let decode_tps = a.gen_len as f64 / decode_s;
    println!("model    {name}");
    println!("backend  cpu, {threads} threads");
    println!(
        "prefill  {} tokens in {:.3} s: {:.1} tok/s",
        a.prompt_len, prefill_s, prefill_tps
    );
    println!(
        "decode   {} tokens at context {}: {:.3} s: {:.2} tok/s",
        a.gen_len, a.prompt_len, decode_s, decode_tps
    );
    if let Some(p) = &a.json {
        let j = serde_json::json!({
            "model": name, "backend": "cpu", "threads": threads,
            "prompt_len": a.prompt_len, "prefill_s": prefill_s, "prefill_tok_s": prefill_tps,
            "gen_len": a.gen_len, "decode_s": decode_s, "decode_tok_s": decode_tps,
        });
        std::fs::write(p, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}
