//! `y = x Wᵀ (+ b)` with `W: [out, in]` in its checkpoint dtype.

use deltamoe_compute::{cpu, Tensor};

use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Load `{prefix}.weight` of shape `[out, inp]` and, when `bias`, `{prefix}.bias`.
    pub fn load(
        store: &WeightStore,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = store.get(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias {
            Some(store.vec_f32(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn new(weight: Tensor) -> Linear {
        Linear { weight, bias: None }
    }

    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `x: [t, in]` → `[t, out]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let n = self.out_features();
        let mut y = vec![0.0; t * n];
        cpu::matmul(x, t, &self.weight, &mut y);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(n) {
                row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
            }
        }
        y
    }
}
