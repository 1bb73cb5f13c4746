//! The activations of a decode step on the GPU.

use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::{GpuFfn, GpuLayer, GpuMixer, Result, ATTN_SPLITS};
use crate::config::ModelConfig;

/// Activations of a step, `rows` rows each (steps run one at a time on one stream).
pub(super) struct Scratch {
    pub(super) x: DevBuf<f32>,
    pub(super) normed: DevBuf<f32>,
    pub(super) delta: DevBuf<f32>,
    pub(super) proj: DevBuf<f32>,
    pub(super) mixed: DevBuf<f32>,
    pub(super) mix_out: DevBuf<f32>,
    pub(super) q: DevBuf<f32>,
    pub(super) part_o: DevBuf<f32>,
    pub(super) part_ml: DevBuf<f32>,
    pub(super) router: DevBuf<f32>,
    pub(super) ids: DevBuf<i32>,
    pub(super) weights: DevBuf<f32>,
    pub(super) sg: DevBuf<f32>,
    pub(super) h: DevBuf<f32>,
    pub(super) y: DevBuf<f32>,
    pub(super) hs: DevBuf<f32>,
    pub(super) ys: DevBuf<f32>,
    pub(super) logits: DevBuf<f32>,
    /// A one-row lm_head's largest logit and its index per block (`VecIo::best`), at most one
    /// block per 16 rows.
    pub(super) best: DevBuf<f32>,
}

impl Scratch {
    pub(super) fn new(
        g: &Gpu,
        c: &ModelConfig,
        layers: &[GpuLayer],
        rows: usize,
    ) -> Result<Scratch> {
        let h = c.hidden_size;
        let mut proj = 0;
        let mut inter = 0;
        let mut shared_inter = 0;
        for l in layers {
            proj = proj.max(match &l.mixer {
                GpuMixer::Linear { proj, .. } | GpuMixer::Full { proj, .. } => proj.n,
            });
            match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => inter = inter.max(gate_up.n / 2),
                GpuFfn::Moe {
                    experts_gu, shared, ..
                } => {
                    inter = inter.max(experts_gu.n / 2 * (c.experts_per_token + 1));
                    if let Some((gu, _)) = shared {
                        shared_inter = shared_inter.max(gu.n / 2);
                    }
                }
            }
        }
        // Room for the shared expert stacked as one more slot.
        let k = c.experts_per_token + 1;
        let qd = c.num_heads * c.head_dim;
        let r = rows;
        Ok(Scratch {
            x: g.zeros(r * h)?,
            normed: g.zeros(r * h)?,
            delta: g.zeros(r * h)?,
            proj: g.zeros(r * proj)?,
            mixed: g.zeros(r * c.conv_dim())?,
            mix_out: g.zeros(r * qd.max(c.linear_value_size()))?,
            q: g.zeros(r * qd)?,
            part_o: g.zeros(r * c.num_heads * ATTN_SPLITS * c.head_dim)?,
            part_ml: g.zeros(r * c.num_heads * ATTN_SPLITS * 2)?,
            router: g.zeros(r * (c.num_experts + 1))?,
            ids: g.zeros(r * k)?,
            weights: g.zeros(r * k)?,
            sg: g.zeros(r)?,
            h: g.zeros(r * inter)?,
            y: g.zeros(r * k * h)?,
            hs: g.zeros(r * shared_inter)?,
            ys: g.zeros(r * h)?,
            logits: g.zeros(r * c.vocab_size)?,
            best: g.zeros(2 * c.vocab_size.div_ceil(16))?,
        })
    }
}
