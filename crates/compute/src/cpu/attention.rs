//! Causal grouped-query attention of new tokens against a KV cache.
//!
//! Shapes (row-major f32): `q: [T, H, D]` for the T new tokens at positions `p0..p0+T`;
//! `k, v: [L, H_kv, D]` with `L ≥ p0 + T` holding every position so far (the new ones
//! included); `out: [T, H, D]`. Query head h reads kv head `h / (H / H_kv)`. Token t attends to
//! positions `0..=p0+t`: `out = softmax(q·kᵀ · scale) · v`. Parallel over (token, head).

use rayon::prelude::*;

use super::matmul::dot;

/// Attention geometry.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], p0: usize, s: AttnShape, out: &mut [f32]) {
    let (h, d) = (s.n_heads, s.head_dim);
    let kv_stride = s.n_kv_heads * d;
    let group = h / s.n_kv_heads;
    out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / h, i % h);
        let kvh = head / group;
        let qv = &q[i * d..(i + 1) * d];
        let n = p0 + t + 1;
        let mut scores: Vec<f32> = (0..n)
            .map(|j| {
                dot(
                    qv,
                    &k[j * kv_stride + kvh * d..j * kv_stride + (kvh + 1) * d],
                ) * s.scale
            })
            .collect();
        super::act::softmax(&mut scores);
        o.fill(0.0);
        for (j, p) in scores.iter().enumerate() {
            let vr = &v[j * kv_stride + kvh * d..j * kv_stride + (kvh + 1) * d];
            for (ov, vv) in o.iter_mut().zip(vr) {
                *ov += p * vv;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_equals_full() {
        let s = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 5,
            scale: 0.4,
        };
        let l = 6;
        let q: Vec<f32> = (0..l * 4 * 5).map(|i| (i as f32 * 0.13).sin()).collect();
        let k: Vec<f32> = (0..l * 2 * 5).map(|i| (i as f32 * 0.29).cos()).collect();
        let v: Vec<f32> = (0..l * 2 * 5).map(|i| (i as f32 * 0.71).sin()).collect();
        let mut full = vec![0.0; l * 20];
        causal_attention(&q, &k, &v, 0, s, &mut full);
        // Last two tokens computed alone against the cache give the same rows.
        let mut tail = vec![0.0; 2 * 20];
        causal_attention(&q[4 * 20..], &k, &v, 4, s, &mut tail);
        for (a, b) in tail.iter().zip(&full[4 * 20..]) {
            assert!((a - b).abs() < 1e-6);
        }
        // First token attends only to itself: output equals its value row.
        assert!((full[0] - v[0]).abs() < 1e-6);
    }
}
