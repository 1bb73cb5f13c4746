//! CPU kernels: f32 arithmetic on f32 activations, weights read in their stored dtype.
//! Multi-threaded with rayon where the work is large enough to pay for it.

pub mod act;
pub mod attention;
pub mod conv;
pub mod fp8;
pub mod gdn;
pub mod gdn_bf16;
pub mod gemm_twin;
pub mod gpu_twin;
#[cfg(test)]
mod gpu_twin_tests;
#[cfg(target_arch = "x86_64")]
mod gpu_twin_x512;
#[cfg(target_arch = "x86_64")]
mod gpu_twin_x86;
pub mod matmul;
pub mod norm;
pub mod quant;
#[cfg(target_arch = "x86_64")]
mod quant_x86;
pub mod rope;

pub use fp8::fp8_matmul;
pub use matmul::matmul;
pub use quant::{qmatmul, quantize};
