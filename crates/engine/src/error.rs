//! Engine errors: each message names the file, key or value at fault and how to fix it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] deltamoe_model::ModelError),
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Input(String),
    /// Every sequence slot is taken; retry when one is released.
    #[error("{0}")]
    Capacity(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// The error for a sequence id the engine does not hold.
pub(crate) fn no_such_sequence(id: crate::SeqId) -> EngineError {
    EngineError::Input(format!("sequence {} does not exist", id.0))
}
