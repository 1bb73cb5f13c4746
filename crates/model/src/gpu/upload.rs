//! Uploading a loaded checkpoint: the model assembled from its layers, one arm per layer kind.

use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::{Gpu, Result};

use super::host_store::Pending;
use super::layers::attention::AttnMixer;
use super::layers::dense::DenseFfn;
use super::layers::gdn::GdnMixer;
use super::layers::head::Head;
use super::layers::moe::MoeFfn;
use super::layers::{FfnMade, GpuLayer, Mixer};
use super::shard::Shard;
use super::Parts;
use crate::checkpoint::{self as ckpt, Checkpoint};
use crate::config::ModelConfig;

/// A loaded model's device weights, and (with `offload`) each MoE layer's routed experts still
/// to be placed (see [`super::offload`]); with `shard`, this GPU's share of the routed experts.
pub(super) fn upload_model<'a>(
    g: &Gpu,
    m: &'a Checkpoint,
    offload: bool,
    shard: Option<&Shard>,
) -> Result<(Parts, Vec<Pending<'a>>)> {
    let c = &m.config;
    let rope = Rope::new(c.rotary_dim, c.rope_theta);
    let mut pending = Vec::new();
    let mut layers = Vec::with_capacity(m.layers.len());
    for (i, l) in m.layers.iter().enumerate() {
        let (layer, experts) = upload_layer(g, l, (i, c, &rope), offload, shard)?;
        pending.extend(experts);
        layers.push(layer);
    }
    let head = Head::upload(g, m)?;
    Ok((Parts { head, layers }, pending))
}

/// Layer `i` of config `c` on the device, and (with `offload`) its routed experts still to be
/// placed; with `shard`, this GPU's share of them.
pub(super) fn upload_layer<'a>(
    g: &Gpu,
    l: &'a ckpt::Layer,
    (i, c, rope): (usize, &ModelConfig, &Rope),
    offload: bool,
    shard: Option<&Shard>,
) -> Result<(GpuLayer, Option<Pending<'a>>)> {
    let h = c.hidden_size;
    let mixer: Box<dyn Mixer> = match &l.mixer {
        ckpt::Mixer::Linear(x) => Box::new(GdnMixer::upload(g, x, h)?),
        ckpt::Mixer::Full(x) => Box::new(AttnMixer::upload(g, x, c, rope)?),
    };
    let (ffn, experts): FfnMade = match &l.ffn {
        ckpt::Ffn::Dense(x) => (Box::new(DenseFfn::upload(g, x, h)?), None),
        ckpt::Ffn::Moe(x) => MoeFfn::upload(g, x, (i, h), offload, shard)?,
    };
    let layer = GpuLayer {
        input_norm: g.upload(&l.input_norm)?,
        mixer,
        post_norm: g.upload(&l.post_norm)?,
        ffn,
    };
    Ok((layer, experts))
}
