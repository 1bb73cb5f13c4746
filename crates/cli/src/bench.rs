//! `bench`: prefill and decode throughput for a model directory, a config.json or a named real
//! shape with synthetic random weights (no files needed), optionally written as JSON.
//!
//! On the CPU it times one prefill of `--prompt-len` tokens and `--gen-len` decode steps. On
//! CUDA it measures the device's copy bandwidth, then decode tok/s at each `--contexts` length
//! (graph replays after moving the sequence to that position), the bytes one step reads and
//! the achieved fraction of the measured bandwidth.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_compute::cuda::{self, Gpu};
use deltamoe_compute::DType;
use deltamoe_model::gpu::GpuModel;
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid, WeightStore};
use serde_json::{json, Value};

use crate::{Device, ModelArgs};

/// Real shapes built into the binary (text model only).
const SHAPES: &[(&str, &str)] = &[
    (
        "qwen3.6-35b-a3b",
        include_str!("../../../configs/qwen3.6-35b-a3b.json"),
    ),
    (
        "qwen3-next-80b-a3b",
        include_str!("../../../configs/qwen3-next-80b-a3b.json"),
    ),
    (
        "qwen3.5-397b-a17b",
        include_str!("../../../configs/qwen3.5-397b-a17b.json"),
    ),
];

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory (real weights).
    #[arg(long, conflicts_with_all = ["config", "synthetic"])]
    model: Option<PathBuf>,
    /// A config.json to instantiate with random bf16 weights.
    #[arg(long, conflicts_with = "synthetic")]
    config: Option<PathBuf>,
    /// A named real shape with random bf16 weights: qwen3.6-35b-a3b, qwen3-next-80b-a3b, qwen3.5-397b-a17b.
    #[arg(long)]
    synthetic: Option<String>,
    /// Prompt length for the CPU prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps timed per measurement.
    #[arg(long, default_value_t = 32)]
    gen_len: usize,
    /// Context lengths for the CUDA decode measurements.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 4096, 32768])]
    contexts: Vec<usize>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The config of a synthetic source and its display name.
fn synthetic_config(a: &BenchArgs) -> Result<Option<(ModelConfig, String)>> {
    if let Some(name) = &a.synthetic {
        let Some((_, text)) = SHAPES.iter().find(|(n, _)| n == name) else {
            let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
            bail!(
                "--synthetic {name}: unknown shape; known: {}",
                names.join(", ")
            );
        };
        let cfg = ModelConfig::from_json_str(text, std::path::Path::new(name))?;
        return Ok(Some((cfg, format!("{name} (synthetic bf16)"))));
    }
    if let Some(path) = &a.config {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config {}", path.display()))?;
        let cfg = ModelConfig::from_json_str(&text, path)?;
        return Ok(Some((cfg, format!("{} (synthetic bf16)", path.display()))));
    }
    Ok(None)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_len == 0 || a.gen_len == 0 {
        bail!("--prompt-len and --gen-len must be at least 1");
    }
    if a.model.is_none() && a.config.is_none() && a.synthetic.is_none() {
        bail!("bench needs one of --model DIR, --config FILE or --synthetic NAME");
    }
    let cuda_ok = cuda::unavailable_reason();
    let on_cuda = match (a.device, &cuda_ok) {
        (Device::Cpu, _) => false,
        (Device::Cuda, Some(why)) => bail!("--device cuda: {why}; use --device cpu"),
        (_, None) => true,
        (Device::Auto, Some(_)) => false,
    };
    let result = if on_cuda { run_cuda(&a)? } else { run_cpu(&a)? };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}

fn run_cpu(a: &BenchArgs) -> Result<Value> {
    let (model, name) = match synthetic_config(a)? {
        Some((cfg, name)) => {
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
            let m = crate::commands::load_model(&ModelArgs {
                model: dir.clone(),
                device: Device::Cpu,
            })?;
            (m, dir.display().to_string())
        }
    };
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt_len as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut engine = crate::commands::engine_for(model, Device::Cpu)?;
    let threads = rayon::current_num_threads();
    let id = engine.add_sequence()?;
    let t0 = Instant::now();
    engine.prefill(id, &prompt, None, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tok = 1u32;
    for _ in 0..a.gen_len {
        tok = engine.decode_greedy(id, tok)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let (prefill_tps, decode_tps) = (a.prompt_len as f64 / prefill_s, a.gen_len as f64 / decode_s);
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
    Ok(json!({
        "model": name, "backend": "cpu", "threads": threads,
        "prompt_len": a.prompt_len, "prefill_s": prefill_s, "prefill_tok_s": prefill_tps,
        "gen_len": a.gen_len, "decode_s": decode_s, "decode_tok_s": decode_tps,
    }))
}

fn run_cuda(a: &BenchArgs) -> Result<Value> {
    let gpu = Arc::new(Gpu::new(0).context("--device cuda")?);
    let bw = gpu.copy_bandwidth(1 << 31, 20)?;
    let t0 = Instant::now();
    let (mut model, name, max_pos) = match synthetic_config(a)? {
        Some((cfg, name)) => (
            GpuModel::synthetic(&cfg, gpu.clone(), 1)?,
            name,
            cfg.max_position_embeddings,
        ),
        None => {
            let dir = a.model.clone().unwrap_or_default();
            let m = crate::commands::load_model(&ModelArgs {
                model: dir.clone(),
                device: Device::Cuda,
            })?;
            let max = m.config().max_position_embeddings;
            (
                GpuModel::upload(&m, gpu.clone())?,
                dir.display().to_string(),
                max,
            )
        }
    };
    let (free, total) = gpu.mem_info()?;
    println!("model    {name}");
    println!(
        "device   {} ({:.1} of {:.1} GiB in use after load, {:.1} s)",
        gpu.name(),
        (total - free) as f64 / 1073741824.0,
        total as f64 / 1073741824.0,
        t0.elapsed().as_secs_f64()
    );
    println!("hbm      device copy {:.0} GB/s (read + write)", bw / 1e9);
    let contexts: Vec<usize> = a
        .contexts
        .iter()
        .copied()
        .filter(|&c| c + a.gen_len + 4 <= max_pos)
        .collect();
    let max_ctx = contexts.iter().max().copied().unwrap_or(0) + a.gen_len + 4;
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut seq = model.new_seq(max_ctx)?;
        model.set_position(&mut seq, ctx.saturating_sub(1))?;
        let mut tok = 1u32;
        for _ in 0..3 {
            tok = model.step(&mut seq, tok)?;
        }
        let t = Instant::now();
        for _ in 0..a.gen_len {
            tok = model.step(&mut seq, tok)?;
        }
        let secs = t.elapsed().as_secs_f64() / a.gen_len as f64;
        let bytes = model.bytes_per_token(ctx);
        let frac = bytes as f64 / secs / bw;
        println!(
            "decode   context {ctx:>6}: {:8.1} tok/s  {:7.3} ms/token  {:6.2} GB read/token  {:5.1}% of measured bandwidth",
            1.0 / secs,
            secs * 1e3,
            bytes as f64 / 1e9,
            frac * 100.0
        );
        rows.push(json!({"context": ctx, "tok_s": 1.0 / secs, "ms_per_token": secs * 1e3, "bytes_per_token": bytes, "fraction_of_bandwidth": frac}));
    }
    Ok(
        json!({"model": name, "backend": "cuda", "device": gpu.name(), "copy_bandwidth_bytes_s": bw, "decode": rows}),
    )
}
