//! The chunked gated delta rule in GPU prefill (`GdnPrefill::Chunked`, what the default `Auto`
//! runs for passes of 64 tokens or more) with the default bf16 products (`PrefillGemm::Bf16`)
//! on every fixture, against the CPU engine run with the same roundings. Needs a GPU:
//! `#[ignore]`d here, run by `scripts/gpu-tests.sh`.
//!
//! The bf16 products round each projection's input rows to bf16 and multiply bf16 weights
//! (affine ones dequantized to bf16 once), summing in f32; `Qwen3Hybrid::set_bf16_products` runs
//! the CPU engine's multi-token passes with those roundings (operands bit-identical to the
//! device's, `cuda_gemm.rs`).
//!
//! The chunked kernel reads q, k, v as bf16 and rounds its tensor-core operands (T, P, the state
//! copy, Y, V') to bf16; `Qwen3Hybrid::set_gdn_gpu_roundings` runs the CPU engine's multi-token
//! passes through a twin of the kernel with the same roundings (`cpu::gdn_bf16`; kernel and twin
//! agree to ~1e-4 on random inputs, `cuda_gdn_chunk.rs`). The fixtures' tiny random GDN layers
//! are chaotic under such roundings: the twin's logits differ from transformers' by up to
//! ~6e-1 of max|ref| (the f32 path: ~1e-5), and GPU and twin, which differ only in f32 summation
//! order, end up as far apart (with the bf16 products, measured on an H100: 1e-3 to 2.8e-1,
//! short prompts included). So the bounds are relative to what the same roundings do on the CPU
//! over a fixture's cases (its prompts and the state case below):
//! - against transformers, the GPU's max error is at most twice the twin's largest over the
//!   fixture's cases (never less than the foundation's 5e-3), and a row's argmax may differ from
//!   the reference's only where the reference's top two logits are closer than that bound (a
//!   near tie the roundings can flip);
//! - the state a chunked prefill leaves: the prefill's rows and the next step's logits against
//!   token-by-token decode on the GPU, under the same rule relative to the twin's prefill against
//!   CPU decode steps.
//!
//! The distance to the twin and whether greedy continuations match are printed.

#[allow(dead_code)]
mod common;

use std::sync::Arc;

use common::{fixtures, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::Engine;
use deltamoe_model::gpu::{GdnPrefill, GpuModel, PREFILL_MAX_ROWS};
use deltamoe_model::{Logits, Qwen3Hybrid};

fn argmax(r: &[f32]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

/// (max |got − want| / max|want|, rows whose argmax agrees, rows).
fn compare(got: &[f32], want: &[f32], vocab: usize) -> (f32, usize, usize) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let agree = got
        .chunks(vocab)
        .zip(want.chunks(vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    (err / scale, agree, want.len() / vocab)
}

/// The CPU engine with the chunked kernel's and the bf16 products' roundings in multi-token
/// passes.
fn cpu_twin(dir: &std::path::Path) -> Engine {
    let mut m = Qwen3Hybrid::load(dir).unwrap();
    m.set_gdn_gpu_roundings(true);
    m.set_bf16_products(true);
    Engine::new(m)
}

/// Greedy continuation of `n` tokens after `logits` (the prompt's last row) on the CPU engine.
fn cpu_greedy(e: &mut Engine, id: deltamoe_engine::SeqId, last: &[f32], n: usize) -> Vec<u32> {
    let mut out = vec![argmax(last) as u32];
    while out.len() < n {
        let l = e.decode(&[(id, out[out.len() - 1])]).unwrap().remove(0);
        out.push(argmax(&l) as u32);
    }
    out
}

/// A GPU result, the same-roundings CPU run's and their reference (logits `[rows, vocab]`).
type Case = (String, Vec<f32>, Vec<f32>, Vec<f32>);

/// The largest error of the same-roundings CPU runs of one fixture against their references:
/// how far this fixture's roundings move its logits (its sensitivity; the bound's base).
fn fixture_spread(cases: &[Case], vocab: usize) -> f32 {
    cases
        .iter()
        .fold(0f32, |m, (_, _, cpu, r)| m.max(compare(cpu, r, vocab).0))
}

/// The GPU's (result, reference) pair is within the bound the fixture's same-roundings CPU runs
/// set: max error at most twice `spread` (the largest CPU error over the fixture's cases, at
/// least 5e-3 of max|ref|: the GPU and the CPU differ in f32 summation order, which these
/// chaotic fixtures amplify as much as the roundings themselves, so one short prompt whose CPU
/// error is small by chance does not set the bound); a row's argmax may differ from the
/// reference's only where the reference's top two logits are closer than that bound (a near
/// tie the roundings can flip). Returns the failure, if any.
fn check(
    name: &str,
    gpu: (&[f32], &[f32]),
    cpu: (&[f32], &[f32]),
    vocab: usize,
    spread: f32,
) -> Option<String> {
    let (e_gpu, a_gpu, rows) = compare(gpu.0, gpu.1, vocab);
    let (e_cpu, a_cpu, _) = compare(cpu.0, cpu.1, vocab);
    let bound = (2.0 * spread).max(5e-3);
    eprintln!(
        "{name}: gpu err {e_gpu:.2e} argmax {a_gpu}/{rows}; cpu same roundings err {e_cpu:.2e} argmax {a_cpu}/{rows}"
    );
    if e_gpu > bound {
        return Some(format!("{name}: err {e_gpu:.3e} > bound {bound:.3e}"));
    }
    let scale = gpu.1.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (row, (g, r)) in gpu.0.chunks(vocab).zip(gpu.1.chunks(vocab)).enumerate() {
        let (ag, ar) = (argmax(g), argmax(r));
        if ag != ar && r[ar] - r[ag] > bound * scale {
            return Some(format!(
                "{name}: row {row} argmax {ag} vs {ar}, reference margin {:.3e} > {:.3e}",
                r[ar] - r[ag],
                bound * scale
            ));
        }
    }
    None
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn chunked_gdn_prefill_is_within_the_bound_of_its_roundings() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let mut failures = Vec::new();
    for dir in fixtures() {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let vocab = model.config().vocab_size;
        let mut gm = GpuModel::upload(&model, gpu.clone()).unwrap();
        gm.reserve(2, 512).unwrap();
        gm.set_prefill_gdn(GdnPrefill::Chunked);
        let mut cpu = cpu_twin(&dir);
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut cases: Vec<Case> = Vec::new();
        for (i, p) in prompts(&dir).iter().enumerate() {
            let mut s = gm.new_seq().unwrap();
            let got = gm
                .prefill(&mut s, &p.tokens, Logits::All, PREFILL_MAX_ROWS)
                .unwrap();
            let id = cpu.add_sequence().unwrap();
            let twin = cpu.prefill(id, &p.tokens, None, Logits::All).unwrap();
            let (e_twin, a_twin, rows) = compare(&got, &twin, vocab);
            eprintln!("{name} prompt{i} vs the twin: err {e_twin:.2e}, argmax {a_twin}/{rows}");
            let name_i = format!("{name} prompt{i} vs transformers");
            // Greedy continuations after the prefill (decode steps are f32 on both).
            let mut out = vec![argmax(&got[got.len() - vocab..]) as u32];
            while out.len() < p.greedy.len() {
                let t = gm.step(&mut s, out[out.len() - 1]).unwrap();
                out.push(t);
            }
            gm.release(s);
            let want = cpu_greedy(&mut cpu, id, &twin[twin.len() - vocab..], p.greedy.len());
            cpu.remove_sequence(id);
            let same = |a: &[u32], b: &[u32]| if a == b { "equals" } else { "differs from" };
            eprintln!(
                "{name} prompt{i}: greedy after the prefill {} the twin's, {} transformers'",
                same(&out, &want),
                same(&out, &p.greedy)
            );
            cases.push((name_i, got, twin, p.logits.clone()));
        }
        // Prefill of all but the last token vs the same tokens decoded step by step, on the GPU
        // (chunked) and on the CPU (the twin), then one more step on each.
        let p = &prompts(&dir)[0];
        let (head, next) = (
            &p.tokens[..p.tokens.len() - 1],
            p.tokens[p.tokens.len() - 1],
        );
        let mut a = gm.new_seq().unwrap();
        let mut pre = gm
            .prefill(&mut a, head, Logits::All, PREFILL_MAX_ROWS)
            .unwrap();
        let mut b = gm.new_seq().unwrap();
        let mut steps = Vec::new();
        for &t in head {
            gm.step(&mut b, t).unwrap();
            steps.extend(gm.logits(0).unwrap());
        }
        let ta = gm.step(&mut a, next).unwrap();
        pre.extend(gm.logits(0).unwrap());
        let tb = gm.step(&mut b, next).unwrap();
        steps.extend(gm.logits(0).unwrap());
        gm.release(a);
        gm.release(b);
        let (ca, cb) = (cpu.add_sequence().unwrap(), cpu.add_sequence().unwrap());
        let mut cpu_pre = cpu.prefill(ca, head, None, Logits::All).unwrap();
        cpu_pre.extend(cpu.decode(&[(ca, next)]).unwrap().remove(0));
        let mut cpu_steps = Vec::new();
        for &t in head.iter().chain([&next]) {
            cpu_steps.extend(cpu.decode(&[(cb, t)]).unwrap().remove(0));
        }
        let name_s = format!("{name} chunked prefill + 1 step vs decode");
        cases.push((name_s, pre, cpu_pre, cpu_steps.clone()));
        let spread = fixture_spread(&cases, vocab);
        let last = cases.len() - 1;
        for (j, (n, g, c, r)) in cases.iter().enumerate() {
            // The state case's GPU reference is the GPU's own decode steps.
            let gpu_ref = if j == last { &steps } else { r };
            failures.extend(check(n, (g, gpu_ref), (c, r), vocab, spread));
        }
        eprintln!("{name}: next token after the chunked prefill {ta}, after decode steps {tb}");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
