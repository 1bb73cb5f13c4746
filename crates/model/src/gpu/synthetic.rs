//! A model of any config with random weights made directly in device memory (no host copy, no
//! files), bf16 or MLX affine-quantized: what `deltamoe bench` measures real shapes with.

use std::ops::Range;
use std::sync::Arc;

use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops::{self, GdnDims};
use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::host_store::{seed_at, Dest, ExpertSource, Fmt};
use super::offload::{ExpertCache, Pending};
use super::{DevMat, DevWeights, GpuFfn, GpuLayer, GpuMixer, GpuModel, Parts, Result};
use crate::config::{FfnKind, LayerKind, ModelConfig};
use crate::convert::ROUTER_SPEC;

/// Fills buffers with seeded uniform values, a new seed per buffer. Matrices are bf16, or
/// affine-quantized with `(bits, group)` when `quant` is set.
struct Filler<'a> {
    g: &'a Gpu,
    seed: u64,
    quant: Option<(u32, usize)>,
}

impl Filler<'_> {
    fn next_seed(&mut self) -> u64 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.seed
    }

    /// `len` bf16 values uniform in ±1/sqrt(k).
    fn bf16(&mut self, len: usize, k: usize) -> Result<DevBuf<u16>> {
        let w: DevBuf<u16> = self.g.zeros(len)?;
        let a = 1.0 / (k as f32).sqrt();
        let seed = self.next_seed();
        ops::fill_uniform(self.g, w.ptr(), len, true, seed, -a, a)?;
        Ok(w)
    }

    /// `count` stacked `[n, k]` matrices with values of magnitude about 1/sqrt(k), quantized as
    /// the model ([`Self::mats_as`]).
    fn mats(&mut self, count: usize, n: usize, k: usize) -> Result<DevMat> {
        self.mats_as(self.quant, count, n, k)
    }

    /// As [`Self::mats`], bf16 or affine-quantized with `quant = Some((bits, group))`: random
    /// bits, with scales and biases that keep w = q·s + b in that range.
    fn mats_as(
        &mut self,
        quant: Option<(u32, usize)>,
        count: usize,
        n: usize,
        k: usize,
    ) -> Result<DevMat> {
        let Some((bits, group)) = quant else {
            let w = DevWeights::Bf16(self.bf16(count * n * k, k)?);
            return Ok(DevMat {
                w,
                n,
                k,
                bias: None,
            });
        };
        let g = self.g;
        let words: DevBuf<u32> = g.zeros(count * n * k * bits as usize / 32)?;
        let seed = self.next_seed();
        ops::fill_random_u32(g, words.ptr(), words.len(), seed)?;
        let a = 1.0 / (k as f32).sqrt();
        let step = 2.0 * a / ((1u32 << bits) - 1) as f32;
        let groups = count * n * k / group;
        let (scales, biases): (DevBuf<u16>, DevBuf<u16>) = (g.zeros(groups)?, g.zeros(groups)?);
        let (s1, s2) = (self.next_seed(), self.next_seed());
        ops::fill_uniform(g, scales.ptr(), groups, true, s1, 0.5 * step, 1.5 * step)?;
        ops::fill_uniform(g, biases.ptr(), groups, true, s2, -1.5 * a, -0.5 * a)?;
        let w = DevWeights::Affine {
            words,
            scales,
            biases,
            bits,
            group,
        };
        Ok(DevMat {
            w,
            n,
            k,
            bias: None,
        })
    }

    /// An MoE router (its experts' rows and the shared-expert gate's) as `deltamoe convert` and
    /// mlx-lm store it in a quantized model: at [`ROUTER_SPEC`] (8 bits, group 64).
    fn router(&mut self, n: usize, k: usize) -> Result<DevMat> {
        let quant = self
            .quant
            .map(|_| (ROUTER_SPEC.bits, ROUTER_SPEC.group_size));
        self.mats_as(quant, 1, n, k)
    }

    /// The seeds [`Self::mats`] would fill `[n, k]` matrices with, for matrices written later
    /// wherever they are placed ([`SeededExperts`]): the same values as a stack made here.
    fn seeded(&mut self, n: usize, k: usize) -> Seeded {
        let fmt = Fmt {
            n,
            k,
            affine: self.quant,
        };
        let seeds = match self.quant {
            None => [self.next_seed(), 0, 0],
            Some(_) => [self.next_seed(), self.next_seed(), self.next_seed()],
        };
        Seeded { fmt, seeds }
    }

    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Result<DevBuf<f32>> {
        let v: DevBuf<f32> = self.g.zeros(n)?;
        let seed = self.next_seed();
        ops::fill_uniform(self.g, v.ptr(), n, false, seed, lo, hi)?;
        Ok(v)
    }
}

/// The seeds of a stack of random `[n, k]` matrices ([`Filler::seeded`]): values, or affine
/// words, scales and biases.
struct Seeded {
    fmt: Fmt,
    seeds: [u64; 3],
}

impl Seeded {
    /// Fill matrices `mats` of the stack into `to`, with the values [`Filler::mats`] gives them.
    fn write(&self, g: &Gpu, mats: Range<usize>, to: Dest<'_>) -> Result<()> {
        let (first, count, dst, at) = (mats.start, mats.len(), to.arrays, to.at);
        let (n, k) = (self.fmt.n, self.fmt.k);
        let a = 1.0 / (k as f32).sqrt();
        let nk = n * k;
        let Some((bits, group)) = self.fmt.affine else {
            let (d, bytes) = dst[0];
            let out = d + (at * bytes) as u64;
            let seed = seed_at(self.seeds[0], first * nk);
            return ops::fill_uniform(g, out, count * nk, true, seed, -a, a);
        };
        let step = 2.0 * a / ((1u32 << bits) - 1) as f32;
        let (words, groups) = (nk * bits as usize / 32, nk / group);
        let at_of = |i: usize| dst[i].0 + (at * dst[i].1) as u64;
        // fill_random_u32 draws two values a word.
        let seed = seed_at(self.seeds[0], 2 * first * words);
        ops::fill_random_u32(g, at_of(0), count * words, seed)?;
        let (s1, s2) = (
            seed_at(self.seeds[1], first * groups),
            seed_at(self.seeds[2], first * groups),
        );
        ops::fill_uniform(
            g,
            at_of(1),
            count * groups,
            true,
            s1,
            0.5 * step,
            1.5 * step,
        )?;
        ops::fill_uniform(g, at_of(2), count * groups, true, s2, -1.5 * a, -0.5 * a)
    }
}

/// A synthetic MoE layer's experts (`[gate | up]`, down): filled where they are placed.
struct SeededExperts(Seeded, Seeded);

impl ExpertSource for SeededExperts {
    fn formats(&self) -> (Fmt, Fmt) {
        (self.0.fmt, self.1.fmt)
    }

    fn write(&self, g: &Gpu, down: bool, experts: Range<usize>, to: Dest<'_>) -> Result<()> {
        if experts.is_empty() {
            return Ok(());
        }
        let stack = if down { &self.1 } else { &self.0 };
        stack.write(g, experts, to)
    }
}

impl GpuModel {
    /// Random weights of config `c` on `gpu`: bf16, or affine-quantized matrices with
    /// `quant = Some((bits, group))` (the MoE routers at 8 bits as the converter writes them;
    /// norms, conv and gates stay f32, the embedding bf16). With
    /// a `cache` other than [`ExpertCache::All`] the routed experts are made in pinned host
    /// memory and cached on the device as that says.
    pub fn synthetic(
        c: &ModelConfig,
        gpu: Arc<Gpu>,
        seed: u64,
        quant: Option<(u32, usize)>,
        cache: ExpertCache,
    ) -> Result<GpuModel> {
        let offload = cache != ExpertCache::All;
        let g = &*gpu;
        let mut f = Filler { g, seed, quant };
        let h = c.hidden_size;
        let mut layers = Vec::with_capacity(c.num_layers);
        let mut pending = Vec::new();
        for i in 0..c.num_layers {
            let mixer = match c.layer_kinds[i] {
                LayerKind::LinearAttention => {
                    let (hv, vd, cd) = (c.linear_v_heads, c.linear_value_size(), c.conv_dim());
                    GpuMixer::Linear {
                        proj: f.mats(1, cd + vd + 2 * hv, h)?,
                        conv_w: f.vec(cd * c.conv_kernel, -0.5, 0.5)?,
                        neg_a: f.vec(hv, -1.0, -0.05)?,
                        dt_bias: f.vec(hv, -1.0, 1.0)?,
                        norm_w: f.vec(c.linear_v_dim, 0.5, 1.5)?,
                        out: f.mats(1, h, vd)?,
                        dims: GdnDims {
                            hk: c.linear_k_heads,
                            hv,
                            dk: c.linear_k_dim,
                            dv: c.linear_v_dim,
                        },
                        conv_dim: cd,
                        kernel: c.conv_kernel,
                    }
                }
                LayerKind::FullAttention => {
                    let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
                    GpuMixer::Full {
                        proj: f.mats(1, 2 * qd + 2 * kvd, h)?,
                        qn: f.vec(c.head_dim, 0.5, 1.5)?,
                        kn: f.vec(c.head_dim, 0.5, 1.5)?,
                        out: f.mats(1, h, qd)?,
                    }
                }
            };
            let ffn = match c.ffn_kinds[i] {
                FfnKind::Dense => {
                    let n = c.intermediate_size;
                    GpuFfn::Dense {
                        gate_up: f.mats(1, 2 * n, h)?,
                        down: f.mats(1, h, n)?,
                    }
                }
                FfnKind::Moe => {
                    let (e, n, sn) = (
                        c.num_experts,
                        c.moe_intermediate_size,
                        c.shared_expert_intermediate_size,
                    );
                    // As on upload: a shared expert of the experts' shape is stacked as expert E.
                    let stacked = sn == n;
                    let shared = if stacked {
                        None
                    } else {
                        Some((f.mats(1, 2 * sn, h)?, f.mats(1, h, sn)?))
                    };
                    let count = e + stacked as usize;
                    let router = f.router(e + 1, h)?;
                    if offload {
                        let src = SeededExperts(f.seeded(2 * n, h), f.seeded(h, n));
                        let ffn = GpuFfn::Moe {
                            router,
                            experts_gu: src.0.fmt.device_stack(g, 0)?,
                            experts_down: src.1.fmt.device_stack(g, 0)?,
                            shared,
                            offload: None,
                        };
                        pending.push(Pending {
                            layer: i,
                            experts: e,
                            stacked,
                            src: Box::new(src),
                        });
                        ffn
                    } else {
                        GpuFfn::Moe {
                            router,
                            experts_gu: f.mats(count, 2 * n, h)?,
                            experts_down: f.mats(count, h, n)?,
                            shared,
                            offload: None,
                        }
                    }
                }
            };
            layers.push(GpuLayer {
                input_norm: f.vec(h, 0.5, 1.5)?,
                mixer,
                post_norm: f.vec(h, 0.5, 1.5)?,
                ffn,
            });
        }
        let embed = DevMat {
            w: DevWeights::Bf16(f.bf16(c.vocab_size * h, h)?),
            n: c.vocab_size,
            k: h,
            bias: None,
        };
        let lm_head = f.mats(1, c.vocab_size, h)?;
        let final_norm = f.vec(h, 0.5, 1.5)?;
        let inv_freq = g.upload(Rope::new(c.rotary_dim, c.rope_theta).inv_freq())?;
        g.sync()?;
        let mut m = GpuModel::assemble(
            c,
            gpu.clone(),
            Parts {
                embed,
                lm_head,
                final_norm,
                inv_freq,
                layers,
            },
        )?;
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
            let GpuFfn::Moe { router, .. } = &mut l.ffn else {
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
