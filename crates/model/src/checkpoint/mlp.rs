//! The weights of a SwiGLU feed-forward `down(silu(gate x) ⊙ up x)`: dense layers, the shared
//! expert and each routed expert.

use deltamoe_compute::Tensor;

use super::{Linear, LinearWeight};
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    /// `{prefix}.{gate,up,down}_proj.weight` with intermediate size `inter`.
    pub fn load(store: &WeightStore, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate: Linear::load(store, &format!("{prefix}.gate_proj"), inter, hidden, false)?,
            up: Linear::load(store, &format!("{prefix}.up_proj"), inter, hidden, false)?,
            down: Linear::load(store, &format!("{prefix}.down_proj"), hidden, inter, false)?,
        })
    }

    pub fn from_tensors(gate: Tensor, up: Tensor, down: Tensor) -> Mlp {
        Mlp::from_weights(gate.into(), up.into(), down.into())
    }

    /// Bytes of its three weights as stored (it has no biases).
    pub fn nbytes(&self) -> usize {
        [&self.gate, &self.up, &self.down]
            .iter()
            .map(|l| l.weight.nbytes())
            .sum()
    }

    /// From weights that may be dense or quantized (e.g. views of stacked experts).
    pub fn from_weights(gate: LinearWeight, up: LinearWeight, down: LinearWeight) -> Mlp {
        Mlp {
            gate: Linear::new(gate),
            up: Linear::new(up),
            down: Linear::new(down),
        }
    }
}
