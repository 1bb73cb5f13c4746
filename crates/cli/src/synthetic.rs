//! Named real shapes with synthetic random weights (no files needed): what `bench --synthetic`
//! measures and `serve --synthetic` serves. On CUDA the weights are made directly in device
//! memory, bf16 or MLX-affine quantized as `convert` would.

use std::sync::Arc;

use anyhow::{bail, Result};
use deltamoe_compute::cuda::{self, Gpu};
use deltamoe_model::gpu::{ExpertCache, GpuModel};
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
const SEED: u64 = 1;

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

/// `--bits B --group-size G` checked against what the CUDA kernels take: `Some((bits,
/// group))`, or `None` (bf16) without `--bits`.
pub fn quant(bits: Option<u32>, group_size: usize) -> Result<Option<(u32, usize)>> {
    let Some(b) = bits else {
        return Ok(None);
    };
    if ![2, 4, 8].contains(&b) || ![32, 64, 128].contains(&group_size) {
        bail!("--bits {b} --group-size {group_size}: the CUDA kernels take bits 2, 4 or 8 and groups of 32, 64 or 128");
    }
    Ok(Some((b, group_size)))
}

/// How the weights are stored, for display: `bf16` or `4-bit affine, group 64`.
pub fn precision(quant: Option<(u32, usize)>) -> String {
    match quant {
        Some((b, g)) => format!("{b}-bit affine, group {g}"),
        None => "bf16".into(),
    }
}

/// Random weights of `cfg` made on `gpu` (quantized as `quant` says; routed experts behind
/// `cache`).
pub fn gpu_model(
    cfg: &ModelConfig,
    gpu: Arc<Gpu>,
    quant: Option<(u32, usize)>,
    cache: ExpertCache,
) -> cuda::Result<GpuModel> {
    GpuModel::synthetic(cfg, gpu, SEED, quant, cache)
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
        assert_eq!(quant(None, 7).unwrap(), None);
        assert_eq!(quant(Some(4), 64).unwrap(), Some((4, 64)));
        assert!(quant(Some(3), 64).is_err() && quant(Some(4), 48).is_err());
        assert_eq!(precision(Some((4, 64))), "4-bit affine, group 64");
    }
}
