//! A model of any config with random bf16 weights made directly in device memory (no host
//! copy, no files): what `deltamoe bench` measures real shapes with.

use std::sync::Arc;

use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops::{self, AttnDims, GdnDims};
use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::{DevMat, GpuFfn, GpuLayer, GpuMixer, GpuModel, Result, Scratch};
use crate::config::{FfnKind, LayerKind, ModelConfig};

/// Fills buffers with seeded uniform values, a new seed per buffer.
struct Filler<'a> {
    g: &'a Gpu,
    seed: u64,
}

impl Filler<'_> {
    fn next_seed(&mut self) -> u64 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.seed
    }

    /// `count` stacked `[n, k]` bf16 matrices, uniform in ±1/sqrt(k).
    fn mats(&mut self, count: usize, n: usize, k: usize) -> Result<DevMat> {
        let w: DevBuf<u16> = self.g.zeros(count * n * k)?;
        let a = 1.0 / (k as f32).sqrt();
        let seed = self.next_seed();
        ops::fill_uniform(self.g, w.ptr(), count * n * k, true, seed, -a, a)?;
        Ok(DevMat {
            w,
            n,
            k,
            bias: None,
        })
    }

    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Result<DevBuf<f32>> {
        let v: DevBuf<f32> = self.g.zeros(n)?;
        let seed = self.next_seed();
        ops::fill_uniform(self.g, v.ptr(), n, false, seed, lo, hi)?;
        Ok(v)
    }
}

impl GpuModel {
    /// Random weights of config `c` on `gpu`.
    pub fn synthetic(c: &ModelConfig, gpu: Arc<Gpu>, seed: u64) -> Result<GpuModel> {
        let g = &*gpu;
        let mut f = Filler { g, seed };
        let h = c.hidden_size;
        let mut layers = Vec::with_capacity(c.num_layers);
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
                    GpuFfn::Moe {
                        router: f.mats(1, e + 1, h)?,
                        experts_gu: f.mats(e, 2 * n, h)?,
                        experts_down: f.mats(e, h, n)?,
                        shared_gu: f.mats(1, 2 * sn, h)?,
                        shared_down: f.mats(1, h, sn)?,
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
        let embed = f.mats(1, c.vocab_size, h)?.w;
        let lm_head = f.mats(1, c.vocab_size, h)?;
        let final_norm = f.vec(h, 0.5, 1.5)?;
        let inv_freq = g.upload(Rope::new(c.rotary_dim, c.rope_theta).inv_freq())?;
        let scratch = Scratch::new(g, c, &layers)?;
        g.sync()?;
        Ok(GpuModel {
            hidden: h,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            attn: AttnDims {
                hq: c.num_heads,
                hkv: c.num_kv_heads,
                d: c.head_dim,
                rotary: c.rotary_dim,
            },
            top_k: c.experts_per_token,
            num_experts: c.num_experts,
            norm_topk: c.norm_topk_prob,
            embed,
            lm_head,
            final_norm,
            inv_freq,
            layers,
            scratch,
            gpu,
        })
    }
}
