//! Normalisations (all per row, f32):
//! - [`rms_norm`]: `y = x / sqrt(mean(x²) + eps) · w'`, where `w'` is the effective scale; for the
//!   zero-centred Qwen3 norms the caller passes `1 + w` (see [`zero_centred_scale`]).
//! - [`gated_rms_norm`]: Gated DeltaNet output norm, `y = x / sqrt(mean(x²) + eps) · w · silu(z)`.
//! - [`l2_normalize`]: `x / sqrt(Σx² + eps)` (eps inside the root, as the reference does).

use super::act::silu;

/// `1 + w` for a zero-centred RMSNorm weight.
pub fn zero_centred_scale(w: &[f32]) -> Vec<f32> {
    w.iter().map(|v| 1.0 + v).collect()
}

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Normalise each row of `x` (width `scale.len()`) in place.
pub fn rms_norm(x: &mut [f32], scale: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(scale.len()) {
        let r = inv_rms(row, eps);
        for (v, s) in row.iter_mut().zip(scale) {
            *v = *v * r * s;
        }
    }
}

/// `out = rms_norm(x) · scale`, rows of `x` unchanged.
pub fn rms_norm_into(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm(out, scale, eps);
}

/// Gated RMSNorm over rows of width `w.len()`: `x ← norm(x) · w · silu(z)`.
pub fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (row, zr) in x.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let r = inv_rms(row, eps);
        for i in 0..d {
            row[i] = row[i] * r * w[i] * silu(zr[i]);
        }
    }
}

/// L2-normalise each row of width `d` in place.
pub fn l2_normalize(x: &mut [f32], d: usize, eps: f32) {
    for row in x.chunks_exact_mut(d) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let r = 1.0 / (ss + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let mut x = vec![3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0];
        rms_norm(&mut x, &[1.0, 1.0, 1.0, 1.0], 0.0);
        let ms: f32 = x[..4].iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        assert!((x[7] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn l2_normalize_gives_unit_norm() {
        let mut x = vec![3.0, 4.0, 1.0, 0.0];
        l2_normalize(&mut x, 2, 0.0);
        assert!((x[0] - 0.6).abs() < 1e-6 && (x[1] - 0.8).abs() < 1e-6 && x[2] == 1.0);
    }
}
