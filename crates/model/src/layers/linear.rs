//! The CPU's linear products: `y = x Wᵀ (+ b)`, one arm per weight format.

use deltamoe_compute::cpu;

use crate::checkpoint::{Linear, LinearWeight};

impl LinearWeight {
    /// `out = x · Wᵀ` for `x: [t, in]`, `out: [t, out]`.
    pub fn matmul(&self, x: &[f32], t: usize, out: &mut [f32]) {
        match self {
            LinearWeight::Dense(w) => cpu::matmul(x, t, w, out),
            LinearWeight::Affine(w) => cpu::qmatmul(x, t, w, out),
        }
    }

    /// Whether `other` is stored alike (both dense, or affine with the same bits and group).
    pub fn stored_alike(&self, other: &LinearWeight) -> bool {
        match (self, other) {
            (LinearWeight::Dense(_), LinearWeight::Dense(_)) => true,
            (LinearWeight::Affine(x), LinearWeight::Affine(y)) => {
                x.bits() == y.bits() && x.group_size() == y.group_size()
            }
            _ => false,
        }
    }

    /// Rows `start..start + len` as a view sharing the storage (quantized weights stay
    /// quantized).
    pub fn rows(&self, start: usize, len: usize) -> LinearWeight {
        match self {
            LinearWeight::Dense(t) => LinearWeight::Dense(t.narrow(start, len)),
            LinearWeight::Affine(a) => LinearWeight::Affine(Box::new(a.rows(start, len))),
        }
    }
}

impl Linear {
    /// `x: [t, in]` → `[t, out]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let n = self.out_features();
        let mut y = vec![0.0; t * n];
        self.weight.matmul(x, t, &mut y);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(n) {
                row.iter_mut().zip(b).for_each(|(v, bb)| *v += bb);
            }
        }
        y
    }
}
