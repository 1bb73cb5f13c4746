//! Per-sequence model state: the position reached and, per layer, the KV cache (full attention)
//! or the conv and recurrent states (Gated DeltaNet). Each sequence owns one; sequences never
//! share state.

use crate::layers::attention::KvCache;

#[derive(Clone, Debug)]
pub enum LayerState {
    /// Conv state `[K−1, C]` and recurrent state `[Hv, Dk, Dv]`, f32.
    Linear {
        conv: Vec<f32>,
        recurrent: Vec<f32>,
    },
    Full(KvCache),
}

#[derive(Clone, Debug)]
pub struct SequenceState {
    /// Tokens processed so far (the next token's position).
    pub pos: usize,
    pub layers: Vec<LayerState>,
    /// The MTP layer's KV cache: one row per (token, hidden state) pair it has run, at the
    /// position of the hidden state (empty without an MTP layer).
    pub mtp: KvCache,
}

impl SequenceState {
    /// Bytes held by the state now.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Linear { conv, recurrent } => conv.len() + recurrent.len(),
                LayerState::Full(c) => c.k.len() + c.v.len(),
            })
            .sum::<usize>()
            * 4
            + (self.mtp.k.len() + self.mtp.v.len()) * 4
    }
}
