//! The gated delta rule (Gated DeltaNet core, arXiv 2412.06464), recurrent and chunked forms.
//!
//! Layouts (row-major f32): `q, k: [T, Hk, Dk]` (already l2-normalised, q already scaled by
//! 1/sqrt(Dk)); `v: [T, Hv, Dv]`; `g, beta: [T, Hv]` (g = log-decay ≤ 0); `state: [Hv, Dk, Dv]`;
//! `out: [T, Hv, Dv]`. Value head h reads key head `h / (Hv / Hk)` (block GQA).
//!
//! Recurrent form, per token and value head, with S ∈ R^{Dk×Dv}:
//!   S ← exp(g)·S;  δ = β·(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq.
//!
//! Chunked form (chunk C, positions i, j inside a chunk, G = cumulative g within the chunk,
//! S the state entering the chunk):
//!   A_ij = β_i (k_i·k_j) e^{G_i−G_j} for j < i;  U = (I+A)⁻¹(β⊙V);  W = (I+A)⁻¹(β⊙e^G⊙K);
//!   V' = U − W S;  O_i = e^{G_i} q_iᵀS + Σ_{j≤i} (q_i·k_j) e^{G_i−G_j} V'_j;
//!   S ← e^{G_last} S + Σ_j e^{G_last−G_j} k_j V'_jᵀ.
//! (I+A)⁻¹ is applied by forward substitution. Both forms give the same outputs and state.
//! Heads run in parallel.

use rayon::prelude::*;

use super::matmul::dot;

/// Head counts and dims of one Gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub struct GdnShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// Inputs for T tokens (see the module doc for layouts).
pub struct GdnInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Per-head copies of the inputs: `q, k: [T, Dk]`, `v: [T, Dv]`, `g, beta: [T]`.
pub(super) struct HeadInputs {
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) g: Vec<f32>,
    pub(super) beta: Vec<f32>,
}

fn head_inputs(x: &GdnInputs, s: GdnShape, h: usize, t: usize) -> HeadInputs {
    let kh = h / (s.n_v_heads / s.n_k_heads);
    let (dk, dv) = (s.k_dim, s.v_dim);
    let mut hi = HeadInputs {
        q: Vec::with_capacity(t * dk),
        k: Vec::with_capacity(t * dk),
        v: Vec::with_capacity(t * dv),
        g: Vec::with_capacity(t),
        beta: Vec::with_capacity(t),
    };
    for tt in 0..t {
        let ko = (tt * s.n_k_heads + kh) * dk;
        let vo = (tt * s.n_v_heads + h) * dv;
        hi.q.extend_from_slice(&x.q[ko..ko + dk]);
        hi.k.extend_from_slice(&x.k[ko..ko + dk]);
        hi.v.extend_from_slice(&x.v[vo..vo + dv]);
        hi.g.push(x.g[tt * s.n_v_heads + h]);
        hi.beta.push(x.beta[tt * s.n_v_heads + h]);
    }
    hi
}

/// Run `per_head(h, inputs, state_h, out_h)` for every value head in parallel, where
/// `out_h: [T, Dv]`, then scatter the per-head outputs into `out: [T, Hv, Dv]`.
fn for_each_head<F>(x: &GdnInputs, s: GdnShape, state: &mut [f32], out: &mut [f32], per_head: F)
where
    F: Fn(&HeadInputs, &mut [f32], &mut [f32]) + Sync,
{
    let t = x.g.len() / s.n_v_heads;
    let dv = s.v_dim;
    let mut tmp = vec![0.0f32; s.n_v_heads * t * dv];
    state
        .par_chunks_mut(s.k_dim * dv)
        .zip(tmp.par_chunks_mut(t * dv))
        .enumerate()
        .for_each(|(h, (st, o))| per_head(&head_inputs(x, s, h, t), st, o));
    for h in 0..s.n_v_heads {
        for tt in 0..t {
            let dst = (tt * s.n_v_heads + h) * dv;
            out[dst..dst + dv].copy_from_slice(&tmp[(h * t + tt) * dv..(h * t + tt + 1) * dv]);
        }
    }
}

/// `out[0..Dv] += Σ_i a[i] · S[i, :]` for `S: [Dk, Dv]`.
#[inline]
fn add_vec_mat(a: &[f32], s: &[f32], dv: usize, out: &mut [f32]) {
    for (ai, row) in a.iter().zip(s.chunks_exact(dv)) {
        for (o, r) in out.iter_mut().zip(row) {
            *o += ai * r;
        }
    }
}

/// Token-by-token recurrence (decode, and the reference for the chunked form).
pub fn gdn_recurrent(x: &GdnInputs, s: GdnShape, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (s.k_dim, s.v_dim);
    for_each_head(x, s, state, out, |hi, st, o| {
        let mut kv = vec![0.0f32; dv];
        for (tt, ot) in o.chunks_exact_mut(dv).enumerate() {
            let decay = hi.g[tt].exp();
            st.iter_mut().for_each(|v| *v *= decay);
            let k = &hi.k[tt * dk..(tt + 1) * dk];
            kv.fill(0.0);
            add_vec_mat(k, st, dv, &mut kv);
            let beta = hi.beta[tt];
            for (d, vv) in kv.iter_mut().zip(&hi.v[tt * dv..(tt + 1) * dv]) {
                *d = beta * (vv - *d);
            }
            for (ki, row) in k.iter().zip(st.chunks_exact_mut(dv)) {
                for (r, d) in row.iter_mut().zip(&kv) {
                    *r += ki * d;
                }
            }
            ot.fill(0.0);
            add_vec_mat(&hi.q[tt * dk..(tt + 1) * dk], st, dv, ot);
        }
    });
}

/// Chunked form for prefill, chunks of `chunk` tokens (the last may be shorter), starting from
/// and updating `state`.
pub fn gdn_chunked(x: &GdnInputs, s: GdnShape, chunk: usize, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (s.k_dim, s.v_dim);
    for_each_chunk(x, s, chunk, state, out, |hi, start, l, st, o| {
        chunk_step(hi, start, l, dk, dv, st, o)
    });
}

/// Run `step(inputs, start, len, state_h, out_chunk)` over the chunks of `chunk` tokens (the
/// last may be shorter) of every value head in order, `out_chunk: [len, Dv]`.
pub(super) fn for_each_chunk<F>(
    x: &GdnInputs,
    s: GdnShape,
    chunk: usize,
    state: &mut [f32],
    out: &mut [f32],
    step: F,
) where
    F: Fn(&HeadInputs, usize, usize, &mut [f32], &mut [f32]) + Sync,
{
    let dv = s.v_dim;
    for_each_head(x, s, state, out, |hi, st, o| {
        let t = hi.g.len();
        let mut start = 0;
        while start < t {
            let l = chunk.min(t - start);
            step(hi, start, l, st, &mut o[start * dv..(start + l) * dv]);
            start += l;
        }
    });
}

/// One chunk of `l` tokens at `start` for one head: writes `o: [l, Dv]`, updates `st`.
fn chunk_step(
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
    let mut cum = Vec::with_capacity(l);
    let mut acc = 0.0f32;
    for &gv in &hi.g[start..start + l] {
        acc += gv;
        cum.push(acc);
    }
    let kr = |i: usize| &k[i * dk..(i + 1) * dk];
    // Strictly lower A, row-major [l, l].
    let mut a = vec![0.0f32; l * l];
    for i in 0..l {
        for j in 0..i {
            a[i * l + j] = beta[i] * dot(kr(i), kr(j)) * (cum[i] - cum[j]).exp();
        }
    }
    // Forward substitution: U = (I+A)⁻¹(β⊙V), W = (I+A)⁻¹(β⊙e^G⊙K).
    let mut u = vec![0.0f32; l * dv];
    let mut w = vec![0.0f32; l * dk];
    for i in 0..l {
        let (done_u, rest_u) = u.split_at_mut(i * dv);
        let ui = &mut rest_u[..dv];
        let (done_w, rest_w) = w.split_at_mut(i * dk);
        let wi = &mut rest_w[..dk];
        let eg = cum[i].exp();
        for c in 0..dv {
            ui[c] = beta[i] * v[i * dv + c];
        }
        for c in 0..dk {
            wi[c] = beta[i] * eg * k[i * dk + c];
        }
        for j in 0..i {
            let aij = a[i * l + j];
            if aij == 0.0 {
                continue;
            }
            for (x, y) in ui.iter_mut().zip(&done_u[j * dv..(j + 1) * dv]) {
                *x -= aij * y;
            }
            for (x, y) in wi.iter_mut().zip(&done_w[j * dk..(j + 1) * dk]) {
                *x -= aij * y;
            }
        }
    }
    // V' = U − W S (in place in u).
    for i in 0..l {
        let mut ws = vec![0.0f32; dv];
        add_vec_mat(&w[i * dk..(i + 1) * dk], st, dv, &mut ws);
        for (x, y) in u[i * dv..(i + 1) * dv].iter_mut().zip(&ws) {
            *x -= y;
        }
    }
    // Outputs.
    for i in 0..l {
        let oi = &mut o[i * dv..(i + 1) * dv];
        oi.fill(0.0);
        let qi = &q[i * dk..(i + 1) * dk];
        let eg = cum[i].exp();
        let qs: Vec<f32> = qi.iter().map(|x| x * eg).collect();
        add_vec_mat(&qs, st, dv, oi);
        for j in 0..=i {
            let c = dot(qi, kr(j)) * (cum[i] - cum[j]).exp();
            for (x, y) in oi.iter_mut().zip(&u[j * dv..(j + 1) * dv]) {
                *x += c * y;
            }
        }
    }
    // State update.
    let last = cum[l - 1];
    let el = last.exp();
    st.iter_mut().for_each(|x| *x *= el);
    for j in 0..l {
        let c = (last - cum[j]).exp();
        let vj = &u[j * dv..(j + 1) * dv];
        for (kj, row) in kr(j).iter().zip(st.chunks_exact_mut(dv)) {
            let f = c * kj;
            for (r, y) in row.iter_mut().zip(vj) {
                *r += f * y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::norm::l2_normalize;
    use rand::{Rng, SeedableRng};

    struct Case {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        state: Vec<f32>,
    }

    fn case(s: GdnShape, t: usize, seed: u64) -> Case {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut r = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(lo..hi)).collect()
        };
        let mut q = r(t * s.n_k_heads * s.k_dim, -1.0, 1.0);
        let mut k = r(t * s.n_k_heads * s.k_dim, -1.0, 1.0);
        l2_normalize(&mut q, s.k_dim, 1e-6);
        l2_normalize(&mut k, s.k_dim, 1e-6);
        Case {
            q,
            k,
            v: r(t * s.n_v_heads * s.v_dim, -1.0, 1.0),
            g: r(t * s.n_v_heads, -0.5, 0.0),
            beta: r(t * s.n_v_heads, 0.0, 1.0),
            state: r(s.n_v_heads * s.k_dim * s.v_dim, -0.5, 0.5),
        }
    }

    #[test]
    fn chunked_equals_recurrent_for_odd_sizes() {
        let s = GdnShape {
            n_k_heads: 2,
            n_v_heads: 6,
            k_dim: 7,
            v_dim: 11,
        };
        for &(t, chunk) in &[(1usize, 64usize), (37, 64), (150, 64), (45, 8)] {
            let c = case(s, t, t as u64);
            let x = GdnInputs {
                q: &c.q,
                k: &c.k,
                v: &c.v,
                g: &c.g,
                beta: &c.beta,
            };
            let (mut s1, mut s2) = (c.state.clone(), c.state.clone());
            let mut o1 = vec![0.0; t * s.n_v_heads * s.v_dim];
            let mut o2 = o1.clone();
            gdn_recurrent(&x, s, &mut s1, &mut o1);
            gdn_chunked(&x, s, chunk, &mut s2, &mut o2);
            let max = o1.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (a, b) in o1.iter().zip(&o2) {
                assert!(
                    (a - b).abs() <= 1e-4 * max.max(1.0),
                    "T={t} C={chunk}: {a} vs {b}"
                );
            }
            for (a, b) in s1.iter().zip(&s2) {
                assert!((a - b).abs() <= 1e-4, "state T={t} C={chunk}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn recurrent_matches_hand_computed_single_step() {
        // One head, Dk = Dv = 1: S' = e^g S + β (v − e^g S k) k, o = S' q.
        let s = GdnShape {
            n_k_heads: 1,
            n_v_heads: 1,
            k_dim: 1,
            v_dim: 1,
        };
        let (q, k, v, g, beta) = ([0.5f32], [1.0f32], [2.0f32], [-0.1f32], [0.3f32]);
        let mut st = vec![0.7f32];
        let mut o = vec![0.0f32];
        gdn_recurrent(
            &GdnInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
            },
            s,
            &mut st,
            &mut o,
        );
        let d = 0.7 * (-0.1f32).exp();
        let want = d + 0.3 * (2.0 - d);
        assert!((st[0] - want).abs() < 1e-6);
        assert!((o[0] - 0.5 * want).abs() < 1e-6);
    }
}
