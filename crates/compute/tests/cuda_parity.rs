//! Every CUDA kernel against its CPU twin on random inputs with odd sizes (the matvec family is
//! in cuda_matvec.rs). Needs a GPU: `#[ignore]`d here, run by `scripts/gpu-tests.sh` on the GPU
//! machine.

mod common;

use common::{assert_close, gpu, rand_vec, rng};
use deltamoe_compute::cpu::act::{sigmoid, softplus};
use deltamoe_compute::cpu::attention::{causal_attention, AttnShape};
use deltamoe_compute::cpu::conv::causal_conv1d_silu;
use deltamoe_compute::cpu::gdn::{gdn_recurrent, GdnInputs, GdnShape};
use deltamoe_compute::cpu::norm::{gated_rms_norm, l2_normalize, rms_norm};
use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops::{self, AffineParams, AttnDims, Batch, GdnDims, SampleParams};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};

#[test]
#[ignore = "needs NVRTC (libnvrtc.so)"]
fn kernels_compile_for_hopper_and_ampere() {
    // Real architectures: NVRTC then also assembles the PTX, so an instruction the older part
    // lacks fails here rather than when a module loads on it. Both builds of the affine kernels
    // (MLX's parameters, f16 zero points).
    for arch in ["sm_90", "sm_80"] {
        deltamoe_compute::cuda::kernels::compile_all(arch).unwrap();
    }
}

/// An allocation past the device's memory is a one-line out-of-memory error with the numbers,
/// and the device stays usable after it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_allocation_past_device_memory_is_out_of_memory() {
    let g = gpu();
    let e = g
        .zeros::<f32>(1 << 38)
        .err()
        .expect("a terabyte allocation fails");
    let msg = e.to_string();
    assert!(
        matches!(e, deltamoe_compute::cuda::CudaError::OutOfMemory(_)),
        "{msg}"
    );
    assert!(
        msg.contains("out of GPU memory: 1024.00 GiB asked for"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
    let small = g.upload(&[1.0f32, 2.0]).unwrap();
    assert_eq!(g.read(&small, 2).unwrap(), vec![1.0, 2.0]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_rmsnorm_matches_cpu() {
    let g = gpu();
    let mut r = rng();
    let (rows, h) = (3, 1001);
    let x = rand_vec(&mut r, rows * h, -2.0, 2.0);
    let d = rand_vec(&mut r, rows * h, -1.0, 1.0);
    let scale = rand_vec(&mut r, h, 0.5, 1.5);
    let (dx, dd, ds) = (
        g.upload(&x).unwrap(),
        g.upload(&d).unwrap(),
        g.upload(&scale).unwrap(),
    );
    let out = g.zeros::<f32>(rows * h).unwrap();
    ops::add_rmsnorm(&g, dx.ptr(), dd.ptr(), ds.ptr(), out.ptr(), rows, h, 1e-6).unwrap();
    let mut sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
    assert_close("residual", &g.read(&dx, rows * h).unwrap(), &sum, 1e-6);
    rms_norm(&mut sum, &scale, 1e-6);
    assert_close("add_rmsnorm", &g.read(&out, rows * h).unwrap(), &sum, 1e-5);
}

/// A random GDN layer step: CPU reference (conv → l2norm → gates → recurrent → gated norm)
/// against gdn_conv_step + gdn_step, over several tokens so the states carry.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gdn_decode_matches_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(hk, hv, dk, dv, kern) in &[
        (2usize, 6usize, 7usize, 11usize, 4usize),
        (16, 32, 128, 128, 4),
        (1, 1, 33, 65, 3),
    ] {
        let c = 2 * hk * dk + hv * dv;
        let vd = hv * dv;
        let conv_w = rand_vec(&mut r, c * kern, -0.5, 0.5);
        let neg_a: Vec<f32> = rand_vec(&mut r, hv, 0.0, 1.0)
            .iter()
            .map(|v| -v.exp())
            .collect();
        let dt_bias = rand_vec(&mut r, hv, -1.0, 1.0);
        let norm_w = rand_vec(&mut r, dv, 0.5, 1.5);
        let (dcw, dna, ddt, dnw) = (
            g.upload(&conv_w).unwrap(),
            g.upload(&neg_a).unwrap(),
            g.upload(&dt_bias).unwrap(),
            g.upload(&norm_w).unwrap(),
        );
        let slot0 = g.upload(&[0i32]).unwrap();
        let one_row = Batch {
            rows: 1,
            slots: slot0.ptr(),
        };
        let dconv = g.zeros::<f32>((kern - 1) * c).unwrap();
        let drec = g.zeros::<f32>(hv * dk * dv).unwrap();
        let (dmixed, dout) = (g.zeros::<f32>(c).unwrap(), g.zeros::<f32>(vd).unwrap());
        let mut conv_state = vec![0.0; (kern - 1) * c];
        let mut rec = vec![0.0; hv * dk * dv];
        let shape = GdnShape {
            n_k_heads: hk,
            n_v_heads: hv,
            k_dim: dk,
            v_dim: dv,
        };
        for step in 0..5 {
            let proj = rand_vec(&mut r, c + vd + 2 * hv, -1.0, 1.0);
            let dproj = g.upload(&proj).unwrap();
            ops::gdn_conv_step(
                &g,
                dproj.ptr(),
                proj.len(),
                dconv.ptr(),
                dcw.ptr(),
                dmixed.ptr(),
                c,
                kern,
                one_row,
            )
            .unwrap();
            let dims = GdnDims { hk, hv, dk, dv };
            ops::gdn_step(
                &g,
                dmixed.ptr(),
                dproj.ptr(),
                proj.len(),
                drec.ptr(),
                dna.ptr(),
                ddt.ptr(),
                dnw.ptr(),
                dout.ptr(),
                dims,
                1e-6,
                one_row,
            )
            .unwrap();

            let mut mixed = vec![0.0; c];
            causal_conv1d_silu(&proj[..c], &conv_w, kern, &mut conv_state, &mut mixed);
            assert_close(
                &format!("gdn conv {dk}/{dv} step {step}"),
                &g.read(&dmixed, c).unwrap(),
                &mixed,
                1e-5,
            );
            let (kd, vdim) = (hk * dk, hv * dv);
            let mut q = mixed[..kd].to_vec();
            let mut k = mixed[kd..2 * kd].to_vec();
            l2_normalize(&mut q, dk, 1e-6);
            l2_normalize(&mut k, dk, 1e-6);
            q.iter_mut().for_each(|v| *v /= (dk as f32).sqrt());
            let gates: Vec<f32> = (0..hv)
                .map(|h| neg_a[h] * softplus(proj[c + vd + hv + h] + dt_bias[h]))
                .collect();
            let beta: Vec<f32> = (0..hv).map(|h| sigmoid(proj[c + vd + h])).collect();
            let mut o = vec![0.0; vdim];
            let x = GdnInputs {
                q: &q,
                k: &k,
                v: &mixed[2 * kd..],
                g: &gates,
                beta: &beta,
            };
            gdn_recurrent(&x, shape, &mut rec, &mut o);
            gated_rms_norm(&mut o, &proj[c..c + vd], &norm_w, 1e-6);
            assert_close(
                &format!("gdn step {dk}/{dv} step {step}"),
                &g.read(&dout, vd).unwrap(),
                &o,
                1e-4,
            );
        }
        assert_close(
            &format!("gdn state {dk}/{dv}"),
            &g.read(&drec, hv * dk * dv).unwrap(),
            &rec,
            1e-4,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_decode_matches_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(hq, hkv, d, rot, steps) in &[
        (4usize, 2usize, 32usize, 8usize, 37usize),
        (16, 2, 256, 64, 70),
        (3, 1, 48, 16, 5),
        // More than ATTN_GQA (8) q heads per kv head (as Qwen3.5-397B): two blocks per kv
        // head; 12 (a full block and one of 4 heads) with head_dim under the 128 lanes' float4s.
        (32, 2, 256, 64, 45),
        (24, 2, 20, 8, 33),
        // Long enough for every split to hold several runs of positions per warp.
        (8, 1, 128, 32, 2600),
    ] {
        let rope = Rope::new(rot, 1e6);
        let (qn, kn) = (rand_vec(&mut r, d, 0.5, 1.5), rand_vec(&mut r, d, 0.5, 1.5));
        let a = AttnDims {
            hq,
            hkv,
            d,
            rotary: rot,
        };
        let (dqn, dkn, dfreq) = (
            g.upload(&qn).unwrap(),
            g.upload(&kn).unwrap(),
            g.upload(rope.inv_freq()).unwrap(),
        );
        let (kc, vc) = (
            g.zeros::<f32>(steps * hkv * d).unwrap(),
            g.zeros::<f32>(steps * hkv * d).unwrap(),
        );
        let (dq, dout) = (
            g.zeros::<f32>(hq * d).unwrap(),
            g.zeros::<f32>(hq * d).unwrap(),
        );
        let splits = 64;
        let (po, pml) = (
            g.zeros::<f32>(hq * splits * d).unwrap(),
            g.zeros::<f32>(hq * splits * 2).unwrap(),
        );
        let (mut kcpu, mut vcpu) = (Vec::new(), Vec::new());
        for pos in 0..steps {
            let proj = rand_vec(&mut r, hq * 2 * d + 2 * hkv * d, -1.0, 1.0);
            let dproj = g.upload(&proj).unwrap();
            let dpos = g.upload(&[pos as i32]).unwrap();
            let slot0 = g.upload(&[0i32]).unwrap();
            let one_row = Batch {
                rows: 1,
                slots: slot0.ptr(),
            };
            ops::attn_prep(
                &g,
                dproj.ptr(),
                proj.len(),
                dqn.ptr(),
                dkn.ptr(),
                dfreq.ptr(),
                dq.ptr(),
                kc.ptr(),
                vc.ptr(),
                dpos.ptr(),
                a,
                1e-6,
                one_row,
                steps,
                false,
            )
            .unwrap();
            ops::attn_decode(
                &g,
                dq.ptr(),
                kc.ptr(),
                vc.ptr(),
                dpos.ptr(),
                po.ptr(),
                pml.ptr(),
                dproj.ptr(),
                proj.len(),
                dout.ptr(),
                a,
                splits,
                one_row,
                steps,
                false,
            )
            .unwrap();

            let mut q: Vec<f32> = (0..hq)
                .flat_map(|h| proj[h * 2 * d..h * 2 * d + d].to_vec())
                .collect();
            let gate: Vec<f32> = (0..hq)
                .flat_map(|h| proj[h * 2 * d + d..(h + 1) * 2 * d].to_vec())
                .collect();
            let mut k = proj[hq * 2 * d..hq * 2 * d + hkv * d].to_vec();
            rms_norm(&mut q, &qn, 1e-6);
            rms_norm(&mut k, &kn, 1e-6);
            rope.apply(&mut q, d, pos);
            rope.apply(&mut k, d, pos);
            kcpu.extend_from_slice(&k);
            vcpu.extend_from_slice(&proj[hq * 2 * d + hkv * d..]);
            if pos % 9 == 0 || pos + 1 == steps {
                let mut o = vec![0.0; hq * d];
                let s = AttnShape {
                    n_heads: hq,
                    n_kv_heads: hkv,
                    head_dim: d,
                    scale: 1.0 / (d as f32).sqrt(),
                };
                causal_attention(&q, &kcpu, &vcpu, pos, s, &mut o);
                o.iter_mut()
                    .zip(&gate)
                    .for_each(|(v, gg)| *v *= sigmoid(*gg));
                assert_close(
                    &format!("attn q d{d} pos {pos}"),
                    &g.read(&dq, hq * d).unwrap(),
                    &q,
                    1e-5,
                );
                assert_close(
                    &format!("attn out d{d} pos {pos}"),
                    &g.read(&dout, hq * d).unwrap(),
                    &o,
                    1e-4,
                );
            }
        }
        assert_close(
            &format!("k cache d{d}"),
            &g.read(&kc, steps * hkv * d).unwrap(),
            &kcpu,
            1e-5,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn router_combine_embed_argmax_match_cpu() {
    let g = gpu();
    let mut r = rng();
    for &(e, k, renorm) in &[
        (8usize, 2usize, true),
        (257, 8, true),
        (512, 10, false),
        (1000, 3, true),
    ] {
        let logits = rand_vec(&mut r, e + 1, -3.0, 3.0);
        let dl = g.upload(&logits).unwrap();
        // One slot more for the shared expert, stacked at index e.
        let (ids, w, sg) = (
            g.zeros::<i32>(k + 1).unwrap(),
            g.zeros::<f32>(k + 1).unwrap(),
            g.zeros::<f32>(1).unwrap(),
        );
        let route = ops::Route {
            experts: e,
            top_k: k,
            renorm,
            shared_gate: true,
            shared_slot: Some(e),
            loc: 0,
            host_take: 0,
            far_from: 0,
            shared_here: true,
        };
        ops::router_topk(&g, dl.ptr(), e + 1, route, ids.ptr(), w.ptr(), sg.ptr(), 1).unwrap();
        assert_eq!(g.read(&ids, k + 1).unwrap()[k], e as i32, "shared slot id");
        assert_close(
            "shared slot weight",
            &g.read(&w, k + 1).unwrap()[k..],
            &[sigmoid(logits[e])],
            1e-6,
        );
        let mut p = logits[..e].to_vec();
        deltamoe_compute::cpu::act::softmax(&mut p);
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        idx.truncate(k);
        let got_ids: Vec<usize> = g
            .read(&ids, k)
            .unwrap()
            .iter()
            .map(|&v| v as usize)
            .collect();
        assert_eq!(got_ids, idx, "router ids E={e}");
        // With a location table the ids name where each chosen expert is.
        let loc: Vec<i32> = (0..e as i32)
            .map(|i| (i * 7 + 3) % e as i32 + 1000)
            .collect();
        let dloc = g.upload(&loc).unwrap();
        let at = ops::Route {
            loc: dloc.ptr(),
            ..route
        };
        ops::router_topk(&g, dl.ptr(), e + 1, at, ids.ptr(), w.ptr(), sg.ptr(), 1).unwrap();
        let got_at = g.read(&ids, k + 1).unwrap();
        let want_at: Vec<i32> = idx.iter().map(|&i| loc[i]).chain([e as i32]).collect();
        assert_eq!(got_at, want_at, "router ids through loc E={e}");
        // Locations from 1000 + e / 2 on are outside the cache: of c such picks the host takes
        // the first c / 2 in rank order (as ids −1 − (location − far_from)).
        let far_from = 1000 + e / 2;
        let table: Vec<i32> = (0..=k as i32).map(|c| c / 2).collect();
        let dt = g.upload(&table).unwrap();
        let split = ops::Route {
            host_take: dt.ptr(),
            far_from,
            ..at
        };
        ops::router_topk(&g, dl.ptr(), e + 1, split, ids.ptr(), w.ptr(), sg.ptr(), 1).unwrap();
        let c = want_at[..k]
            .iter()
            .filter(|&&v| v as usize >= far_from)
            .count();
        let mut handed = 0;
        let want_split: Vec<i32> = want_at
            .iter()
            .enumerate()
            .map(|(r, &v)| {
                if r < k && v as usize >= far_from && handed < c / 2 {
                    handed += 1;
                    -1 - (v - far_from as i32)
                } else {
                    v
                }
            })
            .collect();
        assert_eq!(
            g.read(&ids, k + 1).unwrap(),
            want_split,
            "host split E={e} c={c}"
        );
        let s: f32 = idx.iter().map(|&i| p[i]).sum();
        let want: Vec<f32> = idx
            .iter()
            .map(|&i| if renorm { p[i] / s } else { p[i] })
            .collect();
        assert_close(
            &format!("router weights E={e}"),
            &g.read(&w, k).unwrap(),
            &want,
            1e-5,
        );
        assert_close(
            "shared gate",
            &g.read(&sg, 1).unwrap(),
            &[sigmoid(logits[e])],
            1e-6,
        );
        // Expert parallel: the odd experts and the shared one are another GPU's (loc −1): id −1
        // and weight 0, the others' weights unchanged.
        let own: Vec<i32> = (0..e as i32)
            .map(|i| if i % 2 == 0 { i / 2 } else { -1 })
            .collect();
        let down = g.upload(&own).unwrap();
        let part = ops::Route {
            loc: down.ptr(),
            shared_here: false,
            ..route
        };
        ops::router_topk(&g, dl.ptr(), e + 1, part, ids.ptr(), w.ptr(), sg.ptr(), 1).unwrap();
        let want_ids: Vec<i32> = idx.iter().map(|&i| own[i]).chain([-1]).collect();
        assert_eq!(g.read(&ids, k + 1).unwrap(), want_ids, "own ids E={e}");
        let want_own: Vec<f32> = want
            .iter()
            .zip(&idx)
            .map(|(&v, &i)| if own[i] < 0 { 0.0 } else { v })
            .chain([0.0])
            .collect();
        assert_close("own weights", &g.read(&w, k + 1).unwrap(), &want_own, 1e-5);
        // Ties (seven distinct logits) go to the lower index.
        let tied: Vec<f32> = (0..=e).map(|i| (i % 7) as f32 * 0.5).collect();
        let dtied = g.upload(&tied).unwrap();
        let (tids, tw, tsg) = (
            g.zeros::<i32>(k + 1).unwrap(),
            g.zeros::<f32>(k + 1).unwrap(),
            g.zeros::<f32>(1).unwrap(),
        );
        let (ti, tp) = (tids.ptr(), dtied.ptr());
        ops::router_topk(&g, tp, e + 1, route, ti, tw.ptr(), tsg.ptr(), 1).unwrap();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| tied[b].total_cmp(&tied[a]));
        let want_tied: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
        assert_eq!(g.read(&tids, k).unwrap(), want_tied, "router ties E={e}");

        let h = 77;
        let y = rand_vec(&mut r, k * h, -1.0, 1.0);
        let ys = rand_vec(&mut r, h, -1.0, 1.0);
        let (dy, dys, delta) = (
            g.upload(&y).unwrap(),
            g.upload(&ys).unwrap(),
            g.zeros::<f32>(h).unwrap(),
        );
        ops::moe_combine(
            &g,
            dy.ptr(),
            w.ptr(),
            dys.ptr(),
            sg.ptr(),
            delta.ptr(),
            k,
            h,
            1,
            false,
        )
        .unwrap();
        let wv = g.read(&w, k).unwrap();
        let want: Vec<f32> = (0..h)
            .map(|i| (0..k).map(|j| wv[j] * y[j * h + i]).sum::<f32>() + sigmoid(logits[e]) * ys[i])
            .collect();
        assert_close("moe combine", &g.read(&delta, h).unwrap(), &want, 1e-5);
        // Fused with the residual add and the norm after it: bitwise the two launches.
        let x0 = rand_vec(&mut r, h, -2.0, 2.0);
        let scale = rand_vec(&mut r, h, 0.5, 1.5);
        let (xa, xb, dsc) = (
            g.upload(&x0).unwrap(),
            g.upload(&x0).unwrap(),
            g.upload(&scale).unwrap(),
        );
        let (na, nb) = (g.zeros::<f32>(h).unwrap(), g.zeros::<f32>(h).unwrap());
        ops::add_rmsnorm(&g, xa.ptr(), delta.ptr(), dsc.ptr(), na.ptr(), 1, h, 1e-6).unwrap();
        ops::moe_combine_norm(
            &g,
            dy.ptr(),
            w.ptr(),
            dys.ptr(),
            sg.ptr(),
            xb.ptr(),
            dsc.ptr(),
            nb.ptr(),
            k,
            h,
            1,
            1e-6,
        )
        .unwrap();
        assert_eq!(
            g.read(&xa, h).unwrap(),
            g.read(&xb, h).unwrap(),
            "combine_norm residual"
        );
        assert_eq!(
            g.read(&na, h).unwrap(),
            g.read(&nb, h).unwrap(),
            "combine_norm out"
        );
        // Accumulated into the residual: bitwise combine_norm's residual.
        let xc = g.upload(&x0).unwrap();
        ops::moe_combine(
            &g,
            dy.ptr(),
            w.ptr(),
            dys.ptr(),
            sg.ptr(),
            xc.ptr(),
            k,
            h,
            1,
            true,
        )
        .unwrap();
        assert_eq!(
            g.read(&xc, h).unwrap(),
            g.read(&xb, h).unwrap(),
            "combine accumulate"
        );
    }
    let (v, h) = (1003, 65);
    let table: Vec<u16> = rand_vec(&mut r, v * h, -1.0, 1.0)
        .iter()
        .map(|&x| f32_to_bf16(x))
        .collect();
    let (dt, tok, pos, x) = (
        g.upload(&table).unwrap(),
        g.upload(&[417i32]).unwrap(),
        g.upload(&[5i32]).unwrap(),
        g.zeros::<f32>(h).unwrap(),
    );
    ops::embed_bf16(&g, dt.ptr(), tok.ptr(), x.ptr(), h, 1).unwrap();
    let want: Vec<f32> = table[417 * h..418 * h]
        .iter()
        .map(|&b| bf16_to_f32(b))
        .collect();
    assert_close("embed", &g.read(&x, h).unwrap(), &want, 0.0);
    // Affine tables in each parameter form, groups of 16 included: rows 417 and 2 of two
    // lookups, q·scale + bias with the parameters the kernels apply (one fma).
    let hq = 64;
    let w = rand_vec(&mut r, v * hq, -1.0, 1.0);
    let toks = g.upload(&[417i32, 2]).unwrap();
    let xq = g.zeros::<f32>(2 * hq).unwrap();
    for (bits, group, params) in [
        (4u32, 32usize, AffineParams::Bf16),
        (8, 64, AffineParams::F16Zero),
        (4, 16, AffineParams::F32),
        (8, 16, AffineParams::F32),
    ] {
        let a = common::Affine::with_params(&g, &w, hq, (group, bits), params);
        ops::embed(&g, a.matvec(v, hq), toks.ptr(), xq.ptr(), hq, 2).unwrap();
        let d = a.dequant();
        let want: Vec<f32> = [417, 2]
            .iter()
            .flat_map(|&t| d[t * hq..(t + 1) * hq].to_vec())
            .collect();
        let name = format!("embed {bits}-bit group {group} {params:?}");
        assert_close(&name, &g.read(&xq, 2 * hq).unwrap(), &want, 0.0);
    }
    let mut logits = rand_vec(&mut r, 248_320, -1.0, 1.0);
    logits[200_001] = 5.0;
    logits[7] = 5.0;
    let dl = g.upload(&logits).unwrap();
    let greedy = g.upload(&SampleParams::default().words(0)).unwrap();
    let slot0 = g.upload(&[0i32]).unwrap();
    let one_row = Batch {
        rows: 1,
        slots: slot0.ptr(),
    };
    ops::sample_advance(
        &g,
        dl.ptr(),
        logits.len(),
        greedy.ptr(),
        tok.ptr(),
        pos.ptr(),
        one_row,
        None,
        true,
    )
    .unwrap();
    assert_eq!(
        g.read(&tok, 1).unwrap()[0],
        7,
        "argmax takes the lowest index on ties"
    );
    assert_eq!(g.read(&pos, 1).unwrap()[0], 6);
    // A vocabulary that is not a multiple of 4 takes the scalar scan.
    let mut odd = rand_vec(&mut r, 1003, -1.0, 1.0);
    odd[1001] = 5.0;
    odd[9] = 5.0;
    let dl = g.upload(&odd).unwrap();
    ops::sample_advance(
        &g,
        dl.ptr(),
        odd.len(),
        greedy.ptr(),
        tok.ptr(),
        pos.ptr(),
        one_row,
        None,
        true,
    )
    .unwrap();
    assert_eq!(g.read(&tok, 1).unwrap()[0], 9, "odd vocabulary argmax");
}

/// Draws from the GPU sampler against the CPU's filtered softmax: top-k, top-p and min-p keep
/// exactly the expected tokens, frequencies follow the probabilities, and a seed repeats.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sampling_follows_the_filtered_softmax() {
    let g = gpu();
    let v = 1000;
    let mut logits = vec![-10.0f32; v];
    for (i, l) in [(3usize, 2.0f32), (42, 1.5), (500, 1.0), (999, 0.0)] {
        logits[i] = l;
    }
    let dl = g.upload(&logits).unwrap();
    let (tok, pos) = (g.zeros::<i32>(1).unwrap(), g.zeros::<i32>(1).unwrap());
    let slot0 = g.upload(&[0i32]).unwrap();
    let one_row = Batch {
        rows: 1,
        slots: slot0.ptr(),
    };
    let draw = |p: SampleParams, n: usize| -> Vec<usize> {
        let params = g.upload(&p.words(0)).unwrap();
        (0..n)
            .map(|_| {
                ops::sample_advance(
                    &g,
                    dl.ptr(),
                    v,
                    params.ptr(),
                    tok.ptr(),
                    pos.ptr(),
                    one_row,
                    None,
                    true,
                )
                .unwrap();
                g.read(&tok, 1).unwrap()[0] as usize
            })
            .collect()
    };
    let base = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 11,
    };
    let n = 3000;
    // top-k 3 at temperature 1: exactly {3, 42, 500} with softmax weights.
    let got = draw(SampleParams { top_k: 3, ..base }, n);
    let z: f32 = [2.0f32, 1.5, 1.0].iter().map(|l| l.exp()).sum();
    for (t, l) in [(3usize, 2.0f32), (42, 1.5), (500, 1.0)] {
        let f = got.iter().filter(|&&x| x == t).count() as f32 / n as f32;
        assert!(
            (f - l.exp() / z).abs() < 0.035,
            "top-k: token {t} drawn {f}, want {}",
            l.exp() / z
        );
    }
    assert!(
        got.iter().all(|t| [3, 42, 500].contains(t)),
        "top-k kept another token"
    );
    // top-p 0.6 keeps the smallest most-likely set holding 60% of the mass: {3, 42}.
    let mut p = logits.clone();
    deltamoe_compute::cpu::act::softmax(&mut p);
    assert!(p[3] < 0.6 && p[3] + p[42] >= 0.6);
    assert!(draw(SampleParams { top_p: 0.6, ..base }, 500)
        .iter()
        .all(|t| [3, 42].contains(t)));
    // min-p 0.5 keeps p ≥ p_max / 2 after the temperature: {3, 42} at T = 1 (z = 0, −0.5 ≥ ln 0.5),
    // only {3} at T = 0.5 (token 42's z becomes −1).
    let got = draw(SampleParams { min_p: 0.5, ..base }, 500);
    assert!(got.iter().all(|t| [3, 42].contains(t)) && got.contains(&42));
    let got = draw(
        SampleParams {
            min_p: 0.5,
            temperature: 0.5,
            ..base
        },
        200,
    );
    assert!(got.iter().all(|&t| t == 3));
    // Same seed, same draws; temperature 0 is the argmax.
    assert_eq!(draw(base, 50), draw(base, 50));
    assert!(draw(
        SampleParams {
            temperature: 0.0,
            ..base
        },
        5
    )
    .iter()
    .all(|&t| t == 3));
}
