//! A sequence: its tokens so far and how it samples. Its model state (KV caches, conv and
//! recurrent states) lives on the engine's backend. Sequences are independent; the engine may
//! hold many.

use crate::sampler::Sampler;

/// Identifies a sequence within an [`crate::Engine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

pub struct Sequence {
    pub id: SeqId,
    /// Every token fed so far, prompt and generated.
    pub tokens: Vec<u32>,
    /// Picks the sequence's tokens in [`crate::Engine::step`] (on the host; on CUDA only when a
    /// repetition penalty needs the history).
    pub sampler: Sampler,
}
