//! The weights of gated full attention: `q_proj` (per head `[q_h | gate_h]`), `k_proj`,
//! `v_proj`, `o_proj` and the zero-centred q/k norms.

use deltamoe_compute::cpu::attention::AttnShape;

use super::Linear;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Attention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    /// `1 + q_norm.weight`.
    pub(crate) q_norm: Vec<f32>,
    /// `1 + k_norm.weight`.
    pub(crate) k_norm: Vec<f32>,
    pub(crate) shape: AttnShape,
    pub(crate) eps: f32,
}

impl Attention {
    pub fn load(store: &WeightStore, prefix: &str, c: &ModelConfig) -> Result<Attention> {
        let (h, d) = (c.hidden_size, c.head_dim);
        let (nq, nkv, bias) = (c.num_heads, c.num_kv_heads, c.attention_bias);
        Ok(Attention {
            q_proj: Linear::load(store, &format!("{prefix}.q_proj"), 2 * nq * d, h, bias)?,
            k_proj: Linear::load(store, &format!("{prefix}.k_proj"), nkv * d, h, bias)?,
            v_proj: Linear::load(store, &format!("{prefix}.v_proj"), nkv * d, h, bias)?,
            o_proj: Linear::load(store, &format!("{prefix}.o_proj"), h, nq * d, bias)?,
            q_norm: store.zero_centred_norm(&format!("{prefix}.q_norm.weight"), d)?,
            k_norm: store.zero_centred_norm(&format!("{prefix}.k_norm.weight"), d)?,
            shape: AttnShape {
                n_heads: nq,
                n_kv_heads: nkv,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            },
            eps: c.rms_norm_eps,
        })
    }
}
