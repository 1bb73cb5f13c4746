//! HF `config.json` of the Qwen3 hybrid family, normalised into one [`ModelConfig`].
//!
//! Accepted `model_type`s: `qwen3_next`, `qwen3_5_moe` / `qwen3_5` (outer configs whose text
//! model is nested under `text_config`), `qwen3_5_moe_text`, `qwen3_5_text`. Both spellings seen
//! in the wild are read: hub style (`rope_theta`, `partial_rotary_factor` at the top level) and
//! transformers-5 style (`rope_parameters {rope_theta, partial_rotary_factor, mrope_section}`).
//! With text-only input the multimodal RoPE sections all see the same position, which equals
//! plain partial RoPE, so `mrope_section` needs no handling. The layer pattern comes from
//! `layer_types` or `full_attention_interval` (default 4); Qwen3-Next's dense layers from
//! `mlp_only_layers` / `decoder_sparse_step`.

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};

/// Model family: decides tensor layout and MoE rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3-Next: packed `in_proj_qkvz` / `in_proj_ba`, optional dense layers.
    Qwen3Next,
    /// Qwen3.5 / 3.6 MoE: separate GDN projections, every layer MoE, top-k always renormalised.
    Qwen35Moe,
    /// Qwen3.5 dense: separate GDN projections, every layer a dense MLP.
    Qwen35Dense,
}

/// Token mixer of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    LinearAttention,
    FullAttention,
}

/// Feed-forward block of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

/// Everything the engine needs from a config, in one spelling.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// `model_type` of the file (outer one when nested).
    pub model_type: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub rms_norm_eps: f32,
    pub layer_kinds: Vec<LayerKind>,
    pub ffn_kinds: Vec<FfnKind>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    // Full attention.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub attention_bias: bool,
    // Gated DeltaNet.
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
    pub conv_kernel: usize,
    // Feed-forward.
    pub intermediate_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// MTP layers the config names (`mtp_num_hidden_layers`, or `num_nextn_predict_layers`):
    /// one full-attention decoder layer predicting the token after next (`mtp.*`).
    pub mtp_layers: usize,
}

/// Reads keys from one JSON object, naming the file and key in errors.
struct Keys<'a> {
    obj: &'a Value,
    path: &'a Path,
    /// Key prefix for messages, e.g. `text_config.`.
    scope: &'static str,
}

impl<'a> Keys<'a> {
    fn err(&self, key: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.to_path_buf(),
            key: format!("{}{key}", self.scope),
            msg: msg.into(),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(self.err(key, "missing; this key is required for this model_type")),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                self.err(key, format!("expected a non-negative integer, found {v}"))
            }),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.usize(key)
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a number, found {v}"))),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(key, format!("expected true or false, found {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, found {v}"))),
        }
    }

    /// A token id or a list of them.
    fn ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = || self.err(key, "expected a token id or a list of token ids");
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).ok_or_else(bad))
                .collect(),
            Some(v) => Ok(vec![v.as_u64().ok_or_else(bad)? as u32]),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        let bad = || self.err(key, "expected a list of integers");
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as usize).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }
}

impl ModelConfig {
    /// Read `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            err: source,
        })?;
        ModelConfig::from_json_str(&text, &path)
    }

    /// Parse config JSON; `path` is used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<ModelConfig> {
        let root: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let outer = Keys {
            obj: &root,
            path,
            scope: "",
        };
        let model_type = outer
            .str_opt("model_type")?
            .ok_or_else(|| {
                outer.err(
                    "model_type",
                    "missing; a Qwen3 hybrid config names its model_type",
                )
            })?
            .to_string();
        let family = match model_type.as_str() {
            "qwen3_next" => Family::Qwen3Next,
            "qwen3_5_moe" | "qwen3_5_moe_text" => Family::Qwen35Moe,
            "qwen3_5" | "qwen3_5_text" => Family::Qwen35Dense,
            _ => {
                return Err(ModelError::UnknownModelType {
                    path: path.to_path_buf(),
                    model_type,
                })
            }
        };
        let nested = matches!(model_type.as_str(), "qwen3_5_moe" | "qwen3_5");
        let text_cfg = if nested {
            match root.get("text_config") {
                Some(v) if v.is_object() => v,
                _ => {
                    return Err(outer.err(
                        "text_config",
                        "missing; a qwen3_5 / qwen3_5_moe config nests the text model there",
                    ))
                }
            }
        } else {
            &root
        };
        let k = Keys {
            obj: text_cfg,
            path,
            scope: if nested { "text_config." } else { "" },
        };
        // The outer config of a multimodal checkpoint decides tying; fall back to the text one.
        let tie = match outer.get("tie_word_embeddings") {
            Some(_) if nested => outer.bool_or("tie_word_embeddings", false)?,
            _ => k.bool_or("tie_word_embeddings", false)?,
        };
        let mut eos = k.ids("eos_token_id")?;
        if nested && eos.is_empty() {
            eos = outer.ids("eos_token_id")?;
        }
        if let Some(act) = k.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(k.err(
                    "hidden_act",
                    format!("`{act}` is not supported; these models use silu"),
                ));
            }
        }
        parse_text(k, model_type, family, tie, eos)
    }

    /// Number of GDN key-projection dims (q or k part), `Hk · Dk`.
    pub fn linear_key_size(&self) -> usize {
        self.linear_k_heads * self.linear_k_dim
    }

    /// Number of GDN value dims, `Hv · Dv`.
    pub fn linear_value_size(&self) -> usize {
        self.linear_v_heads * self.linear_v_dim
    }

    /// Channels of the GDN conv1d: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_size() + self.linear_value_size()
    }

    /// A short name for the layer pattern, e.g. `LLLF×10`.
    pub fn layer_pattern(&self) -> String {
        self.layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::LinearAttention => 'L',
                LayerKind::FullAttention => 'F',
            })
            .collect()
    }
}

fn parse_text(
    k: Keys,
    model_type: String,
    family: Family,
    tie: bool,
    eos: Vec<u32>,
) -> Result<ModelConfig> {
    let num_layers = k.usize("num_hidden_layers")?;
    // Checked before anything is sized by it (the per-layer lists below); `validate` checks the rest.
    if num_layers == 0 || num_layers > MAX_LAYERS {
        let msg = format!("{num_layers} is out of range; expected 1..={MAX_LAYERS}");
        return Err(k.err("num_hidden_layers", msg));
    }
    let hidden_size = k.usize("hidden_size")?;
    let num_heads = k.usize("num_attention_heads")?;
    // transformers defaults: head_dim 256, partial_rotary_factor 0.25 for the whole family.
    let head_dim = k.usize_or("head_dim", 256)?;

    // RoPE: transformers-5 `rope_parameters` first, then hub-style top-level keys.
    let rope = k.get("rope_parameters").filter(|v| v.is_object());
    let rope_keys = rope.map(|obj| Keys {
        obj,
        path: k.path,
        scope: "rope_parameters.",
    });
    let from_rope = |key: &str| -> Result<Option<f64>> {
        match &rope_keys {
            Some(r) => r.f64_opt(key),
            None => Ok(None),
        }
    };
    // Each RoPE value is checked against the object it was read from, so errors name that key.
    let (rope_theta, theta_keys) = match from_rope("rope_theta")? {
        Some(v) => (v, rope_keys.as_ref().unwrap_or(&k)),
        None => (
            k.f64_opt("rope_theta")?.ok_or_else(|| {
                k.err(
                    "rope_theta",
                    "missing (neither rope_parameters.rope_theta nor rope_theta is set)",
                )
            })?,
            &k,
        ),
    };
    // theta = 0 makes every rotation frequency infinite or NaN: all-NaN logits.
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(theta_keys.err(
            "rope_theta",
            format!("{rope_theta} is out of range; expected a finite number above 0 (e.g. 10000)"),
        ));
    }
    let (prf, prf_keys) = match from_rope("partial_rotary_factor")? {
        Some(v) => (v, rope_keys.as_ref().unwrap_or(&k)),
        None => (k.f64_opt("partial_rotary_factor")?.unwrap_or(0.25), &k),
    };
    if !(prf > 0.0 && prf <= 1.0) {
        return Err(prf_keys.err(
            "partial_rotary_factor",
            format!("{prf} is out of range; expected a fraction in (0, 1] (e.g. 0.25)"),
        ));
    }
    let rotary_dim = (head_dim as f64 * prf) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
        return Err(prf_keys.err("partial_rotary_factor", format!("gives rotary dim {rotary_dim} for head_dim {head_dim}; it must be even and in 2..=head_dim")));
    }
    // A zero or negative epsilon divides by zero (or takes the root of a negative) in RMSNorm.
    let eps = k.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    if !(eps.is_finite() && (eps as f32) > 0.0 && eps < 1.0) {
        return Err(k.err(
            "rms_norm_eps",
            format!("{eps} is out of range; expected a number in (0, 1) (e.g. 1e-6)"),
        ));
    }

    let layer_kinds = layer_kinds(&k, num_layers)?;
    let num_experts = if family == Family::Qwen35Dense {
        0
    } else {
        k.usize("num_experts")?
    };
    let ffn_kinds = ffn_kinds(&k, family, num_layers, num_experts)?;
    let needs_dense = ffn_kinds.contains(&FfnKind::Dense);
    let needs_moe = ffn_kinds.contains(&FfnKind::Moe);
    let moe_key = |key: &str| {
        if needs_moe {
            k.usize(key)
        } else {
            k.usize_or(key, 0)
        }
    };

    let cfg = ModelConfig {
        model_type,
        family,
        vocab_size: k.usize("vocab_size")?,
        hidden_size,
        num_layers,
        rms_norm_eps: eps as f32,
        layer_kinds,
        ffn_kinds,
        tie_word_embeddings: tie,
        max_position_embeddings: k.usize_or("max_position_embeddings", 32768)?,
        eos_token_ids: eos,
        num_heads,
        num_kv_heads: k.usize("num_key_value_heads")?,
        head_dim,
        rotary_dim,
        rope_theta,
        attention_bias: k.bool_or("attention_bias", false)?,
        linear_k_heads: k.usize("linear_num_key_heads")?,
        linear_v_heads: k.usize("linear_num_value_heads")?,
        linear_k_dim: k.usize("linear_key_head_dim")?,
        linear_v_dim: k.usize("linear_value_head_dim")?,
        conv_kernel: k.usize("linear_conv_kernel_dim")?,
        intermediate_size: if needs_dense {
            k.usize("intermediate_size")?
        } else {
            k.usize_or("intermediate_size", 0)?
        },
        num_experts,
        experts_per_token: moe_key("num_experts_per_tok")?,
        moe_intermediate_size: moe_key("moe_intermediate_size")?,
        shared_expert_intermediate_size: moe_key("shared_expert_intermediate_size")?,
        // Qwen3.5 MoE always renormalises the top-k weights; Qwen3-Next when configured.
        norm_topk_prob: family == Family::Qwen35Moe || k.bool_or("norm_topk_prob", true)?,
        mtp_layers: match k.get("mtp_num_hidden_layers") {
            Some(_) => k.usize("mtp_num_hidden_layers")?,
            None => k.usize_or("num_nextn_predict_layers", 0)?,
        },
    };
    validate(&cfg, &k)?;
    Ok(cfg)
}

fn layer_kinds(k: &Keys, n: usize) -> Result<Vec<LayerKind>> {
    if let Some(v) = k.get("layer_types") {
        let list = v
            .as_array()
            .ok_or_else(|| k.err("layer_types", "expected a list of strings"))?;
        if list.len() != n {
            return Err(k.err(
                "layer_types",
                format!("has {} entries but num_hidden_layers is {n}", list.len()),
            ));
        }
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                Some("full_attention") => Ok(LayerKind::FullAttention),
                _ => Err(k.err(
                    "layer_types",
                    format!("unknown layer type {t}; expected linear_attention or full_attention"),
                )),
            })
            .collect();
    }
    let interval = k.usize_or("full_attention_interval", 4)?;
    if interval == 0 {
        return Err(k.err("full_attention_interval", "must be at least 1"));
    }
    Ok((0..n)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect())
}

fn ffn_kinds(k: &Keys, family: Family, n: usize, num_experts: usize) -> Result<Vec<FfnKind>> {
    Ok(match family {
        Family::Qwen35Dense => vec![FfnKind::Dense; n],
        Family::Qwen35Moe => vec![FfnKind::Moe; n],
        Family::Qwen3Next => {
            let mlp_only = k.usize_list("mlp_only_layers")?;
            let step = k.usize_or("decoder_sparse_step", 1)?;
            if step == 0 {
                return Err(k.err("decoder_sparse_step", "must be at least 1"));
            }
            (0..n)
                .map(|i| {
                    if !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0 {
                        FfnKind::Moe
                    } else {
                        FfnKind::Dense
                    }
                })
                .collect()
        }
    })
}

/// Upper bounds far above any released model of the family: a value past one is a typo or a
/// corrupt file, caught here before it sizes an allocation.
const MAX_VOCAB: usize = 1 << 22;
const MAX_WIDTH: usize = 1 << 16;
pub(crate) const MAX_LAYERS: usize = 1024;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 4096;
const MAX_INTERMEDIATE: usize = 1 << 20;
const MAX_EXPERTS: usize = 1 << 14;
const MAX_CONTEXT: usize = 1 << 24;
const MAX_CONV_KERNEL: usize = 64;

/// Ranges and the relations between sizes the layers rely on; each error names the key and the
/// valid range.
fn validate(c: &ModelConfig, k: &Keys) -> Result<()> {
    let required = [
        ("vocab_size", c.vocab_size, MAX_VOCAB),
        ("hidden_size", c.hidden_size, MAX_WIDTH),
        ("num_hidden_layers", c.num_layers, MAX_LAYERS),
        ("num_attention_heads", c.num_heads, MAX_HEADS),
        ("num_key_value_heads", c.num_kv_heads, MAX_HEADS),
        ("head_dim", c.head_dim, MAX_HEAD_DIM),
        ("linear_num_key_heads", c.linear_k_heads, MAX_HEADS),
        ("linear_num_value_heads", c.linear_v_heads, MAX_HEADS),
        ("linear_key_head_dim", c.linear_k_dim, MAX_HEAD_DIM),
        ("linear_value_head_dim", c.linear_v_dim, MAX_HEAD_DIM),
        ("linear_conv_kernel_dim", c.conv_kernel, MAX_CONV_KERNEL),
        (
            "max_position_embeddings",
            c.max_position_embeddings,
            MAX_CONTEXT,
        ),
    ];
    for (key, v, max) in required {
        if v == 0 || v > max {
            return Err(k.err(key, format!("{v} is out of range; expected 1..={max}")));
        }
    }
    // Sizes that are 0 when the layers that use them are absent.
    let optional = [
        ("intermediate_size", c.intermediate_size, MAX_INTERMEDIATE),
        ("num_experts", c.num_experts, MAX_EXPERTS),
        (
            "moe_intermediate_size",
            c.moe_intermediate_size,
            MAX_INTERMEDIATE,
        ),
        (
            "shared_expert_intermediate_size",
            c.shared_expert_intermediate_size,
            MAX_INTERMEDIATE,
        ),
    ];
    for (key, v, max) in optional {
        if v > max {
            return Err(k.err(key, format!("{v} is out of range; expected 0..={max}")));
        }
    }
    let moe = c.ffn_kinds.contains(&FfnKind::Moe);
    let dense = c.ffn_kinds.contains(&FfnKind::Dense);
    let needed = [
        ("intermediate_size", c.intermediate_size, dense),
        ("moe_intermediate_size", c.moe_intermediate_size, moe),
    ];
    for (key, v, used) in needed {
        if used && v == 0 {
            return Err(k.err(
                key,
                format!("0 is out of range; expected 1..={MAX_INTERMEDIATE}"),
            ));
        }
    }
    if !c.num_heads.is_multiple_of(c.num_kv_heads) {
        return Err(k.err(
            "num_key_value_heads",
            format!(
                "{} does not divide num_attention_heads {}",
                c.num_kv_heads, c.num_heads
            ),
        ));
    }
    if !c.linear_v_heads.is_multiple_of(c.linear_k_heads) {
        return Err(k.err(
            "linear_num_key_heads",
            format!(
                "{} does not divide linear_num_value_heads {}",
                c.linear_k_heads, c.linear_v_heads
            ),
        ));
    }
    if c.ffn_kinds.contains(&FfnKind::Moe)
        && (c.experts_per_token == 0 || c.experts_per_token > c.num_experts)
    {
        return Err(k.err(
            "num_experts_per_tok",
            format!(
                "{} must be in 1..=num_experts ({})",
                c.experts_per_token, c.num_experts
            ),
        ));
    }
    Ok(())
}

mod hf_json;
mod size;

#[cfg(test)]
mod tests;
