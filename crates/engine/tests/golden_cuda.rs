//! The golden fixtures end to end on CUDA (needs a GPU: `#[ignore]`d here, run by
//! `scripts/gpu-tests.sh`). The CUDA path keeps f32 activations and the same bf16 (or MLX
//! affine) weights as the CPU engine, so the foundation tolerance applies unchanged:
//! 5e-3·max|ref| with ≥ 98% argmax agreement against transformers, identical greedy tokens.
//! (A quantized embedding is dequantized to bf16 on upload: one rounding of each embedding
//! value, far inside that tolerance.)

mod common;

use std::sync::Arc;

use common::{check_logits, fixtures, greedy, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::Engine;
use deltamoe_model::{Logits, Qwen3Hybrid};

fn engine(dir: &std::path::Path, gpu: &Arc<Gpu>) -> Engine {
    Engine::new_cuda(Qwen3Hybrid::load(dir).unwrap(), gpu.clone(), 4096).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_logits_and_greedy_match_transformers() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    for dir in fixtures() {
        let mut e = engine(&dir, &gpu);
        let vocab = e.model().config().vocab_size;
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
