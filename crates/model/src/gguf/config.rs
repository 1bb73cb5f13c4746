//! The model config of a GGUF file from its metadata, for llama.cpp's architectures `qwen35moe`
//! (Qwen3.5/3.6 MoE), `qwen35` (Qwen3.5 dense) and `qwen3next`, as its converter writes them:
//! `{arch}.block_count` counts the MTP layers (`{arch}.nextn_predict_layers`) after the main
//! ones; `attention.recurrent_layers` marks the Gated DeltaNet layers (else every
//! `full_attention_interval`-th layer is full attention); the GDN geometry is `ssm.group_count`
//! key heads of `ssm.state_size`, `ssm.time_step_rank` value heads and `ssm.inner_size` values
//! in all; the rotary dims are `rope.dimension_count`. A missing `output.weight` means tied
//! embeddings. llama.cpp's qwen3next has no dense-MLP layers and always renormalizes the top-k
//! weights, so neither is in the metadata.

use super::{GgufFile, Value};
use crate::config::{Family, FfnKind, LayerKind, ModelConfig};
use crate::error::{ModelError, Result};

/// The architectures read, with their family and the `model_type` of the HF configs they come
/// from.
const ARCHS: [(&str, Family, &str); 3] = [
    ("qwen35moe", Family::Qwen35Moe, "qwen3_5_moe"),
    ("qwen35", Family::Qwen35Dense, "qwen3_5"),
    ("qwen3next", Family::Qwen3Next, "qwen3_next"),
];

/// Metadata lookups under the architecture's prefix, naming the file and key when one is missing.
struct Keys<'a> {
    f: &'a GgufFile,
    arch: &'a str,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.f.metadata.get(&format!("{}.{key}", self.arch))
    }

    fn missing(&self, key: &str, what: &str) -> ModelError {
        ModelError::Input(format!(
            "{}: metadata key `{}.{key}` is missing or not {what}; the file may come from an \
             older converter, convert the model again with a current llama.cpp",
            self.f.path().display(),
            self.arch
        ))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| self.missing(key, "an integer"))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| self.missing(key, "a number"))
    }
}

/// The config of `f`'s model.
pub fn config(f: &GgufFile) -> Result<ModelConfig> {
    let arch = f
        .metadata
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    let Some(&(arch, family, model_type)) = ARCHS.iter().find(|a| a.0 == arch) else {
        return Err(ModelError::Input(format!(
            "{}: GGUF architecture `{arch}` is not supported (supported: qwen35moe, qwen35, \
             qwen3next)",
            f.path().display()
        )));
    };
    let k = Keys { f, arch };
    let mtp_layers = k.usize_or("nextn_predict_layers", 0)?;
    let blocks = k.usize("block_count")?;
    let n = blocks
        .checked_sub(mtp_layers)
        .filter(|&n| n > 0)
        .ok_or_else(|| k.missing("block_count", "larger than nextn_predict_layers"))?;
    if n > crate::config::MAX_LAYERS {
        let most = format!("at most {} layers", crate::config::MAX_LAYERS);
        return Err(k.missing("block_count", &most));
    }
    let layer_kinds = layer_kinds(&k, n)?;
    let (v_heads, inner) = (k.usize("ssm.time_step_rank")?, k.usize("ssm.inner_size")?);
    if v_heads == 0 || inner % v_heads != 0 {
        return Err(k.missing("ssm.inner_size", "a multiple of ssm.time_step_rank"));
    }
    let embed = f.info("token_embd.weight")?;
    let moe = family != Family::Qwen35Dense;
    let eos = f.metadata.get("tokenizer.ggml.eos_token_id");
    let first_full = layer_kinds
        .iter()
        .position(|&l| l == LayerKind::FullAttention);
    let bias = first_full.is_some_and(|i| f.tensors.contains_key(&format!("blk.{i}.attn_q.bias")));
    let c = ModelConfig {
        model_type: model_type.to_string(),
        family,
        vocab_size: embed.dims.get(1).copied().unwrap_or(0),
        hidden_size: k.usize("embedding_length")?,
        num_layers: n,
        rms_norm_eps: k.f64("attention.layer_norm_rms_epsilon")? as f32,
        layer_kinds,
        ffn_kinds: vec![if moe { FfnKind::Moe } else { FfnKind::Dense }; n],
        tie_word_embeddings: !f.tensors.contains_key("output.weight"),
        max_position_embeddings: k.usize("context_length")?,
        eos_token_ids: eos
            .and_then(Value::as_u64)
            .map(|e| e as u32)
            .into_iter()
            .collect(),
        num_heads: k.usize("attention.head_count")?,
        num_kv_heads: k.usize("attention.head_count_kv")?,
        head_dim: k.usize("attention.key_length")?,
        rotary_dim: k.usize("rope.dimension_count")?,
        rope_theta: k.f64("rope.freq_base")?,
        attention_bias: bias,
        linear_k_heads: k.usize("ssm.group_count")?,
        linear_v_heads: v_heads,
        linear_k_dim: k.usize("ssm.state_size")?,
        linear_v_dim: inner / v_heads,
        conv_kernel: k.usize("ssm.conv_kernel")?,
        intermediate_size: if moe {
            0
        } else {
            k.usize("feed_forward_length")?
        },
        num_experts: if moe { k.usize("expert_count")? } else { 0 },
        experts_per_token: if moe {
            k.usize("expert_used_count")?
        } else {
            0
        },
        moe_intermediate_size: if moe {
            k.usize("expert_feed_forward_length")?
        } else {
            0
        },
        shared_expert_intermediate_size: if moe {
            k.usize("expert_shared_feed_forward_length")?
        } else {
            0
        },
        norm_topk_prob: true,
        mtp_layers,
    };
    validate(&c, &k)?;
    Ok(c)
}

/// The checks an HF config passes (every size in range, the sizes' relations), run on the
/// config as HF's `config.json` would spell it; an error names the metadata key it came from.
fn validate(c: &ModelConfig, k: &Keys) -> Result<()> {
    let json = c.to_hf_json().to_string();
    match ModelConfig::from_json_str(&json, k.f.path()) {
        Ok(_) => Ok(()),
        Err(ModelError::Config { key, msg, .. }) => {
            let hf = key.rsplit('.').next().unwrap_or(&key);
            let from = GGUF_KEYS
                .iter()
                .find(|(h, _)| *h == hf)
                .map_or(hf, |(_, g)| *g);
            Err(ModelError::Input(format!(
                "{}: metadata `{}.{from}`: {msg}",
                k.f.path().display(),
                k.arch
            )))
        }
        Err(e) => Err(e),
    }
}

/// HF config keys and the metadata keys (after the architecture) they are read from.
const GGUF_KEYS: [(&str, &str); 20] = [
    ("vocab_size", "vocab_size (token_embd.weight rows)"),
    ("hidden_size", "embedding_length"),
    ("num_hidden_layers", "block_count"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("max_position_embeddings", "context_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("partial_rotary_factor", "rope.dimension_count"),
    ("rope_theta", "rope.freq_base"),
    ("linear_num_key_heads", "ssm.group_count"),
    ("linear_num_value_heads", "ssm.time_step_rank"),
    ("linear_key_head_dim", "ssm.state_size"),
    ("linear_value_head_dim", "ssm.inner_size"),
    ("linear_conv_kernel_dim", "ssm.conv_kernel"),
    ("intermediate_size", "feed_forward_length"),
    ("num_experts", "expert_count"),
    ("num_experts_per_tok", "expert_used_count"),
    ("moe_intermediate_size", "expert_feed_forward_length"),
    (
        "shared_expert_intermediate_size",
        "expert_shared_feed_forward_length",
    ),
];

/// The mixer of each of the `n` main layers: `attention.recurrent_layers` (true: GDN), else every
/// `full_attention_interval`-th layer full attention.
fn layer_kinds(k: &Keys, n: usize) -> Result<Vec<LayerKind>> {
    let kind = |recurrent: bool| match recurrent {
        true => LayerKind::LinearAttention,
        false => LayerKind::FullAttention,
    };
    if let Some(v) = k.get("attention.recurrent_layers") {
        let Value::Array(flags) = v else {
            return Err(k.missing("attention.recurrent_layers", "an array of booleans"));
        };
        let flags: Option<Vec<bool>> = flags
            .iter()
            .take(n)
            .map(|f| match f {
                Value::Bool(b) => Some(*b),
                _ => None,
            })
            .collect();
        return match flags {
            Some(f) if f.len() == n => Ok(f.into_iter().map(kind).collect()),
            _ => Err(k.missing("attention.recurrent_layers", "a boolean per layer")),
        };
    }
    let every = k.usize("full_attention_interval")?.max(1);
    Ok((0..n).map(|i| kind((i + 1) % every != 0)).collect())
}
