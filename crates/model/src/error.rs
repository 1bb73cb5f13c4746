//! Model loading errors. Every message is one line that names the file, key or tensor at fault
//! and, where there is one, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The I/O error is shown in the message and deliberately not exposed as `source()`, so
    /// printing the error with its chain of causes does not repeat it.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: key `{key}`: {msg}")]
    Config {
        path: PathBuf,
        key: String,
        msg: String,
    },
    #[error("{path}: not valid JSON: {msg}")]
    Json { path: PathBuf, msg: String },
    #[error("{path}: model_type `{model_type}` is not supported (supported: qwen3_next, qwen3_5_moe, qwen3_5_moe_text, qwen3_5, qwen3_5_text)")]
    UnknownModelType { path: PathBuf, model_type: String },
    #[error("{path}: not a valid safetensors file ({msg}); the file may be truncated or corrupt, download it again")]
    Safetensors { path: PathBuf, msg: String },
    #[error("{dir}: no weights found: expected model.safetensors or model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor `{name}` in {file}: shape {found:?} does not match the config, which implies {expected:?}")]
    Shape {
        name: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` in {file}: dtype {dtype} is not supported (use bf16, f16 or f32)")]
    DType {
        name: String,
        file: PathBuf,
        dtype: String,
    },
    #[error("tensor `{name}` in {file}: {msg}")]
    Quant {
        name: String,
        file: PathBuf,
        msg: String,
    },
    #[error("{0}")]
    Input(String),
}

pub type Result<T> = std::result::Result<T, ModelError>;
