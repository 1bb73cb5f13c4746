//! The CPU forward passes of the Qwen3 hybrid family's layers, one file per kind, over the
//! weights of [`crate::checkpoint`] and the CPU kernels of `deltamoe-compute`. Activations are
//! row-major `[T, features]` f32.

pub mod attention;
pub mod gdn;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod offloaded;

pub use crate::checkpoint::{
    Attention, DenseSource, GatedDeltaNet, Linear, LinearWeight, Mlp, Moe,
};
pub use linear::Products;
pub use offloaded::{ExpertStats, OffloadedExperts};
