//! `bench`: prefill and decode throughput for a model directory, a config.json or a named real
//! shape with synthetic random weights (no files needed), optionally written as JSON.
//!
//! On the CPU it times one prefill of the first `--prompt-len` tokens and `--gen-len` decode
//! steps. On CUDA it measures the device's copy bandwidth, then prefill tok/s at each
//! `--prompt-len` (GPU prefill, passes of up to 4096 tokens) with a model-FLOPs utilisation
//! estimate, then decode tok/s at each `--contexts` length (graph replays after moving the
//! sequence to that position), the bytes one step reads and the achieved fraction of the
//! measured bandwidth.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_compute::cuda::{self, Gpu};
use deltamoe_model::gpu::{ExpertCache, GpuModel, OffloadStats};
use deltamoe_model::{Logits, ModelConfig};
use serde_json::{json, Value};

use crate::{synthetic, Device};

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory or GGUF file (real weights).
    #[arg(long, conflicts_with_all = ["config", "synthetic"])]
    pub(crate) model: Option<PathBuf>,
    /// A config.json to instantiate with random bf16 weights.
    #[arg(long, conflicts_with = "synthetic")]
    pub(crate) config: Option<PathBuf>,
    /// A named real shape with random bf16 weights: qwen3.6-35b-a3b, qwen3-next-80b-a3b, qwen3.5-397b-a17b.
    #[arg(long)]
    pub(crate) synthetic: Option<String>,
    /// Synthetic matrices MLX-affine quantized to this many bits (2, 4 or 8; CUDA only).
    #[arg(long)]
    pub(crate) bits: Option<u32>,
    /// Group size for --bits (default 64) or --gptq (default 128).
    #[arg(long)]
    pub(crate) group_size: Option<usize>,
    /// Synthetic matrices in fine-grained FP8 (e4m3, a scale per 128x128 block; routers and
    /// lm_head bf16, as Qwen's FP8 checkpoints; CUDA only).
    #[arg(long, conflicts_with = "bits")]
    pub(crate) fp8: bool,
    /// Synthetic routed experts in GPTQ int4 (f16 scales and zero points), everything else bf16,
    /// as Qwen's GPTQ-Int4 checkpoints (CUDA only).
    #[arg(long, conflicts_with_all = ["bits", "fp8"])]
    pub(crate) gptq: bool,
    /// With --bits: f32 scales and biases instead of bf16, as the CUDA backend holds GGUF's
    /// K-quants (group 32 by default).
    #[arg(long, requires = "bits")]
    pub(crate) f32_params: bool,
    /// Prompt lengths for the prefill measurements (the CPU measures the first).
    #[arg(long, value_delimiter = ',', default_values_t = [512usize])]
    pub(crate) prompt_len: Vec<usize>,
    /// Decode steps timed per measurement.
    #[arg(long, default_value_t = 32)]
    pub(crate) gen_len: usize,
    /// Decode steps run before each timed measurement (with offload: lets the expert cache
    /// settle on the routing before it is timed).
    #[arg(long, default_value_t = 3)]
    pub(crate) warmup: usize,
    /// Context lengths for the CUDA decode measurements.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 4096, 32768])]
    pub(crate) contexts: Vec<usize>,
    /// Sequences decoded together per step on CUDA (batched decode; tok/s counts all of them).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize])]
    pub(crate) batch: Vec<usize>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub(crate) device: Device,
    /// Instead of a model, time single matrix-vector products at real shapes on CUDA (bf16 and
    /// 2/4/8-bit affine) against the measured copy bandwidth.
    #[arg(long, conflicts_with_all = ["model", "config", "synthetic"])]
    pub(crate) matvec: bool,
    /// CUDA: offload the routed experts to pinned host memory and cache this fraction of each
    /// layer's experts on the GPU; several values are measured one after another.
    #[arg(long, value_delimiter = ',', conflicts_with = "gpu_memory")]
    pub(crate) expert_cache_fraction: Vec<f64>,
    /// CUDA: offload the routed experts and give the whole model this many GB of GPU memory
    /// (the expert cache gets what the other weights leave, less 8 GiB for sequences).
    #[arg(long, value_name = "GB")]
    pub(crate) gpu_memory: Option<f64>,
    /// With offloaded experts: pin at most this many GB of host memory for them. The experts
    /// outside the GPU's cache always take theirs; the rest holds clean copies of cached
    /// experts, which an eviction then need not write back (default: what the host has
    /// available, less 16 GiB).
    #[arg(long, value_name = "GB")]
    pub(crate) host_memory: Option<f64>,
    /// Synthetic models: skew routing towards a Zipf(ALPHA) popularity of the experts (a
    /// router bias of −ALPHA·ln(rank + 1), ranks shuffled per layer) instead of the uniform-like
    /// routing of random weights.
    #[arg(long, value_name = "ALPHA")]
    pub(crate) zipf: Option<f64>,
    /// With offloaded experts: let the CPU compute some of the experts outside the GPU's cache
    /// (on) or read them all over PCIe (off); several values are measured one after another.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [OnOff::Off])]
    pub(crate) cpu_experts: Vec<OnOff>,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// CUDA: measure the model on these GPUs (e.g. 0,1: the routed experts divided among them,
    /// expert parallel over NCCL) through the engine, each GPU's memory and the time a decode
    /// step spends in all-reduces reported; one number measures that GPU the same way. With one
    /// --expert-cache-fraction or --gpu-memory (per GPU), each GPU offloads its share.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub(crate) gpus: Vec<usize>,
    /// With several --gpus: divide the attention and GDN heads and dense MLP rows among them
    /// too (tensor parallel), one all-reduce after each mixer and dense MLP.
    #[arg(long, requires = "gpus")]
    pub(crate) tensor_parallel: bool,
    /// Also measure speculative decoding with the model's MTP layer drafting N tokens a step
    /// (a --config or --synthetic shape gets a random MTP layer: on the CPU when its config
    /// names one, `mtp_num_hidden_layers`; on CUDA always).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) speculative_tokens: usize,
    /// With --speculative-tokens: keep each draft with probability P instead of by the model
    /// (random weights agree with nothing), to time what that acceptance gives.
    #[arg(long, value_name = "P", requires = "speculative_tokens")]
    pub(crate) acceptance: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OnOff {
    On,
    Off,
}

/// The expert caches the flags ask for, in measurement order.
pub(crate) fn cache_specs(a: &BenchArgs) -> Result<Vec<ExpertCache>> {
    if let Some(gb) = a.gpu_memory {
        if !(gb.is_finite() && gb > 0.0) {
            bail!("--gpu-memory {gb}: expected a size in GB above 0");
        }
        return Ok(vec![ExpertCache::GpuMemory(
            (gb * (1u64 << 30) as f64) as usize,
        )]);
    }
    if a.expert_cache_fraction.is_empty() {
        return Ok(vec![ExpertCache::All]);
    }
    a.expert_cache_fraction
        .iter()
        .map(|&f| {
            if (0.0..=1.0).contains(&f) {
                Ok(ExpertCache::Fraction(f))
            } else {
                bail!("--expert-cache-fraction {f}: expected a fraction from 0 to 1")
            }
        })
        .collect()
}

fn precision(a: &BenchArgs) -> String {
    synthetic::quant(a.bits, a.group_size, a.fp8, a.gptq, a.f32_params)
        .map(synthetic::precision)
        .unwrap_or_default()
}

/// The config of a synthetic source and its display name.
pub(crate) fn synthetic_config(a: &BenchArgs) -> Result<Option<(ModelConfig, String)>> {
    if let Some(name) = &a.synthetic {
        let cfg = synthetic::shape(name)?;
        return Ok(Some((cfg, format!("{name} (synthetic {})", precision(a)))));
    }
    if let Some(path) = &a.config {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--config {}", path.display()))?;
        let cfg = ModelConfig::from_json_str(&text, path)?;
        return Ok(Some((
            cfg,
            format!("{} (synthetic {})", path.display(), precision(a)),
        )));
    }
    Ok(None)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_len.contains(&0) || a.prompt_len.is_empty() || a.gen_len == 0 {
        bail!("--prompt-len and --gen-len must be at least 1");
    }
    if a.matvec {
        let result = run_matvec()?;
        if let Some(p) = &a.json {
            std::fs::write(p, serde_json::to_string_pretty(&result)?)
                .with_context(|| format!("--json {}", p.display()))?;
        }
        return Ok(());
    }
    if a.model.is_none() && a.config.is_none() && a.synthetic.is_none() {
        bail!("bench needs one of --model DIR, --config FILE or --synthetic NAME");
    }
    synthetic::quant(a.bits, a.group_size, a.fp8, a.gptq, a.f32_params)?;
    let cuda_ok = cuda::unavailable_reason();
    let on_cuda = match (a.device, &cuda_ok) {
        (Device::Cpu, _) => false,
        (Device::Cuda, Some(why)) => bail!("--device cuda: {why}; use --device cpu"),
        (_, None) => true,
        (Device::Auto, Some(_)) => false,
    };
    if !on_cuda && !a.gpus.is_empty() {
        bail!("--gpus names CUDA devices; drop it to bench on the CPU");
    }
    let result = if on_cuda && !a.gpus.is_empty() {
        crate::bench_gpus::run(&a, &a.gpus)?
    } else if on_cuda {
        run_cuda(&a)?
    } else {
        crate::bench_cpu::run(&a)?
    };
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("--json {}", p.display()))?;
    }
    Ok(())
}

/// Device milliseconds per step by part (summed over layers: "gdn" and "attention" mixers,
/// "ffn" the MoE or MLP blocks, "other" embedding and head), averaged over a few eager steps.
fn layer_times(
    model: &mut GpuModel,
    seqs: &mut [deltamoe_model::gpu::GpuSeq],
    toks: &[u32],
) -> Result<Vec<(String, f32)>> {
    let kinds = model.layer_kinds();
    let mut sums: Vec<(String, f32)> = Vec::new();
    let reps = 5;
    for _ in 0..reps {
        let mut rows: Vec<_> = seqs.iter_mut().zip(toks.iter().copied()).collect();
        let (layers, other) = model.profile_step(&mut rows)?;
        let entries = kinds
            .iter()
            .zip(layers)
            .flat_map(|(k, (mixer, ffn))| [(k.to_string(), mixer), ("ffn".to_string(), ffn)])
            .chain([("other".to_string(), other)]);
        for (k, ms) in entries {
            match sums.iter_mut().find(|(n, _)| *n == k) {
                Some(e) => e.1 += ms / reps as f32,
                None => sums.push((k, ms / reps as f32)),
            }
        }
    }
    Ok(sums)
}

/// The tokens `b` sequences are fed at decode step `step` (within a vocabulary of `vocab`):
/// distinct across the rows and new every step, as the different conversations of a server's
/// batch are (llama.cpp's llama-batched-bench feeds random tokens). Sequences fed the same token
/// from the same state route every row to the same experts, and rows fed their own argmax can
/// converge on one token, as random weights did (docs/benchmarks.md, the same GGUF file in
/// deltamoe and llama.cpp): no server's batch does either.
pub(crate) fn step_tokens(b: usize, step: usize, vocab: usize) -> Vec<u32> {
    (0..b)
        .map(|i| ((1 + (step * b + i) * 7919) % vocab.max(1)) as u32)
        .collect()
}

/// Decode `b` sequences together at context `ctx`: tok/s over all of them, bytes per step
/// and fraction of the copy bandwidth; with one sequence also the eager time per layer kind.
fn decode_at(
    model: &mut GpuModel,
    ctx: usize,
    b: usize,
    (warmup, gen_len): (usize, usize),
    bw: f64,
) -> Result<Value> {
    let mut seqs = (0..b)
        .map(|_| model.new_seq())
        .collect::<Result<Vec<_>, _>>()?;
    for s in &mut seqs {
        model.set_position(s, ctx.saturating_sub(1))?;
    }
    let vocab = model.vocab_size();
    let step = |model: &mut GpuModel, seqs: &mut [deltamoe_model::gpu::GpuSeq], n: usize| {
        let toks = step_tokens(seqs.len(), n, vocab);
        let mut rows: Vec<_> = seqs.iter_mut().zip(toks).collect();
        model.step_batch(&mut rows).map(|_| ())
    };
    for n in 0..warmup {
        step(model, &mut seqs, n)?;
    }
    let t = Instant::now();
    for n in warmup..warmup + gen_len {
        step(model, &mut seqs, n)?;
    }
    let secs = t.elapsed().as_secs_f64() / gen_len as f64;
    let bytes = model.bytes_per_token(ctx);
    let frac = bytes as f64 / secs / bw;
    let tok_s = b as f64 / secs;
    if b == 1 {
        println!(
            "decode   context {ctx:>6}: {tok_s:8.1} tok/s  {:7.3} ms/token  {:6.2} GB read/token  {:5.1}% of measured bandwidth",
            secs * 1e3,
            bytes as f64 / 1e9,
            frac * 100.0
        );
    } else {
        let step = model.bytes_per_step(b, ctx);
        println!(
            "decode   context {ctx:>6}, batch {b:>3}: {tok_s:8.1} tok/s in all  {:7.3} ms/step  {:6.2} GB read/step  {:5.1}% of measured bandwidth",
            secs * 1e3,
            step as f64 / 1e9,
            step as f64 / secs / bw * 100.0
        );
    }
    let step_bytes = model.bytes_per_step(b, ctx);
    let mut row = json!({"context": ctx, "batch": b, "tok_s": tok_s, "ms_per_step": secs * 1e3,
                         "bytes_per_token": bytes, "fraction_of_bandwidth": frac,
                         "bytes_per_step": step_bytes,
                         "step_fraction_of_bandwidth": step_bytes as f64 / secs / bw});
    {
        let toks = step_tokens(b, warmup + gen_len, vocab);
        let per_kind = layer_times(model, &mut seqs, &toks)?;
        let shown: Vec<String> = per_kind
            .iter()
            .map(|(k, ms)| format!("{k} {ms:.3} ms"))
            .collect();
        println!("         per step, eager with timers: {}", shown.join(", "));
        row["eager_ms_by_kind"] = json!(per_kind);
    }
    for s in seqs {
        model.release(s);
    }
    Ok(row)
}

fn run_cuda(a: &BenchArgs) -> Result<Value> {
    let gpu = Arc::new(Gpu::new(0).context("--device cuda")?);
    let bw = gpu.copy_bandwidth(1 << 31, 20)?;
    let caches = cache_specs(a)?;
    let offload = caches[0] != ExpertCache::All;
    match a.host_memory {
        Some(_) if !offload => {
            bail!("--host-memory sizes offloaded experts; add --gpu-memory or --expert-cache-fraction")
        }
        Some(gb) if !(gb.is_finite() && gb >= 0.0) => {
            bail!("--host-memory {gb}: expected a size in GB, 0 or more")
        }
        _ => {}
    }
    let link = if offload {
        let l = gpu.pcie_bandwidth(1 << 30, 10)?;
        println!(
            "pcie     host-to-device copy from pinned memory {:.1} GB/s",
            l / 1e9
        );
        l
    } else {
        0.0
    };
    let t0 = Instant::now();
    let quant = synthetic::quant(a.bits, a.group_size, a.fp8, a.gptq, a.f32_params)?;
    // The host model of --model stays for its MTP layer when speculative decoding is measured.
    let mut host = None;
    let (mut model, name, cfg) = match synthetic_config(a)? {
        Some((cfg, name)) => {
            let mut m = synthetic::gpu_model(&cfg, gpu.clone(), quant, caches[0])?;
            if let Some(alpha) = a.zipf {
                m.skew_routing(alpha, 7)?;
            }
            (m, name, cfg)
        }
        None => {
            if a.zipf.is_some() {
                bail!("--zipf skews the routing of synthetic models only; drop it or use --synthetic/--config");
            }
            let dir = a.model.clone().unwrap_or_default();
            let m = crate::commands::load_dir(&dir)?;
            let cfg = m.config().clone();
            let gm = GpuModel::upload_with(&m, gpu.clone(), caches[0])?;
            if a.speculative_tokens > 0 {
                host = Some(m);
            }
            (gm, dir.display().to_string(), cfg)
        }
    };
    let max_pos = cfg.max_position_embeddings;
    if let Some(gb) = a.host_memory {
        model.set_host_memory(Some((gb * 1e9) as usize));
        model.set_expert_cache(caches[0])?;
    }
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
    let lens: Vec<usize> = a
        .prompt_len
        .iter()
        .map(|&l| l.min(max_pos.saturating_sub(1)).max(1))
        .collect();
    let prompt_max = lens.iter().copied().max().unwrap_or(1);
    let contexts: Vec<usize> = a
        .contexts
        .iter()
        .copied()
        .filter(|&c| c + a.warmup + a.gen_len + 16 <= max_pos)
        .collect();
    let max_ctx = (contexts.iter().max().copied().unwrap_or(0) + a.warmup + a.gen_len + 16)
        .max(prompt_max + 1);
    let max_batch = a.batch.iter().copied().max().unwrap_or(1).max(1);
    model.reserve(max_batch, max_ctx)?;
    let prefill = prefill_at(&mut model, &lens)?;
    let mut rows = Vec::new();
    // ms/token per (context, batch) with every expert cached: what offload stalls are measured
    // against.
    let mut all_cached: Vec<((usize, usize), f64)> = Vec::new();
    let modes: &[OnOff] = if offload {
        &a.cpu_experts
    } else {
        &[OnOff::Off]
    };
    for (ci, &cache) in caches.iter().enumerate() {
        if offload && ci > 0 {
            model.set_expert_cache(cache)?;
        }
        for &mode in modes {
            if offload {
                model.set_host_experts(mode == OnOff::On)?;
            }
            if let Some(slots) = model.expert_cache_slots() {
                let pinned = model.offload_host_bytes().unwrap_or(0) as f64 / 1e9;
                println!(
                    "experts  offloaded; {slots} cached per MoE layer ({cache:?}); {pinned:.1} GB of them in pinned host memory"
                );
                match model.host_expert_costs() {
                Some(c) => println!(
                    "         cpu experts on: a far expert costs the GPU {:.1} µs, the host {:.1} µs + {:.1} µs per expert",
                    c.link * 1e6, c.fixed * 1e6, c.each * 1e6
                ),
                None => println!("         cpu experts off"),
            }
            }
            for &ctx in &contexts {
                for &b in &a.batch {
                    let before = model.offload_stats();
                    let mut row = decode_at(&mut model, ctx, b.max(1), (a.warmup, a.gen_len), bw)?;
                    if let (Some(s0), Some(s1)) = (before, model.offload_stats()) {
                        let ms = row["ms_per_step"].as_f64().unwrap_or(0.0) / b.max(1) as f64;
                        let key = (ctx, b.max(1));
                        let base = all_cached.iter().find(|(k, _)| *k == key).map(|e| e.1);
                        let slots = model.expert_cache_slots();
                        if slots == Some(model.num_experts()) && base.is_none() {
                            all_cached.push((key, ms));
                        }
                        let stall = base.map(|b| ms - b);
                        row["offload"] = offload_report(&s0, &s1, &row, link, slots, stall);
                    }
                    rows.push(row);
                }
            }
        }
    }
    let speculative = match (a.speculative_tokens, contexts.first()) {
        (0, _) | (_, None) => Value::Null,
        (_, Some(&ctx)) => {
            let plain = rows.iter().find(|r| r["batch"] == 1 && r["context"] == ctx);
            let step_s = plain
                .and_then(|r| r["ms_per_step"].as_f64())
                .unwrap_or(f64::NAN)
                / 1e3;
            let spec = crate::bench_spec::SpecRun {
                ctx,
                step_s,
                format: quant,
            };
            crate::bench_spec::speculative_cuda(a, model, (cfg, host.as_ref()), spec)?
        }
    };
    Ok(json!({
        "model": name, "backend": "cuda", "device": gpu.name(), "copy_bandwidth_bytes_s": bw,
        "pcie_bandwidth_bytes_s": link, "prefill": prefill, "decode": rows,
        "speculative": speculative,
    }))
}

/// Offload statistics of one decode measurement (the timed steps and their warm-up): hit rate,
/// bytes over PCIe per token, the link utilisation they imply at the measured speed and, when
/// the run measured the all-cached case first, the stall per token over it.
fn offload_report(
    s0: &OffloadStats,
    s1: &OffloadStats,
    row: &Value,
    link: f64,
    slots: Option<usize>,
    stall_ms: Option<f64>,
) -> Value {
    let d = s1.since(s0);
    let tokens = d.tokens.max(1) as f64;
    let hit_rate = d.hit_rate();
    let far = d.far_bytes as f64 / tokens;
    let admit = d.admit_bytes as f64 / tokens;
    let admitted = d.admitted as f64 / tokens;
    let host = d.host as f64 / tokens;
    let host_ms = d.host_seconds * 1e3 / tokens;
    let back = d.written_back as f64 / tokens;
    let tok_s = row["tok_s"].as_f64().unwrap_or(0.0);
    let link_frac = (far + admit) * tok_s / link.max(1.0);
    let stall = stall_ms.map_or(String::new(), |m| {
        format!(", stall {m:.3} ms/token over all cached")
    });
    let back_note = if back > 0.0 {
        format!(", {back:.2} evicted experts/token written back to the host")
    } else {
        String::new()
    };
    let cpu = if d.host > 0 {
        format!(", {host:.2} experts/token computed by the CPU ({host_ms:.3} ms/token)")
    } else {
        String::new()
    };
    println!(
        "         offload: hit rate {:.3}, PCIe {:.3} GB/token ({:.3} read by kernels + {:.3} admitted, {admitted:.2} experts/token), {:.0}% of the {:.1} GB/s link at this speed{back_note}{cpu}{stall}",
        hit_rate,
        (far + admit) / 1e9,
        far / 1e9,
        admit / 1e9,
        link_frac * 100.0,
        link / 1e9
    );
    json!({"cache_slots_per_layer": slots, "hit_rate": hit_rate, "far_bytes_per_token": far,
           "admit_bytes_per_token": admit, "admitted_per_token": admitted,
           "link_bytes_s": link, "link_fraction": link_frac, "stall_ms_per_token": stall_ms,
           "cpu_experts_per_token": host, "cpu_ms_per_token": host_ms,
           "written_back_per_token": back})
}

/// Dense bf16 tensor-core peak of an H100 or H200 SXM (one chip), FLOP/s: the MFU denominator.
const PEAK_BF16_FLOPS: f64 = 989e12;

/// GPU prefill of a prompt of each length (one warm-up pass first): tok/s and the model-FLOPs
/// utilisation 2·active params·T / time / [`PEAK_BF16_FLOPS`] (attention's own FLOPs not
/// counted).
fn prefill_at(model: &mut GpuModel, lens: &[usize]) -> Result<Vec<Value>> {
    use deltamoe_model::gpu::{GdnPrefill, PREFILL_MAX_ROWS};
    let vocab = model.vocab_size() as u32;
    let flops_per_token = 2.0 * model.active_params() as f64;
    let mut seq = model.new_seq()?;
    let warm: Vec<u32> = (0..64).map(|i| (i * 7919 + 13) % vocab).collect();
    model.prefill(&mut seq, &warm, Logits::Last, PREFILL_MAX_ROWS)?;
    model.release(seq);
    let mut rows = Vec::new();
    for &len in lens {
        let prompt: Vec<u32> = (0..len as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        for (mode, label) in [
            (GdnPrefill::Recurrent, "gdn f32 recurrent"),
            (GdnPrefill::Chunked, "gdn bf16 chunked (default)"),
        ] {
            model.set_prefill_gdn(mode);
            let mut seq = model.new_seq()?;
            let t = Instant::now();
            model.prefill(&mut seq, &prompt, Logits::Last, PREFILL_MAX_ROWS)?;
            let secs = t.elapsed().as_secs_f64();
            model.release(seq);
            let tok_s = len as f64 / secs;
            let mfu = flops_per_token * tok_s / PEAK_BF16_FLOPS;
            println!(
                "prefill  {len:>6} tokens, {label:26}: {tok_s:9.1} tok/s  {secs:8.3} s  MFU {:5.2}% (2 x {:.2} B active params/token, peak {:.0} TFLOP/s dense bf16 of an H100/H200 SXM)",
                mfu * 100.0,
                flops_per_token / 2e9,
                PEAK_BF16_FLOPS / 1e12
            );
            rows.push(
                json!({"tokens": len, "gdn": label, "tok_s": tok_s, "seconds": secs,
                             "mfu": mfu, "active_params": flops_per_token / 2.0,
                             "peak_flops": PEAK_BF16_FLOPS}),
            );
        }
    }
    model.set_prefill_gdn(GdnPrefill::default());
    Ok(rows)
}

/// Matvec throughput at real decode shapes: (name, rows N, cols K, matrices per launch).
const MATVEC_SHAPES: &[(&str, usize, usize, usize)] = &[
    ("8 experts gate+up [1024x2048]", 1024, 2048, 8),
    ("8 experts down [2048x512]", 2048, 512, 8),
    ("GDN in_proj [12352x2048]", 12352, 2048, 1),
    ("GDN out_proj [2048x4096]", 2048, 4096, 1),
    ("MoE router [257x2048]", 257, 2048, 1),
    ("lm_head [248320x2048]", 248320, 2048, 1),
];

fn run_matvec() -> Result<Value> {
    use deltamoe_compute::cuda::ops::{self, Matvec, WeightFormat};
    let gpu = Gpu::new(0).context("--device cuda")?;
    let g = &gpu;
    let bw = g.copy_bandwidth(1 << 31, 20)?;
    println!(
        "device   {}\nhbm      device copy {:.0} GB/s (read + write)",
        g.name(),
        bw / 1e9
    );
    let mut rows = Vec::new();
    for &(name, n, k, slots) in MATVEC_SHAPES {
        // Spread the matrices so each launch reads weights that are not in L2.
        let copies = 64usize.min((8usize << 30) / (n * k * 2 * slots)).max(2);
        let x = g.zeros::<f32>(k * slots)?;
        ops::fill_uniform(
            g,
            x.ptr(),
            k * slots,
            deltamoe_compute::DType::F32,
            7,
            -1.0,
            1.0,
        )?;
        let y = g.zeros::<f32>(n * slots)?;
        let ids = g.upload(&(0..slots as i32).collect::<Vec<_>>())?;
        let sl = if slots > 1 {
            ops::Slots::experts(slots, ids.ptr(), k, 1)
        } else {
            ops::Slots::one()
        };
        let elems = copies * slots * n * k;
        // Times `reps` launches over the copies `m_of(c)`, reading `bytes` each.
        let mut time = |m_of: &dyn Fn(usize) -> Matvec, bytes: usize, label: &str| -> Result<()> {
            let reps = 200;
            for c in 0..copies {
                ops::matvec(g, m_of(c), x.ptr(), y.ptr(), sl)?;
            }
            g.sync()?;
            let t = Instant::now();
            for r in 0..reps {
                ops::matvec(g, m_of(r % copies), x.ptr(), y.ptr(), sl)?;
            }
            g.sync()?;
            let secs = t.elapsed().as_secs_f64() / reps as f64;
            let gbs = bytes as f64 / secs / 1e9;
            println!(
                "matvec   {name:32} {label:9} {:8.2} us  {gbs:7.0} GB/s  {:5.1}% of copy bandwidth",
                secs * 1e6,
                gbs * 1e9 / bw * 100.0
            );
            rows.push(json!({"shape": name, "format": label, "us": secs * 1e6, "gb_s": gbs, "fraction_of_bandwidth": gbs * 1e9 / bw}));
            Ok(())
        };
        for bits in [16u32, 8, 4, 2] {
            let (buf_w, buf_s): (cuda::DevBuf<u32>, cuda::DevBuf<u16>) = if bits == 16 {
                (g.zeros(elems / 2)?, g.zeros(1)?)
            } else {
                (
                    g.zeros(elems * bits as usize / 32)?,
                    g.zeros(2 * elems / 64)?,
                )
            };
            ops::fill_random_u32(g, buf_w.ptr(), buf_w.len(), 3)?;
            ops::fill_uniform(
                g,
                buf_s.ptr(),
                buf_s.len(),
                deltamoe_compute::DType::BF16,
                5,
                0.001,
                0.01,
            )?;
            let bytes =
                slots * (n * k * bits as usize / 8 + if bits == 16 { 0 } else { 4 * n * k / 64 });
            let m_of = |c: usize| {
                let format = if bits == 16 {
                    WeightFormat::Bf16
                } else {
                    let groups = elems / 64;
                    let off = (c * slots * n * k / 64 * 2) as u64;
                    WeightFormat::Affine {
                        bits,
                        group: 64,
                        scales: buf_s.ptr() + off,
                        biases: buf_s.ptr() + groups as u64 * 2 + off,
                        params: cuda::ops::AffineParams::Bf16,
                    }
                };
                Matvec {
                    w: buf_w.ptr() + (c * slots * n * k * bits as usize / 8) as u64,
                    n,
                    k,
                    bias: 0,
                    format,
                }
            };
            let label = if bits == 16 {
                "bf16".to_string()
            } else {
                format!("{bits}-bit g64")
            };
            time(&m_of, bytes, &label)?;
        }
        // FP8 in blocks of 128 (random codes: a NaN now and then costs the same), each row's
        // f32 block scales beside it as the upload writes them.
        let kg = k.div_ceil(128);
        let (codes, scales): (cuda::DevBuf<u32>, cuda::DevBuf<f32>) =
            (g.zeros(elems / 4)?, g.zeros(copies * slots * n * kg)?);
        ops::fill_random_u32(g, codes.ptr(), codes.len(), 3)?;
        ops::fill_uniform(
            g,
            scales.ptr(),
            scales.len(),
            deltamoe_compute::DType::F32,
            5,
            0.001,
            0.01,
        )?;
        let m_of = |c: usize| Matvec {
            w: codes.ptr() + (c * slots * n * k) as u64,
            n,
            k,
            bias: 0,
            format: WeightFormat::Fp8 {
                group: 128,
                scales: scales.ptr() + (4 * c * slots * n * kg) as u64,
            },
        };
        time(&m_of, slots * (n * k + 4 * n * kg), "fp8 b128")?;
    }
    Ok(json!({"device": g.name(), "copy_bandwidth_bytes_s": bw, "matvec": rows}))
}

#[cfg(test)]
mod tests {
    use super::step_tokens;

    #[test]
    fn batched_decode_feeds_every_sequence_its_own_token_each_step() {
        for vocab in [256, 151_936, 248_320] {
            for step in [0, 1, 31] {
                let mut t = step_tokens(256, step, vocab);
                assert!(t.iter().all(|&x| (x as usize) < vocab));
                t.sort_unstable();
                t.dedup();
                assert_eq!(t.len(), 256);
            }
            assert_ne!(step_tokens(8, 0, vocab), step_tokens(8, 1, vocab));
        }
    }
}
