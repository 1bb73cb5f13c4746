//! `bench --gpus LIST`: the model on the named GPUs through the engine (expert parallel over
//! NCCL with several, the plain CUDA backend with one, so that the two are measured the same
//! way): each GPU's memory after load, prefill tok/s at each `--prompt-len`, and decode tok/s
//! at each `--contexts` × `--batch` with the time a step spends in all-reduces measured alone.
//! Sequences reach their context by a prefill of distinct tokens.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::{Engine, SeqId};
use deltamoe_model::gpu::{ExpertCache, OffloadStats};
use deltamoe_model::Logits;
use serde_json::{json, Value};

use crate::bench::{synthetic_config, BenchArgs};
use crate::{commands, synthetic};

/// Runs the measurements on `ordinals`.
pub fn run(a: &BenchArgs, ordinals: &[usize]) -> Result<Value> {
    crate::check_gpus(ordinals)?;
    let host_experts = a.cpu_experts.contains(&crate::bench::OnOff::On);
    if a.speculative_tokens > 0 || a.zipf.is_some() || a.host_memory.is_some() || host_experts {
        bail!("bench --gpus: --speculative-tokens, --zipf, --host-memory and --cpu-experts on measure one GPU; drop them or --gpus");
    }
    if a.tensor_parallel && ordinals.len() < 2 {
        bail!("bench --tensor-parallel divides heads among GPUs: name two or more with --gpus");
    }
    let cache = match crate::bench::cache_specs(a)?[..] {
        [cache] => cache,
        _ => bail!("bench --gpus: one --expert-cache-fraction at a time"),
    };
    let gpus = commands::open_gpus(ordinals).context("--device cuda")?;
    let max_pos_ctx = a.contexts.iter().max().copied().unwrap_or(128);
    let max_ctx = (max_pos_ctx + a.warmup + a.gen_len + 16)
        .max(a.prompt_len.iter().max().copied().unwrap_or(1) + 1);
    let max_batch = a.batch.iter().copied().max().unwrap_or(1).max(1);
    let t0 = Instant::now();
    let (mut engine, name) = engine(a, &gpus, (max_ctx, max_batch), cache)?;
    println!("model    {name}");
    let mut memory = Vec::new();
    for (i, g) in ordinals.iter().zip(&gpus) {
        let (free, total) = g.mem_info()?;
        let used = (total - free) as f64 / (1u64 << 30) as f64;
        println!(
            "gpu {i}    {} ({used:.1} of {:.1} GiB in use)",
            g.name(),
            total as f64 / (1u64 << 30) as f64
        );
        memory.push(
            json!({"gpu": i, "name": g.name(), "used_bytes": total - free, "total_bytes": total}),
        );
    }
    println!("load     {:.1} s", t0.elapsed().as_secs_f64());
    let vocab = engine.config().vocab_size;
    let max_pos = engine.max_context();
    let prefill = prefill_at(&mut engine, &a.prompt_len, vocab)?;
    let mut decode = Vec::new();
    for &ctx in a
        .contexts
        .iter()
        .filter(|&&c| c + a.warmup + a.gen_len + 16 <= max_pos)
    {
        for &b in &a.batch {
            decode.push(decode_at(
                &mut engine,
                ctx,
                b.max(1),
                (a.warmup, a.gen_len),
            )?);
        }
    }
    Ok(
        json!({"model": name, "backend": engine.backend_name(), "gpus": memory,
              "prefill": prefill, "decode": decode}),
    )
}

/// The engine on `gpus` with room for `max_batch` sequences of `max_ctx` tokens, the routed
/// experts behind `cache` (see `ExpertCache::per_gpu`).
fn engine(
    a: &BenchArgs,
    gpus: &[Arc<Gpu>],
    (max_ctx, max_batch): (usize, usize),
    cache: ExpertCache,
) -> Result<(Engine, String)> {
    let quant = synthetic::quant(a.bits, a.group_size, a.fp8, a.gptq, a.f32_params)?;
    let several = gpus.len() > 1;
    if let Some((cfg, name)) = synthetic_config(a)? {
        let e = match several {
            true => {
                let split = (cache, gpus.len(), a.tensor_parallel);
                let make = synthetic::shard_maker(&cfg, quant, split);
                Engine::new_cuda_shards(cfg, gpus.to_vec(), make, max_ctx, max_batch)?
            }
            false => {
                let m = synthetic::gpu_model(&cfg, gpus[0].clone(), quant, cache)?;
                Engine::new_cuda_model(cfg, m, max_ctx, max_batch)?
            }
        };
        return Ok((e, name));
    }
    let dir = a.model.clone().unwrap_or_default();
    let m = commands::load_dir(&dir)?;
    let e = match several {
        true => {
            let split = (cache, a.tensor_parallel);
            Engine::new_cuda_gpus(m, gpus.to_vec(), (max_ctx, max_batch), split)?
        }
        false => Engine::new_cuda_with(m, gpus[0].clone(), max_ctx, max_batch, cache)?,
    };
    Ok((e, dir.display().to_string()))
}

/// `len` distinct-looking tokens, the `n`th prompt's.
fn prompt(len: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + n * 104_729 + 13) % vocab) as u32)
        .collect()
}

/// Prefill tok/s of one prompt of each length (after a short warm-up pass).
fn prefill_at(engine: &mut Engine, lens: &[usize], vocab: usize) -> Result<Vec<Value>> {
    let mut run = |len: usize| -> Result<f64> {
        let id = engine.add_sequence()?;
        let p = prompt(len, 0, vocab);
        let t = Instant::now();
        let r = engine.prefill(id, &p, None, Logits::Last);
        let secs = t.elapsed().as_secs_f64();
        engine.remove_sequence(id);
        r?;
        Ok(secs)
    };
    run(64)?;
    let mut rows = Vec::new();
    for &len in lens {
        let secs = run(len)?;
        let tok_s = len as f64 / secs;
        println!("prefill  {len:>6} tokens: {tok_s:9.1} tok/s  {secs:8.3} s");
        rows.push(json!({"tokens": len, "tok_s": tok_s, "seconds": secs}));
    }
    Ok(rows)
}

/// Decode `b` sequences together at context `ctx`: tok/s over all of them and the step's time
/// in all-reduces.
fn decode_at(
    engine: &mut Engine,
    ctx: usize,
    b: usize,
    (warmup, gen_len): (usize, usize),
) -> Result<Value> {
    let vocab = engine.config().vocab_size;
    let mut ids: Vec<SeqId> = Vec::with_capacity(b);
    for n in 0..b {
        let id = engine.add_sequence()?;
        engine.prefill(
            id,
            &prompt(ctx.saturating_sub(1).max(1), n + 1, vocab),
            None,
            Logits::Last,
        )?;
        ids.push(id);
    }
    let step = |engine: &mut Engine, n: usize| -> Result<()> {
        let toks = crate::bench::step_tokens(b, n, vocab);
        let batch: Vec<(SeqId, u32)> = ids.iter().copied().zip(toks).collect();
        engine.step(&batch)?;
        Ok(())
    };
    for n in 0..warmup {
        step(engine, n)?;
    }
    let before = engine.offload_stats();
    let t = Instant::now();
    for n in warmup..warmup + gen_len {
        step(engine, n)?;
    }
    let secs = t.elapsed().as_secs_f64() / gen_len as f64;
    let offload = offload_during(before, engine.offload_stats());
    let comm = engine.comm_seconds(b)?;
    for id in ids {
        engine.remove_sequence(id);
    }
    let tok_s = b as f64 / secs;
    let comm_note = comm.map_or(String::new(), |c| {
        format!("  {:6.3} ms of it in all-reduces (alone)", c * 1e3)
    });
    let offload_note = offload.map_or(String::new(), |(hit, gb)| {
        format!(
            "  cache hits {:5.1}%, {gb:.3} GB/token over PCIe",
            hit * 100.0
        )
    });
    println!("decode   context {ctx:>6}, batch {b:>3}: {tok_s:8.1} tok/s in all  {:7.3} ms/step{comm_note}{offload_note}", secs * 1e3);
    Ok(
        json!({"context": ctx, "batch": b, "tok_s": tok_s, "ms_per_step": secs * 1e3,
              "comm_ms_per_step": comm.map(|c| c * 1e3),
              "cache_hit_rate": offload.map(|o| o.0), "pcie_gb_per_token": offload.map(|o| o.1)}),
    )
}

/// The expert cache's hit rate and the GB a token read over PCIe between two readings of the
/// offload statistics (all GPUs together), when experts are offloaded.
fn offload_during(before: Option<OffloadStats>, after: Option<OffloadStats>) -> Option<(f64, f64)> {
    let d = after?.since(&before?);
    Some((d.hit_rate(), d.pcie_bytes_per_token() / 1e9))
}
