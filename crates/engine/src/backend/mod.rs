//! Where the model runs. [`Backend`] is the one place the engine's backend choice lives: the
//! CPU backend ([`cpu::CpuBackend`]) owns and runs the host model, the CUDA backend
//! ([`cuda::CudaBackend`]) a model on a GPU (uploaded from a checkpoint, or made there with
//! random weights for synthetic shapes). Each backend keeps the model state
//! of every sequence (keyed by [`SeqId`]); the engine keeps the tokens and samplers, so the
//! engine never looks at a backend-specific type.

pub mod cpu;
pub mod cuda;
pub mod sharded;

use std::any::Any;

use deltamoe_model::gpu::{GdnPrefill, OffloadStats, PrefillGemm};
use deltamoe_model::layers::ExpertStats;
use deltamoe_model::Logits;

use crate::error::{EngineError, Result};
use crate::sampler::{Sampler, SamplingParams};
use crate::sequence::SeqId;

/// One row of a decode step.
pub struct StepRow<'a> {
    pub id: SeqId,
    /// The token fed to the sequence.
    pub token: u32,
    /// Picks the row's next token on the host.
    pub sampler: &'a mut Sampler,
    /// The sequence's tokens, `token` included (the repetition penalty's history).
    pub history: &'a [u32],
    /// Drafts a speculative step may verify after `token` (see [`Backend::speculate`]).
    pub drafts: usize,
}

/// A copy of one sequence's model state, opaque outside the backend that made it.
pub struct SavedState {
    /// Memory the copy holds (host memory on the CPU, device memory on CUDA).
    pub bytes: usize,
    pub state: Box<dyn Any>,
}

/// What the engine needs from a backend.
pub trait Backend {
    /// `"cpu"` or the GPU's name.
    fn name(&self) -> String;

    /// How many more sequences fit; `None` when there is no fixed limit.
    fn free_sequences(&self) -> Option<usize>;

    /// Bytes of state one sequence holds at `ctx` tokens.
    fn sequence_bytes(&self, ctx: usize) -> usize;

    /// Gives `id` a fresh state; [`EngineError::Capacity`] when none is free.
    fn add(&mut self, id: SeqId) -> Result<()>;

    /// Frees the state of `id` (nothing when it has none).
    fn remove(&mut self, id: SeqId);

    /// A copy of the state of `id`.
    fn snapshot(&self, id: SeqId) -> Result<SavedState>;

    /// Gives `id` a state copied from `saved`.
    fn restore(&mut self, id: SeqId, saved: &SavedState) -> Result<()>;

    /// Feeds `tokens` to `id` in passes of at most `chunk` tokens; returns the logits `which`
    /// asks for.
    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>>;

    /// Tells the backend how `id` samples (checked already); a backend sampling on the host
    /// ignores it.
    fn set_sampling(&mut self, _id: SeqId, _p: &SamplingParams) -> Result<()> {
        Ok(())
    }

    /// Feeds each row's token to its sequence and returns each row's next token.
    fn step(&mut self, rows: &mut [StepRow]) -> Result<Vec<u32>>;

    /// Speculative decoding with the model's MTP layer drafting up to `drafts` tokens a step
    /// (0: off), set before any sequence starts; later prefills keep what drafting needs.
    fn set_speculative(&mut self, drafts: usize) -> Result<()>;

    /// For benchmarks of models whose drafts agree with nothing (random weights): each draft is
    /// kept with probability `p` whatever the model says, the next token being the model's pick
    /// after the kept ones. Costs as real speculative steps do; the tokens mean nothing.
    fn force_acceptance(&mut self, p: f64) -> Result<()>;

    /// Feeds each row's token to its sequence, verifies up to `row.drafts` drafts after it in
    /// the same pass, and returns each row's kept drafts followed by its next token. The state
    /// keeps exactly the fed tokens: the row's token and its kept drafts. With speculative
    /// decoding off it is [`Self::step`].
    fn speculate(&mut self, rows: &mut [StepRow]) -> Result<Vec<Vec<u32>>> {
        Ok(self.step(rows)?.into_iter().map(|t| vec![t]).collect())
    }

    /// How later prefills run the Gated DeltaNet delta rule (only CUDA has a choice).
    fn set_gdn_prefill(&mut self, _mode: GdnPrefill) {}

    /// How later prefills run their matrix products (only CUDA has a choice).
    fn set_prefill_gemm(&mut self, _mode: PrefillGemm) {}

    /// Whether the CPU may compute offloaded experts (only CUDA offloads to the host).
    fn set_host_experts(&mut self, _on: bool) -> Result<()> {
        Ok(())
    }

    /// Expert-offload statistics, when the backend offloads experts to the host.
    fn offload_stats(&self) -> Option<OffloadStats> {
        None
    }

    /// Statistics of the host model's experts read from the files, when the CPU model
    /// offloads them.
    fn expert_stats(&self) -> Option<ExpertStats> {
        None
    }

    /// Seconds a decode step of `rows` rows spends in collectives between GPUs, measured
    /// alone; None on one device.
    fn comm_seconds(&mut self, _rows: usize) -> Result<Option<f64>> {
        Ok(None)
    }
}

/// The error for a state that another backend made.
pub(crate) fn wrong_backend() -> EngineError {
    EngineError::Input("a sequence's state is on another backend than the engine".into())
}
