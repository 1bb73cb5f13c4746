//! The verify forms of speculative decoding against the decode kernels they stand for: the GDN
//! conv and delta rule over R consecutive tokens of one sequence (gdn_conv_verify, gdn_verify)
//! against R one-token steps (gdn_conv_step, gdn_step, whose CPU twins are in cuda_parity.rs),
//! and attention over rows of one sequence at consecutive positions against one row a step:
//! outputs, kept states and final states bitwise. Needs a GPU: `#[ignore]`d here, run by
//! `scripts/gpu-tests.sh`.

mod common;

use common::{gpu, rand_vec, rng};
use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops::{self, AttnDims, Batch, GdnDims, GDN_VERIFY_MAX};
use deltamoe_compute::cuda::{DevBuf, Gpu};

/// Whether two float slices hold the same bits.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn read(g: &Gpu, b: &DevBuf<f32>) -> Vec<f32> {
    g.read(b, b.len()).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn_verify_is_its_tokens_decode_steps_bitwise() {
    let g = gpu();
    let mut r = rng();
    for &(hk, hv, dk, dv, kern) in &[
        (2usize, 6usize, 7usize, 11usize, 4usize),
        (16, 32, 128, 128, 4),
        (1, 3, 33, 65, 3),
    ] {
        let c = 2 * hk * dk + hv * dv;
        let (vd, p) = (hv * dv, c + hv * dv + 2 * hv);
        let (cs, rs) = ((kern - 1) * c, hv * dk * dv);
        let up = |v: &[f32]| g.upload(v).unwrap();
        let conv_w = up(&rand_vec(&mut r, c * kern, -0.5, 0.5));
        let neg_a = up(&rand_vec(&mut r, hv, -1.5, -0.1));
        let dt_bias = up(&rand_vec(&mut r, hv, -1.0, 1.0));
        let norm_w = up(&rand_vec(&mut r, dv, 0.5, 1.5));
        let dims = GdnDims { hk, hv, dk, dv };
        // Slot 1 of two, so that the slot index is honoured.
        let slots = g.upload(&[1i32; GDN_VERIFY_MAX]).unwrap();
        for rows in 1..=GDN_VERIFY_MAX {
            let conv0 = rand_vec(&mut r, 2 * cs, -1.0, 1.0);
            let rec0 = rand_vec(&mut r, 2 * rs, -0.5, 0.5);
            let proj = up(&rand_vec(&mut r, rows * p, -1.0, 1.0));
            // One token a step.
            let (conv_a, rec_a) = (up(&conv0), up(&rec0));
            let (mixed_a, out_a) = (
                g.zeros::<f32>(rows * c).unwrap(),
                g.zeros(rows * vd).unwrap(),
            );
            let mut kept = Vec::new();
            for t in 0..rows {
                let one = Batch {
                    rows: 1,
                    slots: slots.ptr(),
                };
                let (pt, mt, ot) = (proj.at(t * p), mixed_a.at(t * c), out_a.at(t * vd));
                ops::gdn_conv_step(&g, pt, p, conv_a.ptr(), conv_w.ptr(), mt, c, kern, one)
                    .unwrap();
                let w = (neg_a.ptr(), dt_bias.ptr(), norm_w.ptr());
                ops::gdn_step(
                    &g,
                    mt,
                    pt,
                    p,
                    rec_a.ptr(),
                    w.0,
                    w.1,
                    w.2,
                    ot,
                    dims,
                    1e-6,
                    one,
                )
                .unwrap();
                let (cv, rc) = (read(&g, &conv_a), read(&g, &rec_a));
                kept.push((cv[cs..].to_vec(), rc[rs..].to_vec()));
            }
            // The verify pass.
            let (conv_b, rec_b) = (up(&conv0), up(&rec0));
            let (mixed_b, out_b) = (
                g.zeros::<f32>(rows * c).unwrap(),
                g.zeros(rows * vd).unwrap(),
            );
            let keep = (rows - 1).max(1);
            let (sconv, srec) = (
                g.zeros::<f32>(keep * cs).unwrap(),
                g.zeros(keep * rs).unwrap(),
            );
            let bt = Batch {
                rows,
                slots: slots.ptr(),
            };
            ops::gdn_conv_verify(
                &g,
                proj.ptr(),
                p,
                conv_b.ptr(),
                conv_w.ptr(),
                mixed_b.ptr(),
                (c, kern),
                bt,
                sconv.ptr(),
            )
            .unwrap();
            let io = (mixed_b.ptr(), proj.ptr(), p);
            let w = (neg_a.ptr(), dt_bias.ptr(), norm_w.ptr());
            ops::gdn_verify(
                &g,
                io,
                rec_b.ptr(),
                w,
                out_b.ptr(),
                dims,
                1e-6,
                bt,
                srec.ptr(),
            )
            .unwrap();
            let tag = format!("{dk}/{dv}, {rows} tokens");
            assert!(
                same(&read(&g, &mixed_a), &read(&g, &mixed_b)),
                "conv out {tag}"
            );
            assert!(same(&read(&g, &out_a), &read(&g, &out_b)), "gdn out {tag}");
            assert!(
                same(&read(&g, &conv_a), &read(&g, &conv_b)),
                "conv state {tag}"
            );
            assert!(same(&read(&g, &rec_a), &read(&g, &rec_b)), "state {tag}");
            let (sc, sr) = (read(&g, &sconv), read(&g, &srec));
            for (t, (kc, kr)) in kept.iter().enumerate().take(rows - 1) {
                assert!(same(&sc[t * cs..(t + 1) * cs], kc), "kept conv {t} {tag}");
                assert!(same(&sr[t * rs..(t + 1) * rs], kr), "kept state {t} {tag}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_rows_at_consecutive_positions_are_their_decode_steps_bitwise() {
    let g = gpu();
    let mut r = rng();
    // Contexts on either side of a split boundary (16 positions a split at least).
    for &(hq, hkv, d, rot, pos0) in &[
        (4usize, 2usize, 32usize, 8usize, 14usize),
        (16, 2, 256, 64, 300),
    ] {
        let ctx = pos0 + GDN_VERIFY_MAX;
        let up = |v: &[f32]| g.upload(v).unwrap();
        let rope = Rope::new(rot, 1e6);
        let (qn, kn, freq) = (
            up(&rand_vec(&mut r, d, 0.5, 1.5)),
            up(&rand_vec(&mut r, d, 0.5, 1.5)),
            up(rope.inv_freq()),
        );
        let a = AttnDims {
            hq,
            hkv,
            d,
            rotary: rot,
        };
        let p = hq * 2 * d + 2 * hkv * d;
        let kv0 = rand_vec(&mut r, ctx * hkv * d, -1.0, 1.0);
        let splits = 64;
        let slot0 = g.upload(&[0i32; GDN_VERIFY_MAX]).unwrap();
        let pos = g.upload(&[pos0 as i32]).unwrap();
        for rows in 1..=GDN_VERIFY_MAX {
            let proj = up(&rand_vec(&mut r, rows * p, -1.0, 1.0));
            let run = |rows_at_once: bool| -> (Vec<f32>, Vec<f32>) {
                let (kc, vc) = (up(&kv0), up(&kv0));
                let out = g.zeros::<f32>(rows * hq * d).unwrap();
                let q = g.zeros::<f32>(rows * hq * d).unwrap();
                let po = g.zeros::<f32>(rows * hq * splits * d).unwrap();
                let pml = g.zeros::<f32>(rows * hq * splits * 2).unwrap();
                let pass = |n: usize, t: usize, at: &DevBuf<i32>, advance: bool| {
                    let bt = Batch {
                        rows: n,
                        slots: slot0.ptr(),
                    };
                    let (pp, qq, oo) = (proj.at(t * p), q.at(t * hq * d), out.at(t * hq * d));
                    let (kp, vp, ap) = (kc.ptr(), vc.ptr(), at.ptr());
                    ops::attn_prep(
                        &g,
                        pp,
                        p,
                        qn.ptr(),
                        kn.ptr(),
                        freq.ptr(),
                        qq,
                        kp,
                        vp,
                        ap,
                        a,
                        1e-6,
                        bt,
                        ctx,
                        advance,
                    )
                    .unwrap();
                    ops::attn_decode(
                        &g,
                        qq,
                        kp,
                        vp,
                        ap,
                        po.ptr(),
                        pml.ptr(),
                        pp,
                        p,
                        oo,
                        a,
                        splits,
                        bt,
                        ctx,
                        advance,
                    )
                    .unwrap();
                };
                if rows_at_once {
                    pass(rows, 0, &pos, true);
                } else {
                    for t in 0..rows {
                        let at = g.upload(&[(pos0 + t) as i32]).unwrap();
                        pass(1, t, &at, false);
                    }
                }
                (read(&g, &out), read(&g, &kc))
            };
            let (steps, rows_pass) = (run(false), run(true));
            let tag = format!("{hq}/{hkv}/{d}, {rows} rows at {pos0}");
            assert!(same(&steps.0, &rows_pass.0), "out {tag}");
            assert!(same(&steps.1, &rows_pass.1), "K cache {tag}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn_restore_copies_every_span_as_the_host_would() {
    let g = gpu();
    let mut r = rng();
    let lens = [1usize, 7, 300, 4097, 65_543];
    let total: usize = lens.iter().sum();
    let src = rand_vec(&mut r, total, -1.0, 1.0);
    let (dsrc, ddst) = (g.upload(&src).unwrap(), g.zeros::<f32>(2 * total).unwrap());
    // Span i lands at twice its offset, so that the gaps between spans must stay zero.
    let (mut table, mut want, mut at) = (Vec::new(), vec![0.0f32; 2 * total], 0);
    for &n in &lens {
        table.extend([ddst.at(2 * at), dsrc.at(at), n as u64]);
        want[2 * at..2 * at + n].copy_from_slice(&src[at..at + n]);
        at += n;
    }
    let dt = g.upload(&table).unwrap();
    // SAFETY: every span lies inside dsrc and ddst, apart from the others.
    unsafe { ops::gdn_restore(&g, dt.ptr(), lens.len()).unwrap() };
    assert!(same(&read(&g, &ddst), &want));
}
