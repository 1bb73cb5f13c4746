//! The weights of a Gated DeltaNet mixer: the input projections (Qwen3.5's `in_proj_qkv`,
//! `in_proj_z`, `in_proj_b`, `in_proj_a`, or Qwen3-Next's per-key-head packed `in_proj_qkvz` and
//! `in_proj_ba`), the depthwise conv kernel, `−exp(A_log)`, `dt_bias`, the gated norm's weight and
//! `out_proj`.

use deltamoe_compute::cpu::gdn::GdnShape;

use super::Linear;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::quant::Layout;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub(crate) enum InProj {
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    Packed {
        qkvz: Linear,
        ba: Linear,
    },
}

#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    pub(crate) proj: InProj,
    /// `[C, K]` depthwise kernel.
    pub(crate) conv_w: Vec<f32>,
    /// `−exp(A_log)` per value head.
    pub(crate) neg_a: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
    pub(crate) norm_w: Vec<f32>,
    pub(crate) out_proj: Linear,
    pub(crate) shape: GdnShape,
    pub(crate) conv_kernel: usize,
    pub(crate) eps: f32,
}

impl GatedDeltaNet {
    pub fn load(store: &WeightStore, prefix: &str, c: &ModelConfig) -> Result<GatedDeltaNet> {
        let (h, nv) = (c.hidden_size, c.linear_v_heads);
        let (kd, vd, cd) = (c.linear_key_size(), c.linear_value_size(), c.conv_dim());
        let packed = format!("{prefix}.in_proj_qkvz");
        let proj = if store.has_linear(&packed) {
            InProj::Packed {
                qkvz: Linear::load(
                    store,
                    &format!("{prefix}.in_proj_qkvz"),
                    2 * kd + 2 * vd,
                    h,
                    false,
                )?,
                ba: Linear::load(store, &format!("{prefix}.in_proj_ba"), 2 * nv, h, false)?,
            }
        } else {
            InProj::Split {
                qkv: Linear::load(store, &format!("{prefix}.in_proj_qkv"), cd, h, false)?,
                z: Linear::load(store, &format!("{prefix}.in_proj_z"), vd, h, false)?,
                b: Linear::load(store, &format!("{prefix}.in_proj_b"), nv, h, false)?,
                a: Linear::load(store, &format!("{prefix}.in_proj_a"), nv, h, false)?,
            }
        };
        let k = c.conv_kernel;
        // HF stores the depthwise kernel as [C, 1, K], mlx-lm as [C, K, 1]: the same bytes.
        let conv_shape = match store.layout() {
            Layout::Hf => [cd, 1, k],
            Layout::Mlx => [cd, k, 1],
        };
        Ok(GatedDeltaNet {
            proj,
            conv_w: store
                .get(&format!("{prefix}.conv1d.weight"), &conv_shape)?
                .to_f32_vec(),
            neg_a: store
                .vec_f32(&format!("{prefix}.A_log"), nv)?
                .iter()
                .map(|v| -v.exp())
                .collect(),
            dt_bias: store.vec_f32(&format!("{prefix}.dt_bias"), nv)?,
            norm_w: store.vec_f32(&format!("{prefix}.norm.weight"), c.linear_v_dim)?,
            out_proj: Linear::load(store, &format!("{prefix}.out_proj"), h, vd, false)?,
            shape: GdnShape {
                n_k_heads: c.linear_k_heads,
                n_v_heads: nv,
                k_dim: c.linear_k_dim,
                v_dim: c.linear_v_dim,
            },
            conv_kernel: k,
            eps: c.rms_norm_eps,
        })
    }
}
