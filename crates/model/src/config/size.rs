//! Parameter counts implied by a config alone (no weight files), for memory estimates made
//! before anything is allocated: `bench --synthetic` sizes its random weights from them.

use super::{FfnKind, LayerKind, ModelConfig};

impl ModelConfig {
    /// Weights the model holds, counted from the shapes its loaders ask for (embedding, lm_head
    /// when untied, each layer's mixer, feed-forward and norms, the final norm; not the MTP
    /// layer). Saturates instead of overflowing on absurd shapes.
    pub fn weight_params(&self) -> u64 {
        let c = self;
        let w = |n: usize| n as u128;
        let (h, v) = (w(c.hidden_size), w(c.vocab_size));
        let mut total = v * h * if c.tie_word_embeddings { 1 } else { 2 } + h;
        let (kd, vd, nv) = (
            w(c.linear_key_size()),
            w(c.linear_value_size()),
            w(c.linear_v_heads),
        );
        let gdn = (2 * kd + 2 * vd + 2 * nv) * h // q, k, v, z, b and a projections
            + w(c.conv_dim()) * w(c.conv_kernel)
            + 2 * nv
            + w(c.linear_v_dim)
            + h * vd;
        let (nq, nkv, d) = (w(c.num_heads), w(c.num_kv_heads), w(c.head_dim));
        // q_proj is twice as wide: it carries the output gate.
        let attn = (2 * nq * d + 2 * nkv * d) * h + h * nq * d + 2 * d;
        let mlp = |inter: usize| 3 * w(inter) * h;
        let e = w(c.num_experts);
        let moe =
            e * h + e * mlp(c.moe_intermediate_size) + mlp(c.shared_expert_intermediate_size) + h;
        for (mixer, ffn) in c.layer_kinds.iter().zip(&c.ffn_kinds) {
            total += 2 * h;
            total += match mixer {
                LayerKind::LinearAttention => gdn,
                LayerKind::FullAttention => attn,
            };
            total += match ffn {
                FfnKind::Dense => mlp(c.intermediate_size),
                FfnKind::Moe => moe,
            };
        }
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// Elements of the largest single tensor the loaders ask for (the embedding, or a layer's
    /// widest projection): random weights are made in f32 one tensor at a time before
    /// conversion, so this bounds that scratch.
    pub fn largest_tensor_params(&self) -> u64 {
        let h = self.hidden_size as u128;
        let widest = [
            self.vocab_size,
            self.conv_dim(),
            2 * self.num_heads * self.head_dim,
            self.intermediate_size,
            self.moe_intermediate_size,
            self.shared_expert_intermediate_size,
        ]
        .into_iter()
        .max()
        .unwrap_or(0) as u128;
        u64::try_from(widest * h).unwrap_or(u64::MAX)
    }
}
