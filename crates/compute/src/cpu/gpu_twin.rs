//! CPU twins of the CUDA decode kernels for one routed expert: the same f32 results, bit for bit,
//! as `matvec_bf16`, `matvec_swiglu_bf16` (kernels/matvec.cu), `matvec_affine` and
//! `matvec_swiglu_affine` (kernels/qmatvec.cu) compute for one slot. They exist so that the host
//! can compute some routed experts of a decode step while the GPU computes the others and the
//! logits do not depend on which side computed which expert.
//!
//! Formulas, per output row `n` of a matrix `W [N, K]` and one input `x [K]` (f32):
//!
//! ```text
//! matvec:  y[n] = W[n]·x                      (affine: + 0.0, as the kernel adds its absent bias)
//! swiglu:  h[n] = silu_portable(W[n]·x) · (W[I + n]·x)    W [2I, K]: gate rows, then up rows
//! ```
//!
//! Layouts ([`TwinMat`]): bf16 `[N, K]` as raw bits; affine: u32 words `[N, K·bits/32]`
//! (value `i` of a word at bits `i·bits`, V = 32/bits values per word), scales and biases
//! `[N, K/group]`, weight `q·scale + bias`; bits 2, 4, 8, group 32, 64, 128. The parameters are
//! MLX's bf16 scales and biases, or f16 scales `s` and zero points `z` with scale `s` and bias
//! `−z·s` in f32, exact ([`AffineParams`], common.cuh's `aff_scale` and `aff_bias`).
//!
//! Order of the arithmetic (what makes the bits equal): one warp of 32 lanes per row. Lane `l`
//! keeps its own partial `a_l` (starting at +0) and adds its terms in a fixed order; then
//! `warp_sum` combines the 32 partials as `a_l = a_l + a_{l+o}` for `l < o`, `o` = 16, 8, 4, 2, 1,
//! result `a_0` (every lane of the butterfly ends with that value, IEEE addition commutes).
//! - affine: lane `l` takes words `w = l, l + 32, …` in order. Per word, with `x_w` its V inputs:
//!   `qx = fma(q_{V−1}, x_{V−1}, … fma(q_0, x_0, 0))`, `xs = 0 + Σ_c ((x₀+x₁)+(x₂+x₃))` over
//!   the word's chunks of 4 in order, `a_l = fma(s_g, qx, fma(b_g, xs, a_l))`, `g = w·V / group`.
//!   The kernels' rows-per-warp `R` and `QMV_UNROLL` only batch loads: each row keeps its own
//!   accumulators, updated in this order.
//! - bf16, K % 8 = 0: lane `l` takes chunks of 8 at `k = 8l + 256j`, `j` ascending, and per chunk
//!   `a_l = fma(w_{k+c}, x_{k+c}, a_l)` for `c` = 0..8; `MV_UNROLL` only batches loads.
//! - bf16, other K: `a_l = fma(w_k, x_k, a_l)` for `k = l + 32j`, `j` ascending.
//!
//! `silu` is [`silu_portable`], the twin of common.cuh's: the kernels' `expf` is a hardware
//! approximation no host can reproduce, so these two kernels use that IEEE-exact one.
//!
//! Speed: with AVX2 + FMA (detected at run time) each AVX2 register holds 8 of the 32 lanes, so
//! four registers are one warp. For affine weights lanes `8t..8t+8` read 8 consecutive words (one
//! load); [`TwinInput`] holds x transposed so that the inputs of value `i` of those 8 words are
//! one contiguous load too, and the per-word sums `xs`. bf16 rows are loaded 16 values at a time
//! and transposed in registers. A row's last warp step, when only some lanes have a term in it,
//! runs in portable code, which also serves CPUs without AVX2 and gives the same bits
//! (`f32::mul_add` is a fused multiply-add).
//!
//! Use: [`TwinInput::new`] once per input vector and format, then [`matvec_rows`] /
//! [`swiglu_rows`] over row ranges. Both are single-threaded; callers split rows over threads.

use std::ops::Range;

use crate::cuda::ops::AffineParams;
use crate::dtype::bf16_to_f32;

/// Lanes of a CUDA warp.
pub(super) const LANES: usize = 32;
/// Elements of a bf16 row that one warp step covers when K % 8 = 0 (8 per lane).
const VEC8_STEP: usize = 8 * LANES;

/// Shapes or formats these functions cannot take. Messages are one line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TwinError {
    #[error("{0}")]
    Shape(String),
    #[error(
        "affine bits {bits}, group {group} not supported (bits 2, 4 or 8; group 32, 64 or 128)"
    )]
    Format { bits: u32, group: usize },
}

fn shape_err<T>(msg: String) -> Result<T, TwinError> {
    Err(TwinError::Shape(msg))
}

/// One expert's matrix `[N, K]` (N from the slice lengths), as the kernels read it.
#[derive(Clone, Copy, Debug)]
pub enum TwinMat<'a> {
    /// bf16 bits, row-major `[N, K]`.
    Bf16(&'a [u16]),
    /// Affine: `words [N, K·bits/32]`, `scales`, `biases [N, K/group]` as `params` says.
    Affine {
        words: &'a [u32],
        scales: &'a [u16],
        biases: &'a [u16],
        bits: u32,
        group: usize,
        params: AffineParams,
    },
}

/// Group `g`'s scale and bias in f32 from the stored arrays, as the kernels take them: bf16
/// scale and bias, f16 scale `s` and zero point `z` as `s` and `−z·s` (exact), or f32 scale and
/// bias (two 16-bit halves each, low first).
#[inline]
pub(super) fn group_params(
    params: AffineParams,
    scales: &[u16],
    biases: &[u16],
    g: usize,
) -> (f32, f32) {
    match params {
        AffineParams::Bf16 => (bf16_to_f32(scales[g]), bf16_to_f32(biases[g])),
        AffineParams::F16Zero => {
            let s = half::f16::from_bits(scales[g]).to_f32();
            (s, -half::f16::from_bits(biases[g]).to_f32() * s)
        }
        AffineParams::F32 => {
            let f = |a: &[u16]| f32::from_bits(a[2 * g] as u32 | (a[2 * g + 1] as u32) << 16);
            (f(scales), f(biases))
        }
    }
}

/// Words and 16-bit parameter values (of each array) of one affine row of width `k`.
fn affine_row(k: usize, bits: u32, group: usize, params: AffineParams) -> (usize, usize) {
    (k * bits as usize / 32, k / group * params.bytes() / 2)
}

/// Which preparation of x a matrix needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bf16,
    Affine(u32),
}

impl<'a> TwinMat<'a> {
    fn kind(&self) -> Kind {
        match self {
            TwinMat::Bf16(_) => Kind::Bf16,
            TwinMat::Affine { bits, .. } => Kind::Affine(*bits),
        }
    }

    /// Rows `rows` of this `[N, k]` matrix as a matrix of their own (matrix e of a stack of
    /// `[N, k]` matrices is rows `e·N..(e+1)·N` of the stack). Panics past the end.
    pub fn row_range(&self, k: usize, rows: Range<usize>) -> TwinMat<'a> {
        match *self {
            TwinMat::Bf16(w) => TwinMat::Bf16(&w[rows.start * k..rows.end * k]),
            TwinMat::Affine {
                words,
                scales,
                biases,
                bits,
                group,
                params,
            } => {
                let (wpr, gpr) = affine_row(k, bits, group, params);
                TwinMat::Affine {
                    words: &words[rows.start * wpr..rows.end * wpr],
                    scales: &scales[rows.start * gpr..rows.end * gpr],
                    biases: &biases[rows.start * gpr..rows.end * gpr],
                    bits,
                    group,
                    params,
                }
            }
        }
    }

    /// Rows N for inputs of width `k`, after checking every length and the format.
    fn rows(&self, k: usize) -> Result<usize, TwinError> {
        match *self {
            TwinMat::Bf16(w) => {
                if !w.len().is_multiple_of(k) {
                    return shape_err(format!("bf16 matrix of {} values is not [N, {k}]", w.len()));
                }
                Ok(w.len() / k)
            }
            TwinMat::Affine {
                words,
                scales,
                biases,
                bits,
                group,
                params,
            } => {
                if !matches!(bits, 2 | 4 | 8) || !matches!(group, 32 | 64 | 128) {
                    return Err(TwinError::Format { bits, group });
                }
                if !k.is_multiple_of(group) {
                    return shape_err(format!("K = {k} is not a multiple of the group {group}"));
                }
                let (wpr, gpr) = affine_row(k, bits, group, params);
                let n = words.len() / wpr;
                if words.len() != n * wpr || scales.len() != n * gpr || biases.len() != n * gpr {
                    return shape_err(format!(
                        "affine matrix of {} words, {} scales, {} biases is not [N, {k}] at \
                         {bits} bits, group {group}",
                        words.len(),
                        scales.len(),
                        biases.len()
                    ));
                }
                Ok(n)
            }
        }
    }
}

/// An input vector prepared once for every row of every matrix of its width and format (bf16,
/// or affine of one bit width; any group): the values, and for the AVX2 path x in lane order
/// (`xt`) and, for affine weights, the per-word sums `xs` in the kernel's order.
#[derive(Clone, Debug)]
pub struct TwinInput {
    kind: Kind,
    x: Vec<f32>,
    /// Affine: `xt[(j·V + i)·32 + l] = x[(32j + l)·V + i]` for the full steps j (all 32 words
    /// present). bf16 with K % 8 = 0: `xt[(8j + c)·32 + 8t + p] = x[256j + 8·(8t + PERM[p]) + c]`
    /// ([`PERM`]: the lane order the register transpose leaves). Empty otherwise.
    xt: Vec<f32>,
    /// Affine: the sum of word w's inputs, `xs[w]`, in the kernel's order.
    xs: Vec<f32>,
}

/// Lane `8t + PERM[p]` of a warp sits at position `p` of register `t` in the bf16 K % 8 = 0 path.
pub(super) const PERM: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

impl TwinInput {
    /// Prepare `x` (its length is K) for matrices of `m`'s format.
    pub fn new(x: &[f32], m: &TwinMat) -> Result<TwinInput, TwinError> {
        let k = x.len();
        if k == 0 {
            return shape_err("empty input".into());
        }
        let kind = m.kind();
        let (mut xt, mut xs) = (Vec::new(), Vec::new());
        match kind {
            Kind::Affine(bits) => {
                if !matches!(bits, 2 | 4 | 8) || !k.is_multiple_of(32) {
                    return shape_err(format!("K = {k} at {bits} bits is not an affine input"));
                }
                let v = 32 / bits as usize;
                let nw = k / v;
                xs = x
                    .chunks_exact(v)
                    .map(|c| {
                        c.chunks_exact(4)
                            .fold(0.0f32, |s, q| s + ((q[0] + q[1]) + (q[2] + q[3])))
                    })
                    .collect();
                let steps = nw / LANES;
                xt = vec![0.0; steps * v * LANES];
                for (w, word_x) in x[..steps * LANES * v].chunks_exact(v).enumerate() {
                    let (j, l) = (w / LANES, w % LANES);
                    for (i, &xv) in word_x.iter().enumerate() {
                        xt[(j * v + i) * LANES + l] = xv;
                    }
                }
            }
            Kind::Bf16 if k.is_multiple_of(8) => {
                let steps = k / VEC8_STEP;
                xt = vec![0.0; steps * VEC8_STEP];
                for j in 0..steps {
                    for t in 0..4 {
                        for (p, &pl) in PERM.iter().enumerate() {
                            let src = VEC8_STEP * j + 8 * (8 * t + pl);
                            for c in 0..8 {
                                xt[(8 * j + c) * LANES + 8 * t + p] = x[src + c];
                            }
                        }
                    }
                }
            }
            Kind::Bf16 => {}
        }
        Ok(TwinInput {
            kind,
            x: x.to_vec(),
            xt,
            xs,
        })
    }

    /// K.
    pub fn len(&self) -> usize {
        self.x.len()
    }

    /// Always false (inputs are not empty); here for `len`'s sake.
    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }
}

/// `silu(x) = x / (1 + e^−x)` from IEEE-exact operations, bit for bit `silu_portable` of
/// kernels/common.cuh (which documents the steps). Within 3 ulp of the exact value where
/// `|silu(x)| ≥ 1e-36`; −0 for `x ≤ −88.72` (where `e^−x` overflows f32); NaN for NaN.
pub fn silu_portable(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = -x;
    if a >= 89.0 {
        return -0.0;
    }
    if a < -104.0 {
        return x;
    }
    let n = (a * f32::from_bits(0x3fb8_aa3b)).round_ties_even();
    let r = (-n).mul_add(f32::from_bits(0x3f31_7218), a);
    let r = (-n).mul_add(f32::from_bits(0xb102_e308), r);
    let mut p = f32::from_bits(0x3950_0d01);
    for c in [
        0x3ab6_0b61,
        0x3c08_8889,
        0x3d2a_aaab,
        0x3e2a_aaab,
        0x3f00_0000,
    ] {
        p = p.mul_add(r, f32::from_bits(c));
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    let k = n as i32;
    let k1 = k >> 1;
    let s1 = f32::from_bits(((k1 + 127) << 23) as u32);
    let s2 = f32::from_bits(((k - k1 + 127) << 23) as u32);
    x / (p * s1).mul_add(s2, 1.0)
}

/// `y[j] = W[rows.start + j]·x` for `W [N, K]`, bit for bit `matvec_bf16` / `matvec_affine`
/// (no bias) for one slot. `x` was prepared for `m`'s format; `y.len() == rows.len()`.
pub fn matvec_rows(
    m: &TwinMat,
    x: &TwinInput,
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), TwinError> {
    matvec_rows_on(best_path(), m, x, rows, y)
}

/// `h[j] = silu_portable(G[n]·x) · (U[n]·x)` with `n = range.start + j` for `W [2I, K]` (gate
/// rows `0..I`, up rows `I..2I`), bit for bit `matvec_swiglu_bf16` / `matvec_swiglu_affine` for
/// one slot. `range ⊆ 0..I`, `h.len() == range.len()`.
pub fn swiglu_rows(
    m: &TwinMat,
    i: usize,
    x: &TwinInput,
    range: Range<usize>,
    h: &mut [f32],
) -> Result<(), TwinError> {
    swiglu_rows_on(best_path(), m, i, x, range, h)
}

/// How the lanes' partial sums are computed; both give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// Affine rows with AVX-512 ([`super::gpu_twin_x512`]), bf16 rows as `Avx2`.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// Every path this CPU runs, the fastest last.
pub(super) fn paths() -> Vec<Path> {
    #[allow(unused_mut)]
    let mut p = vec![Path::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if super::quant_x86::available() {
            p.push(Path::Avx2);
        }
        if super::gpu_twin_x512::available() {
            p.push(Path::Avx512);
        }
    }
    p
}

pub(super) fn best_path() -> Path {
    static BEST: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *BEST.get_or_init(|| paths().last().copied().unwrap_or(Path::Portable))
}

pub(super) fn matvec_rows_on(
    path: Path,
    m: &TwinMat,
    x: &TwinInput,
    rows: Range<usize>,
    y: &mut [f32],
) -> Result<(), TwinError> {
    let n = check(m, x)?;
    if rows.start > rows.end || rows.end > n || y.len() != rows.len() {
        return shape_err(format!("rows {rows:?} of {n} into {} outputs", y.len()));
    }
    let mut d = RowDot::new(path, m, x);
    let affine = matches!(m, TwinMat::Affine { .. });
    let ahead = d.ahead();
    for (out, r) in y.iter_mut().zip(rows) {
        d.prefetch(r + ahead, n);
        let v = d.row(r);
        // matvec_affine writes `out + (bias ? bias : 0.f)`; matvec_bf16 adds only a real bias.
        *out = if affine { v + 0.0 } else { v };
    }
    Ok(())
}

pub(super) fn swiglu_rows_on(
    path: Path,
    m: &TwinMat,
    i: usize,
    x: &TwinInput,
    range: Range<usize>,
    h: &mut [f32],
) -> Result<(), TwinError> {
    let n = check(m, x)?;
    if n != 2 * i || range.start > range.end || range.end > i || h.len() != range.len() {
        return shape_err(format!(
            "SwiGLU outputs {range:?} of I = {i} from {n} rows into {} outputs",
            h.len()
        ));
    }
    let mut d = RowDot::new(path, m, x);
    let ahead = d.ahead();
    for (out, r) in h.iter_mut().zip(range) {
        d.prefetch(r + ahead, n);
        d.prefetch(i + r + ahead, n);
        let g = d.row(r);
        let u = d.row(i + r);
        *out = silu_portable(g) * u;
    }
    Ok(())
}

/// N of `m` after checking that `x` was prepared for it.
fn check(m: &TwinMat, x: &TwinInput) -> Result<usize, TwinError> {
    if m.kind() != x.kind {
        return shape_err(format!(
            "input prepared for {:?}, matrix is {:?}",
            x.kind,
            m.kind()
        ));
    }
    m.rows(x.len())
}

/// Warp-summed dot products of single rows with one input, reusing per-row scratch.
struct RowDot<'a> {
    path: Path,
    m: TwinMat<'a>,
    x: &'a TwinInput,
    /// SIMD affine: the row's scales and biases in f32, padded by 16 (one unaligned load of a
    /// register from any group).
    sc: Vec<f32>,
    bi: Vec<f32>,
}

impl<'a> RowDot<'a> {
    fn new(path: Path, m: &TwinMat<'a>, x: &'a TwinInput) -> RowDot<'a> {
        let gpr = match m {
            TwinMat::Affine { group, .. } => x.len() / group,
            TwinMat::Bf16(_) => 0,
        };
        RowDot {
            path,
            m: *m,
            x,
            sc: vec![0.0; gpr + 16],
            bi: vec![0.0; gpr + 16],
        }
    }

    /// Rows ahead of the current one whose weights to ask the caches for: about 2 KiB ahead, at
    /// most 8 rows (weights come from DRAM, and a piece's rows are too few for the hardware
    /// prefetcher to ramp up).
    fn ahead(&self) -> usize {
        let bytes = match self.m {
            TwinMat::Bf16(_) => 2 * self.x.len(),
            TwinMat::Affine { bits, .. } => self.x.len() * bits as usize / 8,
        };
        (2048 / bytes.max(1)).clamp(1, 8)
    }

    /// Ask the caches for row `r`'s weights (nothing past the last of `n` rows).
    fn prefetch(&self, r: usize, n: usize) {
        if r >= n {
            return;
        }
        let k = self.x.len();
        match self.m.row_range(k, r..r + 1) {
            TwinMat::Bf16(w) => prefetch_bytes(w),
            TwinMat::Affine {
                words,
                scales,
                biases,
                ..
            } => {
                prefetch_bytes(words);
                prefetch_bytes(scales);
                prefetch_bytes(biases);
            }
        }
    }

    /// Row `r`'s dot product with x, summed over the lanes as `warp_sum` does.
    fn row(&mut self, r: usize) -> f32 {
        let k = self.x.len();
        let mut acc = [0.0f32; LANES];
        match self.m.row_range(k, r..r + 1) {
            TwinMat::Bf16(w) => {
                let vec8 = k.is_multiple_of(8);
                let step = if vec8 { VEC8_STEP } else { LANES };
                let done = match self.path {
                    Path::Portable => 0,
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Avx2` and `Avx512` are only chosen when the CPU has avx2 and fma;
                    // `xt` was built for this K (`check`), holding `k / 256` full steps.
                    Path::Avx2 | Path::Avx512 => unsafe {
                        if vec8 {
                            super::gpu_twin_x86::bf16_vec8(w, &self.x.xt, k / step, &mut acc)
                        } else {
                            super::gpu_twin_x86::bf16_lanes(w, &self.x.x, k / step, &mut acc)
                        }
                    },
                };
                bf16_portable(w, &self.x.x, vec8, done, &mut acc);
            }
            TwinMat::Affine {
                words,
                scales,
                biases,
                bits,
                group,
                params,
            } => {
                let (v, nw) = (32 / bits as usize, words.len());
                let done = match self.path {
                    Path::Portable => 0,
                    #[cfg(target_arch = "x86_64")]
                    Path::Avx2 | Path::Avx512 => {
                        let mut a = super::gpu_twin_x86::Affine {
                            words,
                            scales,
                            biases,
                            params,
                            sc: &mut self.sc,
                            bi: &mut self.bi,
                            wpg_log: (group / v).trailing_zeros(),
                            xt: &self.x.xt,
                            xs: &self.x.xs,
                            steps: nw / LANES,
                        };
                        // SAFETY: `Avx2` is only chosen when the CPU has avx2 and fma, `Avx512`
                        // when it also has avx512f; `a`'s slices meet `run`'s requirements:
                        // `xt`, `xs` were built for this K and bit width (`check`), `sc`, `bi`
                        // hold gpr + 16 values.
                        unsafe {
                            if self.path == Path::Avx512 {
                                a.run_avx512(bits, &mut acc)
                            } else {
                                a.run(bits, &mut acc)
                            }
                        }
                    }
                };
                let g = Group {
                    words,
                    scales,
                    biases,
                    params,
                    bits,
                    gshift: group.trailing_zeros(),
                };
                affine_portable(&g, &self.x.x, &self.x.xs, done, &mut acc);
            }
        }
        match self.path {
            Path::Portable => warp_sum(acc),
            // SAFETY: `Avx2` and `Avx512` are only chosen when the CPU has avx2 and fma.
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 | Path::Avx512 => unsafe { super::gpu_twin_x86::warp_sum(&acc) },
        }
    }
}

/// Ask the CPU's caches for the lines of `v` (a hint: no effect on results).
fn prefetch_bytes<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(v);
        let p = v.as_ptr() as *const i8;
        for off in (0..bytes).step_by(64) {
            // SAFETY: `off` is within `v`; a prefetch reads nothing and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// `warp_sum` of common.cuh as lane 0 sees it.
fn warp_sum(mut a: [f32; LANES]) -> f32 {
    let mut o = LANES / 2;
    while o > 0 {
        for l in 0..o {
            a[l] += a[l + o];
        }
        o /= 2;
    }
    a[0]
}

/// One affine row in its stored form.
struct Group<'a> {
    words: &'a [u32],
    scales: &'a [u16],
    biases: &'a [u16],
    params: AffineParams,
    bits: u32,
    gshift: u32,
}

/// Lanes' terms of an affine row from warp step `from` on (word `32·from + l` first).
fn affine_portable(g: &Group, x: &[f32], xs: &[f32], from: usize, acc: &mut [f32; LANES]) {
    if LANES * from >= g.words.len() {
        return;
    }
    let v = 32 / g.bits as usize;
    let mask = (1u32 << g.bits) - 1;
    for (l, a) in acc.iter_mut().enumerate() {
        for w in (LANES * from + l..g.words.len()).step_by(LANES) {
            let word = g.words[w];
            let k = w * v;
            let mut qx = 0.0f32;
            for (i, &xv) in x[k..k + v].iter().enumerate() {
                let q = ((word >> (i as u32 * g.bits)) & mask) as f32;
                qx = q.mul_add(xv, qx);
            }
            let gi = k >> g.gshift;
            let (s, b) = group_params(g.params, g.scales, g.biases, gi);
            *a = s.mul_add(qx, b.mul_add(xs[w], *a));
        }
    }
}

/// Lanes' terms of a bf16 row from warp step `from` on.
fn bf16_portable(w: &[u16], x: &[f32], vec8: bool, from: usize, acc: &mut [f32; LANES]) {
    let k = w.len();
    if from * if vec8 { VEC8_STEP } else { LANES } >= k {
        return;
    }
    for (l, a) in acc.iter_mut().enumerate() {
        if vec8 {
            for base in (VEC8_STEP * from + 8 * l..k).step_by(VEC8_STEP) {
                for c in base..base + 8 {
                    *a = bf16_to_f32(w[c]).mul_add(x[c], *a);
                }
            }
        } else {
            for c in (LANES * from + l..k).step_by(LANES) {
                *a = bf16_to_f32(w[c]).mul_add(x[c], *a);
            }
        }
    }
}
