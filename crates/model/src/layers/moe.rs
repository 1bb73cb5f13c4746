//! Sparse MoE block with a shared expert.
//!
//! Per token: `p = softmax(router · x)` over all experts; the top-k experts by `p` (ties to the
//! lower index); their weights renormalised to sum 1 when `norm_topk_prob`;
//! `y = Σ_e w_e · expert_e(x) + sigmoid(shared_gate · x) · shared(x)`.
//! Experts load from any layout: per expert (`experts.{e}.{gate,up,down}_proj.weight`), fused
//! (`experts.gate_up_proj [E, 2I, H]` gate rows first, `experts.down_proj [E, H, I]`) or
//! mlx-lm's stacked `switch_mlp.{gate,up,down}_proj` (`[E, I, H]`, `[E, H, I]`, dense or
//! affine-quantized), the stacked ones viewed per expert without copies.
//!
//! With `offload` set the routed experts come from an [`OffloadedExperts`] (read from the files
//! behind a cache) instead of `experts`, whose mapped pages are then never touched; the products
//! and their sum run in the same order either way, so the output is bitwise the same.

use std::sync::Arc;

use deltamoe_compute::cpu::act::{sigmoid, softmax};

use super::{Linear, LinearWeight, Mlp, OffloadedExperts};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Moe {
    pub router: Linear,
    /// Routed experts as views of the mapped checkpoint.
    pub experts: Vec<Mlp>,
    /// Where the routed experts are read from instead, when offloaded.
    pub offload: Option<Arc<OffloadedExperts>>,
    pub shared: Mlp,
    pub shared_gate: Linear,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

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
    /// Load `{prefix}.{gate, experts, shared_expert, shared_expert_gate}`.
    pub fn load(store: &WeightStore, prefix: &str, c: &ModelConfig) -> Result<Moe> {
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        Ok(Moe {
            router: Linear::load(store, &format!("{prefix}.gate"), e, h, false)?,
            experts: load_experts(store, prefix, e, h, i)?,
            offload: None,
            shared: Mlp::load(
                store,
                &format!("{prefix}.shared_expert"),
                h,
                c.shared_expert_intermediate_size,
            )?,
            shared_gate: Linear::load(store, &format!("{prefix}.shared_expert_gate"), 1, h, false)?,
            top_k: c.experts_per_token,
            norm_topk_prob: c.norm_topk_prob,
        })
    }

    /// `x: [t, hidden]` → `[t, hidden]`; fails only when an offloaded expert cannot be read.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let h = x.len() / t;
        let logits = self.router.forward(x, t);
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
        let mut add = |ex: usize, mlp: &Mlp| add_expert(mlp, &assigned[ex], x, h, &mut y);
        match &self.offload {
            None => used.iter().for_each(|&ex| add(ex, &self.experts[ex])),
            Some(o) => o.run(&used, &routed, add)?,
        }
        let shared = self.shared.forward(x, t);
        let gate = self.shared_gate.forward(x, t);
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
fn add_expert(mlp: &Mlp, toks: &[(usize, f32)], x: &[f32], h: usize, y: &mut [f32]) {
    let xs: Vec<f32> = toks
        .iter()
        .flat_map(|&(tok, _)| x[tok * h..(tok + 1) * h].iter().copied())
        .collect();
    let out = mlp.forward(&xs, toks.len());
    for (row, &(tok, w)) in out.chunks_exact(h).zip(toks) {
        y[tok * h..(tok + 1) * h]
            .iter_mut()
            .zip(row)
            .for_each(|(a, b)| *a += w * b);
    }
}

/// The `e` routed experts of `{prefix}` (hidden `h`, intermediate `i`) in whichever layout the
/// checkpoint has.
pub(crate) fn load_experts(
    store: &WeightStore,
    prefix: &str,
    e: usize,
    h: usize,
    i: usize,
) -> Result<Vec<Mlp>> {
    let fused = format!("{prefix}.experts.gate_up_proj");
    let switch = format!("{prefix}.switch_mlp");
    let experts = if store.contains(&format!("{switch}.gate_proj.weight")) {
        let stacked = |name: &str, out, inp| {
            LinearWeight::load_stacked(store, &format!("{switch}.{name}"), e, out, inp)
        };
        let (g, u, d) = (
            stacked("gate_proj", i, h)?,
            stacked("up_proj", i, h)?,
            stacked("down_proj", h, i)?,
        );
        g.into_iter()
            .zip(u)
            .zip(d)
            .map(|((g, u), d)| Mlp::from_weights(g, u, d))
            .collect()
    } else if store.contains(&fused) {
        let gate_up = store.get(&fused, &[e, 2 * i, h])?;
        let down = store.get(&format!("{prefix}.experts.down_proj"), &[e, h, i])?;
        (0..e)
            .map(|x| {
                let gu = gate_up.narrow(x, 1).reshape(vec![2 * i, h]);
                Mlp::from_tensors(
                    gu.narrow(0, i),
                    gu.narrow(i, i),
                    down.narrow(x, 1).reshape(vec![h, i]),
                )
            })
            .collect()
    } else {
        (0..e)
            .map(|x| Mlp::load(store, &format!("{prefix}.experts.{x}"), h, i))
            .collect::<Result<Vec<_>>>()?
    };
    Ok(experts)
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
