//! The fixtures on two GPUs, the routed experts divided between them (expert parallel over
//! NCCL; needs two GPUs and libnccl.so: `#[ignore]`d here, run by `scripts/gpu-tests.sh` on a
//! machine with two). Each GPU computes its experts' part and one all-reduce per MoE layer sums
//! the parts, which changes the order of that sum and nothing else: the foundation tolerance
//! against transformers holds as on one GPU (5e-3·max|ref|, argmax ≥ 98%, the same greedy
//! tokens), in one prefill pass, passes of 37, single and batched decode steps, and a restored
//! snapshot resumes bitwise. The GGUF files, whose bf16 roundings make these random models
//! chaotic against transformers (see `golden_cuda.rs`), are checked against one GPU.

mod common;

use std::sync::Arc;

use common::{check_logits, fixtures, gguf_prompts, greedy, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::Engine;
use deltamoe_model::gpu::{GdnPrefill, PrefillGemm};
use deltamoe_model::{Logits, Qwen3Hybrid};

fn gpus(n: usize) -> Vec<Arc<Gpu>> {
    (0..n).map(|i| Arc::new(Gpu::new(i).unwrap())).collect()
}

/// An engine on `gpus` (one: the plain CUDA backend) with the exact prefill products and the
/// f32 delta rule, as `golden_cuda.rs` runs them.
fn engine(path: &std::path::Path, gpus: &[Arc<Gpu>]) -> Engine {
    let model = Qwen3Hybrid::load(path).unwrap();
    let mut e = match gpus.len() {
        1 => Engine::new_cuda(model, gpus[0].clone(), 4096, 8).unwrap(),
        _ => Engine::new_cuda_gpus(model, gpus.to_vec(), 4096, 8).unwrap(),
    };
    e.set_gdn_prefill(GdnPrefill::Recurrent);
    e.set_prefill_gemm(PrefillGemm::Exact);
    e
}

fn prefill_all(e: &mut Engine, tokens: &[u32], chunk: Option<usize>) -> Vec<f32> {
    let id = e.add_sequence().unwrap();
    let got = e.prefill(id, tokens, chunk, Logits::All).unwrap();
    e.remove_sequence(id);
    got
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_match_transformers() {
    let two = gpus(2);
    for dir in fixtures() {
        let mut e = engine(&dir, &two);
        assert!(e.backend_name().ends_with("× 2"), "{}", e.backend_name());
        let vocab = e.config().vocab_size;
        let ps = prompts(&dir);
        for (i, p) in ps.iter().enumerate() {
            for chunk in [None, Some(37)] {
                let got = prefill_all(&mut e, &p.tokens, chunk);
                let name = format!("2 gpus {} prompt{i} chunk {chunk:?}", dir.display());
                check_logits(&name, &got, &p.logits, vocab);
            }
            assert_eq!(
                greedy(&mut e, p),
                p.greedy,
                "2 gpus greedy {}",
                dir.display()
            );
        }
        // Six rows at once take the unfused form, two rows the fused one.
        let rows: Vec<&common::Prompt> = ps.iter().chain(&ps).chain(&ps).collect();
        for stagger in [0, 2] {
            let out = common::greedy_batched(&mut e, &rows, stagger);
            for (i, o) in out.iter().enumerate() {
                assert_eq!(
                    o,
                    &rows[i].greedy,
                    "2 gpus batched {} row {i}",
                    dir.display()
                );
            }
        }
        common::check_snapshot_resume(&mut e, &ps[0]);
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_match_one_on_gguf_files() {
    let two = gpus(2);
    let one = vec![two[0].clone()];
    for (file, ps) in gguf_prompts() {
        let mut e1 = engine(&file, &one);
        let mut e2 = engine(&file, &two);
        let vocab = e1.config().vocab_size;
        for (i, p) in ps.iter().enumerate() {
            let want = prefill_all(&mut e1, &p.tokens, None);
            for chunk in [None, Some(1), Some(37)] {
                let got = prefill_all(&mut e2, &p.tokens, chunk);
                let name = format!("2 gpus {} prompt{i} chunk {chunk:?}", file.display());
                check_logits(&name, &got, &want, vocab);
            }
        }
    }
}
