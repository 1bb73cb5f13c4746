//! The golden fixtures end to end on CUDA (needs a GPU: `#[ignore]`d here, run by
//! `scripts/gpu-tests.sh`). The CUDA path keeps f32 activations and the same bf16 (or MLX
//! affine) weights as the CPU engine, so the foundation tolerance applies unchanged:
//! 5e-3·max|ref| with ≥ 98% argmax agreement against transformers, identical greedy tokens.
//! These tests run prefill's products exactly (`PrefillGemm::Exact`) and its delta rule in f32
//! (`GdnPrefill::Recurrent`); the defaults, bf16 products and the chunked rule for long passes,
//! are checked in `chunked_cuda.rs`.

mod common;

use std::sync::Arc;

use common::{check_logits, fixtures, gguf_prompts, greedy, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::Engine;
use deltamoe_model::gpu::{GdnPrefill, PrefillGemm};
use deltamoe_model::{Logits, Qwen3Hybrid};

fn engine(dir: &std::path::Path, gpu: &Arc<Gpu>) -> Engine {
    let mut e = Engine::new_cuda(Qwen3Hybrid::load(dir).unwrap(), gpu.clone(), 4096, 8).unwrap();
    e.set_gdn_prefill(GdnPrefill::Recurrent);
    e.set_prefill_gemm(PrefillGemm::Exact);
    e
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_logits_and_greedy_match_transformers() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for dir in fixtures() {
        let mut e = engine(&dir, &gpu);
        let vocab = e.config().vocab_size;
        for (i, p) in prompts(&dir).iter().enumerate() {
            let id = e.add_sequence().unwrap();
            let got = e.prefill(id, &p.tokens, None, Logits::All).unwrap();
            e.remove_sequence(id);
            check_logits(
                &format!("cuda {} prompt{i}", dir.display()),
                &got,
                &p.logits,
                vocab,
            );
            let out = greedy(&mut e, p);
            assert_eq!(out, p.greedy, "cuda greedy {} prompt{i}", dir.display());
        }
    }
}

/// The GGUF files of `fixtures/gguf_quant` on CUDA in one pass, passes of one token and of 37,
/// against the CPU engine on the weights the GPU holds for them (`gpu::held_checkpoint`: every
/// affine block type's values exactly, K-quants' and mixed stacks' parameters as f32, Q6_K's codes
/// as 8-bit ones in groups of 16, the embedding as its blocks; the f32 router as bf16 values), and
/// against transformers on the exact (gguf-py-dequantized) weights: the held weights are within
/// that bound on the CPU (`gguf.rs`, held models).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_gguf_files_match_the_held_weights_and_transformers() {
    use deltamoe_model::gpu::held_checkpoint;
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for (file, ps) in gguf_prompts() {
        let mut e = engine(&file, &gpu);
        let vocab = e.config().vocab_size;
        let held = held_checkpoint(Qwen3Hybrid::load(&file).unwrap().checkpoint()).unwrap();
        let mut cpu = Engine::new(Qwen3Hybrid::new(held));
        for (i, p) in ps.iter().enumerate() {
            let id = cpu.add_sequence().unwrap();
            let want = cpu.prefill(id, &p.tokens, None, Logits::All).unwrap();
            cpu.remove_sequence(id);
            for chunk in [None, Some(1), Some(37)] {
                let id = e.add_sequence().unwrap();
                let got = e.prefill(id, &p.tokens, chunk, Logits::All).unwrap();
                e.remove_sequence(id);
                let name = format!("cuda {} prompt{i} chunk {chunk:?}", file.display());
                check_logits(&format!("{name} (held)"), &got, &want, vocab);
                check_logits(&format!("{name} (transformers)"), &got, &p.logits, vocab);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_sampling_is_seeded_and_top_k_1_is_greedy() {
    use deltamoe_engine::sampler::SamplingParams;
    use deltamoe_engine::{generate, GenerateRequest};
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("qwen3_5_moe"))
        .unwrap();
    let mut e = engine(&dir, &gpu);
    let p = &prompts(&dir)[0];
    let mut run = |sampling: SamplingParams| {
        let req = GenerateRequest {
            prompt: &p.tokens,
            max_tokens: p.greedy.len(),
            sampling,
            eos: &[],
            prefill_chunk: None,
        };
        generate(&mut e, &req, |_| Ok(true)).unwrap().0
    };
    let hot = SamplingParams {
        temperature: 1.5,
        top_k: 50,
        top_p: 0.95,
        seed: 3,
        ..Default::default()
    };
    let (a, b) = (run(hot.clone()), run(hot.clone()));
    assert_eq!(a, b, "same seed, same tokens");
    assert_ne!(
        a,
        run(SamplingParams {
            seed: 4,
            ..hot.clone()
        }),
        "another seed draws otherwise"
    );
    assert_eq!(
        run(SamplingParams { top_k: 1, ..hot }),
        p.greedy,
        "top-k 1 is greedy"
    );
}

/// The fixtures' shared experts differ in size from their routed experts; real models' do not,
/// and then the shared expert runs stacked with the routed ones. Check that path against the CPU
/// engine on the same (synthetic bf16) weights: the exact products against the exact CPU, the
/// bf16 products (the grouped bf16 kernel for the stacked experts) against the CPU with the same
/// roundings (`Qwen3Hybrid::set_bf16_products`; only f32 summation order differs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_with_stacked_shared_expert_matches_cpu() {
    use deltamoe_compute::DType;
    use deltamoe_model::{ModelConfig, WeightStore};
    let cfg = r#"{"model_type": "qwen3_5_moe_text", "vocab_size": 1000, "hidden_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "max_position_embeddings": 512}"#;
    let config = || ModelConfig::from_json_str(cfg, std::path::Path::new("inline")).unwrap();
    let load =
        || Qwen3Hybrid::from_store(config(), &WeightStore::synthetic(DType::BF16, 5)).unwrap();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 1000).collect();
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for gemm in [PrefillGemm::Exact, PrefillGemm::Bf16] {
        let mut model = load();
        model.set_bf16_products(gemm == PrefillGemm::Bf16);
        let mut cpu = Engine::new(model);
        let id = cpu.add_sequence().unwrap();
        let want = cpu.prefill(id, &tokens, None, Logits::All).unwrap();
        let mut e = Engine::new_cuda(load(), gpu.clone(), 512, 1).unwrap();
        e.set_gdn_prefill(GdnPrefill::Recurrent);
        e.set_prefill_gemm(gemm);
        let id = e.add_sequence().unwrap();
        let got = e.prefill(id, &tokens, None, Logits::All).unwrap();
        check_logits(
            &format!("stacked shared expert, {gemm:?}"),
            &got,
            &want,
            1000,
        );
    }
}

/// Greedy decoding of several sequences in one batched step (rows at different positions)
/// gives each sequence the tokens it gets alone (which equal transformers'); a snapshot
/// restored into another slot resumes with bitwise the same logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_batched_steps_and_snapshots_match_single_sequences() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for dir in fixtures() {
        let mut e = engine(&dir, &gpu);
        let ps = prompts(&dir);
        let rows: Vec<&common::Prompt> = ps.iter().chain(ps.iter()).chain(ps.iter()).collect();
        for (i, out) in common::greedy_batched(&mut e, &rows, 2).iter().enumerate() {
            assert_eq!(
                out,
                &rows[i].greedy,
                "cuda batched {} row {i}",
                dir.display()
            );
        }
        common::check_snapshot_resume(&mut e, &ps[0]);
    }
}

/// GPU prefill in passes of 37 tokens (the one-pass prefill is what the tests above run) against
/// transformers, and greedy continuations after it. Prefill keeps f32 activations and runs the
/// GDN recurrence in f32 (`GdnPrefill::Recurrent`, the default), so the foundation tolerance
/// applies unchanged.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_chunked_prefill_matches_transformers() {
    use deltamoe_engine::sampler::SamplingParams;
    use deltamoe_engine::{generate, GenerateRequest};
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for dir in fixtures() {
        let mut e = engine(&dir, &gpu);
        let vocab = e.config().vocab_size;
        for (i, p) in prompts(&dir).iter().enumerate() {
            let id = e.add_sequence().unwrap();
            let got = e.prefill(id, &p.tokens, Some(37), Logits::All).unwrap();
            e.remove_sequence(id);
            let name = format!("cuda prefill/37 {} prompt{i}", dir.display());
            check_logits(&name, &got, &p.logits, vocab);
            let req = GenerateRequest {
                prompt: &p.tokens,
                max_tokens: p.greedy.len(),
                sampling: SamplingParams::default(),
                eos: &[],
                prefill_chunk: Some(37),
            };
            let out = generate(&mut e, &req, |_| Ok(true)).unwrap().0;
            assert_eq!(out, p.greedy, "{name} greedy");
        }
    }
}

/// The state a GPU prefill leaves equals the state of token-by-token decode steps of the same
/// tokens: prefill the prompt (passes of 37) into one sequence and decode it step by step into
/// another; the prefill's logits must match each step's and, after both, the next step's logits
/// must match (they read every state: conv, recurrent, KV caches, position). Both paths keep f32
/// activations and the same delta-rule arithmetic; they differ in the projection kernels: a
/// prefill's rows go through the multi-row tensor-core products (inputs split into two bf16
/// halves, ~16 significant bits, ~1e-5 relative per product) where a decode step uses the f32
/// matvec. Measured: ≤ 2.7e-4·max|logit|; the bound is 1e-3·max|logit|, with identical argmax
/// except at near ties, and the same next token.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_prefill_state_equals_decode_state() {
    use deltamoe_model::gpu::GpuModel;
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for dir in fixtures() {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let vocab = model.config().vocab_size;
        let mut gm = GpuModel::upload(&model, gpu.clone()).unwrap();
        gm.reserve(2, 512).unwrap();
        gm.set_prefill_gdn(GdnPrefill::Recurrent);
        gm.set_prefill_gemm(PrefillGemm::Exact);
        let p = &prompts(&dir)[0];
        let (a_toks, next) = (
            &p.tokens[..p.tokens.len() - 1],
            p.tokens[p.tokens.len() - 1],
        );
        let mut a = gm.new_seq().unwrap();
        let pre = gm.prefill(&mut a, a_toks, Logits::All, 37).unwrap();
        let mut b = gm.new_seq().unwrap();
        let mut steps = Vec::new();
        for &t in a_toks {
            gm.step(&mut b, t).unwrap();
            steps.extend(gm.logits(0).unwrap());
        }
        let name = format!("prefill vs decode {}", dir.display());
        check_tight(&name, &pre, &steps);
        assert_eq!((a.pos(), b.pos()), (a_toks.len(), a_toks.len()));
        let ta = gm.step(&mut a, next).unwrap();
        let la = gm.logits(0).unwrap();
        let tb = gm.step(&mut b, next).unwrap();
        let lb = gm.logits(0).unwrap();
        check_tight(&format!("{name}: next step"), &la, &lb);
        // Rows may differ in argmax only where the decode path's top two logits are closer
        // than twice the allowed difference (a near tie the roundings can flip).
        let argmax = |r: &[f32]| (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b });
        let tol = 2e-3 * steps.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (row, (x, y)) in pre.chunks(vocab).zip(steps.chunks(vocab)).enumerate() {
            let (ax, ay) = (argmax(x), argmax(y));
            assert!(
                ax == ay || y[ay] - y[ax] <= tol,
                "{name}: row {row} argmax {ax} vs {ay} (margin {})",
                y[ay] - y[ax]
            );
        }
        assert_eq!(ta, tb, "{name}: next token");
        gm.release(a);
        gm.release(b);
    }
}

/// max |a − b| ≤ 1e-3·max|b|.
fn check_tight(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{name}: max err {err:.2e} of max|ref| {scale:.3}");
    assert!(
        err <= 1e-3 * scale,
        "{name}: max err {err} > 1e-3 * {scale}"
    );
}

/// Up to four sequences decoded in one step get bitwise the logits each gets alone, on the
/// quantized fixtures whose steps run the fused decode form (4- and 8-bit MLX; GPTQ keeps bf16
/// GDN `b`/`a` projections, which opt out): its products take every row through the single-row
/// kernel (each row its one-row result), its SwiGLU and expert products run per row, and the
/// other kernels compute each row on its own.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_quantized_steps_of_up_to_four_rows_are_bitwise_single_rows() {
    use deltamoe_model::gpu::{GpuModel, GpuSeq};
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let quantized = |d: &std::path::Path| {
        let name = d.file_name().unwrap().to_string_lossy();
        name.starts_with("mlx_") || name.starts_with("gptq_")
    };
    let dirs: Vec<_> = fixtures().into_iter().filter(|d| quantized(d)).collect();
    assert!(dirs.len() >= 3, "the quantized fixtures");
    let (mut failed, mut fused) = (Vec::new(), 0);
    for dir in dirs {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let vocab = model.config().vocab_size;
        let mut gm = GpuModel::upload(&model, gpu.clone()).unwrap();
        if !(1..=4).all(|b| gm.fused(b)) {
            continue;
        }
        fused += 1;
        gm.reserve(8, 256).unwrap();
        let prompt = |i: usize| -> Vec<u32> {
            (0..5 + 3 * i)
                .map(|j| ((j * 7 + i * 13 + 1) % vocab) as u32)
                .collect()
        };
        for rows in 2..=4 {
            let seqs = |gm: &mut GpuModel| -> Vec<GpuSeq> {
                (0..rows)
                    .map(|i| {
                        let mut s = gm.new_seq().unwrap();
                        gm.prefill(&mut s, &prompt(i), Logits::Last, 64).unwrap();
                        s
                    })
                    .collect()
            };
            let (mut alone, mut batch) = (seqs(&mut gm), seqs(&mut gm));
            let mut toks: Vec<u32> = (0..rows as u32).map(|i| i + 3).collect();
            for step in 0..6 {
                let mut want = Vec::new();
                for (s, &t) in alone.iter_mut().zip(&toks) {
                    gm.step(s, t).unwrap();
                    want.push(gm.logits(0).unwrap());
                }
                let mut pairs: Vec<(&mut GpuSeq, u32)> =
                    batch.iter_mut().zip(toks.iter().copied()).collect();
                let next = gm.step_batch(&mut pairs).unwrap();
                for (i, w) in want.iter().enumerate() {
                    let got = gm.logits(i).unwrap();
                    let diff = got
                        .iter()
                        .zip(w)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    if got.iter().zip(w).any(|(a, b)| a.to_bits() != b.to_bits()) {
                        failed.push(format!(
                            "{}: {rows} rows, step {step}, row {i}: max diff {diff:e}",
                            dir.display()
                        ));
                    }
                }
                toks = next;
            }
            for s in alone.into_iter().chain(batch) {
                gm.release(s);
            }
        }
    }
    assert!(fused >= 2, "fixtures running the fused form: {fused}");
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
