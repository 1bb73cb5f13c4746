//! Tensor parallel's slicing (`checkpoint::heads`) on the CPU: every mixer and dense MLP of
//! fixtures with each head layout and weight format (Qwen3.5's split projections, Qwen3-Next's
//! per-key-head packing, biases, affine with and without zero points, regrouped where a share
//! cuts its groups, FP8 re-blocked where a share cuts its blocks, GGUF files' repacked blocks),
//! divided between two GPUs' parts, gives outputs that add up to the whole block's, in f32.

use std::path::Path;

use deltamoe_compute::cpu::rope::Rope;
use deltamoe_model::checkpoint::heads::heads_share;
use deltamoe_model::checkpoint::{Ffn, Mixer};
use deltamoe_model::config::ModelConfig;
use deltamoe_model::layers::attention::KvCache;
use deltamoe_model::layers::linear::Products;
use deltamoe_model::Qwen3Hybrid;

/// A seeded value in [−1, 1).
fn val(i: usize) -> f32 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    x as f32 / (1u64 << 23) as f32 - 1.0
}

/// A mixer's output for `x` ([t, H]) from fresh state: what one GPU computes.
fn mixer_out(m: &Mixer, c: &ModelConfig, x: &[f32], t: usize) -> Vec<f32> {
    let exact = Products::Exact;
    match m {
        Mixer::Linear(g) => {
            let mut conv = vec![0.0; g.conv_state_len()];
            let mut state = vec![0.0; g.recurrent_state_len()];
            g.forward(x, t, (&mut conv, &mut state), (false, exact))
        }
        Mixer::Full(a) => {
            let rope = Rope::new(c.rotary_dim, c.rope_theta);
            a.forward(x, t, 0, &rope, &mut KvCache::default(), exact)
        }
    }
}

#[test]
fn the_parts_of_each_mixer_add_up_to_the_whole() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let files = [
        "qwen3_5_moe",
        "qwen3_next",
        "qwen3_5_next_norm_false",
        "mlx_qwen3_5_moe_q8",
        "mlx_qwen3_5_moe_q4",
        "mlx_qwen3_next_q4",
        "gptq_qwen3_next",
        "fp8_qwen3_5_moe",
        "fp8_qwen3_next",
        "fp8_qwen3_5_dense",
        "awq_qwen3_5_dense",
        "qwen3_5_dense",
        "gguf_quant/qwen3_5_moe_q.q4_k_m.gguf",
        "gguf_quant/qwen3_next_q.q8_0.gguf",
    ];
    for f in files {
        let model = Qwen3Hybrid::load(&root.join(f)).unwrap();
        let whole = model.checkpoint();
        let parts: Vec<_> = (0..2).map(|r| heads_share(whole, r, 2).unwrap()).collect();
        let (h, t) = (whole.config.hidden_size, 7);
        let x: Vec<f32> = (0..t * h).map(val).collect();
        for (i, l) in whole.layers.iter().enumerate() {
            let want = mixer_out(&l.mixer, &whole.config, &x, t);
            let got = parts
                .iter()
                .map(|p| mixer_out(&p.layers[i].mixer, &p.config, &x, t));
            check(&format!("{f} layer {i} mixer"), &want, got);
            if let Ffn::Dense(m) = &l.ffn {
                let exact = Products::Exact;
                let got = parts.iter().map(|p| match &p.layers[i].ffn {
                    Ffn::Dense(m) => m.forward(&x, t, exact),
                    Ffn::Moe(_) => panic!("{f} layer {i}: a dense MLP's share is dense"),
                });
                check(&format!("{f} layer {i} MLP"), &m.forward(&x, t, exact), got);
            }
        }
    }
}

/// The parts' outputs add up to `want` in f32.
fn check(name: &str, want: &[f32], parts: impl Iterator<Item = Vec<f32>>) {
    let mut got = vec![0.0; want.len()];
    for y in parts {
        got.iter_mut().zip(y).for_each(|(g, y)| *g += y);
    }
    let max = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= 1e-5 * max.max(1e-3), "{name}: {err} of {max}");
}

/// Every fixture divided among 2 to 8 GPUs: each part is made or refused with a one-line error
/// that says to drop --tensor-parallel, never a panic.
#[test]
fn any_number_of_gpus_divides_or_is_refused_in_one_line() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut files: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    files.extend(
        std::fs::read_dir(root.join("gguf_quant"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "gguf")),
    );
    for f in files {
        let model = Qwen3Hybrid::load(&f).unwrap();
        for world in 2..=8 {
            for rank in 0..world {
                if let Err(e) = heads_share(model.checkpoint(), rank, world) {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("--tensor-parallel") && !msg.contains('\n'),
                        "{} over {world}: {msg}",
                        f.display()
                    );
                }
            }
        }
    }
}
