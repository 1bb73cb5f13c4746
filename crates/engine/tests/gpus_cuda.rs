//! The fixtures on two GPUs, the routed experts divided between them (expert parallel over
//! NCCL; needs two GPUs and libnccl.so: `#[ignore]`d here, run by `scripts/gpu-tests.sh` on a
//! machine with two). Each GPU computes its experts' part and one all-reduce per MoE layer sums
//! the parts, which changes the order of that sum and nothing else: the foundation tolerance
//! against transformers holds as on one GPU (5e-3·max|ref|, argmax ≥ 98%, the same greedy
//! tokens), in one prefill pass, passes of 37, single and batched decode steps, and a restored
//! snapshot resumes bitwise. With each GPU's share of the experts offloaded behind a device
//! cache, the logits are bitwise those of the two GPUs with every expert resident. The GGUF files, whose bf16 roundings make these random models
//! chaotic against transformers (see `golden_cuda.rs`), are checked against one GPU.

mod common;

use std::sync::Arc;

use common::{check_logits, fixtures, gguf_prompts, greedy, prompts};
use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::Engine;
use deltamoe_model::gpu::{ExpertCache, GdnPrefill, OffloadStats, PrefillGemm};
use deltamoe_model::{Logits, Qwen3Hybrid};

fn gpus(n: usize) -> Vec<Arc<Gpu>> {
    (0..n).map(|i| Arc::new(Gpu::new(i).unwrap())).collect()
}

/// An engine on `gpus` (one: the plain CUDA backend) with the exact prefill products and the
/// f32 delta rule, as `golden_cuda.rs` runs them.
fn engine(path: &std::path::Path, gpus: &[Arc<Gpu>]) -> Engine {
    engine_split(path, gpus, false).unwrap()
}

/// [`engine`], the mixers' heads divided among the GPUs too when `heads`.
fn engine_split(
    path: &std::path::Path,
    gpus: &[Arc<Gpu>],
    heads: bool,
) -> deltamoe_engine::Result<Engine> {
    let model = Qwen3Hybrid::load(path).unwrap();
    let split = (ExpertCache::All, heads);
    let mut e = match gpus.len() {
        1 => Engine::new_cuda(model, gpus[0].clone(), 4096, 8)?,
        _ => Engine::new_cuda_gpus(model, gpus.to_vec(), (4096, 8), split)?,
    };
    e.set_gdn_prefill(GdnPrefill::Recurrent);
    e.set_prefill_gemm(PrefillGemm::Exact);
    Ok(e)
}

fn prefill_all(e: &mut Engine, tokens: &[u32], chunk: Option<usize>) -> Vec<f32> {
    let id = e.add_sequence().unwrap();
    let got = e.prefill(id, tokens, chunk, Logits::All).unwrap();
    e.remove_sequence(id);
    got
}

/// Fixture `dir`'s prompts on `e` against transformers in one pass and passes of 37, and its
/// greedy continuations alone and batched (six rows at once take the unfused form, two rows the
/// fused one; `tag` names the run).
fn check_fixture(e: &mut Engine, dir: &std::path::Path, ps: &[common::Prompt], tag: &str) {
    let vocab = e.config().vocab_size;
    for (i, p) in ps.iter().enumerate() {
        for chunk in [None, Some(37)] {
            let got = prefill_all(e, &p.tokens, chunk);
            let name = format!("{tag} {} prompt{i} chunk {chunk:?}", dir.display());
            check_logits(&name, &got, &p.logits, vocab);
        }
        assert_eq!(greedy(e, p), p.greedy, "{tag} greedy {}", dir.display());
    }
    let rows: Vec<&common::Prompt> = ps.iter().chain(ps).chain(ps).collect();
    for stagger in [0, 2] {
        let out = common::greedy_batched(e, &rows, stagger);
        for (i, o) in out.iter().enumerate() {
            assert_eq!(
                o,
                &rows[i].greedy,
                "{tag} batched {} row {i}",
                dir.display()
            );
        }
    }
}

/// Each GGUF file's prompts on `e2` (in one pass, passes of 1 and of 37) against `e1` in one
/// pass (`tag` names the run).
fn check_gguf(
    e1: &mut Engine,
    e2: &mut Engine,
    file: &std::path::Path,
    ps: &[common::Prompt],
    tag: &str,
) {
    let vocab = e1.config().vocab_size;
    for (i, p) in ps.iter().enumerate() {
        let want = prefill_all(e1, &p.tokens, None);
        for chunk in [None, Some(1), Some(37)] {
            let got = prefill_all(e2, &p.tokens, chunk);
            let name = format!("{tag} {} prompt{i} chunk {chunk:?}", file.display());
            check_logits(&name, &got, &want, vocab);
        }
    }
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_match_transformers() {
    let two = gpus(2);
    for dir in fixtures() {
        let mut e = engine(&dir, &two);
        assert!(e.backend_name().ends_with("× 2"), "{}", e.backend_name());
        let ps = prompts(&dir);
        check_fixture(&mut e, &dir, &ps, "2 gpus");
        common::check_snapshot_resume(&mut e, &ps[0]);
    }
}

/// An engine on `gpus` with the mixers' heads divided among them; every fixture divides, so a
/// refusal fails the test with its message.
fn engine_heads(path: &std::path::Path, gpus: &[Arc<Gpu>]) -> Engine {
    engine_split(path, gpus, true).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The mixers' heads and the dense MLPs' rows divided between the two GPUs too (tensor
/// parallel, one all-reduce after each mixer's output projection and each dense MLP): against
/// transformers in one pass and passes of 37, greedy and batched continuations. Every fixture
/// divides: FP8 shares that cut blocks of 128 are re-blocked, and the MLX 4-bit fixtures' GDN
/// output projections (48 inputs a GPU in groups of 32) regrouped in groups of 16.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_with_heads_divided_match_transformers() {
    let two = gpus(2);
    for dir in fixtures() {
        let mut e = engine_heads(&dir, &two);
        check_fixture(&mut e, &dir, &prompts(&dir), "2 gpus heads");
    }
}

/// The GGUF files with the mixers' heads divided between two GPUs against one GPU (the
/// Qwen3-Next Q8_0 file's GDN output projection regrouped in groups of 16, as above).
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_with_heads_divided_match_one_on_gguf_files() {
    let two = gpus(2);
    let one = vec![two[0].clone()];
    for (file, ps) in gguf_prompts() {
        let mut e2 = engine_heads(&file, &two);
        let mut e1 = engine(&file, &one);
        check_gguf(&mut e1, &mut e2, &file, &ps, "2 gpus heads");
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
        check_gguf(&mut e1, &mut e2, &file, &ps, "2 gpus");
    }
}

/// Prefill each prompt in passes of 5 tokens, then 24 batched decode steps of all of them (each
/// row fed its greedy token), then one more token each through a one-token pass: the passes'
/// logit rows and the steps' tokens, in order, and the offload statistics. A step that computed
/// other values would also change the state the last pass reads.
fn prefill_and_steps(
    e: &mut Engine,
    ps: &[Vec<u32>],
) -> (Vec<Vec<f32>>, Vec<u32>, Option<OffloadStats>) {
    let vocab = e.config().vocab_size;
    let argmax = |r: &[f32]| (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b }) as u32;
    let (mut out, mut ids, mut toks) = (Vec::new(), Vec::new(), Vec::new());
    for p in ps {
        let id = e.add_sequence().unwrap();
        let l = e.prefill(id, p, Some(5), Logits::All).unwrap();
        toks.push(argmax(&l[l.len() - vocab..]));
        out.push(l);
        ids.push(id);
    }
    let mut stepped = Vec::new();
    for _ in 0..24 {
        let batch: Vec<_> = ids.iter().copied().zip(toks.iter().copied()).collect();
        toks = e.step(&batch).unwrap();
        stepped.extend(&toks);
    }
    let batch: Vec<_> = ids.iter().copied().zip(toks.iter().copied()).collect();
    out.extend(e.decode(&batch).unwrap());
    for id in ids {
        e.remove_sequence(id);
    }
    (out, stepped, e.offload_stats())
}

/// Each GPU's share of the routed experts in pinned host memory behind a device cache of none
/// or a quarter of them: a prefill in passes of 5 (its experts staged), 24 steps of three
/// sequences at once (far experts read over PCIe, the residency policy's swaps between steps)
/// and a pass after them give bitwise the logits (and the same tokens) of the two GPUs with
/// every expert resident.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn two_gpus_with_offloaded_experts_match_all_resident() {
    let two = gpus(2);
    let mut checked = 0;
    // One fixture of each expert layout and format (every MoE fixture passed; these keep the
    // test to about a minute).
    let kinds = [
        "/qwen3_5_moe",
        "/qwen3_next",
        "/mlx_qwen3_5_moe_q4",
        "/gptq_qwen3_next",
        "/fp8_qwen3_5_moe",
    ];
    for dir in fixtures() {
        let path = dir.display().to_string();
        if !kinds.iter().any(|k| path.ends_with(k)) {
            continue;
        }
        let model = || Qwen3Hybrid::load(&dir).unwrap();
        let ps: Vec<Vec<u32>> = prompts(&dir)
            .iter()
            .map(|p| p.tokens.clone())
            .chain([prompts(&dir)[0].tokens[..7].to_vec()])
            .collect();
        let run = |cache| {
            let mut e =
                Engine::new_cuda_gpus(model(), two.clone(), (4096, 8), (cache, false)).unwrap();
            prefill_and_steps(&mut e, &ps)
        };
        let (want, want_steps, none) = run(ExpertCache::All);
        assert!(
            none.is_none(),
            "{}: all resident, nothing offloaded",
            dir.display()
        );
        for cache in [ExpertCache::Fraction(0.0), ExpertCache::Fraction(0.25)] {
            let (got, steps, st) = run(cache);
            let name = format!("2 gpus {} {cache:?}", dir.display());
            assert_eq!(steps, want_steps, "{name}: the steps' tokens");
            assert_eq!(got.len(), want.len(), "{name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name}: logit row block {i} differs");
            }
            let st = st.unwrap();
            assert!(st.misses > 0 && st.staged_host_bytes > 0, "{name}: {st:?}");
            eprintln!("{name}: bitwise equal; {st:?}");
        }
        checked += 1;
    }
    assert_eq!(checked, kinds.len(), "MoE fixtures checked");
}
