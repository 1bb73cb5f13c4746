//! The matrix-vector kernels (bf16 and MLX affine, slots of experts, batches of rows on CUDA
//! cores and tensor cores) against the CPU on random inputs with odd sizes. Needs a GPU:
//! `#[ignore]`d here, run by `scripts/gpu-tests.sh` on the GPU machine.

mod common;

use common::{assert_close, gpu, rand_vec, rng, Affine};
use deltamoe_compute::cpu::act::sigmoid;
use deltamoe_compute::cuda::dispatch;
use deltamoe_compute::cuda::ops::{self, AffineParams, Matvec, Slots, WeightFormat};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};
use deltamoe_compute::{cpu, DType, Tensor};

#[test]
#[ignore = "needs a CUDA GPU"]
fn matvec_and_swiglu_match_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(n, k, slots, experts) in &[
        (37usize, 64usize, 1usize, 1usize),
        (129, 19, 3, 5),
        (33, 200, 2, 4),
        (8, 4096, 1, 1),
    ] {
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
        let x = rand_vec(&mut r, slots * k, -1.0, 1.0);
        let bias = rand_vec(&mut r, experts * n, -1.0, 1.0);
        let ids: Vec<i32> = (0..slots).map(|s| ((s * 7 + 3) % experts) as i32).collect();
        let (dw, dx, db, di) = (
            g.upload(&bits).unwrap(),
            g.upload(&x).unwrap(),
            g.upload(&bias).unwrap(),
            g.upload(&ids).unwrap(),
        );
        let dy = g.zeros::<f32>(slots * n).unwrap();
        let m = Matvec {
            w: dw.ptr(),
            n,
            k,
            bias: db.ptr(),
            format: WeightFormat::Bf16,
        };
        ops::matvec(
            &g,
            m,
            dx.ptr(),
            dy.ptr(),
            Slots::experts(slots, di.ptr(), k, 1),
        )
        .unwrap();
        let got = g.read(&dy, slots * n).unwrap();
        let mut want = vec![0.0; slots * n];
        for s in 0..slots {
            let e = ids[s] as usize;
            let t = Tensor::from_half_bits(
                DType::BF16,
                vec![n, k],
                bits[e * n * k..(e + 1) * n * k].to_vec(),
            );
            cpu::matmul(&x[s * k..(s + 1) * k], 1, &t, &mut want[s * n..(s + 1) * n]);
            for i in 0..n {
                want[s * n + i] += bias[e * n + i];
            }
        }
        assert_close(&format!("matvec {n}x{k} slots {slots}"), &got, &want, 1e-5);

        // SwiGLU over [gate | up] halves of 2I = n rows (n even only).
        if n % 2 == 0 || experts == 1 {
            let i = n / 2;
            let dh = g.zeros::<f32>(slots * i).unwrap();
            let m = Matvec {
                n: 2 * i,
                bias: 0,
                ..m
            };
            ops::matvec_swiglu(
                &g,
                m,
                dx.ptr(),
                dh.ptr(),
                Slots::experts(slots, di.ptr(), k, 1),
            )
            .unwrap();
            let got = g.read(&dh, slots * i).unwrap();
            let mut want = vec![0.0; slots * i];
            for s in 0..slots {
                let e = ids[s] as usize;
                let base = e * n * k;
                let row = |rr: usize| -> f32 {
                    (0..k)
                        .map(|kk| bf16_to_f32(bits[base + rr * k + kk]) * x[s * k + kk])
                        .sum()
                };
                for j in 0..i {
                    let (gv, uv) = (row(j), row(i + j));
                    want[s * i + j] = gv * sigmoid(gv) * uv;
                }
            }
            assert_close(&format!("swiglu {i}x{k} slots {slots}"), &got, &want, 1e-4);
        }
    }
}

/// Affine-quantized matvec and SwiGLU (slots with ids: qmatvec.cu, 2 rows a warp, and 4 for
/// the launch of 16,400 rows) against the CPU's quantized matmul on the same words and the
/// parameters the kernels apply, for MLX's bf16 parameters and f16 scales and zero points.
#[test]
#[ignore = "needs a CUDA GPU"]
fn affine_matvec_matches_cpu() {
    for params in [AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32] {
        affine_matvec_case(params);
    }
}

fn affine_matvec_case(params: AffineParams) {
    use deltamoe_compute::cpu::quant::qmatmul;
    let g = gpu();
    // The build for the parameters loads on request (else on the first launch that needs it).
    g.kernels().prepare(params).unwrap();
    let mut r = rng();
    for &(bits, group, n, k, experts, slots) in &[
        (4u32, 64usize, 37usize, 256usize, 3usize, 2usize),
        (8, 32, 18, 96, 1, 1),
        (2, 128, 9, 384, 2, 3),
        (4, 32, 64, 2048, 1, 1),
        (2, 32, 11, 96, 1, 2),
        (8, 64, 4100, 128, 2, 4),
        (4, 16, 21, 48, 2, 3),
        (8, 16, 13, 80, 1, 2),
    ] {
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        let a = Affine::with_params(&g, &w, k, (group, bits), params);
        let x = rand_vec(&mut r, slots * k, -1.0, 1.0);
        let ids: Vec<i32> = (0..slots).map(|s| ((s * 5 + 1) % experts) as i32).collect();
        let (dx, di) = (g.upload(&x).unwrap(), g.upload(&ids).unwrap());
        let m = a.matvec(n, k);
        let dy = g.zeros::<f32>(slots * n).unwrap();
        ops::matvec(
            &g,
            m,
            dx.ptr(),
            dy.ptr(),
            Slots::experts(slots, di.ptr(), k, 1),
        )
        .unwrap();
        let mut want = vec![0.0; slots * n];
        for s in 0..slots {
            qmatmul(
                &x[s * k..(s + 1) * k],
                1,
                &a.weight(ids[s] as usize, n),
                &mut want[s * n..(s + 1) * n],
            );
        }
        assert_close(
            &format!("affine {bits}-bit g{group} {n}x{k} {params:?}"),
            &g.read(&dy, slots * n).unwrap(),
            &want,
            1e-4,
        );
        if n % 2 == 0 {
            let i = n / 2;
            let dh = g.zeros::<f32>(slots * i).unwrap();
            ops::matvec_swiglu(
                &g,
                m,
                dx.ptr(),
                dh.ptr(),
                Slots::experts(slots, di.ptr(), k, 1),
            )
            .unwrap();
            let want: Vec<f32> = (0..slots)
                .flat_map(|s| {
                    let y = &want[s * n..(s + 1) * n];
                    (0..i)
                        .map(move |j| y[j] * sigmoid(y[j]) * y[i + j])
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_close(
                &format!("affine swiglu {bits}-bit {i}x{k} {params:?}"),
                &g.read(&dh, slots * i).unwrap(),
                &want,
                1e-4,
            );
        }
    }
}

/// The slot forms of the matvec kernels: a batch of rows through one matrix (no ids; 5 to 530
/// rows: more than one 32-row group, split-K, wide — with and without K split over blocks —
/// and GEMM tensor-core forms, and the CUDA-core rows kernels for 2-bit weights and groups of
/// 16) and the experts
/// of several tokens (ids, groups of `x_div` slots per input row), for bf16 and 4/8-bit affine
/// weights with MLX's parameters or f16 scales and zero points (and 2-bit ones with the latter),
/// plus the SwiGLU form of the row batch. The tensor-core row kernels carry each input as bf16
/// hi + lo (16 significant bits, relative error ≤ 2⁻¹⁸ per input) with f32 accumulation, hence
/// 3e-5 of the largest output rather than the 1e-5 of the f32 kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn matvec_slot_forms_match_cpu() {
    // 5 rows take the split-K tensor-core form, 12 to 100 the wide form (blocks of 1 to 4 tiles
    // of 8 rows), 530 the GEMM form.
    for rows in [5, 12, 19, 37, 100, 530] {
        slot_forms(rows);
    }
}

fn slot_forms(rows: usize) {
    let g = gpu();
    let mut r = rng();
    // 150 outputs: two of the wide form's 128-row blocks, the second partial.
    let (n, k, experts, per_row) = (150usize, 1024usize, 3usize, 2usize);
    let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
    let x = rand_vec(&mut r, rows * k, -1.0, 1.0);
    let ids: Vec<i32> = (0..rows * per_row)
        .map(|s| ((s * 2 + 1) % experts) as i32)
        .collect();
    let (dx, di) = (g.upload(&x).unwrap(), g.upload(&ids).unwrap());
    let bf = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f32_to_bf16(x)).collect() };
    let bits16 = bf(&w);
    let dw = g.upload(&bits16).unwrap();
    let dense: Vec<f32> = bits16.iter().map(|&b| bf16_to_f32(b)).collect();
    let mut forms = vec![(
        "bf16".to_string(),
        dense,
        Matvec {
            w: dw.ptr(),
            n,
            k,
            bias: 0,
            format: WeightFormat::Bf16,
        },
    )];
    let mut keep = Vec::new();
    // Groups within a stage of the wide form (4-bit: 128 inputs) and across stages (8-bit: 64);
    // 2 bits: the CUDA-core rows kernels (matvec_rows.cu).
    let (mlx, f16z, f32p) = (AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32);
    for (bits, group, params) in [
        (4u32, 64usize, mlx),
        (8, 128, mlx),
        (4, 32, mlx),
        (4, 128, mlx),
        (8, 32, mlx),
        (4, 64, f16z),
        (8, 128, f16z),
        (4, 32, f16z),
        (8, 32, f16z),
        (2, 64, f16z),
        (4, 16, mlx),
        (8, 16, f16z),
        (4, 64, f32p),
        (8, 128, f32p),
        (4, 32, f32p),
        (8, 32, f32p),
        (8, 16, f32p),
    ] {
        let a = Affine::with_params(&g, &w, k, (group, bits), params);
        // Dequantized weights as the affine kernels see them.
        forms.push((
            format!("affine {bits}-bit g{group} {params:?}"),
            a.dequant(),
            a.matvec(n, k),
        ));
        keep.push(a);
    }
    let dot = |wt: &[f32], e: usize, row: usize, xr: &[f32]| -> f32 {
        (0..k).map(|c| wt[(e * n + row) * k + c] * xr[c]).sum()
    };
    // Room for the wide form's staged inputs and partial sums: K split over blocks.
    let ws = g
        .zeros::<f32>(rows * 2 * n * k / 32 + 2 * rows * k)
        .unwrap();
    for (name, wt, m) in &forms {
        let dy = g.zeros::<f32>(rows * per_row * n).unwrap();
        let split = Slots::rows(rows, k).with_ws(ws.ptr(), ws.len());
        // Room for the staged inputs alone: K in one block.
        let staged = dispatch::wide_staged_words(m, rows);
        let whole = Slots::rows(rows, k).with_ws(ws.ptr(), staged);
        for (form, sl) in [("rows", whole), ("rows split-K", split)] {
            ops::matvec(&g, *m, dx.ptr(), dy.ptr(), sl).unwrap();
            let want: Vec<f32> = (0..rows * n)
                .map(|i| dot(wt, 0, i % n, &x[i / n * k..(i / n + 1) * k]))
                .collect();
            assert_close(
                &format!("{name} {form}"),
                &g.read(&dy, rows * n).unwrap(),
                &want,
                3e-5,
            );
            let i_half = n / 2;
            let sw = Matvec { bias: 0, ..*m };
            ops::matvec_swiglu(&g, sw, dx.ptr(), dy.ptr(), sl).unwrap();
            let want: Vec<f32> = (0..rows * i_half)
                .map(|i| {
                    let (b, j) = (i / i_half, i % i_half);
                    let xr = &x[b * k..(b + 1) * k];
                    let (gv, uv) = (dot(wt, 0, j, xr), dot(wt, 0, i_half + j, xr));
                    gv * sigmoid(gv) * uv
                })
                .collect();
            let got = g.read(&dy, rows * i_half).unwrap();
            assert_close(&format!("{name} swiglu {form}"), &got, &want, 3e-5);
        }
        let sl = Slots::experts(rows * per_row, di.ptr(), k, per_row);
        ops::matvec(&g, *m, dx.ptr(), dy.ptr(), sl).unwrap();
        let want: Vec<f32> = (0..rows * per_row * n)
            .map(|i| {
                let s = i / n;
                let xr = &x[s / per_row * k..(s / per_row + 1) * k];
                dot(wt, ids[s] as usize, i % n, xr)
            })
            .collect();
        let got = g.read(&dy, rows * per_row * n).unwrap();
        assert_close(&format!("{name} experts per row"), &got, &want, 1e-5);
    }
}

/// One input row through a 4- or 8-bit affine matrix goes to the single-row tensor-core kernel
/// (mma_vec.cu): against the CPU's quantized matmul on the same words, odd N (one to four 16-row
/// tiles per block; staged in blocks of 8 or 16 warps, streamed and ring launches), each group
/// size the kernel takes, with a bias. Like the multi-row tensor-core forms, the input enters as
/// bf16 hi + lo (16 significant bits, relative error ≤ 2⁻¹⁸ per input) with f32 accumulation:
/// 3e-5 of the largest output.
/// An 8-bit code enters as two 4-bit digits meeting x and 16·x (exact scalings): the same bound.
/// MLX's bf16 parameters and f16 scales and zero points (the reference on the parameters the
/// kernels apply, s and −z·s).
#[test]
#[ignore = "needs a CUDA GPU"]
fn single_row_on_tensor_cores_matches_cpu() {
    for params in [AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32] {
        single_row_case(params);
    }
}

fn single_row_case(params: AffineParams) {
    use deltamoe_compute::cpu::quant::qmatmul;
    use deltamoe_compute::cuda::vec;
    let g = gpu();
    let mut r = rng();
    let cases = [
        (32usize, 37usize, 256usize),
        (64, 130, 2048),
        (128, 1001, 4096),
        (64, 16, 8192),
        (128, 5, 384),
        (64, 9001, 256),
        (32, 17003, 128),
        (32, 12352, 2048),
        (64, 67000, 128),
        // More row tiles than resident blocks with whole 16-byte scale rows: the ring kernel.
        (64, 20011, 1024),
        (128, 30001, 2048),
        // 8-bit: an MoE router with its shared-expert gate row (mlx-lm's 8 bits, group 64).
        (64, 257, 2048),
        // Groups of 16 (8-bit codes with f32 parameters only): streamed, staged, ring.
        (16, 37, 256),
        (16, 1001, 2048),
        (16, 20011, 1024),
    ];
    for (bits, &(group, n, k)) in [4, 8]
        .into_iter()
        .flat_map(|b| cases.iter().map(move |c| (b, c)))
    {
        let w = rand_vec(&mut r, n * k, -1.0, 1.0);
        let a = Affine::with_params(&g, &w, k, (group, bits), params);
        let x = rand_vec(&mut r, k, -1.0, 1.0);
        let bias = rand_vec(&mut r, n, -1.0, 1.0);
        let (dx, dbias) = (g.upload(&x).unwrap(), g.upload(&bias).unwrap());
        let m = Matvec {
            bias: dbias.ptr(),
            ..a.matvec(n, k)
        };
        // 4-bit cases are taken in groups of 32 to 128; 8-bit ones with groups of 32 or 64 (16
        // with f32 parameters) and up to 4096 inputs.
        let taken = vec::takes(&m, &Slots::one());
        let g16 = group == 16;
        let want = match bits {
            4 => !g16,
            _ => group <= 64 && k <= 4096 && (!g16 || params == AffineParams::F32),
        };
        assert_eq!(taken, want, "{bits}-bit g{group} {n}x{k}");
        if !taken {
            continue;
        }
        let dy = g.zeros::<f32>(n).unwrap();
        ops::matvec(&g, m, dx.ptr(), dy.ptr(), Slots::one()).unwrap();
        let mut want = vec![0.0; n];
        qmatmul(&x, 1, &a.weight(0, n), &mut want);
        for (o, b) in want.iter_mut().zip(&bias) {
            *o += b;
        }
        let name = format!("single-row {bits}-bit g{group} {n}x{k} {params:?}");
        assert_close(&name, &g.read(&dy, n).unwrap(), &want, 3e-5);
    }
}

/// The single-row kernel's fused input norm, residual add and GDN conv step (`VecIo`) against the
/// separate launches they replace (add_rmsnorm, matvec, the add, gdn_conv_step), staged, ring
/// and streamed launches: the normalized row within float rounding (its sum of squares runs in
/// another order), the outputs within the single-row kernel's 3e-5 of the largest (the norm's
/// factor scales the outputs rather than the staged input), the shifted conv state exactly.
#[test]
#[ignore = "needs a CUDA GPU"]
fn single_row_fused_norm_residual_and_conv_match_separate_launches() {
    use deltamoe_compute::cuda::ops::Batch;
    use deltamoe_compute::cuda::vec::{self, VecIo};
    let g = gpu();
    let mut r = rng();
    for &(bits, group, n, k, c, taps) in &[
        (4, 64usize, 12352usize, 2048usize, 8192usize, 4usize),
        (4, 64, 2051, 4096, 0, 0),
        (4, 64, 20011, 1024, 0, 0),
        (4, 128, 1001, 4096, 999, 3),
        (4, 32, 300, 256, 17, 1),
        // 8-bit: a router that normalizes (staged), a ring launch, a conv step.
        (8, 64, 257, 2048, 0, 0),
        (8, 64, 20011, 512, 0, 0),
        (8, 32, 301, 256, 17, 2),
    ] {
        let w = rand_vec(&mut r, n * k, -1.0, 1.0);
        let a = Affine::new(&g, &w, k, group, bits);
        let m = a.matvec(n, k);
        assert!(vec::takes(&m, &Slots::one()));
        let x = rand_vec(&mut r, k, -3.0, 3.0);
        let scale = rand_vec(&mut r, k, 0.5, 1.5);
        let res = rand_vec(&mut r, n, -1.0, 1.0);
        let cw = rand_vec(&mut r, c.max(1) * taps.max(1), -1.0, 1.0);
        let st = rand_vec(&mut r, (2 * taps.saturating_sub(1) * c).max(1), -1.0, 1.0);
        let up = |v: &[f32]| g.upload(v).unwrap();
        let (dx, dscale, dcw, slots) = (up(&x), up(&scale), up(&cw), g.upload(&[1i32]).unwrap());
        // Separate launches.
        let (normed, y) = (g.zeros::<f32>(k).unwrap(), up(&res));
        let (t, st_a, mixed_a) = (
            g.zeros::<f32>(n).unwrap(),
            up(&st),
            g.zeros::<f32>(c.max(1)).unwrap(),
        );
        ops::add_rmsnorm(&g, dx.ptr(), 0, dscale.ptr(), normed.ptr(), 1, k, 1e-6).unwrap();
        ops::matvec(&g, m, normed.ptr(), t.ptr(), Slots::one()).unwrap();
        let tv = g.read(&t, n).unwrap();
        let want_y: Vec<f32> = res.iter().zip(&tv).map(|(a, b)| a + b).collect();
        let dwant = up(&want_y);
        if c > 0 {
            let bt = Batch {
                rows: 1,
                slots: slots.ptr(),
            };
            ops::gdn_conv_step(
                &g,
                dwant.ptr(),
                n,
                st_a.ptr(),
                dcw.ptr(),
                mixed_a.ptr(),
                c,
                taps,
                bt,
            )
            .unwrap();
        }
        // One launch.
        let (normed_b, y_b) = (g.zeros::<f32>(k).unwrap(), y);
        let (st_b, mixed_b) = (up(&st), g.zeros::<f32>(c.max(1)).unwrap());
        let io = VecIo {
            norm: dscale.ptr(),
            normed: normed_b.ptr(),
            eps: 1e-6,
            accumulate: 1,
            slots: slots.ptr(),
            conv_state: st_b.ptr(),
            conv_w: dcw.ptr(),
            mixed: mixed_b.ptr(),
            conv_c: c as i32,
            conv_k: taps as i32,
            ..VecIo::default()
        };
        vec::matvec(&g, m, dx.ptr(), y_b.ptr(), io).unwrap();
        let name = format!("fused {bits}-bit g{group} {n}x{k} conv {c}x{taps}");
        let nv = g.read(&normed, k).unwrap();
        assert_close(
            &format!("{name} normed"),
            &g.read(&normed_b, k).unwrap(),
            &nv,
            1e-6,
        );
        assert_close(
            &format!("{name} y"),
            &g.read(&y_b, n).unwrap(),
            &want_y,
            3e-5,
        );
        if c > 0 {
            let (ma, mb) = (g.read(&mixed_a, c).unwrap(), g.read(&mixed_b, c).unwrap());
            assert_close(&format!("{name} mixed"), &mb, &ma, 3e-5);
            let len = st.len();
            let (sa, sb) = (g.read(&st_a, len).unwrap(), g.read(&st_b, len).unwrap());
            // Slot 1's newest entry holds this token's input (as y: float-close), the rest the
            // shifted entries (exact).
            let newest = len / 2 + taps.saturating_sub(2) * c;
            let name = format!("{name} state");
            if taps >= 2 {
                assert_close(&name, &sb[newest..], &sa[newest..], 3e-5);
            }
            let end = if taps >= 2 { newest } else { len };
            assert_eq!(sa[..end], sb[..end], "{name}");
        }
    }
}

/// The fused expert down projections + weighted combine into the residual against the expert
/// down matvec then `moe_combine` with accumulate: bitwise equal (the same dots in the same order,
/// the same sum), for each bit width, odd rows, two batch rows, a far stack, MLX's parameters
/// and f16 scales and zero points.
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_down_combine_equals_down_then_combine() {
    for params in [AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32] {
        down_combine_case(params);
    }
}

fn down_combine_case(params: AffineParams) {
    use deltamoe_compute::cuda::ops::Far;
    let g = gpu();
    let mut r = rng();
    let mut wide = false;
    for &(bits, group, n, k, experts, per_row, rows) in &[
        (4u32, 64usize, 37usize, 128usize, 6usize, 3usize, 2usize),
        (8, 32, 2048, 512, 5, 9, 1),
        (2, 128, 101, 256, 4, 11, 2),
        // 4-row blocks that would not fit one wave (2,045 outputs, 11 slots, as the 80B shape):
        // 8 rows a block, the last one overlapping the one before.
        (4, 64, 2045, 512, 12, 11, 1),
        (8, 64, 2045, 512, 12, 11, 1),
    ] {
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        let a = Affine::with_params(&g, &w, k, (group, bits), params);
        let (dw, ds, db) = (&a.dw, &a.ds, &a.db);
        let m = a.matvec(n, k);
        // The same stack doubles as the far one: ids ≥ split read expert id − split of it.
        let split = experts - 1;
        let far = Far {
            w: dw.ptr(),
            scales: ds.ptr(),
            biases: db.ptr(),
            split,
        };
        let slots = rows * per_row;
        let ids: Vec<i32> = (0..slots)
            .map(|s| ((s * 5 + 1) % (experts + 1)) as i32)
            .collect();
        let h = rand_vec(&mut r, slots * k, -1.0, 1.0);
        let wts = rand_vec(&mut r, slots, 0.0, 1.0);
        let x0 = rand_vec(&mut r, rows * n, -2.0, 2.0);
        let (di, dh, dwt) = (
            g.upload(&ids).unwrap(),
            g.upload(&h).unwrap(),
            g.upload(&wts).unwrap(),
        );
        let sl = Slots::experts(slots, di.ptr(), k, 1).with_far(Some(far));
        let (xa, xb, y) = (
            g.upload(&x0).unwrap(),
            g.upload(&x0).unwrap(),
            g.zeros::<f32>(slots * n).unwrap(),
        );
        ops::matvec(&g, m, dh.ptr(), y.ptr(), sl).unwrap();
        ops::moe_combine(
            &g,
            y.ptr(),
            dwt.ptr(),
            0,
            0,
            xa.ptr(),
            per_row,
            n,
            rows,
            true,
        )
        .unwrap();
        ops::moe_down_combine(&g, m, dh.ptr(), xb.ptr(), dwt.ptr(), sl, per_row, rows).unwrap();
        let (down, kernel) = ops::down_combine_form(&g, (bits, params), n, per_row, rows).unwrap();
        wide |= down == 8;
        eprintln!("{bits}-bit {n}x{k}, {per_row} slots x {rows}, {params:?}: {kernel}");
        let (a, b) = (
            g.read(&xa, rows * n).unwrap(),
            g.read(&xb, rows * n).unwrap(),
        );
        assert_eq!(
            a, b,
            "down + combine, {bits}-bit {n}x{k}, {per_row} slots x {rows}, {params:?}"
        );
        let moved = a.iter().zip(&x0).filter(|(u, v)| u != v).count();
        assert!(moved > rows * n / 2, "the sums reached the residual");
    }
    if g.multiprocessors() <= 140 {
        assert!(
            wide,
            "an 8-row form ran (132 SMs: 512 blocks of 11 warps exceed one wave)"
        );
    }
}

/// The ring kernel's pair a block (`VecIo::best`: its largest output and that row) gives the
/// outputs' argmax, lowest row on ties, and the greedy sampler reading the pairs picks the token
/// its scan of the logits picks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn ring_best_pairs_give_the_greedy_token() {
    use deltamoe_compute::cuda::ops::{Batch, SampleParams};
    use deltamoe_compute::cuda::vec::{self, VecIo};
    let g = gpu();
    let mut r = rng();
    let (group, n, k) = (64usize, 30_011usize, 1024usize);
    let mut w = rand_vec(&mut r, n * k, -1.0, 1.0);
    // Rows 20_000 and 7 alike: a tie for the largest output, which the lower row takes.
    let (hi, lo) = (20_000 * k, 7 * k);
    for j in 0..k {
        w[hi + j] = if j % 2 == 0 { 1.0 } else { -1.0 };
        w[lo + j] = w[hi + j];
    }
    let a = Affine::new(&g, &w, k, group, 4);
    let x: Vec<f32> = (0..k)
        .map(|j| if j % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let dx = g.upload(&x).unwrap();
    let m = a.matvec(n, k);
    let blocks = vec::ring_blocks(&g, &m).unwrap().expect("a ring launch") as usize;
    let (dy, pairs) = (
        g.zeros::<f32>(n).unwrap(),
        g.zeros::<f32>(2 * blocks).unwrap(),
    );
    let io = VecIo {
        best: pairs.ptr(),
        ..VecIo::default()
    };
    vec::matvec(&g, m, dx.ptr(), dy.ptr(), io).unwrap();
    let y = g.read(&dy, n).unwrap();
    let want = (0..n).fold(0, |b, i| if y[i] > y[b] { i } else { b });
    assert_eq!(want, 7, "the tied rows lead");
    let p = g.read(&pairs, 2 * blocks).unwrap();
    let (mut bv, mut bi) = (f32::NEG_INFINITY, n as i32);
    for c in p.chunks(2) {
        let (v, i) = (c[0], c[1].to_bits() as i32);
        if v > bv || (v == bv && i < bi) {
            (bv, bi) = (v, i);
        }
    }
    assert_eq!((bi as usize, bv), (want, y[want]), "argmax from the pairs");
    let params = g.upload(&SampleParams::default().words(0)).unwrap();
    let (tok, pos, slot0) = (
        g.zeros::<i32>(1).unwrap(),
        g.zeros::<i32>(1).unwrap(),
        g.upload(&[0i32]).unwrap(),
    );
    let one_row = Batch {
        rows: 1,
        slots: slot0.ptr(),
    };
    for best in [Some((pairs.ptr(), blocks)), None] {
        ops::sample_advance(
            &g,
            dy.ptr(),
            n,
            params.ptr(),
            tok.ptr(),
            pos.ptr(),
            one_row,
            best,
            true,
        )
        .unwrap();
        assert_eq!(g.read(&tok, 1).unwrap()[0] as usize, want, "{best:?}");
    }
}

/// Two to four rows in one launch of the single-row kernel's several-row entries: every row
/// bitwise its one-row launch, plain and with the fused input norm (the normalized rows too) and
/// residual add, in each form the rows take (staged in 16-warp blocks or streamed in them when
/// the rows do not fit, staged, ring, streamed), 4- and 8-bit codes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn several_rows_equal_their_one_row_launches_bitwise() {
    use deltamoe_compute::cuda::vec::{self, VecIo};
    let g = gpu();
    let mut r = rng();
    let mut failed = Vec::new();
    let (mlx, f32p) = (AffineParams::Bf16, AffineParams::F32);
    for &(bits, group, n, k, params) in &[
        (4u32, 64usize, 257usize, 2048usize, mlx),
        (4, 64, 12352, 2048, mlx),
        (4, 64, 2048, 8192, mlx),
        (4, 64, 20011, 1024, mlx),
        (4, 64, 30001, 2048, mlx),
        (4, 32, 37, 256, mlx),
        (4, 128, 1001, 4096, mlx),
        (8, 64, 257, 2048, mlx),
        (8, 32, 20011, 512, mlx),
        (8, 16, 1001, 2048, f32p),
        (8, 16, 20011, 512, f32p),
    ] {
        let w = rand_vec(&mut r, n * k, -1.0, 1.0);
        let a = Affine::with_params(&g, &w, k, (group, bits), params);
        let bias = g.upload(&rand_vec(&mut r, n, -1.0, 1.0)).unwrap();
        let m = Matvec {
            bias: bias.ptr(),
            ..a.matvec(n, k)
        };
        let scale = g.upload(&rand_vec(&mut r, k, 0.5, 1.5)).unwrap();
        for rows in 2..=4 {
            assert!(vec::takes_rows(&m, &Slots::rows(rows, k + 4)));
            let stride = k + 4;
            let x = rand_vec(&mut r, rows * stride, -3.0, 3.0);
            let res = rand_vec(&mut r, rows * n, -1.0, 1.0);
            for fused in [false, true] {
                let io = |normed: u64| match fused {
                    true => VecIo {
                        norm: scale.ptr(),
                        normed,
                        eps: 1e-6,
                        accumulate: 1,
                        ..VecIo::default()
                    },
                    false => VecIo::default(),
                };
                let (mut want_y, mut want_normed) = (Vec::new(), Vec::new());
                for row in 0..rows {
                    let dx = g.upload(&x[row * stride..row * stride + k]).unwrap();
                    let dy = g.upload(&res[row * n..(row + 1) * n]).unwrap();
                    let normed = g.zeros::<f32>(k).unwrap();
                    vec::matvec(&g, m, dx.ptr(), dy.ptr(), io(normed.ptr())).unwrap();
                    want_y.extend(g.read(&dy, n).unwrap());
                    want_normed.extend(g.read(&normed, k).unwrap());
                }
                let (dx, dy) = (g.upload(&x).unwrap(), g.upload(&res).unwrap());
                let normed = g.zeros::<f32>(rows * k).unwrap();
                let xy = (dx.ptr(), dy.ptr());
                vec::matvec_rows(&g, m, xy, rows, stride, io(normed.ptr())).unwrap();
                let name = format!("{rows} rows, {bits}-bit g{group} {n}x{k}, fused {fused}");
                let got = g.read(&dy, rows * n).unwrap();
                failed.extend(differ(&format!("{name}: outputs"), &got, &want_y, n));
                let got = g.read(&normed, rows * k).unwrap();
                failed.extend(differ(
                    &format!("{name}: normalized rows"),
                    &got,
                    &want_normed,
                    k,
                ));
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Where `got` and `want` (rows of `n`) differ in their bits: the count and the first one.
fn differ(name: &str, got: &[f32], want: &[f32], n: usize) -> Option<String> {
    let at: Vec<usize> = (0..want.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    let i = *at.first()?;
    Some(format!(
        "{name}: {} of {} differ, first row {} column {}: {} vs {}",
        at.len(),
        want.len(),
        i / n,
        i % n,
        got[i],
        want[i]
    ))
}
