//! AVX2 + FMA paths of [`super::gpu_twin`]: the 32 lanes of a warp as four registers of 8
//! (register `t` holds lanes `8t..8t+8`), so each lane's partial sum sees exactly the fused
//! multiply-adds of its CUDA lane, in the same order. They run the full warp steps of a row (every
//! lane has a term) and return how many; the portable code finishes the row.

use std::arch::x86_64::*;

use super::gpu_twin::{group_params, LANES};
use crate::cuda::ops::AffineParams;

/// One affine row (bits 2, 4 or 8) and its prepared input, for [`Affine::run`].
pub struct Affine<'a> {
    /// The row's words (at least `32·steps`), scales and biases (of `params`).
    pub words: &'a [u32],
    pub scales: &'a [u16],
    pub biases: &'a [u16],
    pub params: AffineParams,
    /// Scratch for the scales and biases in f32: at least 8 more values than groups (one
    /// unaligned load of 8 from any group).
    pub sc: &'a mut [f32],
    pub bi: &'a mut [f32],
    /// log2 of the words per group (group / V), at least 1.
    pub wpg_log: u32,
    /// x in lane order and the per-word sums (`TwinInput::xt`, `xs`).
    pub xt: &'a [f32],
    pub xs: &'a [f32],
    /// Full warp steps: 32 words each.
    pub steps: usize,
}

/// Lane p of 8 consecutive words (the first a multiple of 8) is in group g0 + IDX[min(wpg_log,
/// 3)][p]: a permutation of 8 scales loaded from g0 (from 8 words per group on, one group).
static IDX: [[i32; 8]; 4] = [
    [0, 1, 2, 3, 4, 5, 6, 7],
    [0, 0, 1, 1, 2, 2, 3, 3],
    [0, 0, 0, 0, 1, 1, 1, 1],
    [0; 8],
];

impl Affine<'_> {
    /// Add the terms of the first `steps` warp steps to the lanes' partial sums; returns `steps`.
    ///
    /// # Safety
    /// The CPU has avx2 and fma; `bits` ∈ {2, 4, 8}; with V = 32/bits: `words.len()` and
    /// `xs.len()` ≥ 32·steps, `xt.len()` ≥ 32·V·steps, `scales.len() == biases.len()`,
    /// `sc.len()` and `bi.len()` ≥ `scales.len()` + 8, and `scales.len()` ≥ (32·steps − 8) /
    /// 2^wpg_log + 1 when steps > 0.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn run(&mut self, bits: u32, acc: &mut [f32; LANES]) -> usize {
        self.scales_to_f32(8);
        match bits {
            4 => self.steps_of::<4, 8>(acc),
            8 => self.steps_of::<8, 4>(acc),
            _ => self.steps_of::<2, 16>(acc),
        }
        self.steps
    }

    /// The same as [`Affine::run`] on the AVX-512 path ([`super::gpu_twin_x512`]), with `sc`
    /// and `bi` holding at least `scales.len()` + 16 values.
    ///
    /// # Safety
    /// The CPU has avx512f, avx2 and fma; otherwise as [`Affine::run`].
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn run_avx512(&mut self, bits: u32, acc: &mut [f32; LANES]) -> usize {
        self.scales_to_f32(16);
        super::gpu_twin_x512::steps(self, bits, acc);
        self.steps
    }

    /// The row's scales and biases in f32 (`sc`, `bi`), which must hold `pad` more values: bf16
    /// ones eight at a time, the others one at a time ([`group_params`]).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scales_to_f32(&mut self, pad: usize) {
        let gpr = self.scales.len() * 2 / self.params.bytes();
        debug_assert!(
            self.words.len() >= LANES * self.steps && self.xs.len() >= LANES * self.steps
        );
        debug_assert!(
            self.biases.len() == self.scales.len()
                && self.sc.len() >= gpr + pad
                && self.bi.len() >= gpr + pad
        );
        debug_assert!(self.steps == 0 || gpr > (LANES * self.steps - 8) >> self.wpg_log);
        let mut g = 0;
        while self.params == AffineParams::Bf16 && g + 8 <= gpr {
            for (src, dst) in [(self.scales, &mut *self.sc), (self.biases, &mut *self.bi)] {
                let h =
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(src.as_ptr().add(g) as *const __m128i));
                _mm256_storeu_ps(
                    dst.as_mut_ptr().add(g),
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)),
                );
            }
            g += 8;
        }
        for g in g..gpr {
            (self.sc[g], self.bi[g]) = group_params(self.params, self.scales, self.biases, g);
        }
    }

    /// [`Affine::run`] for `B` bits, `V` = 32/B values per word.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn steps_of<const B: i32, const V: usize>(&self, acc: &mut [f32; LANES]) {
        debug_assert!(self.xt.len() >= LANES * V * self.steps);
        let mask = _mm256_set1_epi32((1 << B) - 1);
        let idx = _mm256_loadu_si256(IDX[self.wpg_log.min(3) as usize].as_ptr() as *const __m256i);
        let (wp, xp, xsp) = (self.words.as_ptr(), self.xt.as_ptr(), self.xs.as_ptr());
        let (sp, bp) = (self.sc.as_ptr(), self.bi.as_ptr());
        let ap = acc.as_mut_ptr();
        let mut a = load4(ap);
        for j in 0..self.steps {
            let wj = wp.add(LANES * j) as *const __m256i;
            let mut cur = [
                _mm256_loadu_si256(wj),
                _mm256_loadu_si256(wj.add(1)),
                _mm256_loadu_si256(wj.add(2)),
                _mm256_loadu_si256(wj.add(3)),
            ];
            let mut qx = [_mm256_setzero_ps(); 4];
            let xb = xp.add(LANES * V * j);
            for i in 0..V {
                for t in 0..4 {
                    // Value i of each word, exact in f32; qx = fma(q_i, x_i, qx) from qx = +0.
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(cur[t], mask));
                    qx[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xb.add(LANES * i + 8 * t)), qx[t]);
                    cur[t] = _mm256_srli_epi32::<B>(cur[t]);
                }
            }
            for t in 0..4 {
                let w0 = LANES * j + 8 * t;
                let g0 = w0 >> self.wpg_log;
                let s = _mm256_permutevar8x32_ps(_mm256_loadu_ps(sp.add(g0)), idx);
                let b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(bp.add(g0)), idx);
                let inner = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsp.add(w0)), a[t]);
                a[t] = _mm256_fmadd_ps(s, qx[t], inner);
            }
        }
        for (t, v) in a.iter().enumerate() {
            _mm256_storeu_ps(ap.add(8 * t), *v);
        }
    }
}

/// bf16 row with K % 8 = 0: the first `steps` steps of 256 values (lane l: values 8l..8l+8 of
/// each), on `xt` of `TwinInput` (lane order [`super::gpu_twin::PERM`] within each register).
/// Returns `steps`.
///
/// # Safety
/// The CPU has avx2 and fma; `w.len()` ≥ 256·steps, `xt.len()` ≥ 256·steps.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn bf16_vec8(w: &[u16], xt: &[f32], steps: usize, acc: &mut [f32; LANES]) -> usize {
    use super::gpu_twin::PERM;
    debug_assert!(w.len() >= 256 * steps && xt.len() >= 256 * steps);
    let mut perm = [0.0f32; LANES];
    for t in 0..4 {
        for (p, &pl) in PERM.iter().enumerate() {
            perm[8 * t + p] = acc[8 * t + pl];
        }
    }
    let mut a = load4(perm.as_ptr());
    let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
    let (wp, xp) = (w.as_ptr(), xt.as_ptr());
    for j in 0..steps {
        for (t, at) in a.iter_mut().enumerate() {
            // Lanes 8t + 2q, 8t + 2q + 1 (16 bf16) per load; a 4×4 transpose of u32 pairs in
            // each 128-bit half gives m[d] = bf16 pair d of lanes 8t + PERM[p].
            let base = wp.add(256 * j + 64 * t) as *const __m256i;
            let l = [
                _mm256_loadu_si256(base),
                _mm256_loadu_si256(base.add(1)),
                _mm256_loadu_si256(base.add(2)),
                _mm256_loadu_si256(base.add(3)),
            ];
            let (a01, b01) = (
                _mm256_unpacklo_epi32(l[0], l[1]),
                _mm256_unpackhi_epi32(l[0], l[1]),
            );
            let (a23, b23) = (
                _mm256_unpacklo_epi32(l[2], l[3]),
                _mm256_unpackhi_epi32(l[2], l[3]),
            );
            let m = [
                _mm256_unpacklo_epi64(a01, a23),
                _mm256_unpackhi_epi64(a01, a23),
                _mm256_unpacklo_epi64(b01, b23),
                _mm256_unpackhi_epi64(b01, b23),
            ];
            let xb = xp.add(256 * j + 8 * t);
            for (d, md) in m.iter().enumerate() {
                let lo = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(*md));
                let hv = _mm256_castsi256_ps(_mm256_and_si256(*md, hi));
                *at = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xb.add(LANES * 2 * d)), *at);
                *at = _mm256_fmadd_ps(hv, _mm256_loadu_ps(xb.add(LANES * (2 * d + 1))), *at);
            }
        }
    }
    for (t, v) in a.iter().enumerate() {
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *v);
        for (p, &pl) in PERM.iter().enumerate() {
            acc[8 * t + pl] = lanes[p];
        }
    }
    steps
}

/// bf16 row with K % 8 ≠ 0: the first `steps` steps of 32 values (lane l: value 32j + l), on x
/// as it is. Returns `steps`.
///
/// # Safety
/// The CPU has avx2 and fma; `w.len()` and `x.len()` ≥ 32·steps.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn bf16_lanes(w: &[u16], x: &[f32], steps: usize, acc: &mut [f32; LANES]) -> usize {
    debug_assert!(w.len() >= LANES * steps && x.len() >= LANES * steps);
    let ap = acc.as_mut_ptr();
    let mut a = load4(ap);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for j in 0..steps {
        for (t, at) in a.iter_mut().enumerate() {
            let o = LANES * j + 8 * t;
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(wp.add(o) as *const __m128i));
            let wv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h));
            *at = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(o)), *at);
        }
    }
    for (t, v) in a.iter().enumerate() {
        _mm256_storeu_ps(ap.add(8 * t), *v);
    }
    steps
}

/// Four registers from 32 floats at `p` (no closure: closures do not inherit target features).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load4(p: *const f32) -> [__m256; 4] {
    [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ]
}

/// `warp_sum` of common.cuh over the lanes' partial sums, as lane 0 sees it: `a_l + a_{l+o}`
/// for `l < o`, `o` = 16, 8, 4, 2, 1 (the same additions as `gpu_twin::warp_sum`).
///
/// # Safety
/// The CPU has avx2 and fma.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn warp_sum(acc: &[f32; LANES]) -> f32 {
    let a = load4(acc.as_ptr());
    let s = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s)))
}
