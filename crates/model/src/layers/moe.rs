//! Sparse MoE block with a shared expert.
//!
//! Per token: `p = softmax(router · x)` over all experts; the top-k experts by `p` (ties to the
//! lower index); their weights renormalised to sum 1 when `norm_topk_prob`;
//! `y = Σ_e w_e · expert_e(x) + sigmoid(shared_gate · x) · shared(x)`.
//!
//! With an offload the routed experts come from an [`OffloadedExperts`] (read from the files
//! behind a cache) instead of `experts`, whose mapped pages are then never touched; the products
//! and their sum run in the same order either way, so the output is bitwise the same.

use deltamoe_compute::cpu::act::{sigmoid, softmax};

use super::linear::Products;
use super::OffloadedExperts;
use crate::checkpoint::{Mlp, Moe};
use crate::error::Result;

/// Routing of one token: expert indices and their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Top-k of one token's router logits (softmax over all experts first).
pub fn route(logits: &[f32], top_k: usize, renormalise: bool) -> Route {
    let mut p = logits.to_vec();
    softmax(&mut p);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Stable sort: equal probabilities keep the lower expert index first.
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    idx.truncate(top_k);
    let mut weights: Vec<f32> = idx.iter().map(|&e| p[e]).collect();
    if renormalise {
        let s: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= s);
    }
    Route {
        experts: idx,
        weights,
    }
}

impl Moe {
    /// `x: [t, hidden]` → `[t, hidden]`, the routed experts read from `offload` when it is
    /// set; fails only when an offloaded expert cannot be read.
    pub fn forward(
        &self,
        x: &[f32],
        t: usize,
        offload: Option<&OffloadedExperts>,
        p: Products,
    ) -> Result<Vec<f32>> {
        let h = x.len() / t;
        let logits = self.router.forward(x, t, p);
        let e = self.experts.len();
        // Tokens (and weights) per expert, so each expert runs once over its tokens.
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        let mut routed = Vec::with_capacity(t * self.top_k);
        for (tok, l) in logits.chunks_exact(e).enumerate() {
            let r = route(l, self.top_k, self.norm_topk_prob);
            for (&ex, &w) in r.experts.iter().zip(&r.weights) {
                assigned[ex].push((tok, w));
            }
            routed.extend(r.experts);
        }
        let used: Vec<usize> = (0..e).filter(|&ex| !assigned[ex].is_empty()).collect();
        let mut y = vec![0.0f32; t * h];
        let mut add = |ex: usize, mlp: &Mlp| add_expert(mlp, &assigned[ex], (x, h, p), &mut y);
        match offload {
            None => used.iter().for_each(|&ex| add(ex, &self.experts[ex])),
            Some(o) => o.run(&used, &routed, add)?,
        }
        let shared = self.shared.forward(x, t, p);
        let gate = self.shared_gate.forward(x, t, p);
        for tok in 0..t {
            let s = sigmoid(gate[tok]);
            y[tok * h..(tok + 1) * h]
                .iter_mut()
                .zip(&shared[tok * h..(tok + 1) * h])
                .for_each(|(a, b)| *a += s * b);
        }
        Ok(y)
    }
}

/// `y[tok] += w · mlp(x[tok])` for the `(tok, w)` routed to `mlp` (rows of `h`).
fn add_expert(
    mlp: &Mlp,
    toks: &[(usize, f32)],
    (x, h, p): (&[f32], usize, Products),
    y: &mut [f32],
) {
    let xs: Vec<f32> = toks
        .iter()
        .flat_map(|&(tok, _)| x[tok * h..(tok + 1) * h].iter().copied())
        .collect();
    let out = mlp.forward(&xs, toks.len(), p);
    for (row, &(tok, w)) in out.chunks_exact(h).zip(toks) {
        y[tok * h..(tok + 1) * h]
            .iter_mut()
            .zip(row)
            .for_each(|(a, b)| *a += w * b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_picks_top_k_and_renormalises() {
        let r = route(&[0.0, 2.0, 1.0, 2.0], 2, true);
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 0.5).abs() < 1e-6 && (r.weights[1] - 0.5).abs() < 1e-6);
        let r = route(&[0.0, 0.0], 1, false);
        assert_eq!(r.experts, vec![0]);
        assert!((r.weights[0] - 0.5).abs() < 1e-6);
    }
}
