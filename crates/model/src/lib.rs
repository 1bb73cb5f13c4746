//! Model definitions for deltamoe: HF config parsing, safetensors weights and the Qwen3 hybrid
//! family (Gated DeltaNet + gated attention + MoE).

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod error;
pub mod expert_store;
pub mod fp8;
pub mod gguf;
pub mod gptq;
pub mod gpu;
pub mod host_memory;
pub mod host_split;
pub mod layers;
pub mod quant;
pub mod qwen3_hybrid;
pub mod residency;
pub mod source;
pub mod state;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{Family, FfnKind, LayerKind, ModelConfig};
pub use error::{ModelError, Result};
pub use quant::{Layout, QuantConfig, QuantSpec};
pub use qwen3_hybrid::{Qwen3Hybrid, Verified};
pub use source::ModelSource;
pub use state::SequenceState;
pub use weights::{TensorBytes, TensorInfo, WeightStore};

/// Progress of long work over a model's tensors (converting, unpacking a GGUF file): source
/// bytes done of the total, and the tensor at hand.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub done: u64,
    pub total: u64,
    pub tensor: &'a str,
}

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[T, vocab]`, every position (scoring).
    All,
    /// `[vocab]`, the last position only (generation).
    Last,
}
