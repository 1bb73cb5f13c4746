//! Host twins of the bf16 prefill products (`kernels/gemm.cu`, `cuda::gemm`): activations
//! rounded to bf16, MLX affine weights dequantized to bf16 with one rounding of the exact
//! `scale·q + bias`, products summed in f32 (the device's summation order differs, so results
//! agree to f32 rounding, not bit for bit; the rounded operands agree exactly).

use rayon::prelude::*;

use super::gpu_twin::silu_portable;
use crate::dtype::{bf16_to_f32, round_bf16};
use crate::quant::unpack_row;

/// `v` rounded once to bf16 (nearest even), as f32; `v` finite and within bf16's normal range.
fn round_bf16_f64(v: f64) -> f32 {
    const DROP: u32 = 52 - 7;
    let b = v.to_bits();
    let lsb = (b >> DROP) & 1;
    let r = (b + ((1u64 << (DROP - 1)) - 1) + lsb) & !((1u64 << DROP) - 1);
    f64::from_bits(r) as f32
}

/// An MLX affine matrix `[n, k]` (words `[n, k·bits/32]` LSB first, scales and biases bf16 bits
/// `[n, k/group]`) as the device's bf16 operand: `bf16(scale·q + bias)`, exact before the one
/// rounding (the device's `fma.rn.bf16x2` on exact codes).
pub fn dequant_affine_bf16(
    words: &[u32],
    scales: &[u16],
    biases: &[u16],
    (n, k): (usize, usize),
    group: usize,
    bits: u32,
) -> Vec<f32> {
    let (wpr, gpr) = (k * bits as usize / 32, k / group);
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(k).enumerate().for_each(|(r, row)| {
        unpack_row(&words[r * wpr..(r + 1) * wpr], bits, row);
        for (j, v) in row.iter_mut().enumerate() {
            let g = r * gpr + j / group;
            let (s, b) = (bf16_to_f32(scales[g]) as f64, bf16_to_f32(biases[g]) as f64);
            *v = round_bf16_f64(s * *v as f64 + b);
        }
    });
    out
}

/// `y [t, n] = bf16(x) [t, k] · w [n, k]ᵀ` with `w` already the bf16 operand, summed in f32.
pub fn gemm_bf16(x: &[f32], w: &[f32], (n, k, t): (usize, usize, usize)) -> Vec<f32> {
    let xb: Vec<f32> = x[..t * k].iter().map(|&v| round_bf16(v)).collect();
    let mut y = vec![0f32; t * n];
    y.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        let xr = &xb[i * k..(i + 1) * k];
        for (j, o) in row.iter_mut().enumerate() {
            *o = w[j * k..(j + 1) * k]
                .iter()
                .zip(xr)
                .map(|(a, b)| a * b)
                .sum();
        }
    });
    y
}

/// The grouped kernel's SwiGLU output for one row of gate and up sums: `bf16(silu(g)·u)`.
pub fn swiglu_bf16(g: f32, u: f32) -> f32 {
    round_bf16(silu_portable(g) * u)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::f32_to_bf16;

    #[test]
    fn one_rounding_of_the_exact_value() {
        // Ties go to even; a value just above a tie rounds up even where f32 would lose the
        // excess (1 + 2^-8 + 2^-40 needs 41 bits).
        assert_eq!(round_bf16_f64(1.0 + 2f64.powi(-8)), 1.0);
        assert_eq!(
            round_bf16_f64(1.0 + 3.0 * 2f64.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        assert_eq!(
            round_bf16_f64(1.0 + 2f64.powi(-8) + 2f64.powi(-40)),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(
            round_bf16_f64(-(1.0 + 2f64.powi(-8) + 2f64.powi(-40))),
            -(1.0 + 2f32.powi(-7))
        );
        for v in [0.1f32, -3.7, 1e-3, 1234.5] {
            assert_eq!(round_bf16_f64(v as f64), round_bf16(v));
        }
    }

    #[test]
    fn dequant_matches_the_affine_form() {
        // One 4-bit row of 8 codes 0..7, scale 0.5, bias −1: exact values, no rounding.
        let words = [0x7654_3210u32];
        let (s, b) = (f32_to_bf16(0.5), f32_to_bf16(-1.0));
        let w = dequant_affine_bf16(&words, &[s], &[b], (1, 8), 8, 4);
        let want: Vec<f32> = (0..8).map(|q| 0.5 * q as f32 - 1.0).collect();
        assert_eq!(w, want);
    }
}
