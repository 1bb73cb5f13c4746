//! Gated DeltaNet token mixer (linear attention).
//!
//! For T tokens `x: [T, H]`:
//! 1. projections to `qkv: [T, 2·Hk·Dk + Hv·Dv]` (q | k | v), `z: [T, Hv·Dv]`, `b, a: [T, Hv]`.
//!    Qwen3.5 stores them as `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next
//!    packs `in_proj_qkvz` per key head as `[q(Dk) | k(Dk) | v(r·Dv) | z(r·Dv)] × Hk` and
//!    `in_proj_ba` as `[b(r) | a(r)] × Hk` (r = Hv / Hk), unpacked here after the matmul;
//! 2. causal depthwise conv1d (kernel K, from the carried conv state) + SiLU over qkv;
//! 3. q, k l2-normalised per head (eps 1e-6), q ·= 1/sqrt(Dk);
//! 4. g = −exp(A_log) · softplus(a + dt_bias), β = sigmoid(b);
//! 5. the gated delta rule (chunked for T > 1, recurrent for T = 1) on the f32 state;
//! 6. gated RMSNorm per value head: norm(o) · w · silu(z) (plain `w`, not zero-centred);
//! 7. `out_proj`.

use deltamoe_compute::cpu::act::{sigmoid, softplus};
use deltamoe_compute::cpu::conv::causal_conv1d_silu;
use deltamoe_compute::cpu::gdn::{gdn_chunked, gdn_recurrent, GdnInputs};
use deltamoe_compute::cpu::gdn_bf16::gdn_chunked_bf16;
use deltamoe_compute::cpu::norm::{gated_rms_norm, l2_normalize};
use deltamoe_compute::dtype::round_bf16;

use super::linear::Products;
use crate::checkpoint::gdn::InProj;
use crate::checkpoint::GatedDeltaNet;

/// Chunk length of the chunked gated delta rule used for prefill.
pub const CHUNK: usize = 64;

/// Projected activations for T tokens.
struct Projected {
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

impl GatedDeltaNet {
    fn project(&self, x: &[f32], t: usize, p: Products) -> Projected {
        match &self.proj {
            InProj::Split { qkv, z, b, a } => Projected {
                qkv: qkv.forward(x, t, p),
                z: z.forward(x, t, p),
                b: b.forward(x, t, p),
                a: a.forward(x, t, p),
            },
            InProj::Packed { qkvz, ba } => {
                self.unpack(&qkvz.forward(x, t, p), &ba.forward(x, t, p), t)
            }
        }
    }

    /// Reorder Qwen3-Next's per-key-head groups into the split layout.
    fn unpack(&self, qkvz: &[f32], ba: &[f32], t: usize) -> Projected {
        let s = self.shape;
        let r = s.n_v_heads / s.n_k_heads;
        let (dk, rv) = (s.k_dim, r * s.v_dim);
        let (kd, vd) = (s.n_k_heads * dk, s.n_v_heads * s.v_dim);
        let group = 2 * dk + 2 * rv;
        let mut p = Projected {
            qkv: vec![0.0; t * (2 * kd + vd)],
            z: vec![0.0; t * vd],
            b: vec![0.0; t * s.n_v_heads],
            a: vec![0.0; t * s.n_v_heads],
        };
        for tt in 0..t {
            let src = &qkvz[tt * s.n_k_heads * group..(tt + 1) * s.n_k_heads * group];
            let qkv = &mut p.qkv[tt * (2 * kd + vd)..(tt + 1) * (2 * kd + vd)];
            let z = &mut p.z[tt * vd..(tt + 1) * vd];
            for kh in 0..s.n_k_heads {
                let g = &src[kh * group..(kh + 1) * group];
                qkv[kh * dk..(kh + 1) * dk].copy_from_slice(&g[..dk]);
                qkv[kd + kh * dk..kd + (kh + 1) * dk].copy_from_slice(&g[dk..2 * dk]);
                qkv[2 * kd + kh * rv..2 * kd + (kh + 1) * rv]
                    .copy_from_slice(&g[2 * dk..2 * dk + rv]);
                z[kh * rv..(kh + 1) * rv].copy_from_slice(&g[2 * dk + rv..]);
                let bag = &ba[(tt * s.n_k_heads + kh) * 2 * r..(tt * s.n_k_heads + kh + 1) * 2 * r];
                let o = tt * s.n_v_heads + kh * r;
                p.b[o..o + r].copy_from_slice(&bag[..r]);
                p.a[o..o + r].copy_from_slice(&bag[r..]);
            }
        }
        p
    }

    /// Size of the conv state, `(K − 1) · C`.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_w.len() / self.conv_kernel
    }

    /// Size of the recurrent state, `Hv · Dk · Dv`.
    pub fn recurrent_state_len(&self) -> usize {
        self.shape.n_v_heads * self.shape.k_dim * self.shape.v_dim
    }

    /// `x: [t, H]` → `[t, H]`, advancing `conv_state` and `state`; with `gpu_roundings`,
    /// multi-token passes run the CPU twin of the GPU's chunked delta rule with its bf16
    /// roundings (see [`crate::Qwen3Hybrid::set_gdn_gpu_roundings`]).
    pub fn forward(
        &self,
        x: &[f32],
        t: usize,
        (conv_state, state): (&mut [f32], &mut [f32]),
        (gpu_roundings, products): (bool, Products),
    ) -> Vec<f32> {
        let p = self.project(x, t, products);
        let mut o = vec![0.0; t * self.shape.n_v_heads * self.shape.v_dim];
        self.mix(&p, 0..t, (conv_state, state), gpu_roundings, &mut o);
        self.finish(o, &p.z, t, products)
    }

    /// [`Self::forward`] for a verify pass: the products over all `t` rows, the conv and delta
    /// rule one token at a time as decode runs them (so each row is bitwise decode's), the
    /// (conv, recurrent) state after each token pushed to `keep`.
    pub fn forward_steps(
        &self,
        x: &[f32],
        t: usize,
        (conv_state, state): (&mut [f32], &mut [f32]),
        products: Products,
        keep: &mut Vec<(Vec<f32>, Vec<f32>)>,
    ) -> Vec<f32> {
        let p = self.project(x, t, products);
        let vd = self.shape.n_v_heads * self.shape.v_dim;
        let mut o = vec![0.0; t * vd];
        for j in 0..t {
            let oj = &mut o[j * vd..(j + 1) * vd];
            self.mix(&p, j..j + 1, (conv_state, state), false, oj);
            keep.push((conv_state.to_vec(), state.to_vec()));
        }
        self.finish(o, &p.z, t, products)
    }

    /// Steps 2–5 for the projected rows `rows`, advancing the states; `o` gets their outputs.
    fn mix(
        &self,
        p: &Projected,
        rows: std::ops::Range<usize>,
        (conv_state, state): (&mut [f32], &mut [f32]),
        gpu_roundings: bool,
        o: &mut [f32],
    ) {
        let s = self.shape;
        let t = rows.len();
        let cd = self.conv_w.len() / self.conv_kernel;
        let nv = s.n_v_heads;
        let mut mixed = vec![0.0; t * cd];
        causal_conv1d_silu(
            &p.qkv[rows.start * cd..rows.end * cd],
            &self.conv_w,
            self.conv_kernel,
            conv_state,
            &mut mixed,
        );

        let kd = s.n_k_heads * s.k_dim;
        let mut q = Vec::with_capacity(t * kd);
        let mut k = Vec::with_capacity(t * kd);
        let mut v = Vec::with_capacity(t * nv * s.v_dim);
        for row in mixed.chunks_exact(cd) {
            q.extend_from_slice(&row[..kd]);
            k.extend_from_slice(&row[kd..2 * kd]);
            v.extend_from_slice(&row[2 * kd..]);
        }
        let twin = gpu_roundings && t > 1;
        if twin {
            // The chunked kernel reads q, k, v as bf16 and normalises q and k itself.
            for x in [&mut q, &mut k, &mut v] {
                x.iter_mut().for_each(|e| *e = round_bf16(*e));
            }
        }
        if !twin {
            l2_normalize(&mut q, s.k_dim, 1e-6);
            l2_normalize(&mut k, s.k_dim, 1e-6);
            let scale = 1.0 / (s.k_dim as f32).sqrt();
            q.iter_mut().for_each(|v| *v *= scale);
        }

        let (a, b) = (
            &p.a[rows.start * nv..rows.end * nv],
            &p.b[rows.start * nv..rows.end * nv],
        );
        let g: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, a)| self.neg_a[i % nv] * softplus(a + self.dt_bias[i % nv]))
            .collect();
        let beta: Vec<f32> = b.iter().map(|b| sigmoid(*b)).collect();

        let inputs = GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        if twin {
            gdn_chunked_bf16(&inputs, s, state, o);
        } else if t == 1 {
            gdn_recurrent(&inputs, s, state, o);
        } else {
            gdn_chunked(&inputs, s, CHUNK, state, o);
        }
    }

    /// Steps 6–7: gated RMSNorm of the rule's outputs `o` with `z`, then `out_proj`.
    fn finish(&self, mut o: Vec<f32>, z: &[f32], t: usize, products: Products) -> Vec<f32> {
        gated_rms_norm(&mut o, z, &self.norm_w, self.eps);
        self.out_proj.forward(&o, t, products)
    }
}
