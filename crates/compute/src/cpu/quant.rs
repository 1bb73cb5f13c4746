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

use std::borrow::Cow;

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
    let kernel = RowKernel::select(w.bits(), w.group_size());
    // Tasks of at least ~32 KiB of weights (fork/join costs about a microsecond), at most about
    // four per thread.
    let row_bytes = w.words_per_row() * 4 + 2 * gpr * w.scales().dtype().size();
    let rows_per_task = n
        .div_ceil(rayon::current_num_threads() * 4)
        .max((32 << 10) / row_bytes.max(1))
        .max(1);
    // Per-token x in the layout the row kernel reads (only the direct path uses it).
    let xs: Vec<Cow<[f32]>> = if t <= SMALL_T {
        x.chunks_exact(k).map(|xt| kernel.prepare(xt)).collect()
    } else {
        vec![]
    };
    // [N, T] block per task, scattered to [T, N] below when T > 1.
    let mut tr = vec![0.0f32; if t == 1 { 0 } else { n * t }];
    let target: &mut [f32] = if t == 1 { out } else { &mut tr };
    target
        .par_chunks_mut(rows_per_task * t)
        .enumerate()
        .for_each(|(blk, o)| {
            // The block's scales and biases as f32 and its packed words as one slice.
            let (r0, nr) = (blk * rows_per_task, o.len() / t);
            let mut s = vec![0.0f32; nr * gpr];
            let mut b = vec![0.0f32; nr * gpr];
            w.scales().data().read_f32(r0 * gpr, &mut s);
            w.biases().data().read_f32(r0 * gpr, &mut b);
            let mut scratch = Vec::new();
            let words = w.rows_words(r0, nr, &mut scratch);
            if t <= SMALL_T {
                for (tt, xt) in xs.iter().enumerate() {
                    let xsum_t = &xsum[tt * gpr..(tt + 1) * gpr];
                    kernel.run_rows(words, xt, xsum_t, &s, &b, gs, &mut o[tt..], t);
                }
                return;
            }
            let blk = Block {
                words,
                bits: w.bits(),
                s: &s,
                b: &b,
                gs,
            };
            if kernel.fma() {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has avx2 and fma (`RowKernel::Avx2` was selected).
                unsafe {
                    many_tokens_fma(&blk, x, &xsum, t, o)
                }
            } else {
                many_tokens::<false>(&blk, x, &xsum, t, o)
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

/// A block of consecutive rows: packed words, f32 scales and biases.
struct Block<'a> {
    words: &'a [u32],
    bits: u32,
    s: &'a [f32],
    b: &'a [f32],
    gs: usize,
}

/// More than [`SMALL_T`] tokens: each row unpacked once to `q·s` in f32, then one dot product
/// per token plus the bias term; `o` is the block's `[rows, T]` output.
#[inline(always)]
fn many_tokens<const FMA: bool>(blk: &Block, x: &[f32], xsum: &[f32], t: usize, o: &mut [f32]) {
    let k = x.len() / t;
    let (gs, gpr) = (blk.gs, k / blk.gs);
    let wpr = k * blk.bits as usize / 32;
    let mut row = vec![0.0f32; k];
    for (i, orow) in o.chunks_exact_mut(t).enumerate() {
        let wr = &blk.words[i * wpr..(i + 1) * wpr];
        match blk.bits {
            2 => unpack_pow2::<2>(wr, &mut row),
            4 => unpack_pow2::<4>(wr, &mut row),
            8 => unpack_pow2::<8>(wr, &mut row),
            bits => unpack_row(wr, bits, &mut row),
        }
        let (si, bi) = (
            &blk.s[i * gpr..(i + 1) * gpr],
            &blk.b[i * gpr..(i + 1) * gpr],
        );
        for (g, c) in row.chunks_exact_mut(gs).enumerate() {
            c.iter_mut().for_each(|v| *v *= si[g]);
        }
        for (tt, ov) in orow.iter_mut().enumerate() {
            let xt = &x[tt * k..(tt + 1) * k];
            *ov = dot8::<FMA>(&row, xt) + dot8::<FMA>(bi, &xsum[tt * gpr..(tt + 1) * gpr]);
        }
    }
}

/// Unpack a row of a power-of-two width (a fixed shift per value within a word, so the
/// compiler vectorises it).
#[inline(always)]
fn unpack_pow2<const BITS: u32>(words: &[u32], out: &mut [f32]) {
    let per = (32 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    for (w, o) in words.iter().zip(out.chunks_exact_mut(per)) {
        for (i, v) in o.iter_mut().enumerate() {
            *v = ((w >> (i as u32 * BITS)) & mask) as f32;
        }
    }
}

/// [`many_tokens`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn many_tokens_fma(blk: &Block, x: &[f32], xsum: &[f32], t: usize, o: &mut [f32]) {
    many_tokens::<true>(blk, x, xsum, t, o)
}

/// Dot product with 8 independent accumulators (fused multiply-adds with `FMA`, which must
/// only be set where the CPU has them).
#[inline(always)]
fn dot8<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
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
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// `Σ_g s_g · Σ_{k∈g} q_k·x_k` for one packed row, by bit width and CPU features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowKernel {
    #[cfg(target_arch = "x86_64")]
    Avx2(u32),
    Portable(u32),
}

impl RowKernel {
    /// The AVX2 kernels take 2, 4 and 8 bits in groups of a multiple of 32.
    fn select(bits: u32, group: usize) -> RowKernel {
        #[cfg(target_arch = "x86_64")]
        if matches!(bits, 2 | 4 | 8) && group.is_multiple_of(32) && super::quant_x86::available() {
            return RowKernel::Avx2(bits);
        }
        RowKernel::Portable(bits)
    }

    /// Whether the CPU has AVX2 + FMA (whatever the width).
    fn fma(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return super::quant_x86::available();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// `x` in the layout [`RowKernel::run`] reads.
    fn prepare(self, x: &[f32]) -> Cow<'_, [f32]> {
        match self {
            #[cfg(target_arch = "x86_64")]
            RowKernel::Avx2(bits) => Cow::Owned(super::quant_x86::prepare_x(bits, x)),
            RowKernel::Portable(_) => Cow::Borrowed(x),
        }
    }

    /// For consecutive rows (`words`, `s`, `b` of the block, `xs = self.prepare(x)`, `xsum` the
    /// per-group sums of x): `out[i·stride] = Σ_g s[i,g]·Σ q·x + Σ_g b[i,g]·xsum[g]`.
    #[allow(clippy::too_many_arguments)]
    fn run_rows(
        self,
        words: &[u32],
        xs: &[f32],
        xsum: &[f32],
        s: &[f32],
        b: &[f32],
        gs: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only selected when the CPU reports avx2 and fma; the slices are a
            // validated AffineWeight's rows: `words` = rows·in·bits/32, `xs` = in,
            // `s`, `b` = rows·in/gs, `xsum` = in/gs, `out` ≥ (rows−1)·stride + 1.
            RowKernel::Avx2(bits) => unsafe {
                super::quant_x86::rows_dot(bits, words, xs, xsum, s, b, gs, out, stride)
            },
            RowKernel::Portable(bits) => {
                let gpr = xsum.len();
                let wpr = xs.len() * bits as usize / 32;
                let rows = s.len() / gpr.max(1);
                for i in 0..rows {
                    let (si, bi) = (&s[i * gpr..(i + 1) * gpr], &b[i * gpr..(i + 1) * gpr]);
                    let wr = &words[i * wpr..(i + 1) * wpr];
                    out[i * stride] = row_dot_portable(bits, wr, xs, si, gs) + dot(bi, xsum);
                }
            }
        }
    }

    /// `xs` is `self.prepare(x)`.
    #[cfg(test)]
    fn run(self, words: &[u32], xs: &[f32], s: &[f32], gs: usize) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only selected when the CPU reports avx2 and fma; lengths are
            // those of a validated AffineWeight row (`words` = in·bits/32, `xs` = in, `s` = in/gs).
            RowKernel::Avx2(bits) => unsafe { super::quant_x86::row_dot(bits, words, xs, s, gs) },
            RowKernel::Portable(bits) => row_dot_portable(bits, words, xs, s, gs),
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
                let mut scratch = vec![];
                let wr = w.row_words(1, &mut scratch);
                let a = row_dot_portable(bits, wr, &x, &s, gs);
                let kern = RowKernel::select(bits, gs);
                let c = kern.run(wr, &kern.prepare(&x), &s, gs);
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
