//! The prefill kernels (`cuda::prefill`, kernels/prefill.cu and the grouped products of
//! matvec_rows.cu) against their CPU twins on random inputs with odd sizes. Needs a GPU:
//! `#[ignore]`d here, run by `scripts/gpu-tests.sh` on the GPU machine. Everything is f32 on
//! both sides (bf16 weights exact in f32), so only summation order differs: 1e-5 relative for
//! elementwise kernels, 1e-4 for reductions over hundreds of terms.

mod common;

use common::{assert_close, gpu, rand_vec, rng, Affine};

use deltamoe_compute::cpu::act::{sigmoid, softplus};
use deltamoe_compute::cpu::attention::{causal_attention, AttnShape};
use deltamoe_compute::cpu::conv::causal_conv1d_silu;
use deltamoe_compute::cpu::gdn::{gdn_recurrent, GdnInputs, GdnShape};
use deltamoe_compute::cpu::norm::{gated_rms_norm, l2_normalize, rms_norm};
use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops::{
    self, AffineParams, AttnDims, Batch, GdnDims, Matvec, Slots, WeightFormat,
};
use deltamoe_compute::cuda::prefill::{self as pf, GdnPacked, Grouped};
use deltamoe_compute::cuda::wide;
use deltamoe_compute::cuda::Gpu;
use deltamoe_compute::cuda::{dispatch, gemm};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16, round_bf16};
use rand::Rng;

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn_conv_pack_and_gated_norm_rows_match_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(hk, hv, dk, dv, kern, t) in &[
        (2usize, 6usize, 7usize, 11usize, 4usize, 5usize),
        (1, 1, 33, 65, 3, 1),
        (2, 4, 16, 24, 4, 70),
        (1, 2, 9, 5, 2, 3),
    ] {
        let c = 2 * hk * dk + hv * dv;
        let vd = hv * dv;
        let p = c + vd + 2 * hv + 3; // odd row stride
        let proj = rand_vec(&mut r, t * p, -1.0, 1.0);
        let w = rand_vec(&mut r, c * kern, -0.5, 0.5);
        let state0 = rand_vec(&mut r, (kern - 1) * c, -1.0, 1.0);
        let neg_a: Vec<f32> = rand_vec(&mut r, hv, 0.0, 1.0)
            .iter()
            .map(|v| -v.exp())
            .collect();
        let dt_bias = rand_vec(&mut r, hv, -1.0, 1.0);
        let norm_w = rand_vec(&mut r, dv, 0.5, 1.5);
        let (dproj, dw, dstate) = (
            g.upload(&proj).unwrap(),
            g.upload(&w).unwrap(),
            g.upload(&state0).unwrap(),
        );
        let dmixed = g.zeros::<f32>(t * c).unwrap();
        pf::gdn_conv_rows(
            &g,
            dproj.ptr(),
            p,
            dstate.ptr(),
            dw.ptr(),
            dmixed.ptr(),
            c,
            kern,
            t,
        )
        .unwrap();
        let x: Vec<f32> = (0..t)
            .flat_map(|i| proj[i * p..i * p + c].to_vec())
            .collect();
        let (mut state, mut mixed) = (state0.clone(), vec![0.0; t * c]);
        causal_conv1d_silu(&x, &w, kern, &mut state, &mut mixed);
        let name = format!("conv rows c{c} k{kern} t{t}");
        assert_close(&name, &g.read(&dmixed, t * c).unwrap(), &mixed, 1e-5);
        let got_state = g.read(&dstate, (kern - 1) * c).unwrap();
        assert_close(&format!("{name} state"), &got_state, &state, 0.0);

        // Pack + gates.
        let (dna, ddt, dnw) = (
            g.upload(&neg_a).unwrap(),
            g.upload(&dt_bias).unwrap(),
            g.upload(&norm_w).unwrap(),
        );
        let kd = hk * dk;
        let (qb, kb, vb) = (
            g.zeros::<u16>(t * kd).unwrap(),
            g.zeros::<u16>(t * kd).unwrap(),
            g.zeros::<u16>(t * vd).unwrap(),
        );
        let (dg, db) = (
            g.zeros::<f32>(t * hv).unwrap(),
            g.zeros::<f32>(t * hv).unwrap(),
        );
        let packed = GdnPacked {
            q: qb.ptr(),
            k: kb.ptr(),
            v: vb.ptr(),
            gate: dg.ptr(),
            beta: db.ptr(),
        };
        let dims = GdnDims { hk, hv, dk, dv };
        pf::gdn_pack(
            &g,
            dmixed.ptr(),
            dproj.ptr(),
            p,
            dna.ptr(),
            ddt.ptr(),
            packed,
            dims,
            t,
        )
        .unwrap();
        let unb = |b: &[u16]| b.iter().map(|&v| bf16_to_f32(v)).collect::<Vec<f32>>();
        let rnd = |v: &[f32]| {
            v.iter()
                .map(|&x| bf16_to_f32(f32_to_bf16(x)))
                .collect::<Vec<_>>()
        };
        // The GPU's mixed equals the CPU's to 1e-5; compare the rounding on the GPU's own.
        let gm = g.read(&dmixed, t * c).unwrap();
        let gpart = |lo: usize, hi: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|i| rnd(&gm[i * c + lo..i * c + hi]))
                .collect()
        };
        assert_close(
            "pack q",
            &unb(&g.read(&qb, t * kd).unwrap()),
            &gpart(0, kd),
            0.0,
        );
        assert_close(
            "pack k",
            &unb(&g.read(&kb, t * kd).unwrap()),
            &gpart(kd, 2 * kd),
            0.0,
        );
        assert_close(
            "pack v",
            &unb(&g.read(&vb, t * vd).unwrap()),
            &gpart(2 * kd, c),
            0.0,
        );
        let gates: Vec<f32> = (0..t * hv)
            .map(|i| {
                let (row, h) = (i / hv, i % hv);
                neg_a[h] * softplus(proj[row * p + c + vd + hv + h] + dt_bias[h])
            })
            .collect();
        let beta: Vec<f32> = (0..t * hv)
            .map(|i| sigmoid(proj[(i / hv) * p + c + vd + i % hv]))
            .collect();
        assert_close("pack gates", &g.read(&dg, t * hv).unwrap(), &gates, 1e-5);
        assert_close("pack beta", &g.read(&db, t * hv).unwrap(), &beta, 1e-5);

        // The f32 delta rule over the rows from a random state.
        let rec0 = rand_vec(&mut r, hv * dk * dv, -0.5, 0.5);
        let (drec, dcore) = (g.upload(&rec0).unwrap(), g.zeros::<f32>(t * vd).unwrap());
        pf::gdn_rec_rows(
            &g,
            dmixed.ptr(),
            dproj.ptr(),
            p,
            drec.ptr(),
            dna.ptr(),
            ddt.ptr(),
            dcore.ptr(),
            dims,
            t,
        )
        .unwrap();
        let shape = GdnShape {
            n_k_heads: hk,
            n_v_heads: hv,
            k_dim: dk,
            v_dim: dv,
        };
        let pick = |lo: usize, hi: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|i| gm[i * c + lo..i * c + hi].to_vec())
                .collect()
        };
        let (mut q, mut k, v) = (pick(0, kd), pick(kd, 2 * kd), pick(2 * kd, c));
        l2_normalize(&mut q, dk, 1e-6);
        l2_normalize(&mut k, dk, 1e-6);
        q.iter_mut().for_each(|x| *x /= (dk as f32).sqrt());
        let x = GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &gates,
            beta: &beta,
        };
        let (mut rec, mut core) = (rec0.clone(), vec![0.0; t * vd]);
        gdn_recurrent(&x, shape, &mut rec, &mut core);
        assert_close(
            &format!("{name} delta rule"),
            &g.read(&dcore, t * vd).unwrap(),
            &core,
            1e-4,
        );
        assert_close(
            &format!("{name} delta state"),
            &g.read(&drec, hv * dk * dv).unwrap(),
            &rec,
            1e-4,
        );

        // Gated RMSNorm over rows (o from random values, z from the projection rows).
        let o = rand_vec(&mut r, t * vd, -1.0, 1.0);
        let (dout_in, dout) = (g.upload(&o).unwrap(), g.zeros::<f32>(t * vd).unwrap());
        pf::gated_rmsnorm_rows(
            &g,
            dout_in.ptr(),
            dproj.ptr(),
            p,
            c,
            dnw.ptr(),
            dout.ptr(),
            hv,
            dv,
            1e-6,
            t,
        )
        .unwrap();
        let mut want = o.clone();
        for i in 0..t {
            let z = &proj[i * p + c..i * p + c + vd];
            for h in 0..hv {
                let s = i * vd + h * dv;
                gated_rms_norm(
                    &mut want[s..s + dv],
                    &z[h * dv..(h + 1) * dv],
                    &norm_w,
                    1e-6,
                );
            }
        }
        assert_close(
            "gated norm rows",
            &g.read(&dout, t * vd).unwrap(),
            &want,
            1e-5,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_prefill_rows_match_cpu() {
    let g = gpu();
    let mut r = rng();
    // GQA ratios 1, 2, 3, 4, 8; head dims padded to the kernels' 64 / 128 / 256 (7, 45, 100)
    // and exact; odd T, T = 1, pos0 > 0, several blocks of (token, head) rows and K/V tiles.
    for &(hq, hkv, d, rot, pos0, t) in &[
        (4usize, 2usize, 32usize, 8usize, 0usize, 37usize),
        (3, 1, 45, 16, 13, 70),
        (16, 2, 256, 64, 40, 33),
        (2, 2, 7, 4, 100, 1),
        (8, 8, 64, 16, 5, 151),
        (4, 1, 128, 32, 3, 50),
        (8, 1, 100, 32, 31, 41),
        (16, 2, 256, 64, 77, 301),
        (16, 2, 256, 64, 500, 1),
    ] {
        let ctx = pos0 + t + 5;
        let rope = Rope::new(rot, 1e6);
        let (qn, kn) = (rand_vec(&mut r, d, 0.5, 1.5), rand_vec(&mut r, d, 0.5, 1.5));
        let a = AttnDims {
            hq,
            hkv,
            d,
            rotary: rot,
        };
        let p = hq * 2 * d + 2 * hkv * d;
        let proj = rand_vec(&mut r, t * p, -1.0, 1.0);
        // Slot 1 of two; the first pos0 cache rows hold earlier tokens.
        let per_slot = ctx * hkv * d;
        let old_k = rand_vec(&mut r, pos0 * hkv * d, -1.0, 1.0);
        let old_v = rand_vec(&mut r, pos0 * hkv * d, -1.0, 1.0);
        let mut kc0 = vec![0.0f32; 2 * per_slot];
        let mut vc0 = vec![0.0f32; 2 * per_slot];
        kc0[per_slot..per_slot + old_k.len()].copy_from_slice(&old_k);
        vc0[per_slot..per_slot + old_v.len()].copy_from_slice(&old_v);
        let (kc, vc) = (g.upload(&kc0).unwrap(), g.upload(&vc0).unwrap());
        let pos = g.upload(&[0i32, pos0 as i32]).unwrap();
        let slots = g.upload(&vec![1i32; t]).unwrap();
        let (dqn, dkn, dfreq, dproj) = (
            g.upload(&qn).unwrap(),
            g.upload(&kn).unwrap(),
            g.upload(rope.inv_freq()).unwrap(),
            g.upload(&proj).unwrap(),
        );
        let (dq, dout) = (
            g.zeros::<f32>(t * hq * d).unwrap(),
            g.zeros::<f32>(t * hq * d).unwrap(),
        );
        let bt = Batch {
            rows: t,
            slots: slots.ptr(),
        };
        ops::attn_prep(
            &g,
            dproj.ptr(),
            p,
            dqn.ptr(),
            dkn.ptr(),
            dfreq.ptr(),
            dq.ptr(),
            kc.ptr(),
            vc.ptr(),
            pos.ptr(),
            a,
            1e-6,
            bt,
            ctx,
            true,
        )
        .unwrap();
        let (k1, v1) = (kc.at(per_slot), vc.at(per_slot));
        // The bf16 form reads bf16 copies of the caches' written rows.
        let rows = pos0 + t;
        let (kb, vb) = (
            g.zeros::<u16>(rows * hkv * d).unwrap(),
            g.zeros::<u16>(rows * hkv * d).unwrap(),
        );
        let attn = |bf16: bool| {
            let out = (dq.ptr(), dproj.ptr(), p, dout.ptr());
            let caches = if bf16 {
                gemm::rows_to_bf16(&g, k1, hkv * d, kb.ptr(), hkv * d, rows).unwrap();
                gemm::rows_to_bf16(&g, v1, hkv * d, vb.ptr(), hkv * d, rows).unwrap();
                (kb.ptr(), vb.ptr())
            } else {
                (k1, v1)
            };
            pf::attn_prefill(&g, out, caches, a, (t, pos0), bf16).unwrap();
            g.read(&dout, t * hq * d).unwrap()
        };
        let got_split = attn(false);

        let (mut q, mut gate) = (Vec::new(), Vec::new());
        let (mut kall, mut vall) = (old_k.clone(), old_v.clone());
        for i in 0..t {
            let row = &proj[i * p..(i + 1) * p];
            let mut qi: Vec<f32> = (0..hq)
                .flat_map(|h| row[h * 2 * d..h * 2 * d + d].to_vec())
                .collect();
            gate.extend((0..hq).flat_map(|h| row[h * 2 * d + d..(h + 1) * 2 * d].to_vec()));
            let mut ki = row[hq * 2 * d..hq * 2 * d + hkv * d].to_vec();
            rms_norm(&mut qi, &qn, 1e-6);
            rms_norm(&mut ki, &kn, 1e-6);
            rope.apply(&mut qi, d, pos0 + i);
            rope.apply(&mut ki, d, pos0 + i);
            q.extend(qi);
            kall.extend(ki);
            vall.extend_from_slice(&row[hq * 2 * d + hkv * d..]);
        }
        let s = AttnShape {
            n_heads: hq,
            n_kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let mut o = vec![0.0; t * hq * d];
        causal_attention(&q, &kall, &vall, pos0, s, &mut o);
        o.iter_mut()
            .zip(&gate)
            .for_each(|(v, gg)| *v *= sigmoid(*gg));
        let name = format!("attn prefill hq{hq} hkv{hkv} d{d} pos0 {pos0} t{t}");
        assert_close(
            &format!("{name} q"),
            &g.read(&dq, t * hq * d).unwrap(),
            &q,
            1e-5,
        );
        let kgot = g.read_at(&kc, per_slot, (pos0 + t) * hkv * d).unwrap();
        assert_close(&format!("{name} k cache"), &kgot, &kall, 1e-5);
        let vgot = g.read_at(&vc, per_slot, (pos0 + t) * hkv * d).unwrap();
        assert_close(&format!("{name} v cache"), &vgot, &vall, 0.0);
        // Tensor cores with bf16 hi + lo splits (S = Q_hi K_hi + Q_lo K_hi + Q_hi K_lo, likewise
        // P·V): each product keeps ~16 significant bits (the dropped lo·lo term and the rounding
        // of the lo parts ≈ 2⁻¹⁶ relative), sums in f32. Measured on an H200: ≤ 9.3e-6·max|out|
        // over these cases (the f32 CUDA-core kernel it replaced: ≤ 1.1e-6); 1e-4 leaves 10×.
        assert_close(&name, &got_split, &o, 1e-4);
        // The bf16 form rounds q, k, v once (as the twin below does) and the probabilities P
        // (2⁻⁹ relative each, not in the twin): 1e-2 of max|out| bounds what P's rounding does
        // to a weighted mean of these values.
        let r = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| round_bf16(x)).collect() };
        let mut ob = vec![0.0; t * hq * d];
        causal_attention(&r(&q), &r(&kall), &r(&vall), pos0, s, &mut ob);
        ob.iter_mut()
            .zip(&gate)
            .for_each(|(v, gg)| *v *= sigmoid(*gg));
        assert_close(&format!("{name} bf16"), &attn(true), &ob, 1e-2);
        let untouched = g.read(&kc, per_slot).unwrap();
        assert!(
            untouched.iter().all(|&v| v == 0.0),
            "{name}: slot 0 written"
        );
    }
}

/// Grouping by expert and the grouped products against a CPU sort and CPU (bf16) or per-pair
/// GPU (affine: `ops::matvec` with expert slots, itself checked against the CPU in
/// cuda_matvec.rs) products; affine weights with MLX's parameters, f16 scales and zero points or
/// f32 scales and biases (8-bit codes in groups of 16 too).
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_grouping_and_grouped_products_match_cpu() {
    let g = gpu();
    let mut r = rng();
    let (mlx, f16z, f32p) = (AffineParams::Bf16, AffineParams::F16Zero, AffineParams::F32);
    // n even: the SwiGLU form reads each expert as a [2I, K] block with I = n / 2.
    for &(tokens, ks, experts, n, k, quant) in &[
        (37usize, 3usize, 5usize, 24usize, 64usize, None),
        (1, 2, 3, 18, 40, None),
        (200, 9, 33, 40, 128, Some((4u32, 64usize, mlx))),
        (13, 2, 4, 10, 96, Some((8, 32, mlx))),
        // K in whole stages of the wide kernels, outputs over several of their row blocks.
        (29, 8, 6, 300, 512, Some((4, 64, mlx))),
        (11, 4, 3, 130, 256, Some((8, 128, mlx))),
        (9, 8, 5, 200, 256, Some((4, 32, mlx))),
        (17, 3, 4, 66, 256, None),
        // f16 scales and zero points: every form, 2 bits on the CUDA-core tiles only.
        (13, 2, 4, 10, 96, Some((8, 32, f16z))),
        (29, 8, 6, 300, 512, Some((4, 64, f16z))),
        (11, 4, 3, 130, 256, Some((8, 128, f16z))),
        (21, 3, 5, 34, 128, Some((2, 64, f16z))),
        // f32 scales and biases: every form.
        (13, 2, 4, 10, 96, Some((8, 32, f32p))),
        (29, 8, 6, 300, 512, Some((4, 64, f32p))),
        (11, 4, 3, 130, 256, Some((8, 128, f32p))),
        (9, 8, 5, 200, 256, Some((4, 32, f32p))),
        // 8-bit codes in groups of 16 (f32 parameters): a k16 step a group, every form.
        (13, 2, 4, 10, 96, Some((8, 16, f32p))),
        (11, 4, 3, 130, 256, Some((8, 16, f32p))),
        (29, 8, 6, 300, 512, Some((8, 16, f32p))),
    ] {
        let pairs = tokens * ks;
        let ids: Vec<i32> = (0..pairs)
            .map(|_| r.random_range(0..experts as i32))
            .collect();
        let di = g.upload(&ids).unwrap();
        let x = rand_vec(&mut r, tokens * k, -1.0, 1.0);
        let w = rand_vec(&mut r, experts * n * k, -1.0, 1.0);
        let forms = [
            (pf::TILE_CORES, Form::Plain),
            (pf::TILE_MMA, Form::Plain),
            (pf::TILES_SPLIT[0], Form::Split),
            (pf::TILES_SPLIT[1], Form::Split),
            (pf::TILES_SPLIT[0], Form::Wide),
            (pf::TILES_SPLIT[1], Form::Wide),
            // Prefill's tiles on the wide kernels (`dispatch::prefill_wide_tile`): 1 to 4 tiles of 8.
            (pf::TILE_MMA, Form::Wide),
        ];
        for (tile, form) in forms {
            let mma = tile == pf::TILE_MMA || form != Form::Plain;
            let cores_only = matches!(quant, Some((2, _, _)));
            if (mma && (k % 32 != 0 || cores_only)) || (form == Form::Wide && k % 256 != 0) {
                continue;
            }
            grouping_case(
                &g,
                &ids,
                &di,
                (tokens, ks, experts),
                (n, k),
                quant,
                (tile, form),
                (&x, &w),
            );
        }
    }
}

/// The grouped kernels a case runs: prefill's (`pf::grouped_*`), decode's split-K
/// (`pf::grouped_split`) or decode's wide (`wide::grouped`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Plain,
    Split,
    Wide,
}

/// One grouping of `ids` in tiles of `tile` and the grouped products over it on the kernels of
/// `form` against the CPU.
#[allow(clippy::too_many_arguments)]
fn grouping_case(
    g: &Gpu,
    ids: &[i32],
    di: &deltamoe_compute::cuda::DevBuf<i32>,
    (tokens, ks, experts): (usize, usize, usize),
    (n, k): (usize, usize),
    quant: Option<(u32, usize, AffineParams)>,
    (tile, form): (usize, Form),
    (x, w): (&[f32], &[f32]),
) {
    {
        let pairs = tokens * ks;
        let mt = pf::max_tiles(pairs, experts, tile);
        let (order, tiles, nt) = (
            g.zeros::<i32>(pairs).unwrap(),
            g.zeros::<i32>(3 * mt).unwrap(),
            g.zeros::<i32>(1).unwrap(),
        );
        pf::moe_group(
            g,
            di.ptr(),
            pairs,
            experts,
            tile,
            order.ptr(),
            tiles.ptr(),
            nt.ptr(),
        )
        .unwrap();
        let (ord, tl, ntv) = (
            g.read(&order, pairs).unwrap(),
            g.read(&tiles, 3 * mt).unwrap(),
            g.read(&nt, 1).unwrap()[0] as usize,
        );
        let mut seen = vec![false; pairs];
        let mut covered = 0;
        let mut last_e = -1;
        for ti in 0..ntv {
            let (e, f, c) = (tl[3 * ti], tl[3 * ti + 1] as usize, tl[3 * ti + 2] as usize);
            assert!(
                e >= last_e && (1..=tile).contains(&c),
                "tile {ti}: {e} {f} {c}"
            );
            last_e = e;
            assert_eq!(f, covered, "tiles are contiguous");
            for &pi in &ord[f..f + c] {
                assert_eq!(ids[pi as usize], e, "pair {pi} in expert {e}'s tile");
                assert!(!seen[pi as usize], "pair {pi} twice");
                seen[pi as usize] = true;
            }
            covered += c;
        }
        assert_eq!(covered, pairs, "every pair once");

        let dx = g.upload(x).unwrap();
        let (m, _keep): (Matvec, Vec<Box<dyn std::any::Any>>) = match quant {
            None => {
                let bits: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
                let dw = g.upload(&bits).unwrap();
                let m = Matvec {
                    w: dw.ptr(),
                    n,
                    k,
                    bias: 0,
                    format: WeightFormat::Bf16,
                };
                (m, vec![Box::new(dw)])
            }
            Some((bits, group, params)) => {
                let a = Affine::with_params(g, w, k, (group, bits), params);
                (a.matvec(n, k), vec![Box::new(a)])
            }
        };
        let gr = Grouped {
            order: order.ptr(),
            tiles: tiles.ptr(),
            n_tiles: nt.ptr(),
            tile,
            max_tiles: mt,
            x_stride: k,
            x_div: ks,
        };
        let (dy, dh) = (
            g.zeros::<f32>(pairs * n).unwrap(),
            g.zeros::<f32>(pairs * n / 2).unwrap(),
        );
        // Fewer blocks than tiles for the decode forms: each loops over several.
        let blocks = (mt / 3).max(1);
        match form {
            Form::Plain => {
                pf::grouped_matvec(g, m, dx.ptr(), dy.ptr(), gr).unwrap();
                pf::grouped_swiglu(g, m, dx.ptr(), dh.ptr(), gr).unwrap();
            }
            Form::Split => {
                pf::grouped_split(g, m, (dx.ptr(), dy.ptr()), gr, false, blocks).unwrap();
                pf::grouped_split(g, m, (dx.ptr(), dh.ptr()), gr, true, blocks).unwrap();
            }
            Form::Wide => {
                let staged = dispatch::wide_staged_words(&m, tokens);
                let ws = g.zeros::<u32>(staged).unwrap();
                let stage = (tokens, (ws.ptr(), staged));
                wide::grouped(g, m, (dx.ptr(), dy.ptr()), gr, false, blocks, stage).unwrap();
                wide::grouped(g, m, (dx.ptr(), dh.ptr()), gr, true, blocks, stage).unwrap();
            }
        }
        let want: Vec<f32> = match quant {
            None => (0..pairs)
                .flat_map(|pi| {
                    let (e, xr) = (ids[pi] as usize, &x[(pi / ks) * k..(pi / ks + 1) * k]);
                    (0..n)
                        .map(|j| {
                            let row = &w[(e * n + j) * k..(e * n + j + 1) * k];
                            row.iter()
                                .zip(xr)
                                .map(|(a, b)| bf16_to_f32(f32_to_bf16(*a)) * b)
                                .sum()
                        })
                        .collect::<Vec<f32>>()
                })
                .collect(),
            Some(_) => {
                let dref = g.zeros::<f32>(pairs * n).unwrap();
                let sl = Slots::experts(pairs, di.ptr(), k, ks);
                ops::matvec(g, m, dx.ptr(), dref.ptr(), sl).unwrap();
                g.read(&dref, pairs * n).unwrap()
            }
        };
        let name =
            format!("grouped {quant:?} tile {tile} {form:?} {tokens}x{ks} of {experts} [{n}x{k}]");
        assert_close(&name, &g.read(&dy, pairs * n).unwrap(), &want, 1e-4);
        let i = n / 2;
        let hw: Vec<f32> = (0..pairs)
            .flat_map(|pi| {
                let y = &want[pi * n..(pi + 1) * n];
                (0..i)
                    .map(move |j| y[j] * sigmoid(y[j]) * y[i + j])
                    .collect::<Vec<_>>()
            })
            .collect();
        let got = g.read(&dh, pairs * i).unwrap();
        assert_close(&format!("{name} swiglu"), &got, &hw, 1e-4);
    }
}
