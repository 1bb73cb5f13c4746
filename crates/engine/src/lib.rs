//! The engine: sequences and their state on a backend (CPU or CUDA), prefill and decode steps,
//! sampling, a scheduler for continuous batching with prompt reuse, tokenizer and chat
//! templates.

mod backend;
pub mod chat;
pub mod engine;
pub mod error;
pub mod generate;
pub mod generation_config;
pub mod model_text;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod speculative;
pub mod tokenizer;

pub use backend::sharded::MakeShard;
pub use engine::Engine;
pub use error::{EngineError, Result};
pub use generate::{generate, GenerateRequest, GenerateStats};
pub use scheduler::{Event, FinishReason, Request, RequestId, Scheduler, SchedulerConfig};
pub use sequence::{SeqId, Sequence};
