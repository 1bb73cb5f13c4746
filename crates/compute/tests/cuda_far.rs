//! Far expert stacks (`ops::Far`): slot ids from `split` on read their matrices from a second
//! stack in pinned host memory, over PCIe. Results must be bitwise those of the same matrices
//! read from one device stack, for bf16 and affine weights (MLX's parameters, or f16 scales and
//! zero points), plain and SwiGLU products, odd sizes. Needs a GPU: `#[ignore]`d here, run by
//! `scripts/gpu-tests.sh`.

mod common;

use common::{gpu, rand_vec, rng, Affine};
use deltamoe_compute::cuda::host::HostBuf;
use deltamoe_compute::cuda::ops::{self, AffineParams, Far, Matvec, Slots, WeightFormat};
use deltamoe_compute::cuda::Gpu;
use deltamoe_compute::dtype::f32_to_bf16;

/// Matrix `e` of a stack of `per`-element matrices.
fn pick<T: Copy>(v: &[T], e: usize, per: usize) -> &[T] {
    &v[e * per..(e + 1) * per]
}

/// The near stack: `cached` experts' matrices in cache order; the far stack: all of them.
/// Returns ids for `slots` slots (through the cache when cached, else split + e) and the
/// plain ids (expert e at index e) for the reference run.
fn ids(slots: usize, experts: usize, cached: &[usize]) -> (Vec<i32>, Vec<i32>) {
    let split = cached.len();
    let plain: Vec<i32> = (0..slots).map(|s| ((s * 5 + 2) % experts) as i32).collect();
    let far = plain
        .iter()
        .map(|&e| match cached.iter().position(|&c| c == e as usize) {
            Some(c) => c as i32,
            None => (split + e as usize) as i32,
        })
        .collect();
    (far, plain)
}

fn run(g: &Gpu, m: Matvec, x: u64, sl: Slots, out: usize, swiglu: bool) -> Vec<f32> {
    let y = g.zeros::<f32>(sl.n * out).unwrap();
    if swiglu {
        ops::matvec_swiglu(g, m, x, y.ptr(), sl).unwrap();
    } else {
        ops::matvec(g, m, x, y.ptr(), sl).unwrap();
    }
    g.read(&y, sl.n * out).unwrap()
}

fn bitwise(name: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{name}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{name}: element {i}: {x} vs {y}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn far_stacks_read_over_pcie_give_identical_results() {
    let g = gpu();
    let mut r = rng();
    let cached = [3usize, 0];
    for &(n, k, slots, experts) in &[(66usize, 128usize, 7usize, 5usize), (130, 256, 3, 4)] {
        let (far_ids, plain_ids) = ids(slots, experts, &cached);
        let (df, dp) = (g.upload(&far_ids).unwrap(), g.upload(&plain_ids).unwrap());
        let x = g.upload(&rand_vec(&mut r, slots * k, -1.0, 1.0)).unwrap();
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        // bf16.
        let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
        let near: Vec<u16> = cached
            .iter()
            .flat_map(|&e| pick(&bits, e, n * k).to_vec())
            .collect();
        let (all, near, host) = (
            g.upload(&bits).unwrap(),
            g.upload(&near).unwrap(),
            HostBuf::from_slice(&g, &bits).unwrap(),
        );
        let far = Far {
            w: host.ptr(),
            scales: 0,
            biases: 0,
            split: cached.len(),
        };
        let m = |w: u64| Matvec {
            w,
            n,
            k,
            bias: 0,
            format: WeightFormat::Bf16,
        };
        for swiglu in [false, true] {
            let out = if swiglu { n / 2 } else { n };
            let want = run(
                &g,
                m(all.ptr()),
                x.ptr(),
                Slots::experts(slots, dp.ptr(), k, 1),
                out,
                swiglu,
            );
            let sl = Slots::experts(slots, df.ptr(), k, 1).with_far(Some(far));
            let got = run(&g, m(near.ptr()), x.ptr(), sl, out, swiglu);
            bitwise(&format!("bf16 {n}x{k} swiglu {swiglu}"), &got, &want);
        }
        // Affine 4 and 8 bits, both kinds of parameters.
        let (mlx, f16z) = (AffineParams::Bf16, AffineParams::F16Zero);
        for (bits, group, params) in [
            (4u32, 64usize, mlx),
            (8, 32, mlx),
            (4, 64, f16z),
            (8, 32, f16z),
        ] {
            let a = Affine::with_params(&g, &w, k, (group, bits), params);
            let (q, sb, bb) = (&a.q, &a.scales, &a.biases);
            let (wpm, gpm) = (n * k * bits as usize / 32, n * k / group);
            let sub = |v: &[u16], per| -> Vec<u16> {
                cached
                    .iter()
                    .flat_map(|&e| pick(v, e, per).to_vec())
                    .collect()
            };
            let nw: Vec<u32> = cached
                .iter()
                .flat_map(|&e| pick(&q.words, e, wpm).to_vec())
                .collect();
            let dev = (&a.dw, &a.ds, &a.db);
            let near = (
                g.upload(&nw).unwrap(),
                g.upload(&sub(sb, gpm)).unwrap(),
                g.upload(&sub(bb, gpm)).unwrap(),
            );
            let host = (
                HostBuf::from_slice(&g, &q.words).unwrap(),
                HostBuf::from_slice(&g, sb).unwrap(),
                HostBuf::from_slice(&g, bb).unwrap(),
            );
            let far = Far {
                w: host.0.ptr(),
                scales: host.1.ptr(),
                biases: host.2.ptr(),
                split: cached.len(),
            };
            let m = |w: u64, s: u64, b: u64| Matvec {
                w,
                n,
                k,
                bias: 0,
                format: WeightFormat::Affine {
                    bits,
                    group,
                    scales: s,
                    biases: b,
                    params,
                },
            };
            for swiglu in [false, true] {
                let out = if swiglu { n / 2 } else { n };
                let all = m(dev.0.ptr(), dev.1.ptr(), dev.2.ptr());
                let want = run(
                    &g,
                    all,
                    x.ptr(),
                    Slots::experts(slots, dp.ptr(), k, 1),
                    out,
                    swiglu,
                );
                let sl = Slots::experts(slots, df.ptr(), k, 1).with_far(Some(far));
                let nm = m(near.0.ptr(), near.1.ptr(), near.2.ptr());
                let got = run(&g, nm, x.ptr(), sl, out, swiglu);
                bitwise(
                    &format!("{bits}-bit {n}x{k} {params:?} swiglu {swiglu}"),
                    &got,
                    &want,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_buffers_copy_both_ways() {
    let g = gpu();
    let data: Vec<i32> = (0..1000).map(|i| i * 3 - 7).collect();
    let d = g.upload(&data).unwrap();
    let h: HostBuf<i32> = HostBuf::zeros(&g, 1000).unwrap();
    g.download_to(&d, &h, 1000).unwrap();
    g.sync().unwrap();
    assert_eq!(h.as_slice(), &data[..]);
    g.set_i32(&d, 5, 42).unwrap();
    assert_eq!(g.read(&d, 6).unwrap()[5], 42);
    assert!(g.set_i32(&d, 1000, 1).is_err());
}
