//! The FP8 kernels (fp8.cu: slots by id, a batch of rows through one matrix, SwiGLU forms)
//! against the CPU's `fp8_matmul` on random e4m3 codes (every byte but the two NaNs) with random
//! block scales, odd row counts and K with a partial last block (K = 2,320: more than one round
//! of a lane's loads in flight). The device holds each row's
//! copy of its block scales, as the model's upload writes them. Both sides sum f32 products in
//! other orders: 1e-5 of the largest output. Needs a GPU: `#[ignore]`d here, run by
//! `scripts/gpu-tests.sh`.

mod common;

use common::{assert_close, gpu, rand_vec, rng};
use deltamoe_compute::cpu::act::sigmoid;
use deltamoe_compute::cpu::fp8_matmul;
use deltamoe_compute::cuda::ops::{self, Matvec, Slots, WeightFormat};
use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{DType, Fp8Weight};
use rand::Rng;

const BLOCK: usize = 128;

/// `experts` random `[n, k]` FP8 matrices.
fn weights(r: &mut impl Rng, experts: usize, n: usize, k: usize) -> Vec<Fp8Weight> {
    (0..experts)
        .map(|_| {
            let codes: Vec<u8> = (0..n * k)
                .map(|_| r.random_range(0u8..=254))
                .map(|b| if b == 0x7f { 0x7e } else { b })
                .collect();
            let grid = n.div_ceil(BLOCK) * k.div_ceil(BLOCK);
            let scales = rand_vec(r, grid, 1e-3, 4e-3);
            Fp8Weight::new(
                n,
                k,
                [BLOCK, BLOCK],
                Bytes::from_vec(codes),
                scales,
                DType::F32,
            )
            .unwrap()
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_products_match_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(n, k, experts, slots) in &[
        (37usize, 200usize, 3usize, 2usize),
        (160, 48, 1, 5),
        (258, 392, 2, 3),
        (96, 520, 4, 9),
        (70, 2320, 3, 4),
    ] {
        let ws = weights(&mut r, experts, n, k);
        let codes: Vec<u8> = ws.iter().flat_map(|w| w.codes().to_vec()).collect();
        let scales: Vec<f32> = ws
            .iter()
            .flat_map(|w| {
                (0..n)
                    .flat_map(|row| w.row_scales(row).to_vec())
                    .collect::<Vec<_>>()
            })
            .collect();
        let (dw, ds) = (g.upload(&codes).unwrap(), g.upload(&scales).unwrap());
        let m = Matvec {
            w: dw.ptr(),
            n,
            k,
            bias: 0,
            format: WeightFormat::Fp8 {
                group: BLOCK,
                scales: ds.ptr(),
            },
        };
        let x = rand_vec(&mut r, slots * k, -1.0, 1.0);
        let ids: Vec<i32> = (0..slots).map(|s| ((s * 5 + 1) % experts) as i32).collect();
        let (dx, di) = (g.upload(&x).unwrap(), g.upload(&ids).unwrap());
        let cpu = |e: usize, s: usize| {
            let mut y = vec![0.0; n];
            fp8_matmul(&x[s * k..(s + 1) * k], 1, &ws[e], &mut y);
            y
        };
        let swiglu = |y: &[f32]| -> Vec<f32> {
            let i = n / 2;
            (0..i).map(|j| y[j] * sigmoid(y[j]) * y[i + j]).collect()
        };
        // Slots picking experts by id; a batch of rows through matrix 0.
        let by_id: Vec<f32> = (0..slots).flat_map(|s| cpu(ids[s] as usize, s)).collect();
        let rows: Vec<f32> = (0..slots).flat_map(|s| cpu(0, s)).collect();
        for (form, sl, want) in [
            ("slots", Slots::experts(slots, di.ptr(), k, 1), &by_id),
            ("rows", Slots::rows(slots, k), &rows),
        ] {
            let dy = g.zeros::<f32>(slots * n).unwrap();
            ops::matvec(&g, m, dx.ptr(), dy.ptr(), sl).unwrap();
            let name = format!("fp8 {form} {n}x{k} ({slots} slots)");
            assert_close(&name, &g.read(&dy, slots * n).unwrap(), want, 1e-5);
            if n % 2 == 0 {
                let i = n / 2;
                let dh = g.zeros::<f32>(slots * i).unwrap();
                ops::matvec_swiglu(&g, m, dx.ptr(), dh.ptr(), sl).unwrap();
                let want: Vec<f32> = want.chunks(n).flat_map(swiglu).collect();
                assert_close(
                    &format!("{name} swiglu"),
                    &g.read(&dh, slots * i).unwrap(),
                    &want,
                    1e-5,
                );
            }
        }
    }
}
