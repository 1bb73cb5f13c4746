//! AVX-512 path of [`super::gpu_twin`]'s affine rows: the 32 lanes of a warp as two registers
//! of 16 (register `t` holds lanes `16t..16t+16`), each lane's partial sum seeing exactly the
//! fused multiply-adds of its CUDA lane, in the same order (as the AVX2 path of
//! [`super::gpu_twin_x86`], at half the instructions per weight).
//!
//! A 2- or 4-bit code becomes its f32 value through a 16-entry table indexed by the low four
//! bits of the shifted word (`vpermps` reads only those): table entry j is `j mod 2^bits`, so no
//! mask is needed; 8-bit codes are masked and converted.

use std::arch::x86_64::*;

use super::gpu_twin::LANES;
use super::gpu_twin_x86::Affine;

/// Whether the CPU runs this path (it also uses the AVX2 helpers for scales and the lane sum).
pub fn available() -> bool {
    super::quant_x86::available() && is_x86_feature_detected!("avx512f")
}

/// Lane positions 0..16.
static IOTA: [i32; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// Add the terms of the first `a.steps` warp steps to the lanes' partial sums, the scales and
/// biases already in `a.sc`, `a.bi` as f32.
///
/// # Safety
/// The CPU has avx512f; `bits` ∈ {2, 4, 8}; the slices of `a` as [`Affine::run_avx512`]
/// requires.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn steps(a: &Affine, bits: u32, acc: &mut [f32; LANES]) {
    match bits {
        4 => steps_of::<4, 8>(a, acc),
        8 => steps_of::<8, 4>(a, acc),
        _ => steps_of::<2, 16>(a, acc),
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn steps_of<const B: u32, const V: usize>(a: &Affine, acc: &mut [f32; LANES]) {
    debug_assert!(a.xt.len() >= LANES * V * a.steps);
    let mask = (1u32 << B) - 1;
    let table: [f32; 16] = std::array::from_fn(|j| (j as u32 & mask) as f32);
    let table = _mm512_loadu_ps(table.as_ptr());
    let maskv = _mm512_set1_epi32(mask as i32);
    // Lane l of a register starting at word w0 (a multiple of 16) is in group g0 + (l >> log).
    let idx = _mm512_srlv_epi32(
        _mm512_loadu_si512(IOTA.as_ptr() as *const __m512i),
        _mm512_set1_epi32(a.wpg_log as i32),
    );
    let (wp, xp, xsp) = (a.words.as_ptr(), a.xt.as_ptr(), a.xs.as_ptr());
    let (sp, bp) = (a.sc.as_ptr(), a.bi.as_ptr());
    let ap = acc.as_mut_ptr();
    let mut s = [_mm512_loadu_ps(ap), _mm512_loadu_ps(ap.add(16))];
    for j in 0..a.steps {
        let wj = wp.add(LANES * j) as *const __m512i;
        let mut cur = [_mm512_loadu_si512(wj), _mm512_loadu_si512(wj.add(1))];
        let mut qx = [_mm512_setzero_ps(); 2];
        let xb = xp.add(LANES * V * j);
        for i in 0..V {
            for t in 0..2 {
                // Value i of each word, exact in f32; qx = fma(q_i, x_i, qx) from qx = +0.
                let q = if B == 8 {
                    _mm512_cvtepi32_ps(_mm512_and_si512(cur[t], maskv))
                } else {
                    _mm512_permutexvar_ps(cur[t], table)
                };
                qx[t] = _mm512_fmadd_ps(q, _mm512_loadu_ps(xb.add(LANES * i + 16 * t)), qx[t]);
                cur[t] = _mm512_srli_epi32::<B>(cur[t]);
            }
        }
        for t in 0..2 {
            let w0 = LANES * j + 16 * t;
            let g0 = w0 >> a.wpg_log;
            let sc = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(sp.add(g0)));
            let bi = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(bp.add(g0)));
            let inner = _mm512_fmadd_ps(bi, _mm512_loadu_ps(xsp.add(w0)), s[t]);
            s[t] = _mm512_fmadd_ps(sc, qx[t], inner);
        }
    }
    _mm512_storeu_ps(ap, s[0]);
    _mm512_storeu_ps(ap.add(16), s[1]);
}
