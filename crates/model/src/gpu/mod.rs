//! The Qwen3 hybrid model's decode step on CUDA.
//!
//! Weights are uploaded once from a loaded [`Qwen3Hybrid`]: dense ones as bf16 (f16/f32
//! checkpoints rounded to bf16), MLX affine 2/4/8-bit ones kept quantized (u32 words, bf16
//! scales and biases; 3/5/6-bit, which pack across words, are dequantized to bf16). Projections
//! that read the same input are fused into one matrix: GDN `[qkv | z | b | a]` (Qwen3-Next's
//! per-key-head packing reordered by row runs), attention `[q/gate | k | v]`, MoE router
//! `[router | shared_expert_gate]`, and each expert's `[gate | up]`. Norm scales, conv kernels,
//! `−exp(A_log)` and `dt_bias` stay f32; activations are f32 throughout.
//!
//! One token's step (see [`GpuModel::enqueue_step`]) runs every op on the GPU: embedding,
//! add+RMSNorm, fused projections, the GDN conv and delta-rule kernels, attention prep and
//! split-K decode, router top-k, batched expert SwiGLU and down projections (all K experts in
//! one launch each), combine, final norm, lm_head and argmax. The token id and position live in
//! device memory, so the step is captured once per sequence into a CUDA graph and replayed; the
//! only host↔device traffic per greedy token is the token id.

mod synthetic;
mod upload;

pub(crate) use upload::{DevMat, DevWeights};

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use deltamoe_compute::cuda::ops::{self, AttnDims, GdnDims, Route, ATTN_DMAX};
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu};

use crate::qwen3_hybrid::Qwen3Hybrid;
use upload::{upload_ffn, upload_mixer};

type Result<T> = std::result::Result<T, CudaError>;

/// Split-K partitions of the attention decode.
const ATTN_SPLITS: usize = 64;

pub(crate) enum GpuMixer {
    Linear {
        proj: DevMat,
        conv_w: DevBuf<f32>,
        neg_a: DevBuf<f32>,
        dt_bias: DevBuf<f32>,
        norm_w: DevBuf<f32>,
        out: DevMat,
        dims: GdnDims,
        conv_dim: usize,
        kernel: usize,
    },
    Full {
        proj: DevMat,
        qn: DevBuf<f32>,
        kn: DevBuf<f32>,
        out: DevMat,
    },
}

#[allow(clippy::large_enum_variant)] // one per layer; boxing buys nothing
pub(crate) enum GpuFfn {
    Dense {
        gate_up: DevMat,
        down: DevMat,
    },
    /// Routed experts stacked `[E (+1), …]`; `shared` holds the shared expert's `[gate | up]`
    /// and down when it could not be stacked as expert E.
    Moe {
        router: DevMat,
        experts_gu: DevMat,
        experts_down: DevMat,
        shared: Option<(DevMat, DevMat)>,
    },
}

pub(crate) struct GpuLayer {
    input_norm: DevBuf<f32>,
    mixer: GpuMixer,
    post_norm: DevBuf<f32>,
    ffn: GpuFfn,
}

/// Activations shared by every sequence's step (steps run one at a time on one stream).
struct Scratch {
    x: DevBuf<f32>,
    normed: DevBuf<f32>,
    delta: DevBuf<f32>,
    proj: DevBuf<f32>,
    mixed: DevBuf<f32>,
    mix_out: DevBuf<f32>,
    q: DevBuf<f32>,
    part_o: DevBuf<f32>,
    part_ml: DevBuf<f32>,
    router: DevBuf<f32>,
    ids: DevBuf<i32>,
    weights: DevBuf<f32>,
    sg: DevBuf<f32>,
    h: DevBuf<f32>,
    y: DevBuf<f32>,
    hs: DevBuf<f32>,
    ys: DevBuf<f32>,
    logits: DevBuf<f32>,
}

/// A sequence's state on the device, and its captured step.
pub struct GpuSeq {
    conv: Vec<Option<DevBuf<f32>>>,
    rec: Vec<Option<DevBuf<f32>>>,
    k_cache: Vec<Option<DevBuf<f32>>>,
    v_cache: Vec<Option<DevBuf<f32>>>,
    tok: DevBuf<i32>,
    pos: DevBuf<i32>,
    /// Sampling parameters read by the step's last kernel (see `ops::SampleParams`).
    sampling: DevBuf<u32>,
    /// Tokens processed (mirrors the device counter).
    pub host_pos: usize,
    max_ctx: usize,
    graph: Option<CudaGraph>,
}

/// The model on a GPU.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    hidden: usize,
    vocab: usize,
    eps: f32,
    attn: AttnDims,
    top_k: usize,
    num_experts: usize,
    norm_topk: bool,
    embed: DevMat,
    lm_head: DevMat,
    final_norm: DevBuf<f32>,
    inv_freq: DevBuf<f32>,
    layers: Vec<GpuLayer>,
    scratch: Scratch,
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unsupported(msg)
}

/// The device weights a [`GpuModel`] is assembled from.
pub(crate) struct Parts {
    pub embed: DevMat,
    pub lm_head: DevMat,
    pub final_norm: DevBuf<f32>,
    pub inv_freq: DevBuf<f32>,
    pub layers: Vec<GpuLayer>,
}

impl GpuModel {
    /// A model of config `c` from its device weights, with scratch buffers sized for it.
    pub(crate) fn assemble(c: &crate::ModelConfig, gpu: Arc<Gpu>, p: Parts) -> Result<GpuModel> {
        let scratch = Scratch::new(&gpu, c, &p.layers)?;
        Ok(GpuModel {
            hidden: c.hidden_size,
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
            embed: p.embed,
            lm_head: p.lm_head,
            final_norm: p.final_norm,
            inv_freq: p.inv_freq,
            layers: p.layers,
            scratch,
            gpu,
        })
    }

    /// Upload `model` to `gpu`.
    pub fn upload(model: &Qwen3Hybrid, gpu: Arc<Gpu>) -> Result<GpuModel> {
        let c = model.config();
        let g = &*gpu;
        if c.head_dim > ATTN_DMAX {
            return Err(unsupported(format!(
                "head_dim {} exceeds the CUDA attention limit {ATTN_DMAX}",
                c.head_dim
            )));
        }
        let h = c.hidden_size;
        let layers = model
            .layers
            .iter()
            .map(|l| {
                Ok(GpuLayer {
                    input_norm: g.upload(&l.input_norm)?,
                    mixer: upload_mixer(g, &l.mixer, h)?,
                    post_norm: g.upload(&l.post_norm)?,
                    ffn: upload_ffn(g, &l.ffn, h)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = DevMat::stack(g, &[&model.embed], c.vocab_size, h, None)?;
        let lm_head = DevMat::stack(g, &[&model.lm_head], c.vocab_size, h, None)?;
        let parts = Parts {
            embed,
            lm_head,
            final_norm: g.upload(&model.final_norm)?,
            inv_freq: g.upload(model.rope.inv_freq())?,
            layers,
        };
        GpuModel::assemble(c, gpu.clone(), parts)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// A fresh sequence with room for `max_ctx` tokens.
    pub fn new_seq(&self, max_ctx: usize) -> Result<GpuSeq> {
        let g = &*self.gpu;
        let a = self.attn;
        let (mut conv, mut rec, mut k_cache, mut v_cache) = (vec![], vec![], vec![], vec![]);
        for l in &self.layers {
            match &l.mixer {
                GpuMixer::Linear {
                    dims,
                    conv_dim,
                    kernel,
                    ..
                } => {
                    conv.push(Some(g.zeros((kernel - 1) * conv_dim)?));
                    rec.push(Some(g.zeros(dims.hv * dims.dk * dims.dv)?));
                    k_cache.push(None);
                    v_cache.push(None);
                }
                GpuMixer::Full { .. } => {
                    conv.push(None);
                    rec.push(None);
                    k_cache.push(Some(g.zeros(max_ctx * a.hkv * a.d)?));
                    v_cache.push(Some(g.zeros(max_ctx * a.hkv * a.d)?));
                }
            }
        }
        Ok(GpuSeq {
            conv,
            rec,
            k_cache,
            v_cache,
            tok: g.zeros(1)?,
            pos: g.zeros(1)?,
            sampling: g.zeros(7)?,
            host_pos: 0,
            max_ctx,
            graph: None,
        })
    }

    /// Bytes of device state per sequence at `max_ctx` tokens.
    pub fn seq_bytes(&self, max_ctx: usize) -> usize {
        self.layers
            .iter()
            .map(|l| match &l.mixer {
                GpuMixer::Linear {
                    dims,
                    conv_dim,
                    kernel,
                    ..
                } => (kernel - 1) * conv_dim + dims.hv * dims.dk * dims.dv,
                GpuMixer::Full { .. } => 2 * max_ctx * self.attn.hkv * self.attn.d,
            })
            .sum::<usize>()
            * 4
    }

    /// Run one token: `tok` fed at the sequence's position. Returns the next token as the
    /// sequence's sampling parameters pick it (greedy by default); the logits stay on the device
    /// (see [`GpuModel::logits`]).
    pub fn step(&mut self, seq: &mut GpuSeq, tok: u32) -> Result<u32> {
        if seq.host_pos >= seq.max_ctx {
            return Err(unsupported(format!(
                "the sequence is full: {} tokens is its context",
                seq.max_ctx
            )));
        }
        if tok as usize >= self.vocab {
            return Err(unsupported(format!(
                "token id {tok} is out of range: vocab_size is {}",
                self.vocab
            )));
        }
        let g = self.gpu.clone();
        g.write(&mut seq.tok, &[tok as i32])?;
        if seq.graph.is_none() {
            let stream = g.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            let r = self.enqueue_step(seq);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            r?;
            seq.graph = graph;
        }
        match &seq.graph {
            Some(graph) => graph
                .launch()
                .map_err(|e| unsupported(format!("graph launch: {e}")))?,
            None => self.enqueue_step(seq)?,
        }
        seq.host_pos += 1;
        Ok(g.read(&seq.tok, 1)?[0] as u32)
    }

    /// How the step picks the sequence's next token (the draw counter restarts at 0).
    pub fn set_sampling(&self, seq: &mut GpuSeq, p: ops::SampleParams) -> Result<()> {
        self.gpu.write(&mut seq.sampling, &p.words(0))
    }

    /// Move the sequence to position `pos` without running tokens (benchmarks measure decode
    /// at a context length this way; the skipped KV entries hold zeros).
    pub fn set_position(&self, seq: &mut GpuSeq, pos: usize) -> Result<()> {
        if pos >= seq.max_ctx {
            return Err(unsupported(format!(
                "position {pos} is past the sequence's context {}",
                seq.max_ctx
            )));
        }
        self.gpu.write(&mut seq.pos, &[pos as i32])?;
        seq.host_pos = pos;
        Ok(())
    }

    /// Bytes one decode step reads at context `ctx`: the active weights (embedding row,
    /// mixers, router, top-k and shared experts, lm_head), the GDN states (read and written)
    /// and the KV caches.
    pub fn bytes_per_token(&self, ctx: usize) -> usize {
        let mat = |m: &DevMat| m.bytes();
        let mut b = mat(&self.embed) / self.vocab + mat(&self.lm_head);
        for l in &self.layers {
            b += match &l.mixer {
                GpuMixer::Linear {
                    proj, out, dims, ..
                } => mat(proj) + mat(out) + 2 * 4 * dims.hv * dims.dk * dims.dv,
                GpuMixer::Full { proj, out, .. } => {
                    mat(proj) + mat(out) + 2 * 4 * ctx * self.attn.hkv * self.attn.d
                }
            };
            b += match &l.ffn {
                GpuFfn::Dense { gate_up, down } => mat(gate_up) + mat(down),
                GpuFfn::Moe {
                    router,
                    experts_gu,
                    experts_down,
                    shared,
                } => {
                    let slots = self.top_k + shared.is_none() as usize;
                    mat(router)
                        + slots * (mat(experts_gu) + mat(experts_down))
                        + shared.as_ref().map_or(0, |(gu, d)| mat(gu) + mat(d))
                }
            };
        }
        b
    }

    /// Mixer kind of each layer: "gdn" or "attention".
    pub fn layer_kinds(&self) -> Vec<&'static str> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                GpuMixer::Linear { .. } => "gdn",
                GpuMixer::Full { .. } => "attention",
            })
            .collect()
    }

    /// Run one step eagerly (no graph) with a device timer around each layer: milliseconds per
    /// layer, and for the embedding + head together. Advances the sequence like [`Self::step`].
    pub fn profile_step(&mut self, seq: &mut GpuSeq, tok: u32) -> Result<(Vec<f32>, f32)> {
        let g = self.gpu.clone();
        g.write(&mut seq.tok, &[tok as i32])?;
        let marks: Vec<_> = (0..self.layers.len() + 3)
            .map(|_| g.timer())
            .collect::<Result<_>>()?;
        g.mark(&marks[0])?;
        ops::embed(
            &g,
            self.embed.mv(),
            seq.tok.ptr(),
            self.scratch.x.ptr(),
            self.hidden,
        )?;
        g.mark(&marks[1])?;
        for i in 0..self.layers.len() {
            self.enqueue_layer(seq, i)?;
            g.mark(&marks[i + 2])?;
        }
        self.enqueue_head(seq)?;
        g.mark(&marks[self.layers.len() + 2])?;
        g.sync()?;
        seq.host_pos += 1;
        let ms = |a: usize, b: usize| g.elapsed_ms(&marks[a], &marks[b]);
        let layers = (0..self.layers.len())
            .map(|i| ms(i + 1, i + 2))
            .collect::<Result<Vec<_>>>()?;
        let other = ms(0, 1)? + ms(self.layers.len() + 1, self.layers.len() + 2)?;
        Ok((layers, other))
    }

    /// The logits of the last step, `[vocab]`.
    pub fn logits(&self) -> Result<Vec<f32>> {
        self.gpu.read(&self.scratch.logits, self.vocab)
    }

    /// Enqueue one token's forward pass on the stream (eagerly or into a capture).
    fn enqueue_step(&self, seq: &GpuSeq) -> Result<()> {
        let s = &self.scratch;
        ops::embed(
            &self.gpu,
            self.embed.mv(),
            seq.tok.ptr(),
            s.x.ptr(),
            self.hidden,
        )?;
        for i in 0..self.layers.len() {
            self.enqueue_layer(seq, i)?;
        }
        self.enqueue_head(seq)
    }

    /// Layer `i`: the previous sublayer's output (in `delta`) joins the residual, then the
    /// mixer and the ffn run; the ffn's output is left in `delta`.
    fn enqueue_layer(&self, seq: &GpuSeq, i: usize) -> Result<()> {
        let g = &*self.gpu;
        let s = &self.scratch;
        let (h, eps) = (self.hidden, self.eps);
        let l = &self.layers[i];
        let delta = if i == 0 { 0 } else { s.delta.ptr() };
        self.add_norm(delta, l.input_norm.ptr())?;
        match &l.mixer {
            GpuMixer::Linear {
                proj,
                conv_w,
                neg_a,
                dt_bias,
                norm_w,
                out,
                dims,
                conv_dim,
                kernel,
            } => {
                let (conv, rec) = (seq.conv[i].as_ref(), seq.rec[i].as_ref());
                let (conv, rec) = (conv.map_or(0, |b| b.ptr()), rec.map_or(0, |b| b.ptr()));
                ops::matvec(g, proj.mv(), s.normed.ptr(), s.proj.ptr(), 1, 0, 0)?;
                ops::gdn_conv_step(
                    g,
                    s.proj.ptr(),
                    conv,
                    conv_w.ptr(),
                    s.mixed.ptr(),
                    *conv_dim,
                    *kernel,
                )?;
                ops::gdn_step(
                    g,
                    s.mixed.ptr(),
                    s.proj.ptr(),
                    rec,
                    neg_a.ptr(),
                    dt_bias.ptr(),
                    norm_w.ptr(),
                    s.mix_out.ptr(),
                    *dims,
                    eps,
                )?;
                ops::matvec(g, out.mv(), s.mix_out.ptr(), s.delta.ptr(), 1, 0, 0)?;
            }
            GpuMixer::Full { proj, qn, kn, out } => {
                let kc = seq.k_cache[i].as_ref().map_or(0, |b| b.ptr());
                let vc = seq.v_cache[i].as_ref().map_or(0, |b| b.ptr());
                ops::matvec(g, proj.mv(), s.normed.ptr(), s.proj.ptr(), 1, 0, 0)?;
                ops::attn_prep(
                    g,
                    s.proj.ptr(),
                    qn.ptr(),
                    kn.ptr(),
                    self.inv_freq.ptr(),
                    s.q.ptr(),
                    kc,
                    vc,
                    seq.pos.ptr(),
                    self.attn,
                    eps,
                )?;
                ops::attn_decode(
                    g,
                    s.q.ptr(),
                    kc,
                    vc,
                    seq.pos.ptr(),
                    s.part_o.ptr(),
                    s.part_ml.ptr(),
                    s.proj.ptr(),
                    s.mix_out.ptr(),
                    self.attn,
                    ATTN_SPLITS,
                )?;
                ops::matvec(g, out.mv(), s.mix_out.ptr(), s.delta.ptr(), 1, 0, 0)?;
            }
        }
        self.add_norm(s.delta.ptr(), l.post_norm.ptr())?;
        match &l.ffn {
            GpuFfn::Dense { gate_up, down } => {
                ops::matvec_swiglu(g, gate_up.mv(), s.normed.ptr(), s.h.ptr(), 1, 0, 0)?;
                ops::matvec(g, down.mv(), s.h.ptr(), s.delta.ptr(), 1, 0, 0)?;
            }
            GpuFfn::Moe {
                router,
                experts_gu,
                experts_down,
                shared,
            } => {
                let i_e = experts_gu.n / 2;
                let slots = self.top_k + shared.is_none() as usize;
                let route = Route {
                    experts: self.num_experts,
                    top_k: self.top_k,
                    renorm: self.norm_topk,
                    shared_gate: true,
                    shared_slot: shared.is_none().then_some(self.num_experts),
                };
                ops::matvec(g, router.mv(), s.normed.ptr(), s.router.ptr(), 1, 0, 0)?;
                ops::router_topk(
                    g,
                    s.router.ptr(),
                    route,
                    s.ids.ptr(),
                    s.weights.ptr(),
                    s.sg.ptr(),
                )?;
                ops::matvec_swiglu(
                    g,
                    experts_gu.mv(),
                    s.normed.ptr(),
                    s.h.ptr(),
                    slots,
                    s.ids.ptr(),
                    0,
                )?;
                ops::matvec(
                    g,
                    experts_down.mv(),
                    s.h.ptr(),
                    s.y.ptr(),
                    slots,
                    s.ids.ptr(),
                    i_e,
                )?;
                let (ys, sg) = match shared {
                    Some((gu, down)) => {
                        ops::matvec_swiglu(g, gu.mv(), s.normed.ptr(), s.hs.ptr(), 1, 0, 0)?;
                        ops::matvec(g, down.mv(), s.hs.ptr(), s.ys.ptr(), 1, 0, 0)?;
                        (s.ys.ptr(), s.sg.ptr())
                    }
                    None => (0, 0),
                };
                ops::moe_combine(
                    g,
                    s.y.ptr(),
                    s.weights.ptr(),
                    ys,
                    sg,
                    s.delta.ptr(),
                    slots,
                    h,
                )?;
            }
        }
        Ok(())
    }

    /// `x += delta` (when delta ≠ 0), then `normed = rmsnorm(x) · scale`.
    fn add_norm(&self, delta: u64, scale: u64) -> Result<()> {
        let s = &self.scratch;
        ops::add_rmsnorm(
            &self.gpu,
            s.x.ptr(),
            delta,
            scale,
            s.normed.ptr(),
            1,
            self.hidden,
            self.eps,
        )
    }

    /// Final norm, lm_head and the next token (greedy or sampled on the device).
    fn enqueue_head(&self, seq: &GpuSeq) -> Result<()> {
        let g = &*self.gpu;
        let s = &self.scratch;
        self.add_norm(s.delta.ptr(), self.final_norm.ptr())?;
        ops::matvec(
            g,
            self.lm_head.mv(),
            s.normed.ptr(),
            s.logits.ptr(),
            1,
            0,
            0,
        )?;
        ops::sample_advance(
            g,
            s.logits.ptr(),
            self.vocab,
            seq.sampling.ptr(),
            seq.tok.ptr(),
            seq.pos.ptr(),
        )
    }
}

impl Scratch {
    fn new(g: &Gpu, c: &crate::ModelConfig, layers: &[GpuLayer]) -> Result<Scratch> {
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
        Ok(Scratch {
            x: g.zeros(h)?,
            normed: g.zeros(h)?,
            delta: g.zeros(h)?,
            proj: g.zeros(proj)?,
            mixed: g.zeros(c.conv_dim())?,
            mix_out: g.zeros(qd.max(c.linear_value_size()))?,
            q: g.zeros(qd)?,
            part_o: g.zeros(c.num_heads * ATTN_SPLITS * c.head_dim)?,
            part_ml: g.zeros(c.num_heads * ATTN_SPLITS * 2)?,
            router: g.zeros(c.num_experts + 1)?,
            ids: g.zeros(k)?,
            weights: g.zeros(k)?,
            sg: g.zeros(1)?,
            h: g.zeros(inter)?,
            y: g.zeros(k * h)?,
            hs: g.zeros(shared_inter)?,
            ys: g.zeros(h)?,
            logits: g.zeros(c.vocab_size)?,
        })
    }
}
