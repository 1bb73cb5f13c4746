//! Rotary position embedding, NeoX ("rotate half") form, on the first `rotary_dim` dims of each
//! head: for i < r/2, with θ_i = base^(-2i/r) and angle a = pos·θ_i,
//! `x[i] ← x[i]·cos a − x[i + r/2]·sin a`, `x[i + r/2] ← x[i + r/2]·cos a + x[i]·sin a`.
//! Dims `r..head_dim` pass through. Text-only multimodal RoPE (all position ids equal) is this.

/// Precomputed inverse frequencies for a rotary dimension and base.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl Rope {
    pub fn new(rotary_dim: usize, base: f64) -> Rope {
        // As the reference: inverse frequencies computed in f32 from base^(2i/r).
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| (1.0 / base.powf((2 * i) as f64 / rotary_dim as f64)) as f32)
            .collect();
        Rope {
            inv_freq,
            rotary_dim,
        }
    }

    /// θ_i for i < rotary_dim / 2.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// Rotate every head of `x` (`[n_heads · head_dim]` for one token) at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.rotary_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                // The angle is the f32 product pos·θ, as the reference computes it.
                let a = pos as f32 * self.inv_freq[i];
                let (s, c) = a.sin_cos();
                let (x1, x2) = (head[i], head[i + half]);
                head[i] = x1 * c - x2 * s;
                head[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let rope = Rope::new(4, 10000.0);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope.apply(&mut x, 6, 0);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        rope.apply(&mut x, 6, 17);
        let n: f32 = x[..4].iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
        assert_eq!(&x[4..], &[5.0, 6.0]);
    }
}
