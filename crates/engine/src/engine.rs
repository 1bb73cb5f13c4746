//! The engine: a model plus the sequences it serves. Prefill runs a prompt in one pass per layer
//! (optionally in chunks of at most N tokens); [`Engine::step`] feeds one token to each of a
//! batch of sequences and returns each one's next token, picked with the sequence's own
//! sampling parameters. On the CPU the sequences of a step run one after another; on CUDA one
//! batched step (a captured graph per batch size) serves them all. Snapshots copy a sequence's
//! whole state so a later request with the same token prefix can start from it.

use std::collections::BTreeMap;
use std::sync::Arc;

use deltamoe_compute::cuda::ops::SampleParams;
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{ExpertCache, GdnPrefill, GpuModel, GpuSeq, GpuSnapshot, OffloadStats};
use deltamoe_model::{Logits, Qwen3Hybrid, SequenceState};

use crate::error::{EngineError, Result};
use crate::sampler::{Sampler, SamplingParams};
use crate::sequence::{SeqId, Sequence};

/// Per-sequence state on the engine's backend.
pub enum SeqState {
    Cpu(SequenceState),
    Cuda(GpuSeq),
}

/// A copy of a sequence's state after `tokens`, to start new sequences from.
pub struct Snapshot {
    tokens: Vec<u32>,
    state: SnapState,
}

enum SnapState {
    Cpu(SequenceState),
    Cuda(GpuSnapshot),
}

impl Snapshot {
    /// The tokens the state has seen.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Memory the snapshot holds (host memory on the CPU, device memory on CUDA).
    pub fn bytes(&self) -> usize {
        match &self.state {
            SnapState::Cpu(s) => s.bytes(),
            SnapState::Cuda(s) => s.bytes(),
        }
    }
}

pub struct Engine {
    model: Qwen3Hybrid,
    gpu: Option<GpuModel>,
    /// Context per sequence (on CUDA the KV caches are allocated for it up front).
    max_ctx: usize,
    sequences: BTreeMap<SeqId, Sequence>,
    next_id: u64,
}

fn no_such_sequence(id: SeqId) -> EngineError {
    EngineError::Input(format!("sequence {} does not exist", id.0))
}

fn cuda_err(e: deltamoe_compute::cuda::CudaError) -> EngineError {
    EngineError::Input(format!("cuda: {e}"))
}

fn wrong_backend() -> EngineError {
    EngineError::Input("a sequence's state is on another backend than the engine".into())
}

impl Engine {
    /// An engine on the CPU.
    pub fn new(model: Qwen3Hybrid) -> Engine {
        let max_ctx = model.config().max_position_embeddings;
        Engine {
            model,
            gpu: None,
            max_ctx,
            sequences: BTreeMap::new(),
            next_id: 0,
        }
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
    /// device cache sized by `cache` (see [`ExpertCache`]).
    pub fn new_cuda_with(
        model: Qwen3Hybrid,
        gpu: Arc<Gpu>,
        max_ctx: usize,
        max_seqs: usize,
        cache: ExpertCache,
    ) -> Result<Engine> {
        let max_ctx = max_ctx.min(model.config().max_position_embeddings);
        let mut gm = GpuModel::upload_with(&model, gpu, cache).map_err(cuda_err)?;
        gm.reserve(max_seqs, max_ctx).map_err(cuda_err)?;
        Ok(Engine {
            model,
            gpu: Some(gm),
            max_ctx,
            sequences: BTreeMap::new(),
            next_id: 0,
        })
    }

    /// How later GPU prefills run the Gated DeltaNet delta rule (the CPU ignores it).
    pub fn set_gdn_prefill(&mut self, mode: GdnPrefill) {
        if let Some(g) = self.gpu.as_mut() {
            g.set_prefill_gdn(mode);
        }
    }

    /// With offloaded experts on the GPU: whether the CPU may compute some of the experts outside
    /// the cache (see [`GpuModel::set_host_experts`]; off by default).
    pub fn set_host_experts(&mut self, on: bool) -> Result<()> {
        match self.gpu.as_mut() {
            Some(g) => g.set_host_experts(on).map_err(cuda_err),
            None => Ok(()),
        }
    }

    /// Expert-offload statistics, when the GPU model offloads experts.
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.gpu.as_ref().and_then(|g| g.offload_stats())
    }

    pub fn model(&self) -> &Qwen3Hybrid {
        &self.model
    }

    /// `"cpu"` or the GPU's name.
    pub fn backend_name(&self) -> String {
        match &self.gpu {
            Some(g) => format!("cuda ({})", g.gpu().name()),
            None => "cpu".to_string(),
        }
    }

    /// True on a GPU backend.
    pub fn is_cuda(&self) -> bool {
        self.gpu.is_some()
    }

    /// Tokens one sequence can hold.
    pub fn max_context(&self) -> usize {
        self.max_ctx
    }

    /// How many more sequences fit: the free state slots on CUDA, `None` (no fixed limit) on
    /// the CPU.
    pub fn free_sequences(&self) -> Option<usize> {
        self.gpu.as_ref().map(|g| g.free_slots())
    }

    /// Bytes of state one sequence holds at full context.
    pub fn sequence_bytes(&self) -> usize {
        match &self.gpu {
            Some(g) => g.seq_bytes(self.max_ctx),
            None => self.model.state_bytes(self.max_ctx),
        }
    }

    fn insert(&mut self, tokens: Vec<u32>, state: SeqState) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let sampler = Sampler::new(SamplingParams::default());
        self.sequences.insert(
            id,
            Sequence {
                id,
                tokens,
                state,
                sampler,
            },
        );
        id
    }

    /// Start an empty sequence. On CUDA, fails with [`EngineError::Capacity`] when every
    /// reserved slot is taken.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let state = match &mut self.gpu {
            Some(g) => SeqState::Cuda(g.new_seq().map_err(capacity)?),
            None => SeqState::Cpu(self.model.new_state()),
        };
        Ok(self.insert(Vec::new(), state))
    }

    /// Drop a sequence and free its state.
    pub fn remove_sequence(&mut self, id: SeqId) -> Option<Vec<u32>> {
        let seq = self.sequences.remove(&id)?;
        if let (SeqState::Cuda(s), Some(g)) = (seq.state, &mut self.gpu) {
            g.release(s);
        }
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
        let state = match (&seq.state, &self.gpu) {
            (SeqState::Cpu(s), _) => SnapState::Cpu(s.clone()),
            (SeqState::Cuda(s), Some(g)) => SnapState::Cuda(g.snapshot(s).map_err(cuda_err)?),
            (SeqState::Cuda(_), None) => return Err(wrong_backend()),
        };
        Ok(Snapshot {
            tokens: seq.tokens.clone(),
            state,
        })
    }

    /// A new sequence whose state is a copy of `snap` (sampling greedy until set).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<SeqId> {
        let state = match (&snap.state, &mut self.gpu) {
            (SnapState::Cpu(s), None) => SeqState::Cpu(s.clone()),
            (SnapState::Cuda(s), Some(g)) => SeqState::Cuda(g.restore(s).map_err(capacity)?),
            _ => return Err(wrong_backend()),
        };
        Ok(self.insert(snap.tokens.clone(), state))
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
        let vocab = self.model.config().vocab_size;
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
        let (model, gpu) = (&self.model, &mut self.gpu);
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let mut out = Vec::new();
        match (&mut seq.state, gpu) {
            (SeqState::Cpu(st), _) => {
                for part in tokens.chunks(chunk) {
                    let logits = model.forward(part, st, which)?;
                    match which {
                        Logits::All => out.extend_from_slice(&logits),
                        Logits::Last => out = logits,
                    }
                }
            }
            (SeqState::Cuda(st), Some(g)) => {
                out = g.prefill(st, tokens, which, chunk).map_err(cuda_err)?;
            }
            (SeqState::Cuda(_), None) => return Err(wrong_backend()),
        }
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
        if let (SeqState::Cuda(st), Some(g)) = (&seq.state, &mut self.gpu) {
            g.set_sampling(st, device_params(p)).map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Feed one token to each listed sequence (each at most once) and return each one's next
    /// token, picked with its sampling parameters (see [`Self::set_sampling`]). On CUDA all of
    /// them run as one batched step and, without repetition penalty, only token ids cross
    /// between host and device.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<u32>> {
        for (i, &(id, tok)) in batch.iter().enumerate() {
            self.check(id, &[tok])?;
            if batch[..i].iter().any(|&(other, _)| other == id) {
                return Err(EngineError::Input(format!(
                    "sequence {} appears twice in one step",
                    id.0
                )));
            }
        }
        match &mut self.gpu {
            Some(g) => step_cuda(g, &mut self.sequences, batch),
            None => batch
                .iter()
                .map(|&(id, tok)| {
                    let seq = self
                        .sequences
                        .get_mut(&id)
                        .ok_or_else(|| no_such_sequence(id))?;
                    let SeqState::Cpu(st) = &mut seq.state else {
                        return Err(wrong_backend());
                    };
                    let logits = self.model.forward(&[tok], st, Logits::Last)?;
                    seq.tokens.push(tok);
                    Ok(seq.sampler.sample(&logits, &seq.tokens))
                })
                .collect(),
        }
    }
}

/// [`Engine::step`] on CUDA: batches of at most `max_batch` rows; rows whose sequence has a
/// repetition penalty take the logits to the host sampler.
fn step_cuda(
    g: &mut GpuModel,
    sequences: &mut BTreeMap<SeqId, Sequence>,
    batch: &[(SeqId, u32)],
) -> Result<Vec<u32>> {
    let mut rows = Vec::with_capacity(batch.len());
    let mut hosts = Vec::with_capacity(batch.len());
    let mut seqs: Vec<&mut Sequence> = sequences
        .values_mut()
        .filter(|s| batch.iter().any(|&(id, _)| id == s.id))
        .collect();
    seqs.sort_by_key(|s| batch.iter().position(|&(id, _)| id == s.id));
    for (s, &(_, tok)) in seqs.into_iter().zip(batch) {
        let Sequence {
            tokens,
            state,
            sampler,
            ..
        } = s;
        tokens.push(tok);
        match state {
            SeqState::Cuda(st) => rows.push((st, tok)),
            SeqState::Cpu(_) => return Err(wrong_backend()),
        }
        hosts.push((sampler, &*tokens));
    }
    let mut next = Vec::with_capacity(batch.len());
    for (rows, hosts) in rows
        .chunks_mut(g.max_batch())
        .zip(hosts.chunks_mut(g.max_batch()))
    {
        let mut picked = g.step_batch(rows).map_err(cuda_err)?;
        for (row, (sampler, tokens)) in hosts.iter_mut().enumerate() {
            if sampler.params().repetition_penalty != 1.0 {
                let logits = g.logits(row).map_err(cuda_err)?;
                picked[row] = sampler.sample(&logits, tokens);
            }
        }
        next.extend(picked);
    }
    Ok(next)
}

/// The device sampler's parameters for `p` (its repetition penalty is applied on the host).
fn device_params(p: &SamplingParams) -> SampleParams {
    SampleParams {
        temperature: if p.is_greedy() { 0.0 } else { p.temperature },
        top_k: p.top_k as u32,
        top_p: p.top_p,
        min_p: p.min_p,
        seed: p.seed,
    }
}

/// A failure to take a state slot: [`EngineError::Capacity`] when every slot is busy.
fn capacity(e: deltamoe_compute::cuda::CudaError) -> EngineError {
    match e {
        deltamoe_compute::cuda::CudaError::Full(msg) => EngineError::Capacity(msg),
        e => cuda_err(e),
    }
}
