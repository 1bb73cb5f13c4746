//! SwiGLU feed-forward on the CPU: `down(silu(gate x) ⊙ up x)`.

use deltamoe_compute::cpu::act::silu;

use super::linear::Products;
use crate::checkpoint::Mlp;

impl Mlp {
    /// `x: [t, hidden]` → `[t, hidden]`.
    pub fn forward(&self, x: &[f32], t: usize, p: Products) -> Vec<f32> {
        let mut h = self.gate.forward(x, t, p);
        let u = self.up.forward(x, t, p);
        h.iter_mut().zip(&u).for_each(|(g, u)| *g = silu(*g) * u);
        self.down.forward(&h, t, p)
    }
}
