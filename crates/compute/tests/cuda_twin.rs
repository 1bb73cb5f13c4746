//! The host twins of the decode expert kernels (`cpu::gpu_twin`) against the kernels: every
//! output of `ops::matvec` and `ops::matvec_swiglu` on expert stacks with slot ids (the decode
//! expert path: `matvec_bf16`, `matvec_swiglu_bf16`, `matvec_affine`, `matvec_swiglu_affine`)
//! must equal, bit for bit, `matvec_rows` / `swiglu_rows` on that slot's expert and input.
//! Formats: bf16 with K % 8 = 0 and odd K, affine 2/4/8 bits × group 32/64/128 with MLX's bf16
//! parameters, and with f16 scales and zero points; odd N and I;
//! small launches (2 rows per warp) and large ones (4: `ops::affine_rows_per_warp`); inputs at
//! two scales, the larger driving gate values past silu's cutoffs. Needs a GPU: `#[ignore]`d
//! here, run by `scripts/gpu-tests.sh`.

mod common;

use common::{f16_zero_params, f32_halves, gpu, rand_vec, rng};
use deltamoe_compute::cpu::gpu_twin::{matvec_rows, swiglu_rows, TwinInput, TwinMat};
use deltamoe_compute::cpu::quant::quantize;
use deltamoe_compute::cuda::ops::{
    self, affine_rows_per_warp, AffineParams, Matvec, Slots, WeightFormat,
};
use deltamoe_compute::cuda::Gpu;
use deltamoe_compute::dtype::f32_to_bf16;
use rand::Rng;

/// An affine format: bits, group, parameters.
type AffineFmt = (u32, usize, AffineParams);

/// A stack of `experts` matrices `[n, k]` on the host, bf16 or affine.
struct Stack {
    n: usize,
    k: usize,
    affine: Option<AffineFmt>,
    bf16: Vec<u16>,
    words: Vec<u32>,
    scales: Vec<u16>,
    biases: Vec<u16>,
}

impl Stack {
    fn new(
        r: &mut impl Rng,
        experts: usize,
        n: usize,
        k: usize,
        affine: Option<AffineFmt>,
    ) -> Stack {
        let w = rand_vec(r, experts * n * k, -1.0, 1.0);
        let bf = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f32_to_bf16(x)).collect() };
        let mut s = Stack {
            n,
            k,
            affine,
            bf16: Vec::new(),
            words: Vec::new(),
            scales: Vec::new(),
            biases: Vec::new(),
        };
        match affine {
            None => s.bf16 = bf(&w),
            Some((bits, group, params)) => {
                let q = quantize(&w, k, group, bits).unwrap();
                (s.scales, s.biases) = match params {
                    AffineParams::Bf16 => (bf(&q.scales), bf(&q.biases)),
                    AffineParams::F16Zero => f16_zero_params(r, q.scales.len(), bits),
                    AffineParams::F32 => (f32_halves(&q.scales), f32_halves(&q.biases)),
                };
                s.words = q.words;
            }
        }
        s
    }

    /// Expert `e` as the twin reads it.
    fn expert(&self, e: usize) -> TwinMat<'_> {
        fn pick<T>(v: &[T], e: usize, per: usize) -> &[T] {
            &v[e * per..(e + 1) * per]
        }
        match self.affine {
            None => TwinMat::Bf16(pick(&self.bf16, e, self.n * self.k)),
            Some((bits, group, params)) => {
                let (wpm, gpm) = (
                    self.n * self.k * bits as usize / 32,
                    self.n * self.k / group * params.bytes() / 2,
                );
                TwinMat::Affine {
                    words: pick(&self.words, e, wpm),
                    scales: pick(&self.scales, e, gpm),
                    biases: pick(&self.biases, e, gpm),
                    bits,
                    group,
                    params,
                }
            }
        }
    }

    /// `(kernel output, twin output)` for `slots` slots through the stack: slot s uses expert
    /// `ids[s]` and input row `s / x_div` (rows `stride` floats apart).
    fn outputs(
        &self,
        g: &Gpu,
        ids: &[i32],
        x: &[f32],
        stride: usize,
        x_div: usize,
        swiglu: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let slots = ids.len();
        let out = if swiglu { self.n / 2 } else { self.n };
        let dev_ids = g.upload(ids).unwrap();
        let dx = g.upload(x).unwrap();
        let y = g.zeros::<f32>(slots * out).unwrap();
        let dense = self.affine.is_none().then(|| g.upload(&self.bf16).unwrap());
        let quant = self.affine.map(|_| {
            (
                g.upload(&self.words).unwrap(),
                g.upload(&self.scales).unwrap(),
                g.upload(&self.biases).unwrap(),
            )
        });
        let (w, format) = match (&dense, &quant, self.affine) {
            (Some(d), _, _) => (d.ptr(), WeightFormat::Bf16),
            (None, Some((wq, sc, bi)), Some((bits, group, params))) => (
                wq.ptr(),
                WeightFormat::Affine {
                    bits,
                    group,
                    scales: sc.ptr(),
                    biases: bi.ptr(),
                    params,
                },
            ),
            _ => unreachable!("a stack is bf16 or affine"),
        };
        let m = Matvec {
            w,
            n: self.n,
            k: self.k,
            bias: 0,
            format,
        };
        let sl = Slots::experts(slots, dev_ids.ptr(), stride, x_div);
        if swiglu {
            ops::matvec_swiglu(g, m, dx.ptr(), y.ptr(), sl).unwrap();
        } else {
            ops::matvec(g, m, dx.ptr(), y.ptr(), sl).unwrap();
        }
        let got = g.read(&y, slots * out).unwrap();
        let mut want = vec![0.0f32; slots * out];
        for (s, ys) in want.chunks_exact_mut(out).enumerate() {
            let m = self.expert(ids[s] as usize);
            let row = (s / x_div) * stride;
            let xin = TwinInput::new(&x[row..row + self.k], &m).unwrap();
            if swiglu {
                swiglu_rows(&m, out, &xin, 0..out, ys).unwrap();
            } else {
                matvec_rows(&m, &xin, 0..out, ys).unwrap();
            }
        }
        (got, want)
    }
}

fn bitwise(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}");
    let differ = |(_, (a, b)): &(usize, (&f32, &f32))| a.to_bits() != b.to_bits();
    let bad = got.iter().zip(want).enumerate().filter(differ).count();
    if let Some((i, (a, b))) = got.iter().zip(want).enumerate().find(differ) {
        panic!(
            "{name}: {bad} of {} differ; first, element {i}: gpu {a:e} vs twin {b:e}",
            got.len()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_twins_match_the_decode_expert_kernels_bitwise() {
    let g = gpu();
    let mut r = rng();
    let experts = 3;
    let mut formats: Vec<(Option<AffineFmt>, usize)> = vec![(None, 264), (None, 77)];
    for params in [AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32] {
        for bits in [2u32, 4, 8] {
            for group in [32usize, 64, 128] {
                formats.push((Some((bits, group, params)), 384));
            }
        }
    }
    // (rows N for matvec — odd; I for SwiGLU — odd, slots, x_div): the second launches have
    // N·slots ≥ 16384, so affine launches take 4 rows per warp.
    let launches = [(67usize, 33usize, 5usize, 2usize), (2051, 1027, 8, 4)];
    for &(fmt, k) in &formats {
        for &(n, i, slots, x_div) in &launches {
            let stride = k.next_multiple_of(4) + 4;
            let ids: Vec<i32> = (0..slots).map(|s| ((s * 2 + 1) % experts) as i32).collect();
            for scale in [1.0f32, 8.0] {
                let x = rand_vec(&mut r, slots.div_ceil(x_div) * stride, -scale, scale);
                for swiglu in [false, true] {
                    let rows = if swiglu { 2 * i } else { n };
                    let st = Stack::new(&mut r, experts, rows, k, fmt);
                    let rpw = affine_rows_per_warp(rows * slots);
                    let name = format!("{fmt:?} K {k} rows {rows} slots {slots} x·{scale} swiglu {swiglu} (affine rows/warp {rpw})");
                    let (got, want) = st.outputs(&g, &ids, &x, stride, x_div, swiglu);
                    bitwise(&name, &got, &want);
                    eprintln!("{name}: {} outputs equal", got.len());
                }
            }
        }
    }
}
