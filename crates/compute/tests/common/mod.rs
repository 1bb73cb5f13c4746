//! Helpers shared by the GPU parity tests: seeded random inputs, a relative error check and
//! the device.

#![allow(dead_code)]

use deltamoe_compute::cuda::Gpu;
use rand::{Rng, SeedableRng};

pub fn rng() -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(1234)
}

pub fn rand_vec(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// max |got − want| ≤ tol · max |want|.
pub fn assert_close(name: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{name}: max err {err:.3e} (max|want| {scale:.3})");
    assert!(
        err <= tol * scale,
        "{name}: max err {err} > {tol} * {scale}"
    );
}

pub fn gpu() -> Gpu {
    Gpu::new(0).expect("a CUDA device")
}
