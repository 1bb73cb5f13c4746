//! The CPU twin of the GPU's chunked gated delta rule (`kernels/gdn_chunk.cu`) with its bf16
//! roundings: the same decomposition and the same values rounded to bf16 at the same points, so
//! that a model run through it on the CPU is the reference for the chunked GPU prefill ("the CPU
//! engine with the same roundings"). What remains between the two is f32 summation order.
//!
//! Inputs as [`super::gdn`], except that q and k arrive raw (not normalised: the row factors
//! `rk_i = 1/sqrt(Σk_i² + 1e-6)`, `rq_i = 1/sqrt(Σq_i² + 1e-6)/sqrt(Dk)` are folded in as in the
//! kernel) and q, k, v hold bf16 values. Per chunk of 64 (G cumulative g, S the f32 state):
//!   A_ij = β_i rk_i rk_j (k_i·k_j) e^{G_i−G_j} (j < i), f32;  T = bf16((I + A)⁻¹);
//!   P_ij = bf16(rq_i rk_j (q_i·k_j) e^{G_i−G_j}) (j ≤ i);  S_b = bf16(S);
//!   Y_i = bf16(β_i (v_i − rk_i e^{G_i} (K S_b)_i));  V' = T Y;  V'_b = bf16(V');
//!   O_i = rq_i e^{G_i} (Q S_b)_i + (P V'_b)_i;
//!   S ← e^{G_last} S + Kᵀ bf16(diag(rk_j e^{G_last−G_j}) V').

use super::gdn::{for_each_chunk, GdnInputs, GdnShape, HeadInputs};

const CHUNK: usize = 64;

use crate::dtype::round_bf16 as rb;

/// The chunked delta rule with the GPU kernel's roundings, from and into `state`.
pub fn gdn_chunked_bf16(x: &GdnInputs, s: GdnShape, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (s.k_dim, s.v_dim);
    for_each_chunk(x, s, CHUNK, state, out, |hi, start, l, st, o| {
        chunk(hi, start, l, dk, dv, st, o)
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Row factors 1/sqrt(Σx² + 1e-6) of `l` rows of width `d`.
fn row_factors(x: &[f32], l: usize, d: usize) -> Vec<f32> {
    (0..l)
        .map(|i| 1.0 / (dot(&x[i * d..(i + 1) * d], &x[i * d..(i + 1) * d]) + 1e-6).sqrt())
        .collect()
}

fn chunk(
    hi: &HeadInputs,
    start: usize,
    l: usize,
    dk: usize,
    dv: usize,
    st: &mut [f32],
    o: &mut [f32],
) {
    let q = &hi.q[start * dk..(start + l) * dk];
    let k = &hi.k[start * dk..(start + l) * dk];
    let v = &hi.v[start * dv..(start + l) * dv];
    let beta = &hi.beta[start..start + l];
    let kr = |i: usize| &k[i * dk..(i + 1) * dk];
    let qr = |i: usize| &q[i * dk..(i + 1) * dk];
    let rk = row_factors(k, l, dk);
    let scale = 1.0 / (dk as f32).sqrt();
    let rq: Vec<f32> = row_factors(q, l, dk).iter().map(|r| r * scale).collect();
    let mut cum = Vec::with_capacity(l);
    let mut acc = 0.0f32;
    for &gv in &hi.g[start..start + l] {
        acc += gv;
        cum.push(acc);
    }
    let glast = cum[l - 1];

    // A (f32, strictly lower), P (bf16, lower with diagonal).
    let mut a = vec![0.0f32; l * l];
    let mut p = vec![0.0f32; l * l];
    for i in 0..l {
        for j in 0..=i {
            let d = (cum[i] - cum[j]).exp();
            if j < i {
                a[i * l + j] = beta[i] * rk[i] * rk[j] * d * dot(kr(i), kr(j));
            }
            p[i * l + j] = rb(rq[i] * rk[j] * d * dot(qr(i), kr(j)));
        }
    }
    // T = (I + A)⁻¹ by forward substitution in f32, then rounded.
    let mut tm = vec![0.0f32; l * l];
    for j in 0..l {
        for i in j..l {
            let mut x = if i == j { 1.0 } else { 0.0 };
            for m in j..i {
                x -= a[i * l + m] * tm[m * l + j];
            }
            tm[i * l + j] = x;
        }
    }
    tm.iter_mut().for_each(|x| *x = rb(*x));

    let sb: Vec<f32> = st.iter().map(|&x| rb(x)).collect();
    // X = K S_b, Q S_b (f32 sums of bf16 products).
    let mut y = vec![0.0f32; l * dv];
    let mut out = vec![0.0f32; l * dv];
    for i in 0..l {
        let eg = cum[i].exp();
        let (ki, qi) = (kr(i), qr(i));
        for c in 0..dv {
            let (mut xs, mut qs) = (0.0f32, 0.0f32);
            for d in 0..dk {
                xs += ki[d] * sb[d * dv + c];
                qs += qi[d] * sb[d * dv + c];
            }
            y[i * dv + c] = rb(beta[i] * (v[i * dv + c] - rk[i] * eg * xs));
            out[i * dv + c] = rq[i] * eg * qs;
        }
    }
    // V' = T Y; its bf16 copy and the state-update operand diag(rk e^{G_last−G}) V'.
    let mut vp = vec![0.0f32; l * dv];
    let mut vd = vec![0.0f32; l * dv];
    for i in 0..l {
        let w = rk[i] * (glast - cum[i]).exp();
        for c in 0..dv {
            let mut s = 0.0f32;
            for j in 0..=i {
                s += tm[i * l + j] * y[j * dv + c];
            }
            vp[i * dv + c] = rb(s);
            vd[i * dv + c] = rb(w * s);
        }
    }
    for i in 0..l {
        for c in 0..dv {
            let mut s = out[i * dv + c];
            for j in 0..=i {
                s += p[i * l + j] * vp[j * dv + c];
            }
            o[i * dv + c] = s;
        }
    }
    let dc = glast.exp();
    for d in 0..dk {
        for c in 0..dv {
            let mut s = dc * st[d * dv + c];
            for i in 0..l {
                s += k[i * dk + d] * vd[i * dv + c];
            }
            st[d * dv + c] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gdn::gdn_recurrent;
    use crate::cpu::norm::l2_normalize;

    /// Without its roundings the twin is the chunked rule: on bf16-valued inputs it stays within
    /// bf16-rounding distance (a few 2⁻⁹) of the f32 recurrence on the normalised inputs.
    #[test]
    fn twin_follows_the_recurrence_within_bf16_roundings() {
        let s = GdnShape {
            n_k_heads: 2,
            n_v_heads: 4,
            k_dim: 16,
            v_dim: 8,
        };
        let t = 150;
        let mut seed = 5u64;
        let mut rnd = |lo: f32, hi: f32| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((seed >> 40) as f32 / (1u64 << 24) as f32)
        };
        let kd = s.n_k_heads * s.k_dim;
        let vd = s.n_v_heads * s.v_dim;
        let q: Vec<f32> = (0..t * kd).map(|_| rb(rnd(-1.0, 1.0))).collect();
        let k: Vec<f32> = (0..t * kd).map(|_| rb(rnd(-1.0, 1.0))).collect();
        let v: Vec<f32> = (0..t * vd).map(|_| rb(rnd(-1.0, 1.0))).collect();
        let g: Vec<f32> = (0..t * s.n_v_heads).map(|_| rnd(-0.3, 0.0)).collect();
        let beta: Vec<f32> = (0..t * s.n_v_heads).map(|_| rnd(0.1, 0.9)).collect();
        let st0: Vec<f32> = (0..s.n_v_heads * s.k_dim * s.v_dim)
            .map(|_| rnd(-0.5, 0.5))
            .collect();
        let (mut st_a, mut out_a) = (st0.clone(), vec![0.0; t * vd]);
        let x = GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        gdn_chunked_bf16(&x, s, &mut st_a, &mut out_a);
        let (mut qn, mut kn) = (q.clone(), k.clone());
        l2_normalize(&mut qn, s.k_dim, 1e-6);
        l2_normalize(&mut kn, s.k_dim, 1e-6);
        let sc = 1.0 / (s.k_dim as f32).sqrt();
        qn.iter_mut().for_each(|v| *v *= sc);
        let (mut st_b, mut out_b) = (st0, vec![0.0; t * vd]);
        let y = GdnInputs {
            q: &qn,
            k: &kn,
            v: &v,
            g: &g,
            beta: &beta,
        };
        gdn_recurrent(&y, s, &mut st_b, &mut out_b);
        let rel = |a: &[f32], b: &[f32]| {
            let m = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m
        };
        assert!(rel(&out_a, &out_b) < 2e-2, "out {}", rel(&out_a, &out_b));
        assert!(rel(&st_a, &st_b) < 2e-2, "state {}", rel(&st_a, &st_b));
    }
}
