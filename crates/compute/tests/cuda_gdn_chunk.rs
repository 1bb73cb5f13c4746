//! The chunked gated delta rule on the GPU (`cuda::gdn_chunk`, kernels/gdn_chunk.cu) against the
//! CPU recurrent form on random inputs with odd sizes. Needs a GPU: `#[ignore]`d here; each test
//! returns early, saying why, where no CUDA device is usable.
//!
//! Tolerance: the CPU reference runs in f32 on the same bf16-rounded q, k, v that the GPU reads,
//! so what remains is the kernels' own bf16 rounding of tensor-core operands (the state copy, Y,
//! V', T = (I+A)⁻¹ and P, each rounded to 8 significant bits, relative 2⁻⁹ ≈ 2e-3) with f32
//! accumulation. Each output sums O(Dk + 64) such products, so independent roundings leave an
//! error of a few 1e-3 of the largest value; we allow 2e-2 of max|want| and print the measured
//! error.

use deltamoe_compute::cpu::gdn::{gdn_recurrent, GdnInputs, GdnShape};
use deltamoe_compute::cpu::norm::l2_normalize;
use deltamoe_compute::cuda::gdn_chunk::{
    gdn_chunk_prep, gdn_chunk_state, workspace_bytes, GdnChunkBufs, GdnChunkDims, StateTile,
};
use deltamoe_compute::cuda::{unavailable_reason, DevBuf, Gpu};
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};
use rand::{Rng, SeedableRng};

const TOL: f32 = 2e-2;

fn gpu() -> Option<Gpu> {
    if let Some(why) = unavailable_reason() {
        eprintln!("skipped: {why}");
        return None;
    }
    Some(Gpu::new(0).expect("a CUDA device"))
}

/// Max |got − want| relative to max |want| (at least 1).
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err.is_finite(), "non-finite output");
    err / scale
}

/// One random problem; q, k, v already rounded to bf16 (`*_bits` is what the GPU gets).
struct Case {
    d: GdnChunkDims,
    q_bits: Vec<u16>,
    k_bits: Vec<u16>,
    v_bits: Vec<u16>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn bf16_round(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| f32_to_bf16(v)).collect()
}

fn unbits(x: &[u16]) -> Vec<f32> {
    x.iter().map(|&b| bf16_to_f32(b)).collect()
}

/// Random inputs. `norm_qk`: raw q, k (the kernels normalise); else q, k are normalised and q
/// scaled here before rounding. `g_lo`: the most negative log decay.
fn case(d: GdnChunkDims, norm_qk: bool, g_lo: f32, seed: u64) -> Case {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut u = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|_| r.random_range(lo..hi)).collect()
    };
    let nk = d.t * d.hk * d.dk;
    let mut q = u(nk, -1.0, 1.0);
    let mut k = u(nk, -1.0, 1.0);
    if !norm_qk {
        l2_normalize(&mut q, d.dk, 1e-6);
        l2_normalize(&mut k, d.dk, 1e-6);
        let s = 1.0 / (d.dk as f32).sqrt();
        q.iter_mut().for_each(|v| *v *= s);
    }
    Case {
        d,
        q_bits: bf16_round(&q),
        k_bits: bf16_round(&k),
        v_bits: bf16_round(&u(d.t * d.hv * d.dv, -1.0, 1.0)),
        g: u(d.t * d.hv, g_lo, 0.0),
        beta: u(d.t * d.hv, 0.0, 1.0),
        state: u(d.hv * d.dk * d.dv, -0.5, 0.5),
    }
}

/// CPU reference: recurrent form in f32 on the bf16-rounded inputs; returns (out, state).
fn cpu_ref(c: &Case, norm_qk: bool) -> (Vec<f32>, Vec<f32>) {
    let d = c.d;
    let (mut q, mut k) = (unbits(&c.q_bits), unbits(&c.k_bits));
    if norm_qk {
        l2_normalize(&mut q, d.dk, 1e-6);
        l2_normalize(&mut k, d.dk, 1e-6);
        let s = 1.0 / (d.dk as f32).sqrt();
        q.iter_mut().for_each(|v| *v *= s);
    }
    let v = unbits(&c.v_bits);
    let shape = GdnShape {
        n_k_heads: d.hk,
        n_v_heads: d.hv,
        k_dim: d.dk,
        v_dim: d.dv,
    };
    let x = GdnInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &c.g,
        beta: &c.beta,
    };
    let mut state = c.state.clone();
    let mut out = vec![0.0; d.t * d.hv * d.dv];
    gdn_recurrent(&x, shape, &mut state, &mut out);
    (out, state)
}

/// Device copies of one case.
struct Dev {
    q: DevBuf<u16>,
    k: DevBuf<u16>,
    v: DevBuf<u16>,
    g: DevBuf<f32>,
    beta: DevBuf<f32>,
    state: DevBuf<f32>,
    out: DevBuf<f32>,
    ws: DevBuf<u8>,
}

impl Dev {
    fn new(gpu: &Gpu, c: &Case) -> Dev {
        let d = c.d;
        Dev {
            q: gpu.upload(&c.q_bits).unwrap(),
            k: gpu.upload(&c.k_bits).unwrap(),
            v: gpu.upload(&c.v_bits).unwrap(),
            g: gpu.upload(&c.g).unwrap(),
            beta: gpu.upload(&c.beta).unwrap(),
            state: gpu.upload(&c.state).unwrap(),
            out: gpu.zeros(d.t * d.hv * d.dv).unwrap(),
            ws: gpu.zeros(workspace_bytes(d)).unwrap(),
        }
    }

    /// Buffers for tokens [t0, t0 + d.t) of a case laid out for `full` tokens.
    fn bufs(&self, full: GdnChunkDims, t0: usize) -> GdnChunkBufs {
        GdnChunkBufs {
            q: self.q.at(t0 * full.hk * full.dk),
            k: self.k.at(t0 * full.hk * full.dk),
            v: self.v.at(t0 * full.hv * full.dv),
            g: self.g.at(t0 * full.hv),
            beta: self.beta.at(t0 * full.hv),
            state: self.state.ptr(),
            out: self.out.at(t0 * full.hv * full.dv),
            workspace: self.ws.ptr(),
        }
    }
}

fn run(gpu: &Gpu, c: &Case, norm_qk: bool, tile: StateTile) -> (Vec<f32>, Vec<f32>) {
    let d = c.d;
    let dev = Dev::new(gpu, c);
    let b = dev.bufs(d, 0);
    gdn_chunk_prep(gpu, b, d, norm_qk).unwrap();
    gdn_chunk_state(gpu, b, d, tile).unwrap();
    (
        gpu.read(&dev.out, d.t * d.hv * d.dv).unwrap(),
        gpu.read(&dev.state, d.hv * d.dk * d.dv).unwrap(),
    )
}

fn dims(t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> GdnChunkDims {
    GdnChunkDims { t, hk, hv, dk, dv }
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so)"]
fn gdn_chunk_kernels_compile_for_hopper_and_ampere() {
    for arch in ["sm_90", "sm_80"] {
        deltamoe_compute::cuda::kernels::compile_all(arch).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_prefill_matches_cpu_recurrent_on_odd_sizes() {
    let Some(gpu) = gpu() else { return };
    // (dims, kernels normalise q/k, most negative g)
    let cases = [
        (dims(1, 1, 2, 128, 128), false, -0.5),
        (dims(63, 2, 4, 128, 128), true, -0.5),
        (dims(64, 1, 2, 128, 128), false, -3.0),
        (dims(65, 1, 2, 40, 24), true, -0.5),
        (dims(200, 2, 4, 128, 128), true, -0.05),
        (dims(130, 1, 3, 33, 72), false, -1.0),
        (dims(257, 1, 2, 128, 100), true, -0.2),
    ];
    let mut worst = (0.0f32, 0.0f32);
    for (i, &(d, norm, g_lo)) in cases.iter().enumerate() {
        let c = case(d, norm, g_lo, 100 + i as u64);
        let (want_o, want_s) = cpu_ref(&c, norm);
        for tile in [StateTile::V32, StateTile::V64] {
            let (o, s) = run(&gpu, &c, norm, tile);
            let (eo, es) = (rel_err(&o, &want_o), rel_err(&s, &want_s));
            eprintln!("{d:?} norm {norm} g≥{g_lo} {tile:?}: out err {eo:.2e}, state err {es:.2e}");
            assert!(eo <= TOL && es <= TOL, "{d:?} {tile:?}: {eo} / {es}");
            worst = (worst.0.max(eo), worst.1.max(es));
        }
    }
    eprintln!(
        "worst relative error: out {:.2e}, state {:.2e}",
        worst.0, worst.1
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn real_head_shape_matches_cpu_recurrent() {
    let Some(gpu) = gpu() else { return };
    // Qwen3.5 head counts (16 key heads, 32 value heads, 128 dims), a few chunks.
    let d = dims(300, 16, 32, 128, 128);
    let c = case(d, true, -0.3, 7);
    let (want_o, want_s) = cpu_ref(&c, true);
    let (o, s) = run(&gpu, &c, true, StateTile::V32);
    let (eo, es) = (rel_err(&o, &want_o), rel_err(&s, &want_s));
    eprintln!("{d:?}: out err {eo:.2e}, state err {es:.2e}");
    assert!(eo <= TOL && es <= TOL);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_prefills_continue_the_state() {
    let Some(gpu) = gpu() else { return };
    // 150 tokens as 70 + 80 (neither a multiple of 64), the second call starting from the
    // state the first one wrote; compared with the CPU over all 150.
    let full = dims(150, 2, 4, 128, 64);
    let c = case(full, true, -0.4, 11);
    let (want_o, want_s) = cpu_ref(&c, true);
    let dev = Dev::new(&gpu, &c);
    for (t0, n) in [(0usize, 70usize), (70, 80)] {
        let d = GdnChunkDims { t: n, ..full };
        let b = dev.bufs(full, t0);
        gdn_chunk_prep(&gpu, b, d, true).unwrap();
        gdn_chunk_state(&gpu, b, d, StateTile::V32).unwrap();
    }
    let o = gpu.read(&dev.out, 150 * 4 * 64).unwrap();
    let s = gpu.read(&dev.state, 4 * 128 * 64).unwrap();
    let (eo, es) = (rel_err(&o, &want_o), rel_err(&s, &want_s));
    eprintln!("70 + 80 tokens: out err {eo:.2e}, state err {es:.2e}");
    assert!(eo <= TOL && es <= TOL);
}

/// The kernel against its CPU twin with the same bf16 roundings (`cpu::gdn_bf16`, raw q and k):
/// what differs is f32 summation order only, and the occasional intermediate that it moves
/// across a bf16 rounding boundary (one bf16 step, 2⁻⁸ relative, in one element), so both
/// should agree far closer than either agrees with the f32 recurrence. Bound: 2e-3 of max|want|.
#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_prefill_matches_its_cpu_twin() {
    use deltamoe_compute::cpu::gdn_bf16::gdn_chunked_bf16;
    let Some(gpu) = gpu() else { return };
    for (i, &d) in [
        dims(65, 1, 2, 40, 24),
        dims(200, 2, 4, 128, 128),
        dims(257, 1, 2, 128, 100),
    ]
    .iter()
    .enumerate()
    {
        let c = case(d, true, -0.5, 40 + i as u64);
        let (q, k, v) = (unbits(&c.q_bits), unbits(&c.k_bits), unbits(&c.v_bits));
        let x = GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &c.g,
            beta: &c.beta,
        };
        let shape = GdnShape {
            n_k_heads: d.hk,
            n_v_heads: d.hv,
            k_dim: d.dk,
            v_dim: d.dv,
        };
        let mut state = c.state.clone();
        let mut out = vec![0.0; d.t * d.hv * d.dv];
        gdn_chunked_bf16(&x, shape, &mut state, &mut out);
        let (ref_out, ref_state) = cpu_ref(&c, true);
        for tile in [StateTile::V32, StateTile::V64] {
            let (got_out, got_state) = run(&gpu, &c, true, tile);
            let (eo, es) = (rel_err(&got_out, &out), rel_err(&got_state, &state));
            let (fo, fs) = (rel_err(&got_out, &ref_out), rel_err(&got_state, &ref_state));
            eprintln!(
                "{d:?} {tile:?}: vs twin out {eo:.2e} state {es:.2e}; vs f32 recurrence out {fo:.2e} state {fs:.2e}"
            );
            assert!(
                eo < 2e-3 && es < 2e-3,
                "{d:?} {tile:?}: out {eo} state {es}"
            );
        }
    }
}
