//! Tensors, weight storage and compute kernels for deltamoe.
//!
//! Activations are plain row-major `f32` slices (`[tokens, features]`); weights are [`Tensor`]s
//! that keep the checkpoint's dtype (bf16/f16/f32) and are usually memory-mapped. Kernels live in
//! [`cpu`], one module per op family, each with its formula and layout in the module doc.

pub mod cache;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod fp8;
pub mod quant;
pub mod tensor;

pub use dtype::DType;
pub use fp8::{Fp8Error, Fp8Weight};
pub use quant::{AffineWeight, PackedWords, QuantError};
pub use tensor::{Tensor, TensorData};
