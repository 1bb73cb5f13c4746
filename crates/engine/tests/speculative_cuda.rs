//! Speculative decoding on CUDA (needs a GPU: `#[ignore]`d here, run by `scripts/gpu-tests.sh`).
//! The MTP fixtures converted to MLX 4-bit, whose products give each row of a step of up to
//! four rows its one-row bits: every row of a verify pass is bitwise its decode step, a commit
//! leaves exactly the state of decoding the kept tokens one by one, and greedy output with
//! `--speculative-tokens N` is plain greedy output token for token.

mod speculative_common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltamoe_compute::cuda::Gpu;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::{generate, Engine, GenerateRequest};
use deltamoe_model::convert::{convert, ConvertOptions};
use deltamoe_model::gpu::GpuModel;
use deltamoe_model::{Logits, Qwen3Hybrid};
use speculative_common::{fixture, round, run_stats, scheduler, FIXTURES};

/// The fixture `name` converted to MLX 4-bit (its MTP layer kept) under `out`.
fn mlx4(name: &str, out: &Path) -> PathBuf {
    let dst = out.join(name);
    convert(
        &fixture(name),
        &dst,
        &ConvertOptions::new(4, 32),
        &mut |_| {},
    )
    .unwrap();
    dst
}

fn bits_differ(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_verify_rows_are_decode_steps_and_commits_roll_back_exactly() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let model = Qwen3Hybrid::load(&mlx4(name, tmp.path())).unwrap();
        let vocab = model.config().vocab_size as u32;
        let mut gm = GpuModel::upload(&model, gpu.clone()).unwrap();
        assert!(
            gm.upload_mtp(model.checkpoint()).unwrap(),
            "{name}: MTP layer"
        );
        gm.reserve(2, 256).unwrap();
        gm.set_speculative(3).unwrap();
        let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % vocab).collect();
        let (mut spec, mut plain) = (gm.new_seq().unwrap(), gm.new_seq().unwrap());
        // In two parts: the pair across them is carried.
        gm.prefill(&mut spec, &prompt, Logits::Last, 6).unwrap();
        gm.prefill(&mut plain, &prompt, Logits::Last, 64).unwrap();
        assert_eq!(
            spec.mtp_pairs(),
            prompt.len() - 1,
            "{name}: the prompt's pairs"
        );
        let mut tok = 7u32;
        for cycle in 0..24usize {
            // Drafts of every count, arbitrary tokens; a kept prefix of every length.
            let n = 1 + cycle % 3;
            let fed: Vec<u32> = std::iter::once(tok)
                .chain((0..n).map(|j| ((cycle * 101 + j * 13) as u32) % vocab))
                .collect();
            let picks = gm.verify(&mut spec, &fed).unwrap();
            let rows: Vec<Vec<f32>> = (0..fed.len()).map(|r| gm.logits(r).unwrap()).collect();
            let kept = (cycle * 7) % (n + 1);
            for (r, &t) in fed.iter().enumerate().take(kept + 1) {
                let pick = gm.step(&mut plain, t).unwrap();
                let want = gm.logits(0).unwrap();
                assert!(
                    !bits_differ(&rows[r], &want) && pick == picks[r],
                    "{name}: cycle {cycle}, row {r} of {}: verify row differs from its decode step",
                    fed.len()
                );
            }
            gm.commit(&mut spec, fed.len(), kept + 1).unwrap();
            assert_eq!(spec.pos(), plain.pos());
            let pairs = spec.mtp_pairs();
            let out: Vec<u32> = fed[1..=kept].iter().copied().chain([picks[kept]]).collect();
            // Drafting runs the MTP layer and leaves the main state alone.
            let drafts = gm.draft(&mut spec, &out, 3).unwrap();
            assert_eq!(drafts.len(), 3);
            // The kept pairs join the MTP cache (the first cycle's with the prompt's last).
            let carried = usize::from(cycle == 0);
            assert_eq!(
                spec.mtp_pairs(),
                pairs + out.len() + carried,
                "{name}: cycle {cycle}"
            );
            tok = picks[kept];
        }
        gm.release(spec);
        gm.release(plain);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_speculative_greedy_output_is_plain_greedy_output() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let greedy = SamplingParams::default();
    let prompt = [5u32, 17, 300, 2, 44, 44, 9, 128, 77];
    for name in FIXTURES {
        let dir = mlx4(name, tmp.path());
        let run = |drafts: usize| {
            let model = Qwen3Hybrid::load(&dir).unwrap();
            let mut e = Engine::new_cuda(model, gpu.clone(), 512, 2).unwrap();
            e.set_speculative(drafts).unwrap();
            run_stats(&mut e, &prompt, 40, &greedy)
        };
        let (plain, _) = run(0);
        for n in 1..=3 {
            let (got, stats) = run(n);
            assert_eq!(got, plain, "{name}, N = {n}");
            eprintln!("{name}, N = {n}: {stats:?}");
        }
    }
}

/// Under the scheduler (steps of several sequences run plain, of one speculatively; the second
/// round from the prompt cache's snapshots) every request's greedy tokens are its plain ones.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_the_scheduler_mixes_speculative_and_plain_steps_exactly() {
    let gpu = Arc::new(Gpu::new(0).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let dir = mlx4(FIXTURES[0], tmp.path());
    let greedy = SamplingParams::default();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..9 + i).map(|j| (j * 31 + 7 * i + 5) % 512).collect())
        .collect();
    let engine = |drafts: usize| {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let mut e = Engine::new_cuda(model, gpu.clone(), 512, 3).unwrap();
        e.set_speculative(drafts).unwrap();
        e
    };
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let req = GenerateRequest {
                prompt: p,
                max_tokens: 24,
                sampling: greedy.clone(),
                eos: &[],
                prefill_chunk: None,
            };
            generate(&mut engine(0), &req, |_| Ok(true)).unwrap().0
        })
        .collect();
    let mut s = scheduler(engine(2));
    for round_no in 0..2 {
        let got = round(&mut s, &prompts, &greedy, 24);
        assert_eq!(got, want, "round {round_no}");
    }
}
