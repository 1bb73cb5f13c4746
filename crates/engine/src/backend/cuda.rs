//! The CUDA backend: the weights and every sequence's state live on one GPU; a decode step
//! runs all its rows as batched steps (a captured graph per batch size) and, without a
//! repetition penalty, samples on the device so only token ids cross to the host. This is the
//! only place that builds the device sampler's parameters. With speculative decoding on, a step
//! of one greedy sequence verifies the drafts its MTP layer made after the step before (see
//! `deltamoe_model::gpu::GpuModel::verify`); other steps run plain.

use std::collections::BTreeMap;
use std::sync::Arc;

use deltamoe_compute::cuda::ops::SampleParams;
use deltamoe_compute::cuda::{CudaError, Gpu};
use deltamoe_model::gpu::{
    ExpertCache, GdnPrefill, GpuModel, GpuSeq, GpuSnapshot, OffloadStats, PrefillGemm,
};
use deltamoe_model::{Logits, Qwen3Hybrid};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::cpu::no_mtp_layer;
use super::sharded::Member;
use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{no_such_sequence, EngineError, Result};
use crate::sampler::SamplingParams;
use crate::sequence::SeqId;

/// Replays that time a step's collectives.
const COMM_REPS: usize = 20;

/// The GPU model and the device states of the sequences on it.
pub struct CudaBackend {
    gpu: GpuModel,
    seqs: BTreeMap<SeqId, GpuSeq>,
    /// With speculative decoding: each sequence's drafts after its last token.
    drafts: BTreeMap<SeqId, Vec<u32>>,
    /// Benchmarks: each draft kept with this probability instead of by the rule, drawn here.
    forced: Option<(f64, StdRng)>,
}

impl CudaBackend {
    /// Uploads `model`'s weights (routed experts behind `cache`) and reserves state for
    /// `max_seqs` sequences of `max_ctx` tokens (0: as many as the free memory holds).
    pub fn new(
        model: &Qwen3Hybrid,
        gpu: Arc<Gpu>,
        max_ctx: usize,
        max_seqs: usize,
        cache: ExpertCache,
    ) -> Result<CudaBackend> {
        let mut gm = GpuModel::upload_with(model, gpu, cache).map_err(cuda_err)?;
        gm.upload_mtp(model.checkpoint()).map_err(cuda_err)?;
        CudaBackend::with_model(gm, max_ctx, max_seqs)
    }

    /// Serves a model already on the GPU (e.g. synthetic random weights), reserving state as
    /// [`CudaBackend::new`] does.
    pub fn with_model(mut gm: GpuModel, max_ctx: usize, max_seqs: usize) -> Result<CudaBackend> {
        gm.reserve(max_seqs, max_ctx).map_err(cuda_err)?;
        Ok(CudaBackend {
            gpu: gm,
            seqs: BTreeMap::new(),
            drafts: BTreeMap::new(),
            forced: None,
        })
    }

    fn seq(&self, id: SeqId) -> Result<&GpuSeq> {
        self.seqs.get(&id).ok_or_else(|| no_such_sequence(id))
    }

    /// One batched step of `part` (sequence, token fed; at most `max_batch` rows): each row's
    /// pick on the device.
    fn step_part(&mut self, part: &[(SeqId, u32)]) -> Result<Vec<u32>> {
        let mut seqs: Vec<(&SeqId, &mut GpuSeq)> = self
            .seqs
            .iter_mut()
            .filter(|(id, _)| part.iter().any(|r| r.0 == **id))
            .collect();
        if seqs.len() != part.len() {
            return Err(EngineError::Input(
                "a step names a sequence without device state".into(),
            ));
        }
        seqs.sort_by_key(|(id, _)| part.iter().position(|r| r.0 == **id));
        let mut dev: Vec<(&mut GpuSeq, u32)> = seqs
            .into_iter()
            .zip(part)
            .map(|((_, st), r)| (st, r.1))
            .collect();
        self.gpu.step_batch(&mut dev).map_err(cuda_err)
    }
}

/// Another GPU's part of a step whose tokens the first GPU picks (see `super::sharded`).
impl Member for CudaBackend {
    fn feed_tokens(&mut self, rows: &[(SeqId, u32)]) -> Result<()> {
        let max = self.gpu.max_batch();
        rows.chunks(max)
            .try_for_each(|part| self.step_part(part).map(|_| ()))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda ({})", self.gpu.gpu().name())
    }

    fn free_sequences(&self) -> Option<usize> {
        Some(self.gpu.free_slots())
    }

    fn sequence_bytes(&self, ctx: usize) -> usize {
        self.gpu.seq_bytes(ctx)
    }

    fn add(&mut self, id: SeqId) -> Result<()> {
        let s = self.gpu.new_seq().map_err(capacity)?;
        self.seqs.insert(id, s);
        Ok(())
    }

    fn remove(&mut self, id: SeqId) {
        self.drafts.remove(&id);
        if let Some(s) = self.seqs.remove(&id) {
            self.gpu.release(s);
        }
    }

    fn snapshot(&self, id: SeqId) -> Result<SavedState> {
        let snap = self.gpu.snapshot(self.seq(id)?).map_err(cuda_err)?;
        Ok(SavedState {
            bytes: snap.bytes(),
            state: Box::new(snap),
        })
    }

    fn restore(&mut self, id: SeqId, saved: &SavedState) -> Result<()> {
        let snap = saved.state.downcast_ref::<GpuSnapshot>();
        let s = self
            .gpu
            .restore(snap.ok_or_else(wrong_backend)?)
            .map_err(capacity)?;
        self.seqs.insert(id, s);
        Ok(())
    }

    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let st = self.seqs.get_mut(&id).ok_or_else(|| no_such_sequence(id))?;
        // Drafts made after the sequence's last token do not follow these.
        self.drafts.remove(&id);
        self.gpu.prefill(st, tokens, which, chunk).map_err(cuda_err)
    }

    /// The GPU samples, unless a repetition penalty needs the history on the host.
    fn set_sampling(&mut self, id: SeqId, p: &SamplingParams) -> Result<()> {
        let st = self.seqs.get(&id).ok_or_else(|| no_such_sequence(id))?;
        self.gpu
            .set_sampling(st, device_params(p))
            .map_err(cuda_err)
    }

    /// Batches of at most `max_batch` rows; rows whose sequence has a repetition penalty take
    /// the logits to the host sampler.
    fn step(&mut self, rows: &mut [StepRow]) -> Result<Vec<u32>> {
        let fed: Vec<(SeqId, u32)> = rows.iter().map(|r| (r.id, r.token)).collect();
        let max = self.gpu.max_batch();
        let mut next = Vec::with_capacity(rows.len());
        for (part, hosts) in fed.chunks(max).zip(rows.chunks_mut(max)) {
            let mut picked = self.step_part(part)?;
            for (row, host) in hosts.iter_mut().enumerate() {
                if host.sampler.params().repetition_penalty != 1.0 {
                    let logits = self.gpu.logits(row).map_err(cuda_err)?;
                    picked[row] = host.sampler.sample(&logits, host.history);
                }
            }
            next.extend(picked);
        }
        Ok(next)
    }

    fn set_speculative(&mut self, drafts: usize) -> Result<()> {
        if drafts > 0 && !self.gpu.has_mtp() {
            return Err(no_mtp_layer());
        }
        if !self.seqs.is_empty() {
            return Err(EngineError::Input(
                "speculative decoding is set before any sequence starts".into(),
            ));
        }
        self.gpu.set_speculative(drafts).map_err(cuda_err)
    }

    fn force_acceptance(&mut self, p: f64) -> Result<()> {
        self.forced = Some((p, StdRng::seed_from_u64(0)));
        Ok(())
    }

    /// One greedy sequence with drafts verifies them; anything else steps plain (and its
    /// drafts, made for the token it feeds now, are dropped).
    fn speculate(&mut self, rows: &mut [StepRow]) -> Result<Vec<Vec<u32>>> {
        let spec = self.gpu.speculative_drafts();
        let on_device = |r: &StepRow| {
            let p = r.sampler.params();
            p.is_greedy() && p.repetition_penalty == 1.0
        };
        if spec == 0 || rows.len() != 1 || !on_device(&rows[0]) {
            for r in rows.iter() {
                self.drafts.remove(&r.id);
            }
            return Ok(self.step(rows)?.into_iter().map(|t| vec![t]).collect());
        }
        let row = &rows[0];
        let mut drafts = self.drafts.remove(&row.id).unwrap_or_default();
        drafts.truncate(row.drafts.min(spec));
        let fed: Vec<u32> = std::iter::once(row.token).chain(drafts).collect();
        let seq = self
            .seqs
            .get_mut(&row.id)
            .ok_or_else(|| no_such_sequence(row.id))?;
        let picks = self.gpu.verify(seq, &fed).map_err(cuda_err)?;
        let kept = match &mut self.forced {
            Some((p, rng)) => (0..fed.len() - 1)
                .find(|_| rng.random::<f64>() >= *p)
                .unwrap_or(fed.len() - 1),
            None => fed[1..]
                .iter()
                .zip(&picks)
                .take_while(|(d, p)| d == p)
                .count(),
        };
        self.gpu
            .commit(seq, fed.len(), kept + 1)
            .map_err(cuda_err)?;
        let out: Vec<u32> = fed[1..=kept].iter().copied().chain([picks[kept]]).collect();
        let next = self.gpu.draft(seq, &out, spec).map_err(cuda_err)?;
        self.drafts.insert(row.id, next);
        Ok(vec![out])
    }

    fn set_gdn_prefill(&mut self, mode: GdnPrefill) {
        self.gpu.set_prefill_gdn(mode);
    }

    fn set_prefill_gemm(&mut self, mode: PrefillGemm) {
        self.gpu.set_prefill_gemm(mode);
    }

    fn set_host_experts(&mut self, on: bool) -> Result<()> {
        self.gpu.set_host_experts(on).map_err(cuda_err)
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        self.gpu.offload_stats()
    }

    fn comm_seconds(&mut self, rows: usize) -> Result<Option<f64>> {
        self.gpu.comm_seconds(rows, COMM_REPS).map_err(cuda_err)
    }
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

pub(crate) fn cuda_err(e: CudaError) -> EngineError {
    EngineError::Input(format!("cuda: {e}"))
}

/// A failure to take a state slot: [`EngineError::Capacity`] when every slot is busy.
fn capacity(e: CudaError) -> EngineError {
    match e {
        CudaError::Full(msg) => EngineError::Capacity(msg),
        e => cuda_err(e),
    }
}
