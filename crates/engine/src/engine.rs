//! The engine: a model plus the sequences it serves. Prefill runs a prompt in one pass per layer
//! (optionally in chunks of at most N tokens); [`Engine::step`] feeds one token to each of a
//! batch of sequences and returns each one's next token, picked with the sequence's own
//! sampling parameters. Where the model runs is the engine's [`Backend`]: on the CPU the
//! sequences of a step run one after another; on CUDA one batched step serves them all.
//! Snapshots copy a sequence's whole state so a later request with the same token prefix can
//! start from it.

use std::collections::BTreeMap;
use std::sync::Arc;

use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{ExpertCache, GdnPrefill, GpuModel, OffloadStats, PrefillGemm};
use deltamoe_model::layers::ExpertStats;
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::sharded::{MakeShard, ShardedBackend};
use crate::backend::{Backend, SavedState, StepRow};
use crate::error::{no_such_sequence, EngineError, Result};
use crate::sampler::{Sampler, SamplingParams};
use crate::sequence::{SeqId, Sequence};

/// A copy of a sequence's state after `tokens`, to start new sequences from.
pub struct Snapshot {
    tokens: Vec<u32>,
    saved: SavedState,
}

impl Snapshot {
    /// The tokens the state has seen.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Memory the snapshot holds (host memory on the CPU, device memory on CUDA).
    pub fn bytes(&self) -> usize {
        self.saved.bytes
    }
}

/// Drafts a speculative step may verify at most.
pub const MAX_DRAFTS: usize = 4;

pub struct Engine {
    /// The served model's config (the weights belong to the backend).
    config: ModelConfig,
    backend: Box<dyn Backend>,
    /// Context per sequence (on CUDA the KV caches are allocated for it up front).
    max_ctx: usize,
    sequences: BTreeMap<SeqId, Sequence>,
    next_id: u64,
    /// Drafts a speculative step verifies at most (0: off; see [`Engine::set_speculative`]).
    drafts: usize,
}

impl Engine {
    /// An engine on the CPU.
    pub fn new(model: Qwen3Hybrid) -> Engine {
        let max_ctx = model.config().max_position_embeddings;
        let config = model.config().clone();
        Engine::with_backend(config, Box::new(CpuBackend::new(model)), max_ctx)
    }

    /// An engine on a GPU: uploads the weights and reserves state for `max_seqs` sequences of
    /// `max_ctx` tokens each (capped by the model's max_position_embeddings); `max_seqs` 0
    /// reserves as many as the free device memory holds.
    pub fn new_cuda(
        model: Qwen3Hybrid,
        gpu: Arc<Gpu>,
        max_ctx: usize,
        max_seqs: usize,
    ) -> Result<Engine> {
        Engine::new_cuda_with(model, gpu, max_ctx, max_seqs, ExpertCache::All)
    }

    /// As [`Engine::new_cuda`], with the routed experts offloaded to host memory behind a
    /// device cache sized by `cache` (see [`ExpertCache`]). The host model is dropped once
    /// its weights are on the GPU.
    pub fn new_cuda_with(
        model: Qwen3Hybrid,
        gpu: Arc<Gpu>,
        max_ctx: usize,
        max_seqs: usize,
        cache: ExpertCache,
    ) -> Result<Engine> {
        let max_ctx = max_ctx.min(model.config().max_position_embeddings);
        let backend = CudaBackend::new(&model, gpu, max_ctx, max_seqs, cache)?;
        Ok(Engine::with_backend(
            model.config().clone(),
            Box::new(backend),
            max_ctx,
        ))
    }

    /// An engine on a model already on the GPU, e.g. random weights of a real shape
    /// ([`GpuModel::synthetic`]) made without a host copy; `config` is the model's config.
    /// Reserves state as [`Engine::new_cuda`] does.
    pub fn new_cuda_model(
        config: ModelConfig,
        model: GpuModel,
        max_ctx: usize,
        max_seqs: usize,
    ) -> Result<Engine> {
        let max_ctx = max_ctx.min(config.max_position_embeddings);
        let backend = CudaBackend::with_model(model, max_ctx, max_seqs)?;
        Ok(Engine::with_backend(config, Box::new(backend), max_ctx))
    }

    /// An engine on several GPUs, the routed experts divided among them (expert parallel, see
    /// `deltamoe_model::gpu::Shard`): each GPU gets every other weight of `model` and its share
    /// of the experts, read from the loaded checkpoint, behind an expert cache (`cache` for all
    /// GPUs together, see `ExpertCache::per_gpu`), and with `heads` its share of the token
    /// mixers' heads (tensor parallel) rather than all of them; state is reserved as
    /// [`Engine::new_cuda`] does, the same on each GPU.
    pub fn new_cuda_gpus(
        model: Qwen3Hybrid,
        gpus: Vec<Arc<Gpu>>,
        (max_ctx, max_seqs): (usize, usize),
        (cache, heads): (ExpertCache, bool),
    ) -> Result<Engine> {
        let config = model.config().clone();
        let model = Arc::new(model);
        let cache = cache.per_gpu(gpus.len());
        let make: Arc<MakeShard> = Arc::new(move |gpu, shard| {
            GpuModel::upload_shard(&*model, gpu, shard.with_heads(heads), cache)
        });
        Engine::new_cuda_shards(config, gpus, make, max_ctx, max_seqs)
    }

    /// An engine on several GPUs whose parts `make` builds, one on each GPU's thread (e.g.
    /// `GpuModel::synthetic_shard`); `config` is the model's config.
    pub fn new_cuda_shards(
        config: ModelConfig,
        gpus: Vec<Arc<Gpu>>,
        make: Arc<MakeShard>,
        max_ctx: usize,
        max_seqs: usize,
    ) -> Result<Engine> {
        if gpus.len() < 2 {
            return Err(EngineError::Input(
                "several GPUs means two or more: name them with --gpus, e.g. --gpus 0,1".into(),
            ));
        }
        let max_ctx = max_ctx.min(config.max_position_embeddings);
        let backend = ShardedBackend::new(gpus, make, max_ctx, max_seqs)?;
        Ok(Engine::with_backend(config, Box::new(backend), max_ctx))
    }

    pub(crate) fn with_backend(
        config: ModelConfig,
        backend: Box<dyn Backend>,
        max_ctx: usize,
    ) -> Engine {
        Engine {
            config,
            backend,
            max_ctx,
            sequences: BTreeMap::new(),
            next_id: 0,
            drafts: 0,
        }
    }

    /// How later GPU prefills run the Gated DeltaNet delta rule (the CPU ignores it).
    pub fn set_gdn_prefill(&mut self, mode: GdnPrefill) {
        self.backend.set_gdn_prefill(mode);
    }

    /// How later GPU prefills run their matrix products (the CPU ignores it).
    pub fn set_prefill_gemm(&mut self, mode: PrefillGemm) {
        self.backend.set_prefill_gemm(mode);
    }

    /// With offloaded experts on the GPU: whether the CPU may compute some of the experts outside
    /// the cache (see [`deltamoe_model::gpu::GpuModel::set_host_experts`]; off by default).
    pub fn set_host_experts(&mut self, on: bool) -> Result<()> {
        self.backend.set_host_experts(on)
    }

    /// Expert-offload statistics, when the GPU model offloads experts.
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.backend.offload_stats()
    }

    /// The served model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Statistics of the experts the CPU model reads from the files, when it offloads them.
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        self.backend.expert_stats()
    }

    /// `"cpu"` or the GPU's name.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// Tokens one sequence can hold.
    pub fn max_context(&self) -> usize {
        self.max_ctx
    }

    /// How many more sequences fit: the free state slots on CUDA, `None` (no fixed limit) on
    /// the CPU.
    pub fn free_sequences(&self) -> Option<usize> {
        self.backend.free_sequences()
    }

    /// Bytes of state one sequence holds at full context.
    pub fn sequence_bytes(&self) -> usize {
        self.backend.sequence_bytes(self.max_ctx)
    }

    fn next_id(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        id
    }

    /// Registers sequence `id` (its backend state already made) holding `tokens`, sampling
    /// greedily until set.
    fn insert(&mut self, id: SeqId, tokens: Vec<u32>) -> SeqId {
        let sampler = Sampler::new(SamplingParams::default());
        let seq = Sequence {
            id,
            tokens,
            sampler,
        };
        self.sequences.insert(id, seq);
        id
    }

    /// Start an empty sequence. On CUDA, fails with [`EngineError::Capacity`] when every
    /// reserved slot is taken.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let id = self.next_id();
        self.backend.add(id)?;
        Ok(self.insert(id, Vec::new()))
    }

    /// Drop a sequence and free its state.
    pub fn remove_sequence(&mut self, id: SeqId) -> Option<Vec<u32>> {
        let seq = self.sequences.remove(&id)?;
        self.backend.remove(id);
        Some(seq.tokens)
    }

    pub fn sequence(&self, id: SeqId) -> Option<&Sequence> {
        self.sequences.get(&id)
    }

    /// Copy sequence `id`'s state.
    pub fn snapshot(&self, id: SeqId) -> Result<Snapshot> {
        let seq = self
            .sequences
            .get(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        Ok(Snapshot {
            tokens: seq.tokens.clone(),
            saved: self.backend.snapshot(id)?,
        })
    }

    /// A new sequence whose state is a copy of `snap` (sampling greedy until set).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<SeqId> {
        let id = self.next_id();
        self.backend.restore(id, &snap.saved)?;
        Ok(self.insert(id, snap.tokens.clone()))
    }

    fn check(&self, id: SeqId, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(EngineError::Input(
                "the prompt is empty: give at least one token".into(),
            ));
        }
        let seq = self
            .sequences
            .get(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let vocab = self.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Input(format!(
                "token id {bad} is out of range: the model's vocab_size is {vocab}"
            )));
        }
        if seq.tokens.len() + tokens.len() > self.max_ctx {
            return Err(EngineError::Input(format!(
                "{} tokens do not fit the context: {} already used of {}",
                tokens.len(),
                seq.tokens.len(),
                self.max_ctx
            )));
        }
        Ok(())
    }

    /// Feed `tokens` to sequence `id` in passes of at most `chunk` tokens (all at once when
    /// `None`). Returns logits `[T, vocab]` for `Logits::All` or the last row for `Logits::Last`.
    pub fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: Option<usize>,
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.check(id, tokens)?;
        let chunk = chunk.unwrap_or(tokens.len());
        if chunk == 0 {
            return Err(EngineError::Input(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        let out = self.backend.prefill(id, tokens, chunk, which)?;
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        seq.tokens.extend_from_slice(tokens);
        Ok(out)
    }

    /// One decode step returning logits: feed one token to each listed sequence.
    pub fn decode(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter()
            .map(|&(id, tok)| self.prefill(id, &[tok], None, Logits::Last))
            .collect()
    }

    /// How sequence `id` picks its tokens in [`Self::step`] (the draw counter restarts). On
    /// CUDA the GPU samples, unless a repetition penalty needs the history on the host.
    pub fn set_sampling(&mut self, id: SeqId, p: &SamplingParams) -> Result<()> {
        p.validate()?;
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        seq.sampler = Sampler::new(p.clone());
        self.backend.set_sampling(id, p)
    }

    /// Speculative decoding: [`Self::speculate`] lets the model's MTP layer draft up to
    /// `drafts` tokens (1 to 4; 0 turns it off) that one pass verifies. Set before any sequence
    /// starts; fails for a model without an MTP layer or a backend that cannot.
    pub fn set_speculative(&mut self, drafts: usize) -> Result<()> {
        if drafts > MAX_DRAFTS {
            return Err(EngineError::Input(format!(
                "--speculative-tokens {drafts} is out of range: use 1 to {MAX_DRAFTS} (0 = off)"
            )));
        }
        self.backend.set_speculative(drafts)?;
        self.drafts = drafts;
        Ok(())
    }

    /// Benchmarks only: speculative steps keep each draft with probability `p` (in [0, 1])
    /// instead of by the acceptance rule, so that random weights, whose drafts agree with
    /// nothing, cost what a model accepting that often would. The tokens mean nothing.
    pub fn force_acceptance(&mut self, p: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&p) {
            return Err(EngineError::Input(format!(
                "--acceptance {p} is out of range: use a probability in [0, 1]"
            )));
        }
        self.backend.force_acceptance(p)
    }

    /// Drafts a speculative step verifies at most (0: speculative decoding is off).
    pub fn speculative_tokens(&self) -> usize {
        self.drafts
    }

    /// [`Self::step`] with speculative decoding: feeds each listed sequence its token and
    /// returns, per sequence, the drafts the verify pass kept followed by its next token (one
    /// token when speculative decoding is off). Greedy output is the same token for token as
    /// [`Self::step`]'s; sampled output has the same distribution. The sequence holds the fed
    /// token and the kept drafts; the last returned token is the one to feed next.
    pub fn speculate(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<u32>>> {
        self.check_step(batch)?;
        let (max_ctx, drafts) = (self.max_ctx, self.drafts);
        let mut rows = step_rows(&mut self.sequences, batch);
        for row in rows.iter_mut() {
            row.drafts = drafts.min(max_ctx.saturating_sub(row.history.len()));
        }
        let out = self.backend.speculate(&mut rows)?;
        drop(rows);
        for (&(id, _), toks) in batch.iter().zip(&out) {
            if let Some(seq) = self.sequences.get_mut(&id) {
                seq.tokens
                    .extend_from_slice(&toks[..toks.len().saturating_sub(1)]);
            }
        }
        Ok(out)
    }

    /// Feed one token to each listed sequence (each at most once) and return each one's next
    /// token, picked with its sampling parameters (see [`Self::set_sampling`]). On CUDA all of
    /// them run as one batched step and, without repetition penalty, only token ids cross
    /// between host and device.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<u32>> {
        self.check_step(batch)?;
        let mut rows = step_rows(&mut self.sequences, batch);
        self.backend.step(&mut rows)
    }

    /// Seconds a decode step of `rows` rows spends in collectives between GPUs, measured
    /// alone; None on one device.
    pub fn comm_seconds(&mut self, rows: usize) -> Result<Option<f64>> {
        self.backend.comm_seconds(rows)
    }

    /// Checks a step's tokens and that no sequence appears twice.
    fn check_step(&self, batch: &[(SeqId, u32)]) -> Result<()> {
        for (i, &(id, tok)) in batch.iter().enumerate() {
            self.check(id, &[tok])?;
            if batch[..i].iter().any(|&(other, _)| other == id) {
                return Err(EngineError::Input(format!(
                    "sequence {} appears twice in one step",
                    id.0
                )));
            }
        }
        Ok(())
    }
}

/// The rows of a step in `batch` order, each sequence's token appended to its history.
fn step_rows<'a>(
    sequences: &'a mut BTreeMap<SeqId, Sequence>,
    batch: &[(SeqId, u32)],
) -> Vec<StepRow<'a>> {
    let mut seqs: Vec<&mut Sequence> = sequences
        .values_mut()
        .filter(|s| batch.iter().any(|&(id, _)| id == s.id))
        .collect();
    seqs.sort_by_key(|s| batch.iter().position(|&(id, _)| id == s.id));
    seqs.into_iter()
        .zip(batch)
        .map(|(s, &(id, token))| {
            s.tokens.push(token);
            StepRow {
                id,
                token,
                sampler: &mut s.sampler,
                history: &s.tokens,
                drafts: 0,
            }
        })
        .collect()
}
