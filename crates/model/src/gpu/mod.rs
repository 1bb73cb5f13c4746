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
//! A decode step (see [`GpuModel::enqueue_step`]) feeds one token to each of B sequences and
//! runs every op on the GPU with a batch dimension: embedding, add+RMSNorm, fused projections,
//! the GDN conv and delta-rule kernels, attention prep and split-K decode, router top-k, expert
//! SwiGLU and down projections (all K experts of all B rows in one launch each), combine, final
//! norm, lm_head and sampling; at batch 1 the norms, residual adds, conv step and combine ride on
//! the products instead ([`mixer`]). Sequence state lives in a pool of slots ([`pool`]); the
//! token ids and slot indices of a step live in device memory, so the step is captured once per
//! batch size into a CUDA graph and replayed; the only host↔device traffic per token is its id
//! and slot.
//! Prompts run through [`GpuModel::prefill`] ([`prefill`]): many tokens of one sequence per
//! layer pass.

mod homes;
mod host_experts;
mod host_store;
mod host_team;
mod mixer;
mod offload;
mod pool;
mod prefill;
mod scratch;
mod synthetic;
mod upload;

pub use offload::{
    clean_copies, slots_for_bytes, ExpertCache, OffloadStats, HOST_RESERVE, STATE_RESERVE,
};
pub use pool::{GpuSeq, GpuSnapshot};
pub use prefill::{gdn_path, GdnPrefill, CHUNKED_MIN_ROWS, PREFILL_MAX_ROWS};
pub(crate) use upload::{DevMat, DevWeights};

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use deltamoe_compute::cuda::ops::{self, AttnDims, Batch, GdnDims, Route, Slots, ATTN_DMAX};
use deltamoe_compute::cuda::vec::{self, VecIo};
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu};

use crate::config::ModelConfig;
use crate::qwen3_hybrid::Qwen3Hybrid;
use pool::Pool;
use scratch::Scratch;
use upload::{upload_ffn, upload_mixer};

type Result<T> = std::result::Result<T, CudaError>;

/// Split-K partitions of the attention decode.
const ATTN_SPLITS: usize = 64;

/// Most rows one batched step runs; the engine splits larger batches.
pub const MAX_BATCH: usize = 32;

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
    /// and down when it could not be stacked as expert E. With `offload` the stacks are the
    /// expert cache `[slots (+1), …]` (see [`offload`]).
    Moe {
        router: DevMat,
        experts_gu: DevMat,
        experts_down: DevMat,
        shared: Option<(DevMat, DevMat)>,
        offload: Option<Box<host_store::LayerExperts>>,
    },
}

pub(crate) struct GpuLayer {
    input_norm: DevBuf<f32>,
    mixer: GpuMixer,
    post_norm: DevBuf<f32>,
    ffn: GpuFfn,
}

/// The residual an MoE layer's output joins and the scale of the norm after the layer (none in
/// the fused decode form, where the next projection normalizes), for [`GpuModel::moe_tail`] to
/// fuse in (device addresses).
pub(crate) struct NextNorm {
    pub x: u64,
    pub scale: Option<u64>,
}

/// The buffers [`GpuModel::moe_tail`] reads and writes (device addresses).
pub(crate) struct MoeTail {
    pub normed: u64,
    pub hs: u64,
    pub ys: u64,
    pub sg: u64,
    pub y: u64,
    pub weights: u64,
    pub delta: u64,
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
    cfg: ModelConfig,
    /// Rows the scratch holds (the largest batch a step takes).
    rows: usize,
    scratch: Scratch,
    pool: Option<Pool>,
    /// A step's inputs: token ids `[rows]` (overwritten with the next tokens), then slot
    /// indices `[rows]`.
    io: DevBuf<i32>,
    /// The captured step per batch size (index B − 1).
    graphs: Vec<Option<CudaGraph>>,
    /// Activations of a prefill pass (allocated by the first prefill).
    prefill: Option<prefill::PrefillScratch>,
    prefill_gdn: prefill::GdnPrefill,
    /// Routed-id log, staging and statistics when experts are offloaded.
    offload: Option<offload::Offload>,
    /// A cap on the pinned host memory of offloaded experts (see
    /// [`GpuModel::set_host_memory`]).
    host_memory: Option<usize>,
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
        let scratch = Scratch::new(&gpu, c, &p.layers, 1)?;
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
            cfg: c.clone(),
            rows: 1,
            scratch,
            pool: None,
            io: gpu.zeros(2)?,
            graphs: Vec::new(),
            prefill: None,
            prefill_gdn: prefill::GdnPrefill::default(),
            offload: None,
            host_memory: None,
            gpu,
        })
    }

    /// Size the scratch for batches of `rows` rows.
    fn set_rows(&mut self, rows: usize) -> Result<()> {
        self.graphs.clear();
        self.scratch = Scratch::new(&self.gpu, &self.cfg, &self.layers, rows)?;
        self.io = self.gpu.zeros(2 * rows)?;
        self.rows = rows;
        Ok(())
    }

    /// Most sequences one [`Self::step_batch`] takes.
    pub fn max_batch(&self) -> usize {
        self.rows
    }

    /// Upload `model` to `gpu`.
    pub fn upload(model: &Qwen3Hybrid, gpu: Arc<Gpu>) -> Result<GpuModel> {
        GpuModel::upload_with(model, gpu, ExpertCache::All)
    }

    /// Upload `model` to `gpu`, its routed experts offloaded to pinned host memory with a
    /// device cache sized by `cache` unless that is [`ExpertCache::All`].
    pub fn upload_with(model: &Qwen3Hybrid, gpu: Arc<Gpu>, cache: ExpertCache) -> Result<GpuModel> {
        let offload = cache != ExpertCache::All;
        let c = model.config();
        let g = &*gpu;
        if c.head_dim > ATTN_DMAX {
            return Err(unsupported(format!(
                "head_dim {} exceeds the CUDA attention limit {ATTN_DMAX}",
                c.head_dim
            )));
        }
        let h = c.hidden_size;
        let mut pending = Vec::new();
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter().enumerate() {
            let (input_norm, mixer) = (g.upload(&l.input_norm)?, upload_mixer(g, &l.mixer, h)?);
            let post_norm = g.upload(&l.post_norm)?;
            let (ffn, experts) = upload_ffn(g, &l.ffn, i, h, offload)?;
            pending.extend(experts);
            layers.push(GpuLayer {
                input_norm,
                mixer,
                post_norm,
                ffn,
            });
        }
        let embed = DevMat::stack(g, &[&model.embed], c.vocab_size, h, None)?;
        let lm_head = DevMat::stack(g, &[&model.lm_head], c.vocab_size, h, None)?;
        let parts = Parts {
            embed,
            lm_head,
            final_norm: g.upload(&model.final_norm)?,
            inv_freq: g.upload(model.rope.inv_freq())?,
            layers,
        };
        let mut m = GpuModel::assemble(c, gpu.clone(), parts)?;
        m.place_experts(cache, pending)?;
        Ok(m)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Feed one token to each sequence (at most [`Self::max_batch`] of them, each once) as one
    /// batched step. Returns each one's next token as its sampling parameters pick it (greedy by
    /// default); the logits stay on the device (see [`GpuModel::logits`]).
    pub fn step_batch(&mut self, rows: &mut [(&mut GpuSeq, u32)]) -> Result<Vec<u32>> {
        let b = rows.len();
        self.write_inputs(rows)?;
        let g = self.gpu.clone();
        if self.graphs.len() < b {
            self.graphs.resize_with(b, || None);
        }
        if self.graphs[b - 1].is_none() {
            let stream = g.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            // Programmatic dependent launch between the step's kernels: each one's launch
            // overlaps the end of the one before (see `cuda::launch`).
            g.set_pdl(true);
            let r = self.enqueue_step(b);
            g.set_pdl(false);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            r?;
            self.graphs[b - 1] = graph;
        }
        match &self.graphs[b - 1] {
            Some(graph) => graph
                .launch()
                .map_err(|e| unsupported(format!("graph launch: {e}")))?,
            None => self.enqueue_step(b)?,
        }
        // The host computes the experts the step hands it, layer after layer, as it runs.
        let served = self.serve_host_experts(b);
        // The residency policy digests the previous step while this one runs; its swaps follow
        // this step in stream order.
        let policy = match served {
            Ok(_) => self.offload_policy(),
            Err(_) => Ok(()),
        };
        for (seq, _) in rows.iter_mut() {
            seq.pos += 1;
        }
        let next = g.read(&self.io, b)?.into_iter().map(|t| t as u32).collect();
        let failed = self.host_experts_failed();
        let busy = served?;
        failed?;
        policy?;
        self.offload_record(b, busy);
        Ok(next)
    }

    /// Checks a step's rows (1 to [`Self::max_batch`] of them, each sequence once, with room for
    /// one more token and a token id in the vocabulary) and writes their token ids and slots to
    /// the step's device inputs.
    fn write_inputs(&mut self, rows: &[(&mut GpuSeq, u32)]) -> Result<()> {
        if rows.is_empty() || rows.len() > self.rows {
            return Err(unsupported(format!(
                "a step takes 1 to {} sequences, not {}",
                self.rows,
                rows.len()
            )));
        }
        let ctx = self.pool()?.ctx;
        let mut io = vec![0i32; 2 * self.rows];
        for (i, (seq, tok)) in rows.iter().enumerate() {
            if seq.pos >= ctx {
                return Err(unsupported(format!(
                    "the sequence is full: {ctx} tokens is its context"
                )));
            }
            if *tok as usize >= self.vocab {
                return Err(unsupported(format!(
                    "token id {tok} is out of range: vocab_size is {}",
                    self.vocab
                )));
            }
            if rows[..i].iter().any(|(s, _)| s.slot == seq.slot) {
                return Err(unsupported("a sequence appears twice in one step".into()));
            }
            io[i] = *tok as i32;
            io[self.rows + i] = seq.slot as i32;
        }
        self.gpu.write(&mut self.io, &io)
    }

    /// One sequence's step: [`Self::step_batch`] with one row.
    pub fn step(&mut self, seq: &mut GpuSeq, tok: u32) -> Result<u32> {
        Ok(self.step_batch(&mut [(seq, tok)])?[0])
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
                    ..
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

    /// Run one batched step eagerly (no graph) with device timers: milliseconds per layer for
    /// its mixer (with the norm before it, unless the layer before applied it) and its ffn (with
    /// the norm before it, and an MoE ffn with the norm after it), and for the embedding + head
    /// together. Advances the sequences like [`Self::step_batch`] (their next tokens are not
    /// returned).
    pub fn profile_step(
        &mut self,
        rows: &mut [(&mut GpuSeq, u32)],
    ) -> Result<(Vec<(f32, f32)>, f32)> {
        let b = rows.len();
        self.write_inputs(rows)?;
        let g = self.gpu.clone();
        let n = self.layers.len();
        let marks: Vec<_> = (0..2 * n + 3).map(|_| g.timer()).collect::<Result<_>>()?;
        g.mark(&marks[0])?;
        ops::embed(
            &g,
            self.embed.mv(),
            self.io.ptr(),
            self.scratch.x.ptr(),
            self.hidden,
            b,
        )?;
        g.mark(&marks[1])?;
        for i in 0..n {
            self.enqueue_mixer(i, b)?;
            g.mark(&marks[2 * i + 2])?;
            self.enqueue_ffn(i, b)?;
            g.mark(&marks[2 * i + 3])?;
        }
        self.enqueue_head(b)?;
        g.mark(&marks[2 * n + 2])?;
        // Experts the step hands the host are computed as in `step_batch` (else each hand-off
        // would wait out the GPU's time limit and void the step).
        let served = self.serve_host_experts(b);
        g.sync()?;
        for (seq, _) in rows.iter_mut() {
            seq.pos += 1;
        }
        self.host_experts_failed()?;
        served?;
        let ms = |a: usize, b: usize| g.elapsed_ms(&marks[a], &marks[b]);
        let layers = (0..n)
            .map(|i| Ok((ms(2 * i + 1, 2 * i + 2)?, ms(2 * i + 2, 2 * i + 3)?)))
            .collect::<Result<Vec<_>>>()?;
        let other = ms(0, 1)? + ms(2 * n + 1, 2 * n + 2)?;
        Ok((layers, other))
    }

    /// The logits of row `row` of the last step, `[vocab]`.
    pub fn logits(&self, row: usize) -> Result<Vec<f32>> {
        self.gpu
            .read_at(&self.scratch.logits, row * self.vocab, self.vocab)
    }

    /// The rows of a `b`-row step.
    fn batch(&self, b: usize) -> Batch {
        Batch {
            rows: b,
            slots: self.io.at(self.rows),
        }
    }

    /// Enqueue a `b`-row step on the stream (eagerly or into a capture).
    fn enqueue_step(&self, b: usize) -> Result<()> {
        let s = &self.scratch;
        ops::embed(
            &self.gpu,
            self.embed.mv(),
            self.io.ptr(),
            s.x.ptr(),
            self.hidden,
            b,
        )?;
        for i in 0..self.layers.len() {
            self.enqueue_layer(i, b)?;
        }
        self.enqueue_head(b)?;
        self.enqueue_ids_download()
    }

    /// Layer `i` for `b` rows: the previous sublayer's output (in `delta`) joins the residual,
    /// then the mixer and the ffn run; the ffn's output is left in `delta`.
    fn enqueue_layer(&self, i: usize, b: usize) -> Result<()> {
        self.enqueue_mixer(i, b)?;
        self.enqueue_ffn(i, b)
    }

    /// The residual add + input norm (unless the layer before applied them, or the fused form's
    /// input projection does) and the mixer of layer `i`.
    fn enqueue_mixer(&self, i: usize, b: usize) -> Result<()> {
        if !self.fused(b) && !self.normed_by_previous(i) {
            let delta = if i == 0 { 0 } else { self.scratch.delta.ptr() };
            self.add_norm(delta, self.layers[i].input_norm.ptr(), b)?;
        }
        match &self.layers[i].mixer {
            GpuMixer::Linear { .. } => self.enqueue_gdn(i, b),
            GpuMixer::Full { .. } => self.enqueue_attention(i, b),
        }
    }

    /// The residual add + post norm (in the fused form the residual is whole, and the router
    /// normalizes it when it can) and the ffn of layer `i`.
    fn enqueue_ffn(&self, i: usize, b: usize) -> Result<()> {
        let post = self.layers[i].post_norm.ptr();
        if !self.fused(b) {
            self.add_norm(self.scratch.delta.ptr(), post, b)?;
        } else if !self.router_normalizes(i) {
            self.add_norm(0, post, b)?;
        }
        self.enqueue_ffn_only(i, b)
    }

    /// The ffn of `layer` on `normed`; an MoE ffn also joins its output to the residual and
    /// applies the norm after the layer.
    fn enqueue_ffn_only(&self, layer: usize, b: usize) -> Result<()> {
        let (g, s, h) = (&*self.gpu, &self.scratch, self.hidden);
        let ffn = &self.layers[layer].ffn;
        let x_rows = Slots::rows(b, h);
        match ffn {
            GpuFfn::Dense { gate_up, down } => {
                ops::matvec_swiglu(g, gate_up.mv(), s.normed.ptr(), s.h.ptr(), x_rows)?;
                let dm = down.mv();
                ops::matvec(g, dm, s.h.ptr(), s.delta.ptr(), Slots::rows(b, down.k))?;
                if self.fused(b) {
                    // The residual stays whole: the output joins it now (the norm written with
                    // it goes unused; the next projection normalizes).
                    self.add_norm(s.delta.ptr(), self.norm_after(layer), b)?;
                }
                Ok(())
            }
            GpuFfn::Moe {
                router,
                experts_gu,
                experts_down,
                shared,
                offload,
            } => {
                let i_e = experts_gu.n / 2;
                let per_row = self.top_k + shared.is_none() as usize;
                let mut route = self.route(shared.is_none());
                let (mut far_gu, mut far_down) = (None, None);
                let mailbox = offload.as_ref().and(self.active_mailbox());
                if let Some(lx) = offload {
                    route.shared_slot = lx.shared_slot();
                    route.loc = lx.loc();
                    route.far_from = lx.split();
                    if let Some(m) = mailbox {
                        route.host_take = m.take;
                    }
                    (far_gu, far_down) = (Some(lx.far_gu()), Some(lx.far_down()));
                }
                let (ids, n) = (self.moe_ids(layer), b * per_row);
                let fused = self.fused(b);
                if fused && self.router_normalizes(layer) {
                    // The post norm of x, staged by every block; block 0 leaves it in `normed`.
                    let io = VecIo {
                        norm: self.layers[layer].post_norm.ptr(),
                        normed: s.normed.ptr(),
                        eps: self.eps,
                        ..VecIo::default()
                    };
                    vec::matvec(g, router.mv(), s.x.ptr(), s.router.ptr(), io)?;
                } else {
                    ops::matvec(g, router.mv(), s.normed.ptr(), s.router.ptr(), x_rows)?;
                }
                ops::router_topk(
                    g,
                    s.router.ptr(),
                    router.n,
                    route,
                    ids,
                    s.weights.ptr(),
                    s.sg.ptr(),
                    b,
                )?;
                if let Some(m) = mailbox {
                    ops::host_experts_publish(g, m, s.normed.ptr(), ids, per_row, h, b)?;
                }
                let gu_slots = Slots::experts(n, ids, h, per_row).with_far(far_gu);
                ops::matvec_swiglu(g, experts_gu.mv(), s.normed.ptr(), s.h.ptr(), gu_slots)?;
                let down_slots = Slots::experts(n, ids, i_e, 1).with_far(far_down);
                let down = experts_down.mv();
                if fused
                    && shared.is_none()
                    && mailbox.is_none()
                    && ops::down_combine_takes(&down, per_row)
                {
                    // The down projections add their weighted sum into the residual themselves.
                    let (x, w) = (s.x.ptr(), s.weights.ptr());
                    return ops::moe_down_combine(g, down, s.h.ptr(), x, w, down_slots, per_row, b);
                }
                ops::matvec(g, down, s.h.ptr(), s.y.ptr(), down_slots)?;
                if let Some(m) = mailbox {
                    ops::host_experts_wait(g, m, ids, s.y.ptr(), h, n)?;
                }
                let bufs = MoeTail {
                    normed: s.normed.ptr(),
                    hs: s.hs.ptr(),
                    ys: s.ys.ptr(),
                    sg: s.sg.ptr(),
                    y: s.y.ptr(),
                    weights: s.weights.ptr(),
                    delta: s.delta.ptr(),
                };
                let next = NextNorm {
                    x: s.x.ptr(),
                    scale: (!fused).then(|| self.norm_after(layer)),
                };
                self.moe_tail(shared.as_ref(), bufs, per_row, b, Some(next))
            }
        }
    }

    /// The scale of the norm that follows layer `i`: the next layer's input norm, or the final
    /// norm after the last layer.
    fn norm_after(&self, i: usize) -> u64 {
        self.layers
            .get(i + 1)
            .map_or(self.final_norm.ptr(), |l| l.input_norm.ptr())
    }

    /// Whether the norm before layer `i` (the final norm for `i` = layers) was already applied by
    /// the layer before: an MoE ffn adds its output to the residual and normalizes in its
    /// combine, a dense ffn leaves its output in `delta`.
    fn normed_by_previous(&self, i: usize) -> bool {
        i > 0 && matches!(self.layers[i - 1].ffn, GpuFfn::Moe { .. })
    }

    /// An MoE layer's end for `rows` rows: the shared expert when it runs apart (SwiGLU of
    /// `normed` into `hs`, down into `ys`), then `delta = Σ_k w_k y_k (+ sg · ys)`; with `next`,
    /// that sum joins the residual `next.x` instead and `normed` gets the next norm of it.
    pub(crate) fn moe_tail(
        &self,
        shared: Option<&(DevMat, DevMat)>,
        t: MoeTail,
        per_row: usize,
        rows: usize,
        next: Option<NextNorm>,
    ) -> Result<()> {
        let (g, h) = (&*self.gpu, self.hidden);
        let (ys, sg) = match shared {
            Some((gu, down)) => {
                ops::matvec_swiglu(g, gu.mv(), t.normed, t.hs, Slots::rows(rows, h))?;
                ops::matvec(g, down.mv(), t.hs, t.ys, Slots::rows(rows, down.k))?;
                (t.ys, t.sg)
            }
            None => (0, 0),
        };
        let (w, y) = (t.weights, t.y);
        match next {
            Some(NextNorm { x, scale: Some(sc) }) => {
                ops::moe_combine_norm(g, y, w, ys, sg, x, sc, t.normed, per_row, h, rows, self.eps)
            }
            Some(NextNorm { x, scale: None }) => {
                ops::moe_combine(g, y, w, ys, sg, x, per_row, h, rows, true)
            }
            None => ops::moe_combine(g, y, w, ys, sg, t.delta, per_row, h, rows, false),
        }
    }

    /// The router's top-k for an MoE layer whose shared expert is stacked after the routed
    /// ones (`stacked`) or runs apart.
    pub(crate) fn route(&self, stacked: bool) -> Route {
        Route {
            experts: self.num_experts,
            top_k: self.top_k,
            renorm: self.norm_topk,
            shared_gate: true,
            shared_slot: stacked.then_some(self.num_experts),
            loc: 0,
            host_take: 0,
            far_from: 0,
        }
    }

    /// For `b` rows: `x += delta` (when delta ≠ 0), then `normed = rmsnorm(x) · scale`.
    fn add_norm(&self, delta: u64, scale: u64, b: usize) -> Result<()> {
        let s = &self.scratch;
        ops::add_rmsnorm(
            &self.gpu,
            s.x.ptr(),
            delta,
            scale,
            s.normed.ptr(),
            b,
            self.hidden,
            self.eps,
        )
    }

    /// Final norm, lm_head and each row's next token (greedy or sampled on the device).
    fn enqueue_head(&self, b: usize) -> Result<()> {
        let (g, s, pool) = (&*self.gpu, &self.scratch, self.pool()?);
        if self.fused(b) {
            self.add_norm(0, self.final_norm.ptr(), b)?;
        } else if !self.normed_by_previous(self.layers.len()) {
            self.add_norm(s.delta.ptr(), self.final_norm.ptr(), b)?;
        }
        let (head, rows) = (self.lm_head.mv(), Slots::rows(b, self.hidden));
        // One row through the ring kernel: its blocks hand the sampler their largest logit and
        // its index, so a greedy pick need not scan the vocabulary.
        let ring = if b == 1 && vec::takes(&head, &rows) {
            vec::ring_blocks(g, &head)?
        } else {
            None
        };
        let best = ring.map(|n| (s.best.ptr(), n as usize));
        match best {
            Some((p, _)) => {
                let io = VecIo {
                    best: p,
                    ..VecIo::default()
                };
                vec::matvec(g, head, s.normed.ptr(), s.logits.ptr(), io)?;
            }
            None => ops::matvec(g, head, s.normed.ptr(), s.logits.ptr(), rows)?,
        }
        ops::sample_advance(
            g,
            s.logits.ptr(),
            self.vocab,
            pool.sampling.ptr(),
            self.io.ptr(),
            pool.pos.ptr(),
            self.batch(b),
            best,
        )
    }
}
