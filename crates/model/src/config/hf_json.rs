//! A [`ModelConfig`] written back as an HF `config.json` (transformers-5 spelling) that
//! [`ModelConfig::from_json_str`] reads as the same config: what `convert` writes for a source
//! with no config.json of its own (a GGUF file).

use serde_json::{json, Map, Value};

use super::{Family, FfnKind, LayerKind, ModelConfig};

impl ModelConfig {
    /// The config as HF's `config.json`: `qwen3_5_moe` and `qwen3_5` nest the text model under
    /// `text_config` (with tying and the end ids at the top level too), `qwen3_next` is flat.
    pub fn to_hf_json(&self) -> Value {
        let nested = matches!(self.model_type.as_str(), "qwen3_5_moe" | "qwen3_5");
        let text_type = match (nested, self.family) {
            (true, Family::Qwen35Moe) => "qwen3_5_moe_text",
            (true, _) => "qwen3_5_text",
            (false, _) => self.model_type.as_str(),
        };
        let mut t = Map::new();
        let mut put = |k: &str, v: Value| {
            t.insert(k.to_string(), v);
        };
        put("model_type", text_type.into());
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("num_hidden_layers", self.num_layers.into());
        // The f32's shortest decimal (1e-6, not 9.99999997e-7), which reads back as the same f32.
        let eps = self.rms_norm_eps.to_string().parse::<f64>();
        put(
            "rms_norm_eps",
            eps.unwrap_or(f64::from(self.rms_norm_eps)).into(),
        );
        let kinds = self.layer_kinds.iter().map(|k| match k {
            LayerKind::LinearAttention => "linear_attention",
            LayerKind::FullAttention => "full_attention",
        });
        put("layer_types", kinds.collect::<Vec<_>>().into());
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        put(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        put("eos_token_id", self.eos_token_ids.clone().into());
        put("hidden_act", "silu".into());
        put("num_attention_heads", self.num_heads.into());
        put("num_key_value_heads", self.num_kv_heads.into());
        put("head_dim", self.head_dim.into());
        // The fraction whose product with head_dim floors to rotary_dim again (as it is read).
        let mut factor = self.rotary_dim as f64 / self.head_dim as f64;
        if ((self.head_dim as f64 * factor) as usize) < self.rotary_dim {
            factor = f64::from_bits(factor.to_bits() + 1);
        }
        let rope = json!({"rope_type": "default", "rope_theta": self.rope_theta,
            "partial_rotary_factor": factor});
        put("rope_parameters", rope);
        put("attention_bias", self.attention_bias.into());
        put("linear_num_key_heads", self.linear_k_heads.into());
        put("linear_num_value_heads", self.linear_v_heads.into());
        put("linear_key_head_dim", self.linear_k_dim.into());
        put("linear_value_head_dim", self.linear_v_dim.into());
        put("linear_conv_kernel_dim", self.conv_kernel.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_experts", self.num_experts.into());
        put("num_experts_per_tok", self.experts_per_token.into());
        put("moe_intermediate_size", self.moe_intermediate_size.into());
        let shared = self.shared_expert_intermediate_size;
        put("shared_expert_intermediate_size", shared.into());
        put("norm_topk_prob", self.norm_topk_prob.into());
        if self.family == Family::Qwen3Next {
            let dense = (0..self.num_layers).filter(|&i| self.ffn_kinds[i] == FfnKind::Dense);
            put("mlp_only_layers", dense.collect::<Vec<_>>().into());
            put("decoder_sparse_step", 1.into());
        }
        put("mtp_num_hidden_layers", self.mtp_layers.into());
        if !nested {
            return Value::Object(t);
        }
        json!({
            "model_type": self.model_type,
            "architectures": [match self.family {
                Family::Qwen35Moe => "Qwen3_5MoeForConditionalGeneration",
                _ => "Qwen3_5ForConditionalGeneration",
            }],
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_ids,
            "text_config": Value::Object(t),
        })
    }
}
