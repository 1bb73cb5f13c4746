//! Helpers shared by the GPU parity tests: seeded random inputs, a relative error check, the
//! device and affine weights (MLX's or with f16 zero points) uploaded to it.

#![allow(dead_code)]

use deltamoe_compute::cpu::quant::{quantize, Quantized};
use deltamoe_compute::cuda::ops::{AffineParams, Matvec, WeightFormat};
use deltamoe_compute::cuda::{DevBuf, Gpu};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};
use deltamoe_compute::{AffineWeight, PackedWords, Tensor};
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

/// GPTQ/AWQ-style parameters of `groups` groups of `bits`-bit codes, as f16 bits: scales s
/// around 1/(2^bits − 1) (codes minus zero points then span about [−1.5, 1.5]) and integer zero
/// points z in 0..2^bits.
pub fn f16_zero_params(r: &mut impl Rng, groups: usize, bits: u32) -> (Vec<u16>, Vec<u16>) {
    let f16 = |v: f32| half::f16::from_f32(v).to_bits();
    let top = ((1u32 << bits) - 1) as f32;
    let scales = (0..groups)
        .map(|_| f16(r.random_range(0.5f32..1.5) / top))
        .collect();
    let zeros = (0..groups)
        .map(|_| f16(r.random_range(0..1u32 << bits) as f32))
        .collect();
    (scales, zeros)
}

/// Group `g`'s scale and bias as the kernels apply them (common.cuh's aff_scale, aff_bias), from
/// the stored 16-bit values: bf16 scale and bias, f16 scale s and zero point z as s and −z·s
/// (exact), or f32 scale and bias (two values each, low half first).
pub fn group_params(params: AffineParams, scales: &[u16], biases: &[u16], g: usize) -> (f32, f32) {
    match params {
        AffineParams::Bf16 => (bf16_to_f32(scales[g]), bf16_to_f32(biases[g])),
        AffineParams::F16Zero => {
            let s = half::f16::from_bits(scales[g]).to_f32();
            (s, -half::f16::from_bits(biases[g]).to_f32() * s)
        }
        AffineParams::F32 => {
            let f = |a: &[u16]| f32::from_bits(a[2 * g] as u32 | (a[2 * g + 1] as u32) << 16);
            (f(scales), f(biases))
        }
    }
}

/// f32 values as the 16-bit halves the device holds (low first).
pub fn f32_halves(v: &[f32]) -> Vec<u16> {
    v.iter()
        .flat_map(|x| [x.to_bits() as u16, (x.to_bits() >> 16) as u16])
        .collect()
}

/// `w` (rows of `k`) quantized to `bits` in groups of `group`, its parameters as `params` says,
/// and all three arrays uploaded: MLX's scales and biases rounded to bf16 as the device holds
/// them, (F16Zero) the same codes with random f16 scales and zero points
/// ([`f16_zero_params`]), or (F32) the quantizer's f32 scales and biases as they are. `sf`, `bf`: each group's scale and bias as the kernels apply them,
/// exactly, so a CPU product on f32 parameters `sf`, `bf` ([`Affine::weight`]) is the reference.
pub struct Affine {
    pub q: Quantized,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
    pub sf: Vec<f32>,
    pub bf: Vec<f32>,
    pub dw: DevBuf<u32>,
    pub ds: DevBuf<u16>,
    pub db: DevBuf<u16>,
    pub k: usize,
    pub bits: u32,
    pub group: usize,
    pub params: AffineParams,
}

impl Affine {
    /// MLX's form ([`AffineParams::Bf16`]).
    pub fn new(g: &Gpu, w: &[f32], k: usize, group: usize, bits: u32) -> Affine {
        Affine::with_params(g, w, k, (group, bits), AffineParams::Bf16)
    }

    pub fn with_params(
        g: &Gpu,
        w: &[f32],
        k: usize,
        (group, bits): (usize, u32),
        params: AffineParams,
    ) -> Affine {
        let q = quantize(w, k, group, bits).unwrap();
        let (scales, biases) = match params {
            AffineParams::Bf16 => {
                let bf = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f32_to_bf16(x)).collect() };
                (bf(&q.scales), bf(&q.biases))
            }
            AffineParams::F16Zero => {
                let mut r = rand::rngs::StdRng::seed_from_u64(w.len() as u64);
                f16_zero_params(&mut r, q.scales.len(), bits)
            }
            AffineParams::F32 => (f32_halves(&q.scales), f32_halves(&q.biases)),
        };
        let (sf, bf) = (0..q.scales.len())
            .map(|g| group_params(params, &scales, &biases, g))
            .unzip();
        let (dw, ds, db) = (
            g.upload(&q.words).unwrap(),
            g.upload(&scales).unwrap(),
            g.upload(&biases).unwrap(),
        );
        Affine {
            q,
            scales,
            biases,
            sf,
            bf,
            dw,
            ds,
            db,
            k,
            bits,
            group,
            params,
        }
    }

    /// Matrix `e` of `n` rows as a CPU weight with the f32 parameters the kernels apply.
    pub fn weight(&self, e: usize, n: usize) -> AffineWeight {
        let (wpr, gpr) = (self.k * self.bits as usize / 32, self.k / self.group);
        let t =
            |v: &[f32]| Tensor::from_f32(vec![n, gpr], v[e * n * gpr..(e + 1) * n * gpr].to_vec());
        let words = PackedWords::from_vec(self.q.words[e * n * wpr..(e + 1) * n * wpr].to_vec());
        AffineWeight::new(
            self.bits,
            self.group,
            n,
            self.k,
            words,
            t(&self.sf),
            t(&self.bf),
        )
        .unwrap()
    }

    /// Every row dequantized as q·scale + bias in f32 with the parameters the kernels apply
    /// (exact for f16 zero points: (q − z)·s).
    pub fn dequant(&self) -> Vec<f32> {
        let (k, bits) = (self.k, self.bits);
        let per = 32 / bits as usize;
        (0..self.q.words.len() * per)
            .map(|i| {
                let (row, col) = (i / k, i % k);
                let word = self.q.words[row * k / per + col / per];
                let v = ((word >> ((col % per) as u32 * bits)) & ((1 << bits) - 1)) as f32;
                let gi = row * (k / self.group) + col / self.group;
                v.mul_add(self.sf[gi], self.bf[gi])
            })
            .collect()
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
                params: self.params,
            },
        }
    }
}
