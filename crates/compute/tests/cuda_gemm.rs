//! The bf16 prefill products (`cuda::gemm`: operand conversion, cuBLASLt, the grouped expert
//! kernel) against their CPU twins (`cpu::gemm_twin`) on random inputs with odd sizes, for bf16,
//! affine (MLX's parameters, or f16 scales and zero points: their bf16 operand is the exact
//! (q − z)·s rounded once) and FP8 weights. Needs a
//! GPU: `#[ignore]`d here, run by `scripts/gpu-tests.sh`. The rounded operands must agree bit for
//! bit; products of the same bf16 operands summed in f32 in another order agree to 1e-4 of the
//! largest output; SwiGLU outputs rounded to bf16 may differ by one bf16 step (2^-8 relative).

mod common;

use common::{assert_close, gpu, rand_vec, rng, Affine};

use deltamoe_compute::cpu::gemm_twin::{dequant_affine_bf16, gemm_bf16, swiglu_bf16};
use deltamoe_compute::cuda::gemm::{self, TILE_GEMM};
use deltamoe_compute::cuda::ops::{AffineParams, Matvec, WeightFormat};
use deltamoe_compute::cuda::prefill::{self as pf, Grouped};
use deltamoe_compute::cuda::{DevBuf, Gpu};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16, round_bf16};
use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{DType, Fp8Weight};
use rand::Rng;

fn bf(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| f32_to_bf16(x)).collect()
}

/// A weight format of the tests: bf16, affine (bits, group, parameters) or FP8 in blocks of 128.
#[derive(Clone, Copy, Debug)]
enum Q {
    Bf16,
    Affine(u32, usize, AffineParams),
    Fp8,
}

const MLX: AffineParams = AffineParams::Bf16;
const F16Z: AffineParams = AffineParams::F16Zero;
const F32P: AffineParams = AffineParams::F32;

/// A stack of `e` matrices `[n, k]` on the device in `quant`'s format and the bf16 operand the
/// products use, as f32 `[e, n, k]` (FP8: random codes and block scales, `w` unused).
struct Stack {
    m: Matvec,
    wf: Vec<f32>,
    _bf16: Option<DevBuf<u16>>,
    _affine: Option<Affine>,
    _fp8: Option<(DevBuf<u8>, DevBuf<f32>)>,
}

fn stack(g: &Gpu, w: &[f32], (e, n, k): (usize, usize, usize), quant: Q) -> Stack {
    match quant {
        Q::Fp8 => {
            let mut r = rng();
            let (mut codes, mut scales, mut wf) = (vec![], vec![], vec![]);
            for _ in 0..e {
                let c: Vec<u8> = (0..n * k)
                    .map(|_| r.random_range(0u8..=254) & 0xf7)
                    .collect();
                let grid = rand_vec(&mut r, n.div_ceil(128) * k.div_ceil(128), 1e-3, 4e-3);
                let f = Fp8Weight::new(
                    n,
                    k,
                    [128, 128],
                    Bytes::from_vec(c.clone()),
                    grid,
                    DType::F32,
                )
                .unwrap();
                wf.extend(f.dequantize().into_iter().map(round_bf16));
                scales.extend((0..n).flat_map(|row| f.row_scales(row).to_vec()));
                codes.extend(c);
            }
            let (dc, ds) = (g.upload(&codes).unwrap(), g.upload(&scales).unwrap());
            let format = WeightFormat::Fp8 {
                group: 128,
                scales: ds.ptr(),
            };
            Stack {
                m: Matvec {
                    w: dc.ptr(),
                    n,
                    k,
                    bias: 0,
                    format,
                },
                wf,
                _bf16: None,
                _affine: None,
                _fp8: Some((dc, ds)),
            }
        }
        Q::Bf16 => {
            let bits = bf(w);
            let dw = g.upload(&bits).unwrap();
            let m = Matvec {
                w: dw.ptr(),
                n,
                k,
                bias: 0,
                format: WeightFormat::Bf16,
            };
            let wf = bits.iter().map(|&b| bf16_to_f32(b)).collect();
            Stack {
                m,
                wf,
                _bf16: Some(dw),
                _affine: None,
                _fp8: None,
            }
        }
        Q::Affine(bits, group, params) => {
            let a = Affine::with_params(g, w, k, (group, bits), params);
            let wf = match params {
                AffineParams::Bf16 => {
                    dequant_affine_bf16(&a.q.words, &a.scales, &a.biases, (e * n, k), group, bits)
                }
                // (q − z)·s is exact in f32 (`Affine::dequant`): one rounding to bf16; f32
                // parameters: the kernel's f32 fma, then bf16.
                AffineParams::F16Zero | AffineParams::F32 => {
                    a.dequant().into_iter().map(round_bf16).collect()
                }
            };
            Stack {
                m: a.matvec(n, k),
                wf,
                _bf16: None,
                _affine: Some(a),
                _fp8: None,
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn operands_and_library_gemm_match_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(n, k, t, quant) in &[
        (37usize, 72usize, 5usize, Q::Bf16),
        (300, 256, 129, Q::Affine(4, 64, MLX)),
        (65, 96, 33, Q::Affine(8, 32, MLX)),
        (257, 128, 7, Q::Affine(8, 128, MLX)),
        (301, 256, 17, Q::Affine(4, 64, F16Z)),
        (65, 96, 33, Q::Affine(8, 32, F16Z)),
        (129, 384, 7, Q::Affine(4, 128, F16Z)),
        (301, 256, 17, Q::Affine(4, 32, F32P)),
        (65, 96, 33, Q::Affine(8, 32, F32P)),
        (129, 160, 9, Q::Affine(8, 16, F32P)),
        (131, 160, 9, Q::Fp8),
    ] {
        // Strided f32 input rows: odd strides take the scalar conversion, multiples of 4 the
        // float4 one.
        let xs = if matches!(quant, Q::Bf16) {
            k + 3
        } else {
            k + 4
        };
        let x = rand_vec(&mut r, t * xs, -2.0, 2.0);
        let w = rand_vec(&mut r, n * k, -1.0, 1.0);
        let s = stack(&g, &w, (1, n, k), quant);
        let dx = g.upload(&x).unwrap();
        let (xb, wb, y) = (
            g.zeros::<u16>(t * k).unwrap(),
            g.zeros::<u16>(n * k).unwrap(),
            g.zeros::<f32>(t * n).unwrap(),
        );
        gemm::rows_to_bf16(&g, dx.ptr(), xs, xb.ptr(), k, t).unwrap();
        let packed: Vec<f32> = (0..t)
            .flat_map(|i| x[i * xs..i * xs + k].to_vec())
            .collect();
        let got_xb: Vec<f32> = g
            .read(&xb, t * k)
            .unwrap()
            .iter()
            .map(|&b| bf16_to_f32(b))
            .collect();
        let want_xb: Vec<f32> = packed.iter().map(|&v| round_bf16(v)).collect();
        assert_eq!(got_xb, want_xb, "rows_to_bf16 {n}x{k}");
        let wptr = gemm::weights_bf16(&g, &s.m, &wb).unwrap();
        let got_w: Vec<f32> = if wptr == wb.ptr() {
            g.read(&wb, n * k)
                .unwrap()
                .iter()
                .map(|&b| bf16_to_f32(b))
                .collect()
        } else {
            s.wf.clone()
        };
        assert_eq!(got_w, s.wf, "weights_bf16 {n}x{k} {quant:?}");
        g.blas()
            .unwrap()
            .gemm(&g, wptr, xb.ptr(), y.ptr(), (n, k, t))
            .unwrap();
        let want = gemm_bf16(&packed, &s.wf, (n, k, t));
        assert_close(
            &format!("gemm {n}x{k} t{t} {quant:?}"),
            &g.read(&y, t * n).unwrap(),
            &want,
            1e-4,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_gemm_matches_cpu() {
    let g = gpu();
    let mut r = rng();
    // n even: the SwiGLU form reads each expert as [2I, K] with I = n / 2.
    for &(tokens, ks, experts, n, k, quant) in &[
        (37usize, 3usize, 5usize, 24usize, 64usize, Q::Bf16),
        (1, 2, 3, 18, 40, Q::Bf16),
        (200, 9, 33, 300, 128, Q::Affine(4, 64, MLX)),
        (70, 2, 4, 260, 96, Q::Affine(8, 32, MLX)),
        (9, 8, 257, 40, 256, Q::Affine(4, 128, MLX)),
        (150, 7, 17, 302, 128, Q::Affine(4, 64, F16Z)),
        (70, 2, 4, 260, 96, Q::Affine(8, 32, F16Z)),
        (31, 3, 5, 66, 256, Q::Affine(8, 128, F16Z)),
        (150, 7, 17, 302, 128, Q::Affine(4, 32, F32P)),
        (70, 2, 4, 260, 96, Q::Affine(8, 32, F32P)),
        (70, 2, 4, 260, 96, Q::Affine(8, 16, F32P)),
        (31, 3, 5, 66, 256, Q::Affine(4, 16, MLX)),
        (100, 8, 9, 202, 160, Q::Fp8),
    ] {
        let pairs = tokens * ks;
        let ids: Vec<i32> = (0..pairs)
            .map(|_| r.random_range(0..experts as i32))
            .collect();
        let x = rand_vec(&mut r, tokens * k, -2.0, 2.0);
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        let s = stack(&g, &w, (experts, n, k), quant);
        let mt = pf::max_tiles(pairs, experts, TILE_GEMM);
        let (di, order, tiles, nt) = (
            g.upload(&ids).unwrap(),
            g.zeros::<i32>(pairs).unwrap(),
            g.zeros::<i32>(3 * mt).unwrap(),
            g.zeros::<i32>(1).unwrap(),
        );
        pf::moe_group(
            &g,
            di.ptr(),
            pairs,
            experts,
            TILE_GEMM,
            order.ptr(),
            tiles.ptr(),
            nt.ptr(),
        )
        .unwrap();
        let xb = g.upload(&bf(&x)).unwrap();
        let gr = Grouped {
            order: order.ptr(),
            tiles: tiles.ptr(),
            n_tiles: nt.ptr(),
            tile: TILE_GEMM,
            max_tiles: mt,
            x_stride: k,
            x_div: ks,
        };
        let (dy, dh) = (
            g.zeros::<f32>(pairs * n).unwrap(),
            g.zeros::<u16>(pairs * n / 2).unwrap(),
        );
        gemm::grouped_gemm(&g, s.m, xb.ptr(), dy.ptr(), gr, false).unwrap();
        gemm::grouped_gemm(&g, s.m, xb.ptr(), dh.ptr(), gr, true).unwrap();
        let mut want = Vec::with_capacity(pairs * n);
        for (p, &e) in ids.iter().enumerate() {
            let xr = &x[(p / ks) * k..(p / ks + 1) * k];
            let we = &s.wf[e as usize * n * k..(e as usize + 1) * n * k];
            want.extend(gemm_bf16(xr, we, (n, k, 1)));
        }
        let name = format!("grouped {tokens}x{ks} e{experts} {n}x{k} {quant:?}");
        assert_close(&name, &g.read(&dy, pairs * n).unwrap(), &want, 1e-4);
        let i = n / 2;
        let got_h: Vec<f32> = g
            .read(&dh, pairs * i)
            .unwrap()
            .iter()
            .map(|&b| bf16_to_f32(b))
            .collect();
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for p in 0..pairs {
            for j in 0..i {
                let h = swiglu_bf16(want[p * n + j], want[p * n + i + j]);
                let got = got_h[p * i + j];
                let tol = h.abs() / 128.0 + 1e-4 * scale * scale;
                assert!(
                    (got - h).abs() <= tol,
                    "{name} swiglu pair {p} out {j}: {got} vs {h}"
                );
            }
        }
    }
}
