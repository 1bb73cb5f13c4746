//! `deltamoe convert`: an HF checkpoint to an MLX affine-quantized one in mlx-lm's naming and
//! layout, loadable by deltamoe and by mlx-lm (`mlx_lm.load`); with `--fp8`, to a fine-grained
//! FP8 one in the layout of Qwen's FP8 checkpoints ([`fp8`]; same writer).
//!
//! Output (what mlx-lm's converter writes for these models):
//! - tensors renamed like mlx-lm's `sanitize`: multimodal models get the prefix
//!   `language_model.` (`language_model.model.layers…`, `language_model.lm_head.weight`), experts
//!   are stacked as `mlp.switch_mlp.{gate,up,down}_proj.weight` `[E, out, in]` (from per-expert or
//!   fused HF tensors), zero-centred norms (input/post-attention/final/q/k) are stored as `1 + w`
//!   (rounded once to the model dtype; the GDN gated norm is not shifted), conv1d weights become
//!   `[C, K, 1]`; MTP, vision and (when tied) lm_head tensors are dropped;
//! - each quantized linear `m` as `m.weight` (uint32), `m.scales`, `m.biases` (model dtype),
//!   quantized exactly like `mlx.core.quantize` (see [`deltamoe_compute::cpu::quant`]);
//! - `config.json` = the source config without `vision_config`, plus `quantization` (and the
//!   same object as `quantization_config`): `{"group_size", "bits", "mode": "affine"}` and one
//!   `{"group_size", "bits"}` entry per module quantized differently from the default;
//! - safetensors shards of at most `max_shard_bytes` (`model.safetensors` when one suffices,
//!   else `model-0000i-of-0000N.safetensors`) with `model.safetensors.index.json`; every other
//!   file of the source directory (tokenizer, generation config, chat template) is copied.
//!
//! Policy ([`ConvertOptions`]): every linear and the embedding/lm_head at the default bits and
//! group size; the MoE router `mlp.gate` and `mlp.shared_expert_gate` at 8 bits, group 64 (as
//! mlx-lm); then `--bits-for` rules, the last matching one winning. A module stays in the model
//! dtype when its input dim is not a multiple of its group size (as mlx-lm) or a rule says
//! `none`. Norms, `A_log`, `dt_bias`, conv1d and biases keep their dtype.
//!
//! Memory stays bounded: tensors are read through the memory map a block of rows at a time,
//! quantized, and written at their offsets in the current shard, whose header is computed up
//! front from the shapes.

mod fp8;
mod gguf;
mod gptq;
mod writer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use deltamoe_compute::quant::check_params;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::quant::{Layout, QuantSpec};
use crate::qwen3_hybrid::Qwen3Hybrid;
use crate::weights::WeightStore;

pub use crate::Progress;
pub use gguf::{convert_gguf, GgufOutput};

/// Default largest shard.
pub const DEFAULT_SHARD_BYTES: u64 = 2 << 30;

/// The MoE router and shared-expert gate setting mlx-lm uses for this family.
pub const ROUTER_SPEC: QuantSpec = QuantSpec {
    bits: 8,
    group_size: 64,
};

/// Zero-centred RMSNorm weights (stored as `1 + w` in mlx-lm checkpoints).
const ZERO_CENTRED: [&str; 8] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
];

/// One `--bits-for PATTERN=N[:G]` rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitsRule {
    /// Glob over module paths (`*` matches anything, dots included); a pattern also matches any
    /// dot-separated suffix, so `mlp.gate` matches `model.layers.0.mlp.gate` but not `mlp.gate_proj`.
    pub pattern: String,
    /// `None`: keep the module in the model dtype.
    pub spec: Option<QuantSpec>,
}

impl BitsRule {
    /// Parse `PATTERN=N`, `PATTERN=N:G` or `PATTERN=none`; `default_group` fills in `G`.
    pub fn parse(s: &str, default_group: usize) -> std::result::Result<BitsRule, String> {
        let bad = |why: &str| {
            format!("--bits-for `{s}`: {why}; expected PATTERN=BITS[:GROUP] (e.g. mlp.gate=8:64, lm_head=6, switch_mlp.*=none)")
        };
        let (pattern, val) = s.rsplit_once('=').ok_or_else(|| bad("no `=`"))?;
        if pattern.is_empty() {
            return Err(bad("empty pattern"));
        }
        let spec = if matches!(val, "none" | "0" | "dense") {
            None
        } else {
            let (b, g) = match val.split_once(':') {
                Some((b, g)) => (b, g.parse().map_err(|_| bad("group is not a number"))?),
                None => (val, default_group),
            };
            let bits = b.parse().map_err(|_| bad("bits is not a number"))?;
            check_params(bits, g).map_err(|e| bad(&e.to_string()))?;
            Some(QuantSpec {
                bits,
                group_size: g,
            })
        };
        Ok(BitsRule {
            pattern: pattern.to_string(),
            spec,
        })
    }

    pub fn matches(&self, module: &str) -> bool {
        glob(self.pattern.as_bytes(), module.as_bytes())
            || module
                .match_indices('.')
                .any(|(i, _)| glob(self.pattern.as_bytes(), &module.as_bytes()[i + 1..]))
    }
}

/// `*`-only glob match.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// What to convert to.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub bits: u32,
    pub group_size: usize,
    pub rules: Vec<BitsRule>,
    pub max_shard_bytes: u64,
    /// What to write.
    pub output: Output,
}

/// The format a conversion writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// MLX affine (bits, group size and rules apply).
    Mlx,
    /// Fine-grained FP8 in Qwen's `*-FP8` layout ([`fp8`]; bits, group and rules unused).
    Fp8,
    /// GPTQ int4 v1, groups of `group_size` ([`gptq`]; bits and rules unused).
    Gptq,
}

impl ConvertOptions {
    pub fn new(bits: u32, group_size: usize) -> ConvertOptions {
        ConvertOptions {
            bits,
            group_size,
            rules: vec![],
            max_shard_bytes: DEFAULT_SHARD_BYTES,
            output: Output::Mlx,
        }
    }

    /// FP8 output ([`fp8`]).
    pub fn fp8() -> ConvertOptions {
        ConvertOptions {
            output: Output::Fp8,
            ..ConvertOptions::new(8, 64)
        }
    }

    /// GPTQ int4 output with groups of `group_size` ([`gptq`]).
    pub fn gptq(group_size: usize) -> ConvertOptions {
        ConvertOptions {
            output: Output::Gptq,
            ..ConvertOptions::new(4, group_size)
        }
    }

    fn default_spec(&self) -> QuantSpec {
        QuantSpec {
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    /// Spec of a linear module (normalised path), before the divisibility check.
    pub fn spec_for(&self, module: &str) -> Option<QuantSpec> {
        self.resolve(module).0
    }

    /// The spec and whether a rule (the router rule or `--bits-for`) chose it; like mlx-lm,
    /// the config gets an entry for every rule-chosen module, even one equal to the default.
    fn resolve(&self, module: &str) -> (Option<QuantSpec>, bool) {
        let mut spec = (Some(self.default_spec()), false);
        if module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate") {
            spec = (Some(ROUTER_SPEC), true);
        }
        for r in &self.rules {
            if r.matches(module) {
                spec = (r.spec, true);
            }
        }
        spec
    }
}

/// Rows `row0..row0 + rows` of a source tensor viewed as `[rows_total, cols]`.
#[derive(Clone, Debug)]
pub(crate) struct Part {
    pub src: String,
    pub row0: usize,
    pub rows: usize,
}

/// One unit of work; its outputs are written together into one shard.
#[derive(Clone, Debug)]
pub(crate) enum Job {
    /// Parts concatenated, dtype kept (`add_one`: a zero-centred norm stored as `1 + w`).
    Dense {
        parts: Vec<Part>,
        cols: usize,
        add_one: bool,
        out: usize,
    },
    /// Parts concatenated and quantized into words, scales, biases.
    Quantize {
        parts: Vec<Part>,
        cols: usize,
        spec: QuantSpec,
        out: [usize; 3],
    },
    /// One part quantized to FP8 codes and block scales (`convert --fp8`).
    Fp8 {
        part: Part,
        cols: usize,
        out: [usize; 2],
    },
    /// One part quantized to GPTQ int4 (`convert --gptq`): qweight, qzeros, scales, g_idx.
    Gptq {
        part: Part,
        cols: usize,
        group: usize,
        out: [usize; 4],
    },
}

/// An output tensor.
#[derive(Clone, Debug)]
pub(crate) struct OutTensor {
    pub name: String,
    /// safetensors dtype name: U32, BF16, F16, F32, F8_E4M3.
    pub dtype: &'static str,
    pub shape: Vec<usize>,
}

impl OutTensor {
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.elem_bytes()
    }

    pub fn elem_bytes(&self) -> u64 {
        match self.dtype {
            "F8_E4M3" => 1,
            d if d.ends_with("16") => 2,
            _ => 4,
        }
    }
}

/// What a conversion did.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    pub tensors_in: usize,
    pub tensors_out: usize,
    pub quantized_modules: usize,
    pub dense_modules: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub shards: usize,
    /// Files copied from the source directory.
    pub copied: Vec<String>,
}

/// The conversion plan: outputs, jobs, the config entries.
pub(crate) struct Plan {
    pub outs: Vec<OutTensor>,
    pub jobs: Vec<Job>,
    pub overrides: BTreeMap<String, QuantSpec>,
    pub quantized: usize,
    pub dense: usize,
    pub tensors_in: usize,
}

fn stored_dtype(store: &WeightStore, name: &str, shape: &[usize]) -> Result<&'static str> {
    // FP8 and GPTQ/AWQ weights are written from their f32 dequantization, in bf16 where they
    // stay dense.
    let gptq = name
        .strip_suffix(".weight")
        .is_some_and(|m| crate::gptq::logical_shape(store, m).is_some());
    if gptq || store.fp8_codes(name).is_some() {
        return Ok("BF16");
    }
    Ok(store.get(name, shape)?.dtype().name())
}

/// `[rows, cols]` view of a shape (a vector is one row).
fn flat2d(shape: &[usize]) -> (usize, usize) {
    let cols = shape.last().copied().unwrap_or(1);
    (shape.iter().product::<usize>() / cols.max(1), cols)
}

impl Plan {
    fn add_linear(
        &mut self,
        opts: &ConvertOptions,
        module: &str,
        out_module: &str,
        parts: Vec<Part>,
        shape: Vec<usize>,
        dtype: &'static str,
    ) {
        let (rows, cols) = flat2d(&shape);
        let (spec, explicit) = opts.resolve(module);
        let spec = spec.filter(|s| cols.is_multiple_of(s.group_size));
        let Some(spec) = spec else {
            self.dense += 1;
            let out = self.push(format!("{out_module}.weight"), dtype, shape);
            self.jobs.push(Job::Dense {
                parts,
                cols,
                add_one: false,
                out,
            });
            return;
        };
        self.quantized += 1;
        if explicit || spec != opts.default_spec() {
            self.overrides.insert(out_module.to_string(), spec);
        }
        let lead = &shape[..shape.len() - 1];
        let with = |last: usize| lead.iter().copied().chain([last]).collect::<Vec<_>>();
        let words = self.push(
            format!("{out_module}.weight"),
            "U32",
            with(cols * spec.bits as usize / 32),
        );
        let scales = self.push(
            format!("{out_module}.scales"),
            dtype,
            with(cols / spec.group_size),
        );
        let biases = self.push(
            format!("{out_module}.biases"),
            dtype,
            with(cols / spec.group_size),
        );
        debug_assert_eq!(rows * cols, shape.iter().product::<usize>());
        self.jobs.push(Job::Quantize {
            parts,
            cols,
            spec,
            out: [words, scales, biases],
        });
    }

    fn push(&mut self, name: String, dtype: &'static str, shape: Vec<usize>) -> usize {
        self.outs.push(OutTensor { name, dtype, shape });
        self.outs.len() - 1
    }
}

/// Build the plan for `store` (an HF-layout checkpoint of config `c`).
pub(crate) fn plan(
    store: &WeightStore,
    c: &ModelConfig,
    nested: bool,
    opts: &ConvertOptions,
) -> Result<Plan> {
    let mut p = Plan {
        outs: vec![],
        jobs: vec![],
        overrides: BTreeMap::new(),
        quantized: 0,
        dense: 0,
        tensors_in: 0,
    };
    let out_name = |n: &str| {
        if nested {
            format!("language_model.{n}")
        } else {
            n.to_string()
        }
    };
    let names = crate::gptq::logical_names(store);
    let has = |n: &str| names.binary_search_by(|(m, _)| m.as_str().cmp(n)).is_ok();
    let (e, i, h) = (c.num_experts, c.moe_intermediate_size, c.hidden_size);
    for (name, shape) in &names {
        let (name, shape) = (name.as_str(), shape.clone());
        let part = |src: &str, row0, rows| Part {
            src: src.to_string(),
            row0,
            rows,
        };
        if c.tie_word_embeddings && name == "lm_head.weight" {
            continue;
        }
        if name.ends_with(".weight_scale_inv") {
            continue; // read with its FP8 weight
        }
        p.tensors_in += 1;
        let dtype = stored_dtype(store, name, &shape)?;
        if let Some(mlp) = name.strip_suffix(".experts.gate_up_proj") {
            let sw = format!("{mlp}.switch_mlp");
            for (k, proj) in ["gate_proj", "up_proj"].iter().enumerate() {
                let parts = (0..e).map(|x| part(name, x * 2 * i + k * i, i)).collect();
                let m = format!("{sw}.{proj}");
                p.add_linear(opts, &m, &out_name(&m), parts, vec![e, i, h], dtype);
            }
        } else if let Some(mlp) = name.strip_suffix(".experts.down_proj") {
            let m = format!("{mlp}.switch_mlp.down_proj");
            let parts = vec![part(name, 0, e * h)];
            p.add_linear(opts, &m, &out_name(&m), parts, vec![e, h, i], dtype);
        } else if let Some((mlp, proj)) = per_expert(name) {
            if !name.contains(".experts.0.") {
                continue; // stacked once, from expert 0's entry
            }
            let (out, inp) = if proj == "down_proj" { (h, i) } else { (i, h) };
            let parts = (0..e)
                .map(|x| {
                    let src = format!("{mlp}.experts.{x}.{proj}.weight");
                    if !has(&src) {
                        return Err(ModelError::MissingTensor {
                            name: store.stored_name(&src),
                            dir: store.dir().to_path_buf(),
                        });
                    }
                    Ok(part(&src, 0, out))
                })
                .collect::<Result<Vec<_>>>()?;
            let m = format!("{mlp}.switch_mlp.{proj}");
            p.add_linear(opts, &m, &out_name(&m), parts, vec![e, out, inp], dtype);
        } else if name.ends_with("conv1d.weight") && shape.len() == 3 {
            let (rows, cols) = flat2d(&shape);
            let out = p.push(out_name(name), dtype, vec![shape[0], shape[2], shape[1]]);
            let parts = vec![part(name, 0, rows)];
            p.jobs.push(Job::Dense {
                parts,
                cols,
                add_one: false,
                out,
            });
        } else if shape.len() == 2 && name.ends_with(".weight") {
            let m = &name[..name.len() - ".weight".len()];
            p.add_linear(
                opts,
                m,
                &out_name(m),
                vec![part(name, 0, shape[0])],
                shape,
                dtype,
            );
        } else {
            let (rows, cols) = flat2d(&shape);
            let add_one = shape.len() == 1 && ZERO_CENTRED.iter().any(|s| name.ends_with(s));
            let out = p.push(out_name(name), dtype, shape);
            p.jobs.push(Job::Dense {
                parts: vec![part(name, 0, rows)],
                cols,
                add_one,
                out,
            });
        }
    }
    Ok(p)
}

/// `(…mlp, gate_proj|up_proj|down_proj)` of a per-expert weight name.
fn per_expert(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_suffix(".weight")?;
    let (head, proj) = rest.rsplit_once('.')?;
    let (mlp, idx) = head.rsplit_once(".experts.")?;
    let ok = matches!(proj, "gate_proj" | "up_proj" | "down_proj")
        && !idx.is_empty()
        && idx.bytes().all(|b| b.is_ascii_digit());
    ok.then_some((mlp, proj))
}

/// Convert `src` (an HF model directory) into `dst` (created; must not exist or be empty).
pub fn convert(
    src: &Path,
    dst: &Path,
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ConvertReport> {
    check_params(opts.bits, opts.group_size).map_err(|e| {
        ModelError::Input(format!(
            "--bits {} --group-size {}: {e}",
            opts.bits, opts.group_size
        ))
    })?;
    let cfg_path = src.join("config.json");
    let config = ModelConfig::from_dir(src)?;
    let store = WeightStore::open(src)?;
    if store.layout() == Layout::Mlx
        || store.quantization().is_some()
        || (opts.output == Output::Fp8 && store.fp8().is_some())
        || (opts.output == Output::Gptq && store.gptq().is_some())
    {
        return Err(ModelError::Input(format!(
            "--model {}: already an mlx-lm (converted or quantized) checkpoint; convert the original HF checkpoint",
            src.display()
        )));
    }
    // Every shape is checked against the config before anything is written.
    Qwen3Hybrid::from_store(config.clone(), &store)?;
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| ModelError::Io {
        path: cfg_path.clone(),
        err: source,
    })?;
    let mut root: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: cfg_path.clone(),
        msg: e.to_string(),
    })?;
    let nested = matches!(config.model_type.as_str(), "qwen3_5_moe" | "qwen3_5");
    let (plan, kept) = match opts.output {
        Output::Fp8 => fp8::plan_per_expert(&store, &config, None).map(|(p, k)| (p, Some(k)))?,
        Output::Gptq => {
            let g = Some(opts.group_size);
            fp8::plan_per_expert(&store, &config, g).map(|(p, k)| (p, Some(k)))?
        }
        Output::Mlx => (plan(&store, &config, nested, opts)?, None),
    };

    prepare_dst(dst)?;
    let written = writer::write_shards(&store, &plan, dst, opts.max_shard_bytes, progress);
    let (shards, bytes_in, bytes_out) = match written {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_dir_all(dst);
            return Err(e);
        }
    };

    if let Some(text) = root.get_mut("text_config").and_then(Value::as_object_mut) {
        text.remove("quantization_config"); // a source's FP8 or GPTQ block
    }
    let q = match (opts.output, kept) {
        (Output::Fp8, Some(kept)) => fp8::fp8_config(&kept),
        (Output::Gptq, _) => gptq::gptq_config(opts.group_size),
        _ => Value::Object(mlx_config(opts, &plan)),
    };
    if let Some(obj) = root.as_object_mut() {
        obj.remove("vision_config");
        if opts.output == Output::Mlx {
            obj.insert("quantization".into(), q.clone());
        }
        obj.insert("quantization_config".into(), q);
    }
    write_json(&dst.join("config.json"), &root)?;
    let copied = copy_side_files(src, dst)?;
    Ok(ConvertReport {
        tensors_in: plan.tensors_in,
        tensors_out: plan.outs.len(),
        quantized_modules: plan.quantized,
        dense_modules: plan.dense,
        bytes_in,
        bytes_out,
        shards,
        copied,
    })
}

/// The MLX `quantization` block: the default and one entry per module quantized otherwise.
fn mlx_config(opts: &ConvertOptions, plan: &Plan) -> serde_json::Map<String, Value> {
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), opts.group_size.into());
    q.insert("bits".into(), opts.bits.into());
    q.insert("mode".into(), "affine".into());
    for (m, s) in &plan.overrides {
        q.insert(
            m.clone(),
            serde_json::json!({"group_size": s.group_size, "bits": s.bits}),
        );
    }
    q
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        err: source,
    }
}

/// `v` as pretty JSON with a final newline.
pub(crate) fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    write_file(path, text.as_bytes())
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(io_err(path))
}

pub(crate) fn prepare_dst(dst: &Path) -> Result<()> {
    if dst.exists() {
        let mut it = std::fs::read_dir(dst).map_err(io_err(dst))?;
        if it.next().is_some() {
            return Err(ModelError::Input(format!(
                "--out {}: exists and is not empty; give a new directory",
                dst.display()
            )));
        }
    }
    std::fs::create_dir_all(dst).map_err(io_err(dst))
}

/// Copy the source directory's other files (tokenizer, generation config, templates).
fn copy_side_files(src: &Path, dst: &Path) -> Result<Vec<String>> {
    let mut copied = vec![];
    let mut entries: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(io_err(src))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        let Some(name) = p.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        let skip = !p.is_file()
            || name.starts_with('.')
            || name.ends_with(".safetensors")
            || name == "model.safetensors.index.json"
            || name == "config.json";
        if skip {
            continue;
        }
        let to = dst.join(&name);
        std::fs::copy(&p, &to).map_err(io_err(&p))?;
        copied.push(name);
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_match_dot_aligned_suffixes() {
        let r = BitsRule::parse("mlp.gate=8:64", 32).unwrap();
        assert!(r.matches("model.layers.0.mlp.gate"));
        assert!(!r.matches("model.layers.0.mlp.gate_proj"));
        let r = BitsRule::parse("switch_mlp.*=2", 64).unwrap();
        assert_eq!(
            r.spec,
            Some(QuantSpec {
                bits: 2,
                group_size: 64
            })
        );
        assert!(r.matches("model.layers.3.mlp.switch_mlp.down_proj"));
        assert!(BitsRule::parse("lm_head=none", 64).unwrap().spec.is_none());
        assert!(BitsRule::parse("lm_head", 64)
            .unwrap_err()
            .contains("no `=`"));
        assert!(BitsRule::parse("x=7", 64).unwrap_err().contains("bits 7"));
        let mut o = ConvertOptions::new(4, 32);
        assert_eq!(
            o.spec_for("model.layers.1.mlp.shared_expert_gate"),
            Some(ROUTER_SPEC)
        );
        o.rules.push(BitsRule::parse("layers.1.*=8", 32).unwrap());
        assert_eq!(
            o.spec_for("model.layers.1.self_attn.q_proj").unwrap().bits,
            8
        );
        assert_eq!(
            o.spec_for("model.layers.11.self_attn.q_proj").unwrap().bits,
            4
        );
        assert_eq!(
            per_expert("model.layers.2.mlp.experts.17.up_proj.weight"),
            Some(("model.layers.2.mlp", "up_proj"))
        );
        assert_eq!(
            per_expert("model.layers.2.mlp.shared_expert.up_proj.weight"),
            None
        );
    }
}
