//! Helpers shared by the GPU parity tests: seeded random inputs, a relative error check, the
//! device and MLX affine weights uploaded to it.

#![allow(dead_code)]

use deltamoe_compute::cpu::quant::{quantize, Quantized};
use deltamoe_compute::cuda::ops::{Matvec, WeightFormat};
use deltamoe_compute::cuda::{DevBuf, Gpu};
use deltamoe_compute::dtype::f32_to_bf16;
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

/// `w` (rows of `k`) quantized to `bits` in groups of `group`, with its scales and biases rounded
/// to bf16 as the device holds them, and all three uploaded.
pub struct Affine {
    pub q: Quantized,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
    pub dw: DevBuf<u32>,
    pub ds: DevBuf<u16>,
    pub db: DevBuf<u16>,
    pub bits: u32,
    pub group: usize,
}

impl Affine {
    pub fn new(g: &Gpu, w: &[f32], k: usize, group: usize, bits: u32) -> Affine {
        let q = quantize(w, k, group, bits).unwrap();
        let bf = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f32_to_bf16(x)).collect() };
        let (scales, biases) = (bf(&q.scales), bf(&q.biases));
        let (dw, ds, db) = (
            g.upload(&q.words).unwrap(),
            g.upload(&scales).unwrap(),
            g.upload(&biases).unwrap(),
        );
        Affine {
            q,
            scales,
            biases,
            dw,
            ds,
            db,
            bits,
            group,
        }
    }

    /// The uploaded weights as matrices of `n` rows of `k` (a stack when there are more rows),
    /// without a bias.
    pub fn matvec(&self, n: usize, k: usize) -> Matvec {
        Matvec {
            w: self.dw.ptr(),
            n,
            k,
            bias: 0,
            format: WeightFormat::Affine {
                bits: self.bits,
                group: self.group,
                scales: self.ds.ptr(),
                biases: self.db.ptr(),
            },
        }
    }
}
