//! The CUDA backend: the weights and every sequence's state live on one GPU; a decode step
//! runs all its rows as batched steps (a captured graph per batch size) and, without a
//! repetition penalty, samples on the device so only token ids cross to the host. This is the
//! only place that builds the device sampler's parameters.

use std::collections::BTreeMap;
use std::sync::Arc;

use deltamoe_compute::cuda::ops::SampleParams;
use deltamoe_compute::cuda::{CudaError, Gpu};
use deltamoe_model::gpu::{
    ExpertCache, GdnPrefill, GpuModel, GpuSeq, GpuSnapshot, OffloadStats, PrefillGemm,
};
use deltamoe_model::{Logits, Qwen3Hybrid};

use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{no_such_sequence, EngineError, Result};
use crate::sampler::SamplingParams;
use crate::sequence::SeqId;

/// The GPU model and the device states of the sequences on it.
pub struct CudaBackend {
    gpu: GpuModel,
    seqs: BTreeMap<SeqId, GpuSeq>,
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
        let gm = GpuModel::upload_with(model, gpu, cache).map_err(cuda_err)?;
        CudaBackend::with_model(gm, max_ctx, max_seqs)
    }

    /// Serves a model already on the GPU (e.g. synthetic random weights), reserving state as
    /// [`CudaBackend::new`] does.
    pub fn with_model(mut gm: GpuModel, max_ctx: usize, max_seqs: usize) -> Result<CudaBackend> {
        gm.reserve(max_seqs, max_ctx).map_err(cuda_err)?;
        Ok(CudaBackend {
            gpu: gm,
            seqs: BTreeMap::new(),
        })
    }

    fn seq(&self, id: SeqId) -> Result<&GpuSeq> {
        self.seqs.get(&id).ok_or_else(|| no_such_sequence(id))
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
        let mut seqs: Vec<(&SeqId, &mut GpuSeq)> = self
            .seqs
            .iter_mut()
            .filter(|(id, _)| rows.iter().any(|r| r.id == **id))
            .collect();
        if seqs.len() != rows.len() {
            return Err(EngineError::Input(
                "a step names a sequence without device state".into(),
            ));
        }
        seqs.sort_by_key(|(id, _)| rows.iter().position(|r| r.id == **id));
        let mut dev: Vec<(&mut GpuSeq, u32)> = seqs
            .into_iter()
            .zip(rows.iter())
            .map(|((_, st), r)| (st, r.token))
            .collect();
        let max = self.gpu.max_batch();
        let mut next = Vec::with_capacity(rows.len());
        for (dev, hosts) in dev.chunks_mut(max).zip(rows.chunks_mut(max)) {
            let mut picked = self.gpu.step_batch(dev).map_err(cuda_err)?;
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

fn cuda_err(e: CudaError) -> EngineError {
    EngineError::Input(format!("cuda: {e}"))
}

/// A failure to take a state slot: [`EngineError::Capacity`] when every slot is busy.
fn capacity(e: CudaError) -> EngineError {
    match e {
        CudaError::Full(msg) => EngineError::Capacity(msg),
        e => cuda_err(e),
    }
}
