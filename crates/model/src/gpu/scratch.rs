//! The activations of a decode step on the GPU.

use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::layers::FfnBufs;
use super::layers::{GpuLayer, Needs};
use super::{Result, ATTN_SPLITS};
use crate::config::ModelConfig;

/// What every layer needs, together, for passes of `rows` rows.
pub(super) fn needs(layers: &[GpuLayer], rows: usize) -> Needs {
    layers.iter().fold(Needs::default(), |n, l| {
        n.max(l.mixer.needs(rows)).max(l.ffn.needs())
    })
}

/// Activations of a step, `rows` rows each (steps run one at a time on one stream).
pub(crate) struct Scratch {
    pub(crate) x: DevBuf<f32>,
    pub(crate) normed: DevBuf<f32>,
    pub(crate) delta: DevBuf<f32>,
    pub(crate) proj: DevBuf<f32>,
    pub(crate) mixed: DevBuf<f32>,
    pub(crate) mix_out: DevBuf<f32>,
    pub(crate) q: DevBuf<f32>,
    pub(crate) part_o: DevBuf<f32>,
    pub(crate) part_ml: DevBuf<f32>,
    pub(crate) ffn: FfnBufs,
    pub(crate) logits: DevBuf<f32>,
    /// A one-row lm_head's largest logit and its index per block (`VecIo::best`), at most one
    /// block per 16 rows.
    pub(crate) best: DevBuf<f32>,
}

impl Scratch {
    pub(super) fn new(
        g: &Gpu,
        c: &ModelConfig,
        layers: &[GpuLayer],
        rows: usize,
    ) -> Result<Scratch> {
        let h = c.hidden_size;
        let needs = needs(layers, rows);
        let qd = c.num_heads * c.head_dim;
        let r = rows;
        Ok(Scratch {
            x: g.zeros(r * h)?,
            normed: g.zeros(r * h)?,
            delta: g.zeros(r * h)?,
            proj: g.zeros(r * needs.proj)?,
            mixed: g.zeros(r * c.conv_dim())?,
            mix_out: g.zeros(r * qd.max(c.linear_value_size()))?,
            q: g.zeros(r * qd)?,
            part_o: g.zeros(r * c.num_heads * ATTN_SPLITS * c.head_dim)?,
            part_ml: g.zeros(r * c.num_heads * ATTN_SPLITS * 2)?,
            ffn: FfnBufs::new(g, c, needs, r)?,
            logits: g.zeros(r * c.vocab_size)?,
            best: g.zeros(2 * c.vocab_size.div_ceil(16))?,
        })
    }
}
