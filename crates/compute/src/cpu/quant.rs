//! Affine quantization on the CPU: [`quantize`] (bit-compatible with `mlx.core.quantize`) and the
//! quantized matrix product [`qmatmul`]. Format and layout: see [`crate::quant`].
//!
//! Product: `out[t, n] = Σ_k x[t, k] · W[n, k]` with `W[n, k] = q·s_g + b_g` evaluated in the
//! FMA dequant form
//!
//! ```text
//! out[t, n] = Σ_g ( s[n, g] · Σ_{k∈g} q[n, k]·x[t, k]  +  b[n, g] · Σ_{k∈g} x[t, k] )
//! ```
//!
//! so the inner loop is an integer-to-float convert and one FMA per weight; the per-group sums
//! of x are computed once per call. Work is split over blocks of output rows with rayon. For
//! up to [`SMALL_T`] tokens every row is dotted straight from its packed words (AVX2+FMA kernels
//! for 2/4/8 bits when the CPU has them, portable code otherwise and for 3/5/6 bits); for more
//! tokens each row is unpacked once to `q·s` in f32 and reused for all tokens.
//!
//! Quantize (per group of `group_size` weights, all in f32, matching mlx's CPU kernel bit for
//! bit — `fixtures/quant/` holds mlx's own outputs and the tests compare words, scales and
//! biases exactly):
//!
//! ```text
//! n = 2^bits − 1,  s = max((max − min)/n, 1e-7)
//! if |min| > |max|: edge = min, else: edge = max, s = −s
//! q0 = round_half_even(edge / s)
//! if q0 ≠ 0: s = edge / q0, b = edge   else: b = 0
//! q = clamp(round_half_even((w − b) / s), 0, n)
//! ```
//!
//! so the group's extreme value of larger magnitude is represented exactly. Scales and biases
//! are returned in f32; the caller rounds them to the model dtype (as mlx does).

use rayon::prelude::*;

use super::matmul::dot;
use crate::quant::{check_params, unpack_row, AffineWeight, QuantError};

/// Token counts up to this use the direct packed-row kernels.
pub const SMALL_T: usize = 4;

/// Output of [`quantize`]: `words [rows, cols·bits/32]`, `scales`, `biases [rows, cols/group]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub words: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

/// Quantize a row-major `[rows, cols]` matrix (`rows = w.len() / cols`) like
/// `mlx.core.quantize(w, group_size, bits)`.
pub fn quantize(
    w: &[f32],
    cols: usize,
    group_size: usize,
    bits: u32,
) -> Result<Quantized, QuantError> {
    check_params(bits, group_size)?;
    if cols == 0 || !cols.is_multiple_of(group_size) {
        return Err(QuantError::Indivisible {
            inp: cols,
            group_size,
        });
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            row: i / cols,
            col: i % cols,
        });
    }
    let rows = w.len() / cols;
    let (wpr, gpr) = (cols * bits as usize / 32, cols / group_size);
    let mut out = Quantized {
        words: vec![0; rows * wpr],
        scales: vec![0.0; rows * gpr],
        biases: vec![0.0; rows * gpr],
    };
    out.words
        .par_chunks_mut(wpr)
        .zip(out.scales.par_chunks_mut(gpr))
        .zip(out.biases.par_chunks_mut(gpr))
        .zip(w.par_chunks(cols))
        .for_each(|(((words, s), b), row)| {
            let mut q = vec![0u8; cols];
            for (g, (wg, qg)) in row
                .chunks_exact(group_size)
                .zip(q.chunks_exact_mut(group_size))
                .enumerate()
            {
                (s[g], b[g]) = quantize_group(wg, bits, qg);
            }
            crate::quant::pack_row(&q, bits, words);
        });
    Ok(out)
}

/// One group: q values into `q`, returns `(scale, bias)`.
fn quantize_group(w: &[f32], bits: u32, q: &mut [u8]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in w {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let min_is_edge = lo.abs() > hi.abs();
    let mut scale = ((hi - lo) / n_bins).max(1e-7);
    if !min_is_edge {
        scale = -scale;
    }
    let edge = if min_is_edge { lo } else { hi };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for (o, &v) in q.iter_mut().zip(w) {
        *o = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u8;
    }
    (scale, bias)
}

/// `out = x · Wᵀ` for `x: [t, in]`, `W` quantized `[out, in]`, `out: [t, out]`.
pub fn qmatmul(x: &[f32], t: usize, w: &AffineWeight, out: &mut [f32]) {
    let (n, k) = (w.out_features(), w.in_features());
    debug_assert_eq!(x.len(), t * k);
    debug_assert_eq!(out.len(), t * n);
    let (gs, gpr) = (w.group_size(), w.groups_per_row());
    let xsum: Vec<f32> = x.chunks_exact(gs).map(|c| c.iter().sum()).collect();
    let kernel = RowKernel::select(w.bits());
    let rows_per_task = n.div_ceil(rayon::current_num_threads() * 8).max(8);
    let wpr = w.words_per_row();
    let words = w.words();
    // [N, T] block per task, scattered to [T, N] below when T > 1.
    let mut tr = vec![0.0f32; if t == 1 { 0 } else { n * t }];
    let target: &mut [f32] = if t == 1 { out } else { &mut tr };
    target
        .par_chunks_mut(rows_per_task * t)
        .enumerate()
        .for_each(|(blk, o)| {
            let mut s = vec![0.0f32; gpr];
            let mut b = vec![0.0f32; gpr];
            let mut row = if t > SMALL_T { vec![0.0f32; k] } else { vec![] };
            for (i, orow) in o.chunks_exact_mut(t).enumerate() {
                let r = blk * rows_per_task + i;
                w.row_params(r, &mut s, &mut b);
                let wr = &words[r * wpr..(r + 1) * wpr];
                if t > SMALL_T {
                    unpack_row(wr, w.bits(), &mut row);
                    for (g, c) in row.chunks_exact_mut(gs).enumerate() {
                        c.iter_mut().for_each(|v| *v *= s[g]);
                    }
                }
                for (tt, ov) in orow.iter_mut().enumerate() {
                    let xt = &x[tt * k..(tt + 1) * k];
                    let main = if t > SMALL_T {
                        dot(&row, xt)
                    } else {
                        kernel.run(wr, xt, &s, gs)
                    };
                    *ov = main + dot(&b, &xsum[tt * gpr..(tt + 1) * gpr]);
                }
            }
        });
    if t > 1 {
        for (ni, col) in tr.chunks_exact(t).enumerate() {
            for (tt, v) in col.iter().enumerate() {
                out[tt * n + ni] = *v;
            }
        }
    }
}

/// `Σ_g s_g · Σ_{k∈g} q_k·x_k` for one packed row, by bit width and CPU features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowKernel {
    #[cfg(target_arch = "x86_64")]
    Avx2(u32),
    Portable(u32),
}

impl RowKernel {
    fn select(bits: u32) -> RowKernel {
        #[cfg(target_arch = "x86_64")]
        if matches!(bits, 2 | 4 | 8) && super::quant_x86::available() {
            return RowKernel::Avx2(bits);
        }
        RowKernel::Portable(bits)
    }

    #[inline]
    fn run(self, words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only selected when the CPU reports avx2 and fma; lengths are
            // those of a validated AffineWeight row (`words` = in·bits/32, `x` = in, `s` = in/gs).
            RowKernel::Avx2(bits) => unsafe { super::quant_x86::row_dot(bits, words, x, s, gs) },
            RowKernel::Portable(bits) => row_dot_portable(bits, words, x, s, gs),
        }
    }
}

/// Portable packed-row dot product (any supported width).
pub fn row_dot_portable(bits: u32, words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
    let wpg = gs * bits as usize / 32;
    let mut total = 0.0f32;
    let mut buf = [0.0f32; 128];
    for (g, (wg, xg)) in words.chunks_exact(wpg).zip(x.chunks_exact(gs)).enumerate() {
        let qx = match bits {
            2 => group_dot_pow2::<2>(wg, xg),
            4 => group_dot_pow2::<4>(wg, xg),
            8 => group_dot_pow2::<8>(wg, xg),
            _ => {
                unpack_row(wg, bits, &mut buf[..gs]);
                dot(&buf[..gs], xg)
            }
        };
        total += s[g] * qx;
    }
    total
}

/// `Σ q·x` over one group of a power-of-two width, written so the compiler vectorises it.
#[inline]
fn group_dot_pow2<const BITS: u32>(words: &[u32], x: &[f32]) -> f32 {
    let per = (32 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    let mut acc = [0.0f32; 8];
    for (w, xs) in words.iter().zip(x.chunks_exact(per)) {
        for (i, xv) in xs.iter().enumerate() {
            acc[i % 8] += ((w >> (i as u32 * BITS)) & mask) as f32 * xv;
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::f32_to_bf16;
    use crate::quant::{PackedWords, SUPPORTED_BITS};
    use crate::{DType, Tensor};
    use rand::{Rng, SeedableRng};

    /// An AffineWeight of a random matrix, scales/biases stored in `dtype`.
    fn random_weight(
        rng: &mut impl Rng,
        n: usize,
        k: usize,
        bits: u32,
        gs: usize,
        dtype: DType,
    ) -> AffineWeight {
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5..0.5)).collect();
        let q = quantize(&w, k, gs, bits).unwrap();
        let shape = vec![n, k / gs];
        let t = |v: &[f32]| match dtype {
            DType::F32 => Tensor::from_f32(shape.clone(), v.to_vec()),
            DType::BF16 => Tensor::from_half_bits(
                dtype,
                shape.clone(),
                v.iter().map(|&x| f32_to_bf16(x)).collect(),
            ),
            DType::F16 => Tensor::from_half_bits(
                dtype,
                shape.clone(),
                v.iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect(),
            ),
        };
        AffineWeight::new(
            bits,
            gs,
            n,
            k,
            PackedWords::from_vec(q.words),
            t(&q.scales),
            t(&q.biases),
        )
        .unwrap()
    }

    fn naive(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0.0; t * n];
        for tt in 0..t {
            for nn in 0..n {
                out[tt * n + nn] = (0..k)
                    .map(|kk| x[tt * k + kk] as f64 * w[nn * k + kk] as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn qmatmul_matches_dequantized_f32_matmul() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let dtypes = [DType::BF16, DType::F16, DType::F32];
        let mut case = 0;
        for bits in SUPPORTED_BITS {
            for gs in [32, 64, 128] {
                for &(t, n, k) in &[(1, 37, 384), (3, 19, 128), (7, 33, 256), (17, 5, 640)] {
                    if k % gs != 0 {
                        continue;
                    }
                    case += 1;
                    let w = random_weight(&mut rng, n, k, bits, gs, dtypes[case % 3]);
                    let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut got = vec![0.0; t * n];
                    qmatmul(&x, t, &w, &mut got);
                    let want = naive(&x, t, &w.dequantize(), n, k);
                    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (*a as f64 - b).abs() <= 2e-5 * scale,
                            "bits {bits} gs {gs} t {t} n {n} k {k} at {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn portable_and_dispatched_kernels_agree() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for bits in [2, 4, 8] {
            for gs in [32, 64, 128] {
                let w = random_weight(&mut rng, 3, 256, bits, gs, DType::BF16);
                let x: Vec<f32> = (0..256).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut s = vec![0.0; w.groups_per_row()];
                let mut b = vec![0.0; w.groups_per_row()];
                w.row_params(1, &mut s, &mut b);
                let wr = &w.words()[w.words_per_row()..2 * w.words_per_row()];
                let a = row_dot_portable(bits, wr, &x, &s, gs);
                let c = RowKernel::select(bits).run(wr, &x, &s, gs);
                assert!(
                    (a - c).abs() <= 1e-5 * a.abs().max(1.0),
                    "{bits}/{gs}: {a} vs {c}"
                );
            }
        }
    }

    #[test]
    fn quantize_represents_the_extreme_exactly_and_errs_within_half_a_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for bits in SUPPORTED_BITS {
            let w: Vec<f32> = (0..5 * 64).map(|_| rng.random_range(-2.0..1.0)).collect();
            let q = quantize(&w, 64, 32, bits).unwrap();
            let aw = AffineWeight::new(
                bits,
                32,
                5,
                64,
                PackedWords::from_vec(q.words.clone()),
                Tensor::from_f32(vec![5, 2], q.scales.clone()),
                Tensor::from_f32(vec![5, 2], q.biases.clone()),
            )
            .unwrap();
            let d = aw.dequantize();
            for (g, (wg, dg)) in w.chunks_exact(32).zip(d.chunks_exact(32)).enumerate() {
                // Inside the represented range the error is at most half the (adjusted) step;
                // values clipped at the far end stay within one step of the unadjusted scale.
                let (lo, hi) = wg
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
                let step = (hi - lo) / ((1u32 << bits) - 1) as f32;
                let far = if lo.abs() > hi.abs() { lo } else { hi };
                assert!(dg.iter().any(|v| (v - far).abs() <= 1e-6 * far.abs()));
                for (a, b) in wg.iter().zip(dg) {
                    let half = 0.5001 * q.scales[g].abs() + 1e-6;
                    assert!(
                        (a - b).abs() <= half || (a - b).abs() <= step,
                        "bits {bits}: {a} vs {b}"
                    );
                }
            }
        }
        // A constant group: the tiny-scale branch still reproduces the value.
        let q = quantize(&[0.25; 32], 32, 32, 4).unwrap();
        assert_eq!(q.biases, vec![0.25]);
        assert!(quantize(&[0.0; 32], 32, 32, 4)
            .unwrap()
            .words
            .iter()
            .all(|&w| w == 0));
        assert_eq!(
            quantize(&[1.0; 48], 48, 32, 4).unwrap_err(),
            QuantError::Indivisible {
                inp: 48,
                group_size: 32
            }
        );
        let mut bad = vec![0.0; 64];
        bad[40] = f32::NAN;
        assert_eq!(
            quantize(&bad, 32, 32, 4).unwrap_err(),
            QuantError::NonFinite { row: 1, col: 8 }
        );
    }
}
