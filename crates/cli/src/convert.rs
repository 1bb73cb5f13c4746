//! `convert`: quantize an HF checkpoint into an MLX affine-quantized one (mlx-lm layout), or a
//! fine-grained FP8 or GPTQ int4 one, tensor by tensor with bounded memory; or write a GGUF
//! model as an mlx-lm checkpoint with the same values. Policy and output format:
//! `deltamoe_model::convert`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_model::convert::{
    convert, convert_gguf, BitsRule, ConvertOptions, ConvertReport, GgufOutput, Progress,
    DEFAULT_SHARD_BYTES,
};
use deltamoe_model::source::ModelSource;
use deltamoe_model::Qwen3Hybrid;

use crate::commands::{bytes_bar, show_progress};

#[derive(Args)]
pub struct ConvertArgs {
    /// Source model: an HF model directory (bf16/f16/f32, fine-grained FP8, GPTQ or AWQ), or a
    /// GGUF file (the first part of a split one), written as an mlx-lm checkpoint with its
    /// quantized matrices in the affine form of the same values.
    #[arg(long)]
    model: PathBuf,
    /// Output directory (created; must not exist or be empty).
    #[arg(long)]
    out: PathBuf,
    /// Default bits per weight: 2, 3, 4, 5, 6 or 8 (default 4).
    #[arg(long)]
    bits: Option<u32>,
    /// Weights per scale/bias group: 32, 64 or 128 (default 64; 128 with --gptq).
    #[arg(long)]
    group_size: Option<usize>,
    /// Per-module override PATTERN=BITS[:GROUP] or PATTERN=none (keep the model dtype);
    /// repeatable, the last match wins. PATTERN is a glob over module paths such as
    /// model.layers.3.mlp.switch_mlp.down_proj, matching whole dot-separated suffixes:
    /// e.g. `lm_head=8`, `switch_mlp.*=2`, `mlp.gate=none`.
    #[arg(long = "bits-for", value_name = "PATTERN=N")]
    bits_for: Vec<String>,
    /// Write fine-grained FP8 (e4m3, a scale per 128x128 block) in the layout of Qwen's
    /// `*-FP8` checkpoints instead of MLX affine (--bits, --group-size, --bits-for unused).
    #[arg(long, conflicts_with_all = ["bits", "group_size", "bits_for", "gptq"])]
    fp8: bool,
    /// Write GPTQ int4 (v1 layout, symmetric, round to nearest, groups of --group-size) instead
    /// of MLX affine: the router, gates, embeddings and lm_head stay as stored (--bits and
    /// --bits-for unused).
    #[arg(long, conflicts_with_all = ["bits", "bits_for"])]
    gptq: bool,
    /// With a GGUF source: write its quantized matrices dequantized to bf16 instead of in the
    /// affine form.
    #[arg(long, conflicts_with_all = ["bits", "group_size", "bits_for", "fp8", "gptq"])]
    dequantize: bool,
    /// Largest output shard in MiB.
    #[arg(long, default_value_t = DEFAULT_SHARD_BYTES >> 20)]
    shard_mib: u64,
}

pub fn run(a: ConvertArgs) -> Result<()> {
    if a.shard_mib == 0 {
        bail!("--shard-mib must be at least 1");
    }
    let gguf = match ModelSource::resolve(&a.model)? {
        ModelSource::Gguf(f) => Some(f),
        ModelSource::Dir(_) => None,
    };
    if gguf.is_none() && a.dequantize {
        bail!("--dequantize: only for a GGUF source; an HF checkpoint is written quantized");
    }
    let gguf_flag = [
        (a.bits.is_some(), "--bits"),
        (a.group_size.is_some(), "--group-size"),
        (!a.bits_for.is_empty(), "--bits-for"),
        (a.fp8, "--fp8"),
        (a.gptq, "--gptq"),
    ];
    if let (Some(f), Some((_, flag))) = (&gguf, gguf_flag.iter().find(|(on, _)| *on)) {
        bail!(
            "{flag}: a GGUF source is written with its own quantization, not re-quantized; drop {flag} (or add --dequantize for bf16) to convert {}",
            f.display()
        );
    }
    let max_shard = a.shard_mib << 20;
    let t0 = Instant::now();
    let bar = bytes_bar("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {wide_msg}");
    let mut show = |p: Progress| show_progress(&bar, p);
    let report = match &gguf {
        Some(f) => {
            let output = match a.dequantize {
                true => GgufOutput::Bf16,
                false => GgufOutput::Affine,
            };
            Ok(convert_gguf(f, &a.out, output, max_shard, &mut show)?)
        }
        None => hf_options(&a).and_then(|mut opts| {
            opts.max_shard_bytes = max_shard;
            Ok(convert(&a.model, &a.out, &opts, &mut show)?)
        }),
    };
    bar.finish_and_clear();
    let report: ConvertReport = report?;
    // The output must load: every shape against the config, every quantized tensor against the
    // quantization block.
    Qwen3Hybrid::load(&a.out).with_context(|| {
        format!(
            "--out {}: the converted checkpoint does not load",
            a.out.display()
        )
    })?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    eprintln!(
        "converted {} -> {} in {:.1} s: {} tensors -> {} ({} linears quantized, {} kept dense), {:.1} MiB -> {:.1} MiB in {} shard(s); copied {}",
        a.model.display(),
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        report.tensors_in,
        report.tensors_out,
        report.quantized_modules,
        report.dense_modules,
        mib(report.bytes_in),
        mib(report.bytes_out),
        report.shards,
        if report.copied.is_empty() { "nothing".to_string() } else { report.copied.join(", ") },
    );
    Ok(())
}

/// The conversion an HF source's flags ask for.
fn hf_options(a: &ConvertArgs) -> Result<ConvertOptions> {
    let bits = a.bits.unwrap_or(4);
    let mut opts = match (a.fp8, a.gptq) {
        (true, _) => ConvertOptions::fp8(),
        (_, true) => ConvertOptions::gptq(a.group_size.unwrap_or(128)),
        _ => ConvertOptions::new(bits, a.group_size.unwrap_or(64)),
    };
    for r in &a.bits_for {
        opts.rules
            .push(BitsRule::parse(r, opts.group_size).map_err(anyhow::Error::msg)?);
    }
    Ok(opts)
}
