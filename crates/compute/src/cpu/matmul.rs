//! Dense matrix product against a weight in its stored dtype.
//!
//! `out[t, n] = Σ_k x[t, k] · W[n, k]` with `x: [T, K]` f32 row-major, `W: [N, K]` (the PyTorch
//! `nn.Linear` layout) in f32/f16/bf16, `out: [T, N]` f32. Work is split over blocks of output
//! rows `n`; each weight row is converted to f32 once and reused for all T tokens.

use rayon::prelude::*;

use crate::tensor::{Tensor, TensorData};

/// Rows of W per parallel task: large enough to amortise scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

/// `out = x · Wᵀ`. `w` must be 2-D `[N, K]` with `K = x.len() / t`; `out.len() == t * N`.
pub fn matmul(x: &[f32], t: usize, w: &Tensor, out: &mut [f32]) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    debug_assert_eq!(x.len(), t * k);
    debug_assert_eq!(out.len(), t * n);
    let data = w.data();
    let fma = has_avx2_fma();
    // Results are produced transposed, [N, T], so each task writes a contiguous block; for one
    // token that is already `out`'s layout.
    let run = |tr: &mut [f32]| {
        tr.par_chunks_mut(ROWS_PER_TASK * t)
            .enumerate()
            .for_each(|(b, o)| {
                let first = b * ROWS_PER_TASK;
                if fma {
                    // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        rows_avx2(data, x, t, k, first, o)
                    }
                } else {
                    rows::<false>(data, x, t, k, first, o)
                }
            })
    };
    if t == 1 {
        run(out);
        return;
    }
    let mut tr = vec![0.0f32; n * t];
    run(&mut tr);
    untranspose(&tr, t, n, out);
}

/// `out [T, N]` from results computed transposed, `tr [N, T]`.
pub(crate) fn untranspose(tr: &[f32], t: usize, n: usize, out: &mut [f32]) {
    for (ni, col) in tr.chunks_exact(t).enumerate() {
        for (tt, v) in col.iter().enumerate() {
            out[tt * n + ni] = *v;
        }
    }
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows `first..` of W (as many as `o` holds, T results each) against all T tokens.
#[inline(always)]
fn rows<const FMA: bool>(
    data: TensorData,
    x: &[f32],
    t: usize,
    k: usize,
    first: usize,
    o: &mut [f32],
) {
    let mut row = vec![0.0f32; k];
    for (i, orow) in o.chunks_exact_mut(t).enumerate() {
        data.read_f32((first + i) * k, &mut row);
        for (tt, ov) in orow.iter_mut().enumerate() {
            *ov = dot_impl::<FMA>(&x[tt * k..(tt + 1) * k], &row);
        }
    }
}

/// [`rows`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(data: TensorData, x: &[f32], t: usize, k: usize, first: usize, o: &mut [f32]) {
    rows::<true>(data, x, t, k, first, o)
}

/// Dot product with 8 independent accumulators so the loop vectorises.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_impl::<false>(a, b)
}

/// With `FMA` the accumulation uses fused multiply-adds (only where the CPU has them).
#[inline(always)]
fn dot_impl<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = if FMA {
                x[i].mul_add(y[i], acc[i])
            } else {
                acc[i] + x[i] * y[i]
            };
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
