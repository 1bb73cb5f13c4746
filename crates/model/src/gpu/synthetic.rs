//! A model of any config with random weights made directly in device memory (no host copy, no
//! files), bf16 or MLX affine-quantized: what `deltamoe bench` measures real shapes with.

use std::sync::Arc;

use deltamoe_compute::cuda::{Gpu, Result};

use super::format::DevFormat;
use super::host_store::Pending;
use super::layers::attention::AttnMixer;
use super::layers::dense::DenseFfn;
use super::layers::gdn::GdnMixer;
use super::layers::head::Head;
use super::layers::moe::MoeFfn;
use super::layers::{FfnMade, GpuLayer, Mixer};
use super::offload::ExpertCache;
use super::random::Filler;
use super::{GpuModel, Parts, Shard};
use crate::checkpoint::heads::heads_config;
use crate::config::{FfnKind, LayerKind, ModelConfig};

impl GpuModel {
    /// Random weights of config `c` on `gpu`, matrices in `format`: bf16, affine (the MoE
    /// routers at 8 bits as the converter writes them) or FP8 (routers and lm_head bf16, as
    /// Qwen's FP8 checkpoints; the GDN `b`/`a` rows FP8 with the rest of their projection);
    /// norms, conv and gates stay f32, the embedding bf16. With
    /// a `cache` other than [`ExpertCache::All`] the routed experts are made in pinned host
    /// memory and cached on the device as that says.
    pub fn synthetic(
        c: &ModelConfig,
        gpu: Arc<Gpu>,
        seed: u64,
        format: DevFormat,
        cache: ExpertCache,
    ) -> Result<GpuModel> {
        let offload = cache != ExpertCache::All;
        let (parts, pending) =
            random_parts(c, &gpu, (seed, format), offload, None).map_err(super::weights_err)?;
        let mut m = GpuModel::assemble(c, gpu.clone(), parts)?;
        m.place_experts(cache, pending)?;
        Ok(m)
    }

    /// GPU `shard.rank()`'s part of the model [`Self::synthetic`] makes with `seed` and
    /// `format`: every weight but the routed experts, and its share of those, cached on the
    /// device as `cache` says (for this GPU's share). With [`Shard::heads`], random mixers of
    /// its share of the heads (not the values the one-GPU model's have).
    pub fn synthetic_shard(
        c: &ModelConfig,
        gpu: Arc<Gpu>,
        (seed, format): (u64, DevFormat),
        shard: Shard,
        cache: ExpertCache,
    ) -> Result<GpuModel> {
        let local;
        let c = match shard.heads() {
            true => {
                local = heads_config(c, shard.world()).map_err(super::input_err)?;
                &local
            }
            false => c,
        };
        let offload = cache != ExpertCache::All;
        let (parts, pending) = random_parts(c, &gpu, (seed, format), offload, Some(&shard))
            .map_err(super::weights_err)?;
        let mut m = GpuModel::assemble(c, gpu, parts)?;
        m.set_shard(shard)?;
        m.place_experts(cache, pending)?;
        Ok(m)
    }

    /// Skew routing towards a Zipf(`alpha`) popularity: each MoE layer's router gets the bias
    /// −alpha·ln(rank + 1) on expert logits, ranks a seeded shuffle per layer (the shared-gate
    /// logit unbiased). For benchmarks of expert offload under skewed routing.
    pub fn skew_routing(&mut self, alpha: f64, seed: u64) -> Result<()> {
        let g = self.gpu.clone();
        let mut state = seed;
        for l in &mut self.layers {
            let Some(MoeFfn { router, .. }) = MoeFfn::of_mut(&mut *l.ffn) else {
                continue;
            };
            let e = router.n - 1;
            let mut rank: Vec<usize> = (0..e).collect();
            for i in (1..e).rev() {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                rank.swap(i, (state >> 33) as usize % (i + 1));
            }
            let bias: Vec<f32> = rank
                .iter()
                .map(|&r| (-alpha * ((r + 1) as f64).ln()) as f32)
                .chain([0.0])
                .collect();
            router.bias = Some(g.upload(&bias)?);
        }
        self.graphs.clear();
        Ok(())
    }
}

/// Random device weights of config `c` (see [`GpuModel::synthetic`]), and with `offload` each MoE
/// layer's routed experts still to be placed.
fn random_parts(
    c: &ModelConfig,
    gpu: &Arc<Gpu>,
    (seed, format): (u64, DevFormat),
    offload: bool,
    shard: Option<&Shard>,
) -> Result<(Parts, Vec<Pending<'static>>)> {
    let mut f = Filler::new(gpu, seed, format);
    let mut layers = Vec::with_capacity(c.num_layers);
    let mut pending = Vec::new();
    for i in 0..c.num_layers {
        let mixer: Box<dyn Mixer> = match c.layer_kinds[i] {
            LayerKind::LinearAttention => Box::new(GdnMixer::random(&mut f, c)?),
            LayerKind::FullAttention => Box::new(AttnMixer::random(&mut f, c)?),
        };
        let (ffn, experts): FfnMade = match c.ffn_kinds[i] {
            FfnKind::Dense => {
                let dense = DenseFfn::random(&mut f, c.hidden_size, c.intermediate_size)?;
                (Box::new(dense), None)
            }
            FfnKind::Moe => MoeFfn::random(&mut f, c, i, offload, shard)?,
        };
        pending.extend(experts);
        layers.push(GpuLayer {
            input_norm: f.vec(c.hidden_size, 0.5, 1.5)?,
            mixer,
            post_norm: f.vec(c.hidden_size, 0.5, 1.5)?,
            ffn,
        });
    }
    let head = Head::random(&mut f, c)?;
    gpu.sync()?;
    Ok((Parts { head, layers }, pending))
}
