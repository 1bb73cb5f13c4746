//! Named real shapes with synthetic random weights (no files needed): what `bench --synthetic`
//! measures and `serve --synthetic` serves. On CUDA the weights are made directly in device
//! memory, bf16, MLX-affine quantized as `convert` would, or FP8 as Qwen's `*-FP8` checkpoints.

use std::sync::Arc;

use anyhow::{bail, Result};
use deltamoe_compute::cuda::ops::AffineParams;
use deltamoe_compute::cuda::{self, Gpu};
use deltamoe_engine::MakeShard;
use deltamoe_model::gpu::{DevFormat, ExpertCache, GpuModel};
use deltamoe_model::ModelConfig;

/// Real shapes built into the binary (text model only).
pub const SHAPES: &[(&str, &str)] = &[
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

/// Quantization group size unless `--group-size` says otherwise.
pub const DEFAULT_GROUP: usize = 64;

/// Seed of the random weights: every run makes the same model.
pub(crate) const SEED: u64 = 1;

/// The config of the shape `name` (`--synthetic NAME`); an unknown name is an error listing
/// the known ones.
pub fn shape(name: &str) -> Result<ModelConfig> {
    let Some((_, text)) = SHAPES.iter().find(|(n, _)| *n == name) else {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        bail!(
            "--synthetic {name}: unknown shape; known: {}",
            names.join(", ")
        );
    };
    Ok(ModelConfig::from_json_str(
        text,
        std::path::Path::new(name),
    )?)
}

/// The synthetic weights' format: `--bits B [--group-size G]` (MLX affine, checked against what
/// the CUDA kernels take; group 64 by default; with `--f32-params`, f32 scales and biases as
/// GGUF's K-quants are held, group 32 by default), `--fp8` (blocks of 128), `--gptq
/// [--group-size G]` (int4 with f16 scales and zero points on the routed experts, the rest bf16,
/// as Qwen's GPTQ-Int4 checkpoints; group 128 by default), or bf16.
pub fn quant(
    bits: Option<u32>,
    group_size: Option<usize>,
    fp8: bool,
    gptq: bool,
    f32_params: bool,
) -> Result<DevFormat> {
    let (b, params) = match (bits, fp8, gptq) {
        (Some(_), true, _) | (Some(_), _, true) | (_, true, true) => {
            bail!("--bits, --fp8 and --gptq: pick one")
        }
        (None, true, _) => return Ok(DevFormat::Fp8 { group: 128 }),
        (None, false, false) => return Ok(DevFormat::Bf16),
        (None, false, true) => (4, AffineParams::F16Zero),
        (Some(b), false, false) if f32_params => (b, AffineParams::F32),
        (Some(b), false, false) => (b, AffineParams::Bf16),
    };
    let default = match params {
        AffineParams::F16Zero => 128,
        AffineParams::Bf16 => DEFAULT_GROUP,
        AffineParams::F32 => 32,
    };
    let group = group_size.unwrap_or(default);
    let g16 = group == 16 && b != 2;
    if ![2, 4, 8].contains(&b) || !([32, 64, 128].contains(&group) || g16) {
        bail!("--bits {b} --group-size {group}: the CUDA kernels take bits 2, 4 or 8 and groups of 32, 64 or 128 (16 at 4 or 8 bits)");
    }
    Ok(DevFormat::Affine {
        bits: b,
        group,
        params,
    })
}

/// How the weights are stored, for display: `bf16`, `4-bit affine, group 64` or `FP8 e4m3,
/// blocks of 128`.
pub fn precision(format: DevFormat) -> String {
    match format {
        DevFormat::Affine {
            bits,
            group,
            params: AffineParams::Bf16,
        } => format!("{bits}-bit affine, group {group}"),
        DevFormat::Affine {
            bits,
            group,
            params: AffineParams::F16Zero,
        } => format!("GPTQ {bits}-bit experts, group {group}"),
        DevFormat::Affine {
            bits,
            group,
            params: AffineParams::F32,
        } => format!("{bits}-bit affine, group {group}, f32 scales and biases"),
        DevFormat::Fp8 { group } => format!("FP8 e4m3, blocks of {group}"),
        DevFormat::Bf16 => "bf16".into(),
    }
}

/// Random weights of `cfg` made on `gpu` in `format`; routed experts behind `cache`.
pub fn gpu_model(
    cfg: &ModelConfig,
    gpu: Arc<Gpu>,
    format: DevFormat,
    cache: ExpertCache,
) -> cuda::Result<GpuModel> {
    GpuModel::synthetic(cfg, gpu, SEED, format, cache)
}

/// How each of several GPUs makes its part of [`gpu_model`]'s model (`--gpus`), its share of the
/// routed experts behind its part of `cache` (see `ExpertCache::per_gpu`), and with `heads` its
/// share of the mixers' heads.
pub fn shard_maker(
    cfg: &ModelConfig,
    format: DevFormat,
    (cache, gpus, heads): (ExpertCache, usize, bool),
) -> Arc<MakeShard> {
    let cfg = cfg.clone();
    let cache = cache.per_gpu(gpus);
    Arc::new(move |gpu, shard| {
        let shard = shard.with_heads(heads);
        GpuModel::synthetic_shard(&cfg, gpu, (SEED, format), shard, cache)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_names_are_checked() {
        for (name, _) in SHAPES {
            assert!(shape(name).unwrap().num_layers > 0, "{name}");
        }
        let e = shape("x").unwrap_err().to_string();
        assert!(
            e.contains("--synthetic x") && e.contains("qwen3.6-35b-a3b"),
            "{e}"
        );
        assert_eq!(
            quant(None, Some(7), false, false, false).unwrap(),
            DevFormat::Bf16
        );
        let four = DevFormat::Affine {
            bits: 4,
            group: 64,
            params: AffineParams::Bf16,
        };
        assert_eq!(quant(Some(4), None, false, false, false).unwrap(), four);
        assert!(quant(Some(3), None, false, false, false).is_err());
        assert!(quant(Some(4), Some(48), false, false, false).is_err());
        assert!(quant(Some(2), Some(16), false, false, false).is_err());
        let kq = quant(Some(8), Some(16), false, false, true).unwrap();
        assert_eq!(
            precision(kq),
            "8-bit affine, group 16, f32 scales and biases"
        );
        assert!(quant(Some(4), None, false, true, false).is_err());
        assert_eq!(precision(four), "4-bit affine, group 64");
        let gptq = quant(None, None, false, true, false).unwrap();
        assert_eq!(precision(gptq), "GPTQ 4-bit experts, group 128");
        assert_eq!(
            quant(None, None, true, false, false).unwrap(),
            DevFormat::Fp8 { group: 128 }
        );
        assert!(quant(Some(4), None, true, false, false).is_err());
    }
}
