//! AVX2 + FMA kernels for blocks of packed rows of an affine-quantized matrix (2, 4 and 8 bits):
//! per row `Σ_g s_g · Σ_{k∈g} q_k·x_k + Σ_g b_g · xsum_g`, the FMA dequant form of
//! [`super::quant`].
//!
//! Unpacking avoids per-lane variable shifts: a word (2-bit) or a pair of words (4-bit) is
//! broadcast to all 8 lanes and each lane ANDs out its own field *in place*, so lane `i` holds
//! `q·2^(bits·i)` (exact in f32; masks stay below bit 16, so the signed convert is safe), and a
//! 16-bit shift gives the second half. The matching powers of two are folded into a permuted,
//! pre-scaled copy of x made once per call ([`prepare_x`]). Per 16 weights at 4 bits: one
//! broadcast load, one shift, two ANDs, two int→float converts, two FMAs. 8-bit widens bytes
//! with `vpmovzxbd` and reads x as is. Four independent accumulators per group hide FMA
//! latency; each group's sum is FMA'd with its broadcast scale into the row accumulator, summed
//! horizontally once per row.

use std::arch::x86_64::*;

/// Whether this CPU runs these kernels (checked once; `is_x86_feature_detected!` caches).
pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// Dispatch by width; `xs` is `prepare_x(bits, x)`.
///
/// # Safety
/// The CPU must support avx2 and fma ([`available`]); `bits` is 2, 4 or 8; `gs` is a multiple
/// of 32; `xs.len()` is a multiple of `gs`, `s.len() == xs.len() / gs` and
/// `words.len() == xs.len() · bits / 32`.
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn row_dot(bits: u32, words: &[u32], xs: &[f32], s: &[f32], gs: usize) -> f32 {
    debug_assert_eq!(words.len() * 32, xs.len() * bits as usize);
    debug_assert_eq!(s.len() * gs, xs.len());
    match bits {
        4 => row_dot4(words, xs, s, gs),
        8 => row_dot8(words, xs, s, gs),
        _ => row_dot2(words, xs, s, gs),
    }
}

/// [`row_dot`] over consecutive rows plus each row's bias term `Σ_g b_g·xsum_g`:
/// `out[i·stride] = row_dot(row i) + Σ_g b[i, g]·xsum[g]`, one call per block of rows.
///
/// # Safety
/// As [`row_dot`], for `s.len() / xsum.len()` rows: `words` holds their words back to back,
/// `s` and `b` their scales and biases (`xsum.len()` each), and
/// `out.len() > (rows − 1)·stride`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rows_dot(
    bits: u32,
    words: &[u32],
    xs: &[f32],
    xsum: &[f32],
    s: &[f32],
    b: &[f32],
    gs: usize,
    out: &mut [f32],
    stride: usize,
) {
    let gpr = xsum.len();
    let wpr = xs.len() * bits as usize / 32;
    let rows = s.len() / gpr;
    debug_assert!(words.len() >= rows * wpr && out.len() > (rows.max(1) - 1) * stride);
    for i in 0..rows {
        let wr = words.get_unchecked(i * wpr..(i + 1) * wpr);
        let si = s.get_unchecked(i * gpr..(i + 1) * gpr);
        let bi = b.get_unchecked(i * gpr..(i + 1) * gpr);
        let main = match bits {
            4 => row_dot4(wr, xs, si, gs),
            8 => row_dot8(wr, xs, si, gs),
            _ => row_dot2(wr, xs, si, gs),
        };
        *out.get_unchecked_mut(i * stride) = main + bias_dot(bi, xsum);
    }
}

/// `Σ b·xsum` over one row's groups.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bias_dot(b: &[f32], xsum: &[f32]) -> f32 {
    let n = b.len();
    let mut acc = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= n {
        let bv = _mm256_loadu_ps(b.as_ptr().add(g));
        acc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xsum.as_ptr().add(g)), acc);
        g += 8;
    }
    let mut tail = 0.0;
    while g < n {
        tail += b[g] * xsum[g];
        g += 1;
    }
    hsum(acc) + tail
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
unsafe fn row_dot4(words: &[u32], xs: &[f32], s: &[f32], gs: usize) -> f32 {
    // Two words broadcast as [w0, w1, w0, w1, …]; lane masks keep nibble i of each word in
    // place (value q·16^i, exact in f32), the second vector after a 16-bit shift; `xs` holds x
    // permuted to that lane order and scaled by 16^-i (see `prepare_x`).
    let mask = _mm256_setr_epi32(0xF, 0xF, 0xF0, 0xF0, 0xF00, 0xF00, 0xF000, 0xF000);
    let wpg = gs / 8;
    let (wp, xp) = (words.as_ptr(), xs.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut j = g * wpg;
        let end = j + wpg;
        while j < end {
            let w = _mm256_set1_epi64x((wp.add(j) as *const i64).read_unaligned());
            let hi = _mm256_srli_epi32::<16>(w);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(8 * j)), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(8 * j + 8)), a1);
            let w = _mm256_set1_epi64x((wp.add(j + 2) as *const i64).read_unaligned());
            let hi = _mm256_srli_epi32::<16>(w);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
            a2 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(8 * j + 16)), a2);
            a3 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(8 * j + 24)), a3);
            j += 4;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(sg), acc);
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
unsafe fn row_dot2(words: &[u32], xs: &[f32], s: &[f32], gs: usize) -> f32 {
    // One word broadcast; lane masks keep values 0..8 in place (q·4^i), a 16-bit shift brings
    // values 8..16; `xs` is x scaled by 4^-(k mod 8) (see `prepare_x`).
    let mask = _mm256_setr_epi32(0x3, 0xC, 0x30, 0xC0, 0x300, 0xC00, 0x3000, 0xC000);
    let wpg = gs / 16;
    let (wp, xp) = (words.as_ptr(), xs.as_ptr());
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let mut j = g * wpg;
        let end = j + wpg;
        while j < end {
            let w = _mm256_set1_epi32(*wp.add(j) as i32);
            let hi = _mm256_srli_epi32::<16>(w);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
            a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(16 * j)), a0);
            a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(16 * j + 8)), a1);
            let w = _mm256_set1_epi32(*wp.add(j + 1) as i32);
            let hi = _mm256_srli_epi32::<16>(w);
            let q0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
            let q1 = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
            a2 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xp.add(16 * j + 16)), a2);
            a3 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xp.add(16 * j + 24)), a3);
            j += 2;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        acc = _mm256_fmadd_ps(sum, _mm256_set1_ps(sg), acc);
    }
    hsum(acc)
}

/// `x` rearranged for the 2- and 4-bit kernels (8-bit reads `x` as is): 4-bit, per 16 inputs
/// `[x0, x8, x1/16, x9/16, x2/16², x10/16², x3/16³, x11/16³ | x4, x12, x5/16, …]`; 2-bit, every
/// `x[k]` times `4^-(k mod 8)`. The scalings are exact powers of two.
pub fn prepare_x(bits: u32, x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    match bits {
        4 => {
            let sc = [1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0];
            for (o, c) in out.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
                for i in 0..4 {
                    o[2 * i] = c[i] * sc[i];
                    o[2 * i + 1] = c[8 + i] * sc[i];
                    o[8 + 2 * i] = c[4 + i] * sc[i];
                    o[8 + 2 * i + 1] = c[12 + i] * sc[i];
                }
            }
        }
        2 => {
            for (k, (o, v)) in out.iter_mut().zip(x).enumerate() {
                *o = v * (0.25f32).powi((k % 8) as i32);
            }
        }
        _ => out.copy_from_slice(x),
    }
    out
}
