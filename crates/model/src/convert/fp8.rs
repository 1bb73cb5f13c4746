//! `convert --fp8`: an HF checkpoint to a fine-grained FP8 one in the layout of Qwen's `*-FP8`
//! repos, loadable by deltamoe and by the engines that read those (format in
//! [`deltamoe_compute::fp8`]).
//!
//! Output: tensor names as the source spells them, except fused experts, which are written per
//! expert (`experts.{e}.{gate,up,down}_proj.weight`) as Qwen's FP8 checkpoints store them. Each
//! quantized linear `m` becomes `m.weight` (F8_E4M3 `[out, in]`) and `m.weight_scale_inv` (F32
//! `[⌈out/128⌉, ⌈in/128⌉]`), quantized by [`quantize_blocks`] (`s = amax/448` per 128 × 128
//! block, torch's round-to-nearest-even cast). Quantized: the GDN, attention, dense-MLP and
//! expert (routed and shared) projections; kept as stored: the embedding, lm_head, norms, conv,
//! `A_log`, `dt_bias`, biases, the router, the shared-expert gate and the GDN `a`/`b`
//! projections, which `quantization_config.modules_to_not_convert` lists.

use deltamoe_compute::fp8::blocks;
use serde_json::{json, Value};

use super::{flat2d, per_expert, stored_dtype, Job, Part, Plan};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightStore;

/// Rows and inputs a scale covers.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// Linear modules FP8 checkpoints leave unquantized (module path suffixes).
const KEPT: [&str; 7] = [
    "embed_tokens",
    "lm_head",
    ".mlp.gate",
    ".shared_expert_gate",
    ".in_proj_a",
    ".in_proj_b",
    ".in_proj_ba",
];

/// Whether the 2-D linear module `m` is written in FP8.
fn quantized(m: &str) -> bool {
    !KEPT.iter().any(|k| m.ends_with(k))
}

impl Plan {
    /// `module` quantized: to GPTQ with groups of `gptq` when given (or kept, see
    /// [`Plan::keep`], when GPTQ cannot hold its shape), else to FP8.
    fn add_quantized(
        &mut self,
        module: &str,
        part: Part,
        [out, inp]: [usize; 2],
        gptq: Option<usize>,
        (dtype, kept): (&'static str, &mut Vec<String>),
    ) {
        match gptq {
            Some(g) if !super::gptq::fits(out, inp, g) => {
                self.keep(kept, module, part, (dtype, vec![out, inp]))
            }
            Some(g) => self.add_gptq(module, part, [out, inp], g),
            None => self.add_fp8(module, part, [out, inp]),
        }
    }

    /// The linear `module` written unquantized as `{module}.weight` (`dtype`, `shape`), from
    /// `part`, and listed in `kept`.
    fn keep(
        &mut self,
        kept: &mut Vec<String>,
        module: &str,
        part: Part,
        (dtype, shape): (&'static str, Vec<usize>),
    ) {
        kept.push(module.to_string());
        self.dense += 1;
        self.add_dense_part(format!("{module}.weight"), dtype, shape, part);
    }

    fn add_fp8(&mut self, module: &str, part: Part, [out, inp]: [usize; 2]) {
        self.quantized += 1;
        let codes = self.push(format!("{module}.weight"), "F8_E4M3", vec![out, inp]);
        let grid = vec![blocks(out, FP8_BLOCK[0]), blocks(inp, FP8_BLOCK[1])];
        let scales = self.push(format!("{module}.weight_scale_inv"), "F32", grid);
        self.jobs.push(Job::Fp8 {
            part,
            cols: inp,
            out: [codes, scales],
        });
    }

    fn add_dense(&mut self, name: String, dtype: &'static str, shape: Vec<usize>, src: &str) {
        let rows = flat2d(&shape).0;
        let part = Part {
            src: src.to_string(),
            row0: 0,
            rows,
        };
        self.add_dense_part(name, dtype, shape, part);
    }

    /// Output `name` (`dtype`, `shape`) written as it is from `part` of a source tensor.
    fn add_dense_part(&mut self, name: String, dtype: &'static str, shape: Vec<usize>, part: Part) {
        let cols = flat2d(&shape).1;
        let out = self.push(name, dtype, shape);
        self.jobs.push(Job::Dense {
            parts: vec![part],
            cols,
            add_one: false,
            out,
        });
    }
}

/// The plan of a per-expert conversion of `store` (config `c`) — FP8, or GPTQ int4 with groups of
/// `gptq` — and the modules it keeps unquantized.
pub(crate) fn plan_per_expert(
    store: &WeightStore,
    c: &ModelConfig,
    gptq: Option<usize>,
) -> Result<(Plan, Vec<String>)> {
    let mut p = Plan {
        outs: vec![],
        jobs: vec![],
        overrides: Default::default(),
        quantized: 0,
        dense: 0,
        tensors_in: 0,
    };
    let mut kept = vec![];
    let names = crate::gptq::logical_names(store);
    let (i, h) = (c.moe_intermediate_size, c.hidden_size);
    for (name, shape) in &names {
        let (name, shape) = (name.as_str(), shape.clone());
        let stored = store.stored_name(name);
        if c.tie_word_embeddings && name == "lm_head.weight" {
            continue;
        }
        p.tensors_in += 1;
        let dtype = stored_dtype(store, name, &shape)?;
        let part = |row0, rows| Part {
            src: name.to_string(),
            row0,
            rows,
        };
        if let Some(mlp) = stored.strip_suffix(".experts.gate_up_proj") {
            for e in 0..c.num_experts {
                for (k, proj) in ["gate_proj", "up_proj"].iter().enumerate() {
                    let m = format!("{mlp}.experts.{e}.{proj}");
                    let dk = (dtype, &mut kept);
                    p.add_quantized(&m, part(e * 2 * i + k * i, i), [i, h], gptq, dk);
                }
            }
        } else if let Some(mlp) = stored.strip_suffix(".experts.down_proj") {
            for e in 0..c.num_experts {
                let m = format!("{mlp}.experts.{e}.down_proj");
                p.add_quantized(&m, part(e * h, h), [h, i], gptq, (dtype, &mut kept));
            }
        } else if let (Some(m), [out, inp]) = (stored.strip_suffix(".weight"), shape.as_slice()) {
            if quantized(m) || per_expert(name).is_some() {
                let dk = (dtype, &mut kept);
                p.add_quantized(m, part(0, *out), [*out, *inp], gptq, dk);
            } else {
                p.keep(&mut kept, m, part(0, *out), (dtype, shape));
            }
        } else {
            p.add_dense(stored.clone(), dtype, shape, name);
        }
    }
    Ok((p, kept))
}

/// The `quantization_config` of an FP8 conversion keeping `kept` unquantized.
pub(crate) fn fp8_config(kept: &[String]) -> Value {
    json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": FP8_BLOCK,
        "modules_to_not_convert": kept,
    })
}

#[cfg(test)]
mod tests {
    use super::quantized;

    #[test]
    fn routers_gates_and_embeddings_stay_unquantized() {
        for m in [
            "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert_gate",
            "model.layers.0.linear_attn.in_proj_a",
            "model.layers.0.linear_attn.in_proj_ba",
            "model.embed_tokens",
            "lm_head",
        ] {
            assert!(!quantized(m), "{m}");
        }
        for m in [
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.shared_expert.gate_proj",
            "model.layers.0.linear_attn.in_proj_qkvz",
            "model.layers.3.self_attn.o_proj",
        ] {
            assert!(quantized(m), "{m}");
        }
    }
}
