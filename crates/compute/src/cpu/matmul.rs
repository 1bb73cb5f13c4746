//! Dense matrix product against a weight in its stored dtype.
//!
//! `out[t, n] = Σ_k x[t, k] · W[n, k]` with `x: [T, K]` f32 row-major, `W: [N, K]` (the PyTorch
//! `nn.Linear` layout) in f32/f16/bf16, `out: [T, N]` f32. Work is split over blocks of output
//! rows `n`; each weight row is converted to f32 once and reused for all T tokens.

use rayon::prelude::*;

use crate::tensor::Tensor;

/// Rows of W per parallel task: large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

/// `out = x · Wᵀ`. `w` must be 2-D `[N, K]` with `K = x.len() / t`; `out.len() == t * N`.
pub fn matmul(x: &[f32], t: usize, w: &Tensor, out: &mut [f32]) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    debug_assert_eq!(x.len(), t * k);
    debug_assert_eq!(out.len(), t * n);
    let data = w.data();
    if t == 1 {
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(b, o)| {
                let mut row = vec![0.0f32; k];
                for (i, oi) in o.iter_mut().enumerate() {
                    data.read_f32((b * ROWS_PER_TASK + i) * k, &mut row);
                    *oi = dot(x, &row);
                }
            });
        return;
    }
    // Transposed result [N, T] so each task writes a contiguous block, then scatter to [T, N].
    let mut tr = vec![0.0f32; n * t];
    tr.par_chunks_mut(ROWS_PER_TASK * t)
        .enumerate()
        .for_each(|(b, o)| {
            let mut row = vec![0.0f32; k];
            for (i, orow) in o.chunks_exact_mut(t).enumerate() {
                data.read_f32((b * ROWS_PER_TASK + i) * k, &mut row);
                for (tt, ov) in orow.iter_mut().enumerate() {
                    *ov = dot(&x[tt * k..(tt + 1) * k], &row);
                }
            }
        });
    for (ni, col) in tr.chunks_exact(t).enumerate() {
        for (tt, v) in col.iter().enumerate() {
            out[tt * n + ni] = *v;
        }
    }
}

/// Dot product with 8 independent accumulators so the loop vectorises.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{bf16_to_f32, f32_to_bf16, DType};
    use rand::{Rng, SeedableRng};

    fn naive(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; t * n];
        for tt in 0..t {
            for nn in 0..n {
                let mut s = 0.0f64;
                for kk in 0..k {
                    s += x[tt * k + kk] as f64 * w[nn * k + kk] as f64;
                }
                out[tt * n + nn] = s as f32;
            }
        }
        out
    }

    #[test]
    fn matches_naive_for_odd_sizes_and_dtypes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for &(t, n, k) in &[(1, 37, 19), (5, 33, 67), (3, 1, 9), (17, 70, 130)] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let bits: Vec<u16> = wf.iter().map(|&v| f32_to_bf16(v)).collect();
            let wr: Vec<f32> = bits.iter().map(|&b| bf16_to_f32(b)).collect();
            for (w, wref) in [
                (Tensor::from_f32(vec![n, k], wf.clone()), wf.clone()),
                (
                    Tensor::from_half_bits(DType::BF16, vec![n, k], bits.clone()),
                    wr.clone(),
                ),
            ] {
                let mut out = vec![0.0; t * n];
                matmul(&x, t, &w, &mut out);
                let want = naive(&x, t, &wref, n, k);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-4, "{t}x{n}x{k}: {a} vs {b}");
                }
            }
        }
    }
}
