//! AVX2 + FMA kernels for one packed row of an affine-quantized matrix (2, 4 and 8 bits):
//! `Σ_g s_g · Σ_{k∈g} q_k·x_k`, the first term of the FMA dequant form in [`super::quant`].
//!
//! Per 8 weights: broadcast the word (4-bit: one word = 8 values; 2-bit: one word = 16 values,
//! two vectors; 8-bit: two words widened byte-wise), shift each lane by its value's bit offset,
//! mask, convert to f32 and FMA with 8 consecutive x values into a per-group accumulator; the
//! group accumulator is then FMA'd with the broadcast scale into the row accumulator, which is
//! summed horizontally once per row. Two independent group accumulators hide FMA latency.

use std::arch::x86_64::*;

/// Whether this CPU runs these kernels (checked once; `is_x86_feature_detected!` caches).
pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Dispatch by width.
///
/// # Safety
/// The CPU must support avx2 and fma ([`available`]); `bits` is 2, 4 or 8; `gs` is a multiple
/// of 32; `x.len()` is a multiple of `gs`, `s.len() == x.len() / gs` and
/// `words.len() == x.len() · bits / 32`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn row_dot(bits: u32, words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
    debug_assert_eq!(words.len() * 32, x.len() * bits as usize);
    debug_assert_eq!(s.len() * gs, x.len());
    match bits {
        4 => row_dot4(words, x, s, gs),
        8 => row_dot8(words, x, s, gs),
        _ => row_dot2(words, x, s, gs),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot4(words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let mask = _mm256_set1_epi32(0xF);
    let wpg = gs / 8;
    let (wp, xp) = (words.as_ptr(), x.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut j = g * wpg;
        let end = j + wpg;
        while j < end {
            let w0 = _mm256_set1_epi32(*wp.add(j) as i32);
            let w1 = _mm256_set1_epi32(*wp.add(j + 1) as i32);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w0, shifts), mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w1, shifts), mask));
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(8 * j)), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(8 * j + 8)), a1);
            j += 2;
        }
        acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sg), acc);
    }
    hsum(acc)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot8(words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
    let bytes = words.as_ptr() as *const u8;
    let xp = x.as_ptr();
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut k = g * gs;
        let end = k + gs;
        while k < end {
            let b0 = _mm_loadl_epi64(bytes.add(k) as *const __m128i);
            let b1 = _mm_loadl_epi64(bytes.add(k + 8) as *const __m128i);
            let q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b0));
            let q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b1));
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(k)), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(k + 8)), a1);
            k += 16;
        }
        acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sg), acc);
    }
    hsum(acc)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dot2(words: &[u32], x: &[f32], s: &[f32], gs: usize) -> f32 {
    let lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    let hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
    let mask = _mm256_set1_epi32(0x3);
    let wpg = gs / 16;
    let (wp, xp) = (words.as_ptr(), x.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for j in g * wpg..(g + 1) * wpg {
            let w = _mm256_set1_epi32(*wp.add(j) as i32);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, lo), mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, hi), mask));
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(16 * j)), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(16 * j + 8)), a1);
        }
        acc = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(sg), acc);
    }
    hsum(acc)
}
