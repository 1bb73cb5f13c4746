//! The weights of a sparse MoE block with a shared expert: the router (`gate`), the routed
//! experts from any layout (per expert `experts.{e}.{gate,up,down}_proj.weight`, fused
//! `experts.gate_up_proj [E, 2I, H]` gate rows first and `experts.down_proj [E, H, I]`, or
//! mlx-lm's stacked `switch_mlp.{gate,up,down}_proj`, dense or affine-quantized, the stacked ones
//! viewed per expert without copies), the shared expert and its gate.

use super::{Linear, LinearWeight, Mlp};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub struct Moe {
    pub router: Linear,
    /// Routed experts as views of the mapped checkpoint.
    pub experts: Vec<Mlp>,
    pub shared: Mlp,
    pub shared_gate: Linear,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl Moe {
    /// Load `{prefix}.{gate, experts, shared_expert, shared_expert_gate}`.
    pub fn load(store: &WeightStore, prefix: &str, c: &ModelConfig) -> Result<Moe> {
        let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
        Ok(Moe {
            router: Linear::load(store, &format!("{prefix}.gate"), e, h, false)?,
            experts: load_experts(store, prefix, e, h, i)?,
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
