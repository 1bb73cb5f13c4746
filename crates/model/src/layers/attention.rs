//! Gated full attention.
//!
//! `q_proj` yields per head `[q_h (D) | gate_h (D)]`; q and k get a zero-centred RMSNorm over
//! the head dim (`q_norm`, `k_norm`), then partial NeoX RoPE at their positions; k and v are
//! appended to the sequence's cache; causal GQA softmax attention with scale 1/sqrt(D); the
//! output is multiplied by `sigmoid(gate)` and projected by `o_proj`.

use deltamoe_compute::cpu::act::sigmoid;
use deltamoe_compute::cpu::attention::causal_attention;
use deltamoe_compute::cpu::norm::rms_norm;
use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::dtype::round_bf16;

use super::linear::Products;
use crate::checkpoint::Attention;

/// A sequence's keys and values for one attention layer: `[positions, H_kv, D]` each.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl KvCache {
    /// Keep the first `len` floats of K and of V (the positions before a cut).
    pub fn truncate(&mut self, len: usize) {
        self.k.truncate(len);
        self.v.truncate(len);
    }
}

impl Attention {
    /// `x: [t, H]` for positions `pos0..pos0 + t` → `[t, H]`, appending to `cache`.
    pub fn forward(
        &self,
        x: &[f32],
        t: usize,
        pos0: usize,
        rope: &Rope,
        cache: &mut KvCache,
        p: Products,
    ) -> Vec<f32> {
        let s = self.shape;
        let d = s.head_dim;
        let qg = self.q_proj.forward(x, t, p);
        let mut q = Vec::with_capacity(t * s.n_heads * d);
        let mut gate = Vec::with_capacity(t * s.n_heads * d);
        for head in qg.chunks_exact(2 * d) {
            q.extend_from_slice(&head[..d]);
            gate.extend_from_slice(&head[d..]);
        }
        let mut k = self.k_proj.forward(x, t, p);
        let v = self.v_proj.forward(x, t, p);
        rms_norm(&mut q, &self.q_norm, self.eps);
        rms_norm(&mut k, &self.k_norm, self.eps);
        let (qw, kw) = (s.n_heads * d, s.n_kv_heads * d);
        for tt in 0..t {
            rope.apply(&mut q[tt * qw..(tt + 1) * qw], d, pos0 + tt);
            rope.apply(&mut k[tt * kw..(tt + 1) * kw], d, pos0 + tt);
        }
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
        let mut o = vec![0.0; t * qw];
        match p {
            Products::Exact => causal_attention(&q, &cache.k, &cache.v, pos0, s, &mut o),
            Products::Bf16 => {
                // The GPU's bf16 prefill attention reads q, k and v rounded to bf16.
                let r = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| round_bf16(x)).collect() };
                causal_attention(&r(&q), &r(&cache.k), &r(&cache.v), pos0, s, &mut o)
            }
        }
        o.iter_mut().zip(&gate).for_each(|(v, g)| *v *= sigmoid(*g));
        self.o_proj.forward(&o, t, p)
    }
}
