//! Layers of the Qwen3 hybrid family, each loading its own tensors (shape-checked against the
//! config) and running on the CPU kernels of `deltamoe-compute`. Activations are row-major
//! `[T, features]` f32.

pub mod attention;
pub mod gdn;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod offloaded;

pub use attention::Attention;
pub use gdn::GatedDeltaNet;
pub use linear::{DenseSource, Linear, LinearWeight};
pub use mlp::Mlp;
pub use moe::Moe;
pub use offloaded::{ExpertStats, OffloadedExperts};
