//! The Qwen3 hybrid model's decode step on CUDA.
//!
//! Weights are uploaded once from a loaded [`Checkpoint`]: dense ones as bf16 (f16/f32
//! checkpoints rounded to bf16), MLX affine 2/4/8-bit ones kept quantized (u32 words, bf16
//! scales and biases; 3/5/6-bit, which pack across words, are dequantized to bf16). Projections
//! that read the same input are fused into one matrix: GDN `[qkv | z | b | a]` (Qwen3-Next's
//! per-key-head packing reordered by row runs), attention `[q/gate | k | v]`, MoE router
//! `[router | shared_expert_gate]`, and each expert's `[gate | up]`. Norm scales, conv kernels,
//! `−exp(A_log)` and `dt_bias` stay f32; activations are f32 throughout.
//!
//! A decode step (see [`GpuModel::enqueue_pass`]) feeds one token to each of B sequences and
//! runs every op on the GPU with a batch dimension: embedding, add+RMSNorm, fused projections,
//! the GDN conv and delta-rule kernels, attention prep and split-K decode, router top-k, expert
//! SwiGLU and down projections (all K experts of all B rows in one launch each), combine, final
//! norm, lm_head and sampling; up to four rows, the norms, residual adds, combine and (for one
//! row) the conv step ride on the products instead (the fused form, below). Each layer kind enqueues its own work
//! ([`layers`]). Sequence state lives in a pool of slots ([`pool`]); the
//! token ids and slot indices of a step live in device memory, so the step is captured once per
//! batch size into a CUDA graph and replayed; the only host↔device traffic per token is its id
//! and slot.
//! Prompts run through [`GpuModel::prefill`] ([`prefill`]): many tokens of one sequence per
//! layer pass.
//!
//! ## The fused decode form
//!
//! In the fused form (one to four rows, every mixer projection on the single-row tensor-core
//! kernel, as `deltamoe_compute::cuda::dispatch::fused_decode` decides) the residual `x` is whole
//! at every sublayer boundary: the input projection normalizes each row of `x` as it stages it
//! and, for a GDN layer at one row, runs the conv step on its output rows (more rows take the
//! conv launch, the same arithmetic); the output projection adds into `x`; the router
//! normalizes `x` for the ffn and leaves those rows in `normed` for the experts (a router the kernel
//! does not take, e.g. bf16 or 2-bit, or a dense ffn gets the norm as its own launch); the expert
//! down projections (or, with the shared expert apart or experts on the host, the combine after
//! them) add their weighted sum into `x`. That saves the add+norm, conv and combine launches of
//! every layer. Each row of a fused step of up to four rows is bitwise that row's step alone: the
//! several-row products give each row its one-row result. Otherwise the norms run as their own
//! launches on `normed` and each sublayer's output waits in `delta` for the next add+norm.

mod format;
mod held;
mod homes;
mod host_experts;
mod host_store;
mod host_team;
mod layers;
mod mtp;
mod offload;
mod pool;
mod prefill;
mod random;
mod shard;
mod speculative;
mod synthetic;
mod upload;

pub use format::DevFormat;
pub use held::held_checkpoint;
pub use layers::{gdn_path, GdnPrefill, PrefillGemm, CHUNKED_MIN_ROWS};
pub use offload::{
    clean_copies, slots_for_bytes, ExpertCache, OffloadStats, HOST_RESERVE, STATE_RESERVE,
};
pub use pool::{GpuSeq, GpuSnapshot};
pub use prefill::PREFILL_MAX_ROWS;
pub use shard::{expert_share, Shard};

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use deltamoe_compute::cuda::dispatch;
use deltamoe_compute::cuda::ops::Batch;
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu};

use crate::checkpoint::heads::heads_share;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use layers::head::{Head, Picks};
use layers::{needs, FfnIo, GpuLayer, Scratch, Step};
use pool::Pool;

type Result<T> = std::result::Result<T, CudaError>;

/// Most rows one batched step runs; the engine splits larger batches.
pub const MAX_BATCH: usize = 256;

/// The model on a GPU: its layers ([`layers`]) and what runs them — the step's scratch, the
/// sequence pool, the captured graphs and the expert residency.
pub struct GpuModel {
    gpu: Arc<Gpu>,
    hidden: usize,
    vocab: usize,
    eps: f32,
    top_k: usize,
    num_experts: usize,
    head: Head,
    layers: Vec<GpuLayer>,
    cfg: ModelConfig,
    /// Rows the scratch holds (the largest batch a step takes).
    rows: usize,
    scratch: Scratch,
    pool: Option<Pool>,
    /// A step's inputs: token ids `[rows]` (overwritten with the next tokens), then slot
    /// indices `[rows]`.
    io: DevBuf<i32>,
    /// The captured passes per kind and row count.
    graphs: Graphs,
    /// The MTP layer, when uploaded for speculative decoding.
    mtp: Option<mtp::GpuMtp>,
    /// Drafts a speculative step verifies at most (0: off).
    drafts: usize,
    /// Hidden rows of a prefill pass's pairs for the MTP layer (allocated by the first prefill
    /// with speculative decoding on).
    mtp_rows: Option<DevBuf<f32>>,
    /// Activations of a prefill pass (allocated by the first prefill).
    prefill: Option<layers::PrefillScratch>,
    prefill_gdn: GdnPrefill,
    prefill_gemm: PrefillGemm,
    /// Routed-id log, staging and statistics when experts are offloaded.
    offload: Option<offload::Offload>,
    /// A cap on the pinned host memory of offloaded experts (see
    /// [`GpuModel::set_host_memory`]).
    host_memory: Option<usize>,
    /// This GPU's share of the experts when several GPUs run the model ([`shard`]).
    shard: Option<Shard>,
}

fn unsupported(msg: String) -> CudaError {
    CudaError::Unsupported(msg)
}

/// Device memory kept free beyond the weights when checking that a model fits before its upload
/// (scratch and the first sequences' state; more is reserved, and checked, as they are sized).
const UPLOAD_RESERVE: usize = 1 << 30;

/// Why weights of `bytes` (of them `experts` in routed experts) cannot all go to a device with
/// `free` of `total` bytes free; None when they fit with [`UPLOAD_RESERVE`] to spare.
fn weights_do_not_fit(
    (bytes, experts): (usize, usize),
    (free, total): (usize, usize),
) -> Option<String> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    (bytes + UPLOAD_RESERVE > free).then(|| {
        format!(
            "the weights take {:.1} GiB and the GPU has {:.1} of {:.1} GiB free: the model does not \
             fit this GPU; keep its routed experts ({:.1} GiB) in host memory with --expert-cache \
             GB, or use --device cpu",
            gib(bytes),
            gib(free),
            gib(total),
            gib(experts)
        )
    })
}

/// A model error met while making a GPU's part of the weights, as a CUDA error.
pub(crate) fn input_err(e: crate::error::ModelError) -> CudaError {
    CudaError::Unsupported(e.to_string())
}

/// An error met while placing the weights on the device; running out of memory there says what
/// to do about it.
pub(crate) fn weights_err(e: CudaError) -> CudaError {
    match e {
        CudaError::OutOfMemory(m) => CudaError::OutOfMemory(format!(
            "{m} while uploading the weights: the model does not fit this GPU; keep its routed \
             experts in host memory (--expert-cache GB; bench: --gpu-memory GB) or use --device cpu"
        )),
        e => e,
    }
}

/// The passes a graph is captured for: a decode step, a verify pass of speculative decoding, a
/// pass of the MTP layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PassKind {
    Step,
    Verify,
    Mtp,
}

/// The captured passes, per kind and row count (index rows − 1).
#[derive(Default)]
struct Graphs {
    by_kind: [Vec<Option<CudaGraph>>; 3],
}

impl Graphs {
    fn clear(&mut self) {
        self.by_kind.iter_mut().for_each(Vec::clear);
    }

    fn get(&self, k: PassKind, rows: usize) -> Option<&CudaGraph> {
        self.by_kind[k as usize].get(rows - 1)?.as_ref()
    }

    fn set(&mut self, k: PassKind, rows: usize, graph: Option<CudaGraph>) {
        let v = &mut self.by_kind[k as usize];
        if v.len() < rows {
            v.resize_with(rows, || None);
        }
        v[rows - 1] = graph;
    }
}

/// The device weights a [`GpuModel`] is assembled from.
pub(crate) struct Parts {
    pub head: Head,
    pub layers: Vec<GpuLayer>,
}

impl GpuModel {
    /// A model of config `c` from its device weights, with scratch buffers sized for it.
    pub(crate) fn assemble(c: &crate::ModelConfig, gpu: Arc<Gpu>, p: Parts) -> Result<GpuModel> {
        let scratch = Scratch::new(&gpu, c, (needs(&p.layers, 1), 1), None)?;
        Ok(GpuModel {
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            top_k: c.experts_per_token,
            num_experts: c.num_experts,
            head: p.head,
            layers: p.layers,
            cfg: c.clone(),
            rows: 1,
            scratch,
            pool: None,
            io: gpu.zeros(2)?,
            graphs: Graphs::default(),
            mtp: None,
            drafts: 0,
            mtp_rows: None,
            prefill: None,
            prefill_gdn: GdnPrefill::default(),
            prefill_gemm: PrefillGemm::default(),
            offload: None,
            host_memory: None,
            shard: None,
            gpu,
        })
    }

    /// Size the scratch for batches of `rows` rows.
    fn set_rows(&mut self, rows: usize) -> Result<()> {
        self.graphs.clear();
        let mut n = needs(&self.layers, rows);
        if let Some(m) = &self.mtp {
            n = n.max(m.needs(self.hidden));
        }
        let window = self.shard.as_ref().and_then(Shard::window);
        self.scratch = Scratch::new(&self.gpu, &self.cfg, (n, rows), window)?;
        self.io = self.gpu.zeros(2 * rows)?;
        self.rows = rows;
        Ok(())
    }

    /// Most sequences one [`Self::step_batch`] takes.
    pub fn max_batch(&self) -> usize {
        self.rows
    }

    /// Upload `model`'s weights (a [`Checkpoint`], or a loaded model holding one) to `gpu`.
    pub fn upload(model: &impl AsRef<Checkpoint>, gpu: Arc<Gpu>) -> Result<GpuModel> {
        GpuModel::upload_with(model, gpu, ExpertCache::All)
    }

    /// Upload `model` to `gpu`, its routed experts offloaded to pinned host memory with a
    /// device cache sized by `cache` unless that is [`ExpertCache::All`].
    pub fn upload_with(
        model: &impl AsRef<Checkpoint>,
        gpu: Arc<Gpu>,
        cache: ExpertCache,
    ) -> Result<GpuModel> {
        let ckpt = model.as_ref();
        if cache == ExpertCache::All {
            if let Some(msg) = weights_do_not_fit(ckpt.weight_bytes(), gpu.mem_info()?) {
                return Err(CudaError::OutOfMemory(msg));
            }
        }
        let (parts, pending) = upload::upload_model(&gpu, ckpt, cache != ExpertCache::All, None)
            .map_err(weights_err)?;
        let mut m = GpuModel::assemble(&ckpt.config, gpu.clone(), parts)?;
        m.place_experts(cache, pending)?;
        Ok(m)
    }

    /// GPU `shard.rank()`'s part of `model` on `gpu`: every weight but the routed experts, and
    /// its share of those (see [`shard`]), read from the loaded checkpoint; offloaded to pinned
    /// host memory with a device cache sized by `cache` (for this GPU's share) unless that is
    /// [`ExpertCache::All`]. With [`Shard::heads`], only its share of the mixers' heads
    /// (`checkpoint::heads`).
    pub fn upload_shard(
        model: &impl AsRef<Checkpoint>,
        gpu: Arc<Gpu>,
        shard: Shard,
        cache: ExpertCache,
    ) -> Result<GpuModel> {
        let whole = model.as_ref();
        let part = match shard.heads() {
            true => Some(heads_share(whole, shard.rank(), shard.world()).map_err(input_err)?),
            false => None,
        };
        let ckpt = part.as_ref().unwrap_or(whole);
        let offload = cache != ExpertCache::All;
        if !offload {
            let (bytes, experts) = ckpt.weight_bytes();
            let held = experts.div_ceil(shard.world());
            if let Some(msg) = weights_do_not_fit((bytes - experts + held, held), gpu.mem_info()?) {
                return Err(CudaError::OutOfMemory(msg));
            }
        }
        let (parts, pending) =
            upload::upload_model(&gpu, ckpt, offload, Some(&shard)).map_err(weights_err)?;
        let mut m = GpuModel::assemble(&ckpt.config, gpu, parts)?;
        m.set_shard(shard)?;
        m.place_experts(cache, pending)?;
        Ok(m)
    }

    /// Takes its place among several GPUs: the scratch is made again, its all-reduced rows in
    /// the communicator's symmetric window when there is one.
    pub(crate) fn set_shard(&mut self, shard: Shard) -> Result<()> {
        self.shard = Some(shard);
        self.set_rows(self.rows)
    }

    /// This GPU's place when several run the model.
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
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
        self.run_pass(PassKind::Step, b)?;
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
            // The MTP layer does not see a plain step's pair.
            seq.mtp_carry = false;
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
        let layers = self.layers.iter();
        let l: usize = layers
            .map(|l| l.mixer.bytes_per_token(ctx) + l.ffn.bytes_per_token())
            .sum();
        self.head.bytes_per_token() + l
    }

    /// Bytes a decode step of `rows` sequences at context `ctx` must read at least: each weight
    /// once (the routed experts uniform routing touches on average), the states and KV caches
    /// of every row.
    pub fn bytes_per_step(&self, rows: usize, ctx: usize) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                let w = l.mixer.weight_bytes();
                w + rows * (l.mixer.bytes_per_token(ctx) - w) + l.ffn.bytes_per_step(rows)
            })
            .sum();
        self.head.bytes_per_token() + l
    }

    /// Weights one token multiplies (2 FLOPs each): projections, router, the top-k (and shared)
    /// experts and the lm_head; the embedding is a lookup and attention's own FLOPs are not
    /// weights.
    pub fn active_params(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.mixer.params() + l.ffn.params())
            .sum();
        self.head.params() + l
    }

    /// Mixer kind of each layer: "gdn" or "attention".
    pub fn layer_kinds(&self) -> Vec<&'static str> {
        self.layers.iter().map(|l| l.mixer.kind()).collect()
    }

    /// Tokens of the vocabulary (rows of the lm_head).
    pub fn vocab_size(&self) -> usize {
        self.vocab
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
        let st = self.step_ctx(b, PassKind::Step)?;
        g.mark(&marks[0])?;
        self.head
            .embed(&g, self.io.ptr(), self.scratch.x.ptr(), b)?;
        g.mark(&marks[1])?;
        for i in 0..n {
            self.enqueue_mixer(&st, i)?;
            g.mark(&marks[2 * i + 2])?;
            self.enqueue_ffn(&st, i)?;
            g.mark(&marks[2 * i + 3])?;
        }
        self.enqueue_head(&st)?;
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

    /// What the layers of a `b`-row pass of kind `k` see (an MTP pass runs unfused at the MTP
    /// layer's positions).
    fn step_ctx(&self, b: usize, k: PassKind) -> Result<Step<'_>> {
        let pool = self.pool()?;
        let mtp = k == PassKind::Mtp;
        Ok(Step {
            g: &self.gpu,
            s: &self.scratch,
            bt: Batch {
                rows: b,
                slots: self.io.at(self.rows),
            },
            fused: !mtp && self.fused(b),
            verify: k != PassKind::Step,
            eps: self.eps,
            hidden: self.hidden,
            pos: if mtp {
                pool.mtp_pos.ptr()
            } else {
                pool.pos.ptr()
            },
            ctx: pool.ctx,
            shard: self.shard.as_ref(),
        })
    }

    /// Run a `b`-row pass of kind `k` on the stream: its graph, captured on first use.
    fn run_pass(&mut self, k: PassKind, b: usize) -> Result<()> {
        let g = self.gpu.clone();
        if self.graphs.get(k, b).is_none() {
            let stream = g.stream();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            // Programmatic dependent launch between the pass's kernels: each one's launch
            // overlaps the end of the one before (see `cuda::launch`).
            g.set_pdl(true);
            let r = self.enqueue_pass(k, b);
            g.set_pdl(false);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(|e| unsupported(format!("graph capture: {e}")))?;
            r?;
            self.graphs.set(k, b, graph);
        }
        match self.graphs.get(k, b) {
            Some(graph) => graph
                .launch()
                .map_err(|e| unsupported(format!("graph launch: {e}"))),
            None => self.enqueue_pass(k, b),
        }
    }

    /// Enqueue a `b`-row pass of kind `k` on the stream (eagerly or into a capture).
    fn enqueue_pass(&self, k: PassKind, b: usize) -> Result<()> {
        let st = self.step_ctx(b, k)?;
        if k == PassKind::Mtp {
            return self.enqueue_mtp(&st);
        }
        self.head.embed(st.g, self.io.ptr(), st.s.x.ptr(), b)?;
        for i in 0..self.layers.len() {
            self.enqueue_mixer(&st, i)?;
            self.enqueue_ffn(&st, i)?;
        }
        self.enqueue_head(&st)?;
        self.enqueue_ids_download()
    }

    /// The residual add + input norm (unless the layer before applied them, or the fused form's
    /// input projection does) and the mixer of layer `i`.
    fn enqueue_mixer(&self, st: &Step, i: usize) -> Result<()> {
        let l = &self.layers[i];
        if !st.fused && !self.normed_by_previous(i) {
            let delta = if i == 0 { 0 } else { st.s.delta.ptr() };
            st.add_norm(delta, l.input_norm.ptr())?;
        }
        let pool = self.pool()?;
        let saved = if st.verify { pool.saved(i) } else { [0, 0] };
        l.mixer.decode(st, pool.state(i), saved, l.input_norm.ptr())
    }

    /// The residual add + post norm (in the fused form the residual is whole, and the ffn
    /// normalizes it when it can) and the ffn of layer `i`.
    fn enqueue_ffn(&self, st: &Step, i: usize) -> Result<()> {
        let l = &self.layers[i];
        let post = l.post_norm.ptr();
        if !st.fused {
            st.add_norm(st.s.delta.ptr(), post)?;
        } else if !l.ffn.normalizes_input() {
            st.add_norm(0, post)?;
        }
        let io = FfnIo {
            post_norm: post,
            norm_after: self.norm_after(i),
            ids: self.moe_ids(i),
            mailbox: self.active_mailbox(),
        };
        l.ffn.decode(st, &io)
    }

    /// Final norm, lm_head and each row's next token (greedy or sampled on the device).
    fn enqueue_head(&self, st: &Step) -> Result<()> {
        let pool = self.pool()?;
        let picks = Picks {
            tokens: self.io.ptr(),
            sampling: pool.sampling.ptr(),
            pos: st.pos,
        };
        let normed = self.normed_by_previous(self.layers.len());
        self.head.decode(st, normed, picks)
    }

    /// Whether a `b`-row step runs the fused decode form (see the module doc).
    pub fn fused(&self, b: usize) -> bool {
        let mats = self.layers.iter().flat_map(|l| l.mixer.projections());
        self.layers.iter().all(|l| l.mixer.fusable()) && dispatch::fused_decode(b, mats)
    }

    /// The scale of the norm that follows layer `i`: the next layer's input norm, or the final
    /// norm after the last layer.
    fn norm_after(&self, i: usize) -> u64 {
        self.layers
            .get(i + 1)
            .map_or(self.head.final_norm(), |l| l.input_norm.ptr())
    }

    /// Whether the norm before layer `i` (the final norm for `i` = layers) was already applied by
    /// the layer before (an MoE ffn adds its output to the residual and normalizes in its
    /// combine; a dense ffn leaves its output in `delta`).
    fn normed_by_previous(&self, i: usize) -> bool {
        i > 0 && self.layers[i - 1].ffn.normalizes_after()
    }
}

#[cfg(test)]
mod fit_tests {
    use super::weights_do_not_fit;

    #[test]
    fn weights_past_the_free_memory_are_refused_with_the_numbers() {
        let gib = 1usize << 30;
        assert!(weights_do_not_fit((20 * gib, 18 * gib), (79 * gib, 80 * gib)).is_none());
        let m = weights_do_not_fit((200 * gib, 190 * gib), (79 * gib, 80 * gib)).unwrap();
        assert_eq!(
            m,
            "the weights take 200.0 GiB and the GPU has 79.0 of 80.0 GiB free: the model does not \
             fit this GPU; keep its routed experts (190.0 GiB) in host memory with --expert-cache \
             GB, or use --device cpu"
        );
        // Within a GiB of the free memory is too close.
        assert!(weights_do_not_fit((79 * gib, 0), (79 * gib + gib / 2, 80 * gib)).is_some());
    }
}
