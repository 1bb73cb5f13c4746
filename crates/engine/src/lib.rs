//! The engine: sequences and their state on a backend (CPU or CUDA), prefill and decode steps,
//! sampling, tokenizer and chat templates.

mod backend;
pub mod chat;
pub mod engine;
pub mod error;
pub mod generate;
pub mod generation_config;
pub mod sampler;
pub mod sequence;
pub mod tokenizer;

pub use engine::Engine;
pub use error::{EngineError, Result};
pub use generate::{generate, GenerateRequest, GenerateStats};
pub use sequence::{SeqId, Sequence};
