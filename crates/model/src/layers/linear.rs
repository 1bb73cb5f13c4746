//! The CPU's linear products: `y = x Wᵀ (+ b)`, one arm per weight format.

use deltamoe_compute::cpu;
use deltamoe_compute::cpu::gemm_twin;

use crate::checkpoint::{Linear, LinearWeight};

/// How the CPU runs a pass's products: exactly (f32 activations, weights as stored), or with the
/// roundings of the GPU's bf16 prefill (`gpu::PrefillGemm::Bf16`): linear products with inputs
/// rounded to bf16 and weights taken as the bf16 operand the GPU multiplies
/// ([`LinearWeight::bf16_operand`]), sums in f32 (matrices the GPU's bf16 path does not take —
/// a bias, 2-bit weights, odd shapes — stay exact on both); attention over q, k, v rounded to
/// bf16 (the GPU also rounds the softmax probabilities, which this does not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Products {
    #[default]
    Exact,
    Bf16,
}

impl LinearWeight {
    /// `out = x · Wᵀ` for `x: [t, in]`, `out: [t, out]`.
    pub fn matmul(&self, x: &[f32], t: usize, out: &mut [f32]) {
        match self {
            LinearWeight::Dense(w) => cpu::matmul(x, t, w, out),
            LinearWeight::Affine(w) => cpu::qmatmul(x, t, w, out),
            LinearWeight::Fp8(w) => cpu::fp8_matmul(x, t, w, out),
        }
    }

    /// Whether the GPU's bf16 products take this matrix (bf16 rows of a multiple of 8 values,
    /// 4/8-bit affine groups of 32, 64 or 128, FP8 rows and blocks of multiples of 32; as
    /// `cuda::gemm::supported`).
    pub fn bf16_products(&self) -> bool {
        match self {
            LinearWeight::Fp8(w) => {
                w.in_features().is_multiple_of(32) && w.block()[1].is_multiple_of(32)
            }
            LinearWeight::Dense(_) => self.in_features().is_multiple_of(8),
            LinearWeight::Affine(a) => {
                matches!(a.bits(), 4 | 8) && matches!(a.group_size(), 32 | 64 | 128)
            }
        }
    }

    /// The matrix as the GPU's bf16 products multiply it, `[out, in]` in f32: stored values
    /// rounded to bf16, affine weights dequantized to bf16 with one rounding (`cpu::gemm_twin`),
    /// FP8 weights dequantized in f32 then rounded to bf16.
    pub fn bf16_operand(&self) -> Vec<f32> {
        match self {
            LinearWeight::Dense(t) => t
                .to_f32_vec()
                .into_iter()
                .map(deltamoe_compute::dtype::round_bf16)
                .collect(),
            LinearWeight::Affine(a) => {
                let bf = |t: &deltamoe_compute::tensor::Tensor| -> Vec<u16> {
                    let v = t.to_f32_vec();
                    v.into_iter()
                        .map(deltamoe_compute::dtype::f32_to_bf16)
                        .collect()
                };
                let shape = (a.out_features(), a.in_features());
                let (s, b) = (bf(a.scales()), bf(a.biases()));
                gemm_twin::dequant_affine_bf16(&a.words(), &s, &b, shape, a.group_size(), a.bits())
            }
            LinearWeight::Fp8(w) => w
                .dequantize()
                .into_iter()
                .map(deltamoe_compute::dtype::round_bf16)
                .collect(),
        }
    }

    /// Whether `other` is stored alike (both dense, both FP8 in the same blocks, or affine
    /// with the same bits and group).
    pub fn stored_alike(&self, other: &LinearWeight) -> bool {
        match (self, other) {
            (LinearWeight::Dense(_), LinearWeight::Dense(_)) => true,
            (LinearWeight::Fp8(x), LinearWeight::Fp8(y)) => x.block() == y.block(),
            (LinearWeight::Affine(x), LinearWeight::Affine(y)) => {
                x.bits() == y.bits()
                    && x.group_size() == y.group_size()
                    && x.has_zero_points() == y.has_zero_points()
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
            LinearWeight::Fp8(w) => LinearWeight::Fp8(Box::new(w.rows(start, len))),
        }
    }
}

impl Linear {
    /// `x: [t, in]` → `[t, out]`, the products as `p` says.
    pub fn forward(&self, x: &[f32], t: usize, p: Products) -> Vec<f32> {
        let n = self.out_features();
        if p == Products::Bf16 && self.bias.is_none() && self.weight.bf16_products() {
            let (k, w) = (self.weight.in_features(), self.weight.bf16_operand());
            return gemm_twin::gemm_bf16(x, &w, (n, k, t));
        }
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
