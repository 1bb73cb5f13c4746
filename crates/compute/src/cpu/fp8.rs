//! Products against fine-grained FP8 weights ([`Fp8Weight`]).
//!
//! `out[t, n] = Σ_k x[t, k] · w[n, k]` with `x: [T, K]` f32, `w` dequantized row by row exactly
//! as the format's formula rounds it (`e4m3(code) · scale`, one f32 rounding: the values
//! transformers multiplies after its own f32 dequantization), `out: [T, N]` f32. Split over
//! blocks of output rows like [`super::matmul`]; each row is dequantized once for all T tokens.

use rayon::prelude::*;

use super::matmul::{dot, untranspose};
use crate::fp8::Fp8Weight;

/// Rows of W per parallel task.
const ROWS_PER_TASK: usize = 16;

/// `out = x · Wᵀ`; `x.len() == t · K`, `out.len() == t · N`.
pub fn fp8_matmul(x: &[f32], t: usize, w: &Fp8Weight, out: &mut [f32]) {
    let (n, k) = (w.out_features(), w.in_features());
    debug_assert_eq!(x.len(), t * k);
    debug_assert_eq!(out.len(), t * n);
    // Results [N, T] so that each task writes one contiguous block (for t == 1, `out` itself).
    let run = |tr: &mut [f32]| {
        tr.par_chunks_mut(ROWS_PER_TASK * t)
            .enumerate()
            .for_each(|(b, o)| {
                let mut row = vec![0.0f32; k];
                for (i, res) in o.chunks_exact_mut(t).enumerate() {
                    w.dequantize_row(b * ROWS_PER_TASK + i, &mut row);
                    for (tt, r) in res.iter_mut().enumerate() {
                        *r = dot(&row, &x[tt * k..(tt + 1) * k]);
                    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::fp8::Bytes;

    #[test]
    fn matches_the_dequantized_product_on_partial_blocks() {
        let (n, k, t) = (37usize, 300usize, 3usize);
        let codes: Vec<u8> = (0..n * k)
            .map(|i| ((i * 73 + 11) % 256) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0x3a } else { b })
            .collect();
        let grid = n.div_ceil(16) * k.div_ceil(128);
        let scales: Vec<f32> = (0..grid).map(|i| 0.01 + 0.003 * i as f32).collect();
        let w =
            Fp8Weight::new(n, k, [16, 128], Bytes::from_vec(codes), scales, DType::F32).unwrap();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let d = w.dequantize();
        let mut out = vec![0.0; t * n];
        fp8_matmul(&x, t, &w, &mut out);
        for tt in 0..t {
            for r in 0..n {
                let want: f64 = (0..k)
                    .map(|j| d[r * k + j] as f64 * x[tt * k + j] as f64)
                    .sum();
                let got = out[tt * n + r] as f64;
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{r} {tt}: {got} vs {want}"
                );
            }
        }
        let mut one = vec![0.0; n];
        fp8_matmul(&x[..k], 1, &w, &mut one);
        assert_eq!(one, out[..n].to_vec());
    }
}
