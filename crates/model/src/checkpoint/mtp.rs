//! The multi-token-prediction layer of Qwen3-Next and Qwen3.5/3.6 (`mtp.*`): from the embedding
//! of token t + 1 and the main model's final (normed) hidden state at t it predicts token t + 2.
//! `fc` projects `[pre_fc_norm_embedding(embed) ; pre_fc_norm_hidden(hidden)]` (embedding first)
//! to the hidden size; one full-attention decoder layer with the main layers' ffn follows, then
//! its own final norm; the embedding and lm_head are the main model's.

use super::{load_block, Layer, Linear};
use crate::config::{FfnKind, LayerKind, ModelConfig};
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Mtp {
    /// `1 + pre_fc_norm_embedding.weight`.
    pub embed_norm: Vec<f32>,
    /// `1 + pre_fc_norm_hidden.weight`.
    pub hidden_norm: Vec<f32>,
    /// `[H, 2H]`.
    pub fc: Linear,
    pub layer: Layer,
    /// `1 + norm.weight`.
    pub norm: Vec<f32>,
}

impl Mtp {
    /// The MTP layer when the config names one and the checkpoint holds it (converters such as
    /// mlx-lm drop `mtp.*` and keep the config key); configs naming several are not read.
    pub fn load(store: &WeightStore, c: &ModelConfig) -> Result<Option<Mtp>> {
        if c.mtp_layers != 1 || !store.contains_prefix("mtp.") {
            return Ok(None);
        }
        let h = c.hidden_size;
        let ffn = match c.num_experts {
            0 => FfnKind::Dense,
            _ => FfnKind::Moe,
        };
        Ok(Some(Mtp {
            embed_norm: store.zero_centred_norm("mtp.pre_fc_norm_embedding.weight", h)?,
            hidden_norm: store.zero_centred_norm("mtp.pre_fc_norm_hidden.weight", h)?,
            fc: Linear::load(store, "mtp.fc", h, 2 * h, false)?,
            layer: load_block(store, c, "mtp.layers.0", LayerKind::FullAttention, ffn)?,
            norm: store.zero_centred_norm("mtp.norm.weight", h)?,
        }))
    }
}
