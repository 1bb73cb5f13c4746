//! Host tests of [`super::gpu_twin`]: `silu_portable`'s accuracy and constants, the SIMD paths
//! this CPU has (AVX2, AVX-512) against the portable one (bitwise) for every format (affine with
//! either kind of parameters) at odd sizes, all against an f64 dot product (loosely), and the
//! shape checks. GPU parity: tests/cuda_twin.rs.

use rand::{Rng, SeedableRng};

use super::gpu_twin::{
    best_path, matvec_rows, matvec_rows_on, paths, silu_portable, swiglu_rows_on, Path, TwinError,
    TwinInput, TwinMat,
};
use crate::cuda::ops::AffineParams;
use crate::dtype::{bf16_to_f32, f32_to_bf16};

fn rng() -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(77)
}

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Distance in ulps of the f32 `want` (its exponent's ulp; subnormal spacing below).
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let e = (w.abs().max(f32::MIN_POSITIVE)).log2().floor() as i32;
    (got as f64 - want).abs() / 2f64.powi(e - 23)
}

#[test]
fn silu_portable_is_within_3_ulp() {
    let mut r = rng();
    let mut xs: Vec<f32> = (0..2_000_000)
        .map(|_| r.random_range(-100.0f32..100.0))
        .collect();
    // Small magnitudes, both signs, and the edges of the range reduction and the cutoffs.
    for e in -149..8 {
        for m in [1.0f32, 1.37, 1.999] {
            let v = m * 2f32.powi(e);
            xs.extend([v, -v]);
        }
    }
    for v in [
        88.72f32, 88.7228, 88.73, 89.0, 87.33, 87.34, 103.9, 104.0, 104.1, 0.3466, 0.3467,
    ] {
        for d in -3..=3 {
            let b = (v.to_bits() as i32 + d) as u32;
            xs.extend([f32::from_bits(b), -f32::from_bits(b)]);
        }
    }
    let mut worst = (0.0f64, 0.0f32);
    for &x in &xs {
        let (got, want) = (silu_portable(x), silu64(x as f64));
        if want.abs() >= 1e-36 {
            let u = ulps(got, want);
            assert!(u <= 3.0, "silu({x:e}) = {got:e}, want {want:e}: {u} ulp");
            if u > worst.0 {
                worst = (u, x);
            }
        } else {
            assert!(
                (got as f64 - want).abs() <= 1e-36,
                "silu({x:e}) = {got:e}, want {want:e}"
            );
        }
    }
    eprintln!(
        "silu_portable: worst {:.3} ulp at x = {:e}",
        worst.0, worst.1
    );
    assert!(silu_portable(f32::NAN).is_nan());
    assert_eq!(silu_portable(f32::INFINITY), f32::INFINITY);
    assert_eq!(
        silu_portable(f32::NEG_INFINITY).to_bits(),
        (-0.0f32).to_bits()
    );
    assert_eq!(silu_portable(-100.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!(silu_portable(0.0).to_bits(), 0);
    assert_eq!(silu_portable(-0.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!(silu_portable(200.0), 200.0);
}

#[test]
fn silu_portable_constants_are_what_they_claim() {
    // The hex patterns of silu_portable (and common.cuh): log2 e, ln 2 split hi + lo, 1/k!.
    let f = |b: u32| f32::from_bits(b);
    assert_eq!(f(0x3fb8_aa3b), std::f64::consts::LOG2_E as f32);
    assert_eq!(f(0x3f31_7218), std::f64::consts::LN_2 as f32);
    let lo = std::f64::consts::LN_2 - f(0x3f31_7218) as f64;
    assert_eq!(f(0xb102_e308), lo as f32);
    let inv_fact = |k: u32| (1.0 / (1..=k).map(|i| i as f64).product::<f64>()) as f32;
    let pats = [
        0x3f00_0000,
        0x3e2a_aaab,
        0x3d2a_aaab,
        0x3c08_8889,
        0x3ab6_0b61,
        0x3950_0d01,
    ];
    for (k, &b) in (2..=7).zip(&pats) {
        assert_eq!(f(b), inv_fact(k), "1/{k}!");
    }
}

/// A random affine matrix `[n, k]` with `params`: words, bf16 scales and biases, f16 scales
/// and f16 integer zero points, or f32 scales and biases (as 16-bit halves).
fn affine(
    r: &mut impl Rng,
    (n, k): (usize, usize),
    (bits, group): (u32, usize),
    params: AffineParams,
) -> Matrix {
    let words = (0..n * k * bits as usize / 32)
        .map(|_| r.random())
        .collect();
    let groups = n * k / group;
    let (scales, biases) = match params {
        AffineParams::Bf16 => {
            let mut half = || -> Vec<u16> {
                (0..groups)
                    .map(|_| f32_to_bf16(r.random_range(-0.05f32..0.05)))
                    .collect()
            };
            (half(), half())
        }
        AffineParams::F16Zero => {
            let f16 = |v: f32| half::f16::from_f32(v).to_bits();
            let scales = (0..groups)
                .map(|_| f16(r.random_range(0.001f32..0.05)))
                .collect();
            let zeros = (0..groups)
                .map(|_| f16(r.random_range(0..1u32 << bits) as f32))
                .collect();
            (scales, zeros)
        }
        AffineParams::F32 => {
            let mut halves = || -> Vec<u16> {
                (0..groups)
                    .flat_map(|_| {
                        let v = r.random_range(-0.05f32..0.05).to_bits();
                        [v as u16, (v >> 16) as u16]
                    })
                    .collect()
            };
            (halves(), halves())
        }
    };
    Matrix::Affine(words, scales, biases, (bits, group), params)
}

enum Matrix {
    Bf16(Vec<u16>),
    Affine(Vec<u32>, Vec<u16>, Vec<u16>, (u32, usize), AffineParams),
}

impl Matrix {
    fn view(&self) -> TwinMat<'_> {
        match self {
            Matrix::Bf16(w) => TwinMat::Bf16(w),
            Matrix::Affine(w, s, b, (bits, group), params) => TwinMat::Affine {
                words: w,
                scales: s,
                biases: b,
                bits: *bits,
                group: *group,
                params: *params,
            },
        }
    }

    /// Row `r` dequantized, in f64.
    fn row(&self, r: usize, k: usize) -> Vec<f64> {
        match self {
            Matrix::Bf16(w) => w[r * k..(r + 1) * k]
                .iter()
                .map(|&v| bf16_to_f32(v) as f64)
                .collect(),
            Matrix::Affine(w, s, b, (bits, group), params) => {
                let v = 32 / *bits as usize;
                (0..k)
                    .map(|c| {
                        let word = w[(r * k + c) / v];
                        let q = ((word >> ((c % v) as u32 * bits)) & ((1 << bits) - 1)) as f64;
                        let g = (r * k + c) / group;
                        match params {
                            AffineParams::Bf16 => {
                                q * bf16_to_f32(s[g]) as f64 + bf16_to_f32(b[g]) as f64
                            }
                            AffineParams::F16Zero => {
                                let h = |v: u16| half::f16::from_bits(v).to_f64();
                                (q - h(b[g])) * h(s[g])
                            }
                            AffineParams::F32 => {
                                let f = |a: &[u16]| {
                                    f32::from_bits(a[2 * g] as u32 | (a[2 * g + 1] as u32) << 16)
                                        as f64
                                };
                                q * f(s) + f(b)
                            }
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Inputs in [-1, 1] with some exact zeros.
fn input(r: &mut impl Rng, k: usize) -> Vec<f32> {
    (0..k)
        .map(|_| {
            if r.random_range(0..10) == 0 {
                0.0
            } else {
                r.random_range(-1.0f32..1.0)
            }
        })
        .collect()
}

/// Every path this CPU has against the portable one, bitwise, for `matvec_rows` over all rows
/// and a range from row 3, and `swiglu_rows` (I = n / 2, odd in the tests); the matvec against
/// f64.
fn check_paths(name: &str, m: &Matrix, n: usize, x: &[f32]) {
    let k = x.len();
    let (view, paths) = (m.view(), paths());
    let xin = TwinInput::new(x, &view).unwrap();
    let mut outs = Vec::new();
    for &p in &paths {
        let mut y = vec![0.0; n];
        matvec_rows_on(p, &view, &xin, 0..n, &mut y).unwrap();
        let mut part = vec![0.0; n - 3];
        matvec_rows_on(p, &view, &xin, 3..n, &mut part).unwrap();
        let mut h = vec![0.0; n / 2 - 1];
        swiglu_rows_on(p, &view, n / 2, &xin, 1..n / 2, &mut h).unwrap();
        outs.push((y, part, h));
    }
    let a = &outs[0];
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.0[3..]), bits(&a.1), "{name}: row range");
    for (b, p) in outs.iter().zip(&paths).skip(1) {
        assert_eq!(bits(&a.0), bits(&b.0), "{name}: matvec, {p:?}");
        assert_eq!(bits(&a.1), bits(&b.1), "{name}: row range, {p:?}");
        assert_eq!(bits(&a.2), bits(&b.2), "{name}: swiglu, {p:?}");
    }
    for (r, &got) in a.0.iter().enumerate() {
        let (mut want, mut mag) = (0.0f64, 0.0f64);
        for (w, &xv) in m.row(r, k).iter().zip(x) {
            want += w * xv as f64;
            mag += (w * xv as f64).abs();
        }
        assert!(
            (got as f64 - want).abs() <= 1e-5 * mag + 1e-30,
            "{name} row {r}: {got} vs {want}"
        );
    }
    for (j, &got) in a.2.iter().enumerate() {
        let (g, u) = (a.0[1 + j], a.0[n / 2 + 1 + j]);
        assert_eq!(
            got.to_bits(),
            (silu_portable(g) * u).to_bits(),
            "{name}: swiglu {j}"
        );
    }
}

#[test]
fn simd_and_portable_paths_agree_bitwise() {
    let mut r = rng();
    // bf16: K % 8 = 0 with and without a partial 256-step, and K % 8 ≠ 0 (odd, < 32, > 32).
    for k in [8usize, 256, 264, 1000, 2048, 7, 31, 33, 777] {
        let n = 38;
        let m = Matrix::Bf16(
            (0..n * k)
                .map(|_| f32_to_bf16(r.random_range(-1.0f32..1.0)))
                .collect(),
        );
        check_paths(&format!("bf16 K {k}"), &m, n, &input(&mut r, k));
    }
    // Affine: words per row below 32, a multiple of 32, and with a partial step; both kinds of
    // parameters.
    for params in [AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32] {
        for bits in [2u32, 4, 8] {
            for group in [32usize, 64, 128] {
                for k in [128usize, 384, 1024, 1152] {
                    let n = 34;
                    let m = affine(&mut r, (n, k), (bits, group), params);
                    check_paths(
                        &format!("{bits}-bit g{group} K {k} {params:?}"),
                        &m,
                        n,
                        &input(&mut r, k),
                    );
                }
            }
        }
    }
}

#[test]
fn fastest_path_is_used_where_available() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        assert_eq!(best_path(), Path::Avx512);
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert_eq!(best_path(), Path::Avx2);
    }
}

#[test]
fn shapes_and_formats_are_checked() {
    let m = Matrix::Affine(
        vec![0; 2 * 16],
        vec![0; 4],
        vec![0; 4],
        (4, 64),
        AffineParams::Bf16,
    );
    let bf = Matrix::Bf16(vec![0; 2 * 128]);
    let x = vec![0.5f32; 128];
    let (xa, xb) = (
        TwinInput::new(&x, &m.view()).unwrap(),
        TwinInput::new(&x, &bf.view()).unwrap(),
    );
    let mut y = vec![0.0; 2];
    assert!(matvec_rows(&m.view(), &xa, 0..2, &mut y).is_ok());
    assert!(matvec_rows(&bf.view(), &xb, 0..2, &mut y).is_ok());
    assert!(
        matvec_rows(&m.view(), &xb, 0..2, &mut y).is_err(),
        "bf16 input, affine matrix"
    );
    assert!(
        matvec_rows(&m.view(), &xa, 0..3, &mut [0.0; 3]).is_err(),
        "rows past N"
    );
    assert!(
        matvec_rows(&m.view(), &xa, 0..2, &mut [0.0; 1]).is_err(),
        "output length"
    );
    assert!(
        swiglu_rows_on(best_path(), &m.view(), 2, &xa, 0..1, &mut [0.0]).is_err(),
        "N ≠ 2I"
    );
    let bad = Matrix::Affine(
        vec![0; 16],
        vec![0; 2],
        vec![0; 2],
        (3, 64),
        AffineParams::Bf16,
    );
    assert_eq!(
        matvec_rows(&bad.view(), &xa, 0..1, &mut [0.0]).unwrap_err(),
        TwinError::Shape("input prepared for Affine(4), matrix is Affine(3)".into())
    );
    assert!(
        TwinInput::new(&x[..100], &m.view()).is_err(),
        "K not a multiple of 32"
    );
    assert!(TwinInput::new(&[], &bf.view()).is_err());
}
