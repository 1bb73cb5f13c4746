//! MLX affine-quantized checkpoints written by mlx-lm's own converter (`fixtures/mlx_*`, made by
//! scripts/make_quant_fixtures.py from the committed HF fixtures): deltamoe's logits against
//! transformers' float32 logits on the same weights dequantized, for one prefill and for splits
//! (pure decode and chunks of 37). Tolerance 5e-3·max|ref| and ≥ 98% argmax agreement, as for
//! the HF fixtures. Also: bad checkpoints fail with one-line errors naming the tensor.

mod common;

use std::path::{Path, PathBuf};

use deltamoe_model::{Layout, Qwen3Hybrid, WeightStore};
use safetensors::SafeTensors;

use common::{
    check_logits, copy_fixture, drop_tensors, edit_quantization, f32s, fixture, ids, load_err,
    run_chunks,
};

fn mlx_fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixture(""))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("mlx_"))
        })
        .collect();
    v.sort();
    assert!(
        v.len() >= 3,
        "expected the committed fixtures/mlx_* checkpoints"
    );
    v
}

/// `(tokens, logits)` of prompt0 and prompt1.
fn prompts(dir: &Path) -> Vec<(Vec<u32>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    (0..2)
        .map(|i| {
            (
                ids(&st, &format!("prompt{i}.tokens")),
                f32s(&st, &format!("prompt{i}.logits")),
            )
        })
        .collect()
}

#[test]
fn mlx_lm_checkpoints_match_transformers_on_dequantized_weights() {
    for dir in mlx_fixtures() {
        let store = WeightStore::open(&dir).unwrap();
        assert_eq!(store.layout(), Layout::Mlx, "{}", dir.display());
        assert!(store.quantization().is_some());
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let vocab = model.config().vocab_size;
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        for (i, (tokens, logits)) in prompts(&dir).iter().enumerate() {
            for chunk in [tokens.len(), 1, 37] {
                let got = run_chunks(&model, tokens, chunk);
                check_logits(
                    &format!("{name} prompt{i} chunk {chunk}"),
                    &got,
                    logits,
                    vocab,
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad checkpoints: one-line errors naming the tensor.
// ---------------------------------------------------------------------------------------------

#[test]
fn config_bits_or_group_disagreeing_with_shapes_is_an_error_naming_the_tensor() {
    // Default bits 4 -> 8: every 4-bit tensor is now too small.
    let d = copy_fixture("mlx_qwen3_next_q4");
    edit_quantization(d.path(), |v| {
        v["quantization"]["bits"] = 8.into();
        v["quantization_config"]["bits"] = 8.into();
    });
    let e = load_err(d.path());
    assert!(
        e.contains(".weight`")
            && e.contains("bits 8, group_size 32")
            && e.contains("imply bits 4, group_size 32"),
        "{e}"
    );
    // The router override's group size 64 -> 32.
    let d = copy_fixture("mlx_qwen3_next_q4");
    edit_quantization(d.path(), |v| {
        for k in ["quantization", "quantization_config"] {
            v[k]["model.layers.0.mlp.gate"]["group_size"] = 32.into();
        }
    });
    let e = load_err(d.path());
    assert!(
        e.contains("`model.layers.0.mlp.gate.weight`")
            && e.contains("its entry `model.layers.0.mlp.gate`")
            && e.contains("imply bits 8, group_size 64"),
        "{e}"
    );
    // No quantization block at all.
    let d = copy_fixture("mlx_qwen3_next_q4");
    edit_quantization(d.path(), |v| {
        let o = v.as_object_mut().unwrap();
        o.remove("quantization");
        o.remove("quantization_config");
    });
    let e = load_err(d.path());
    assert!(
        e.contains(".scales`") && e.contains("no `quantization` block"),
        "{e}"
    );
}

#[test]
fn missing_scales_or_biases_is_an_error_naming_the_tensor() {
    let name = "model.layers.0.linear_attn.in_proj_qkvz";
    let d = copy_fixture("mlx_qwen3_next_q4");
    drop_tensors(d.path(), |n| n == format!("{name}.scales"));
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("`{name}.weight`"))
            && e.contains(&format!("`{name}.scales` is missing")),
        "{e}"
    );
    let d = copy_fixture("mlx_qwen3_next_q4");
    drop_tensors(d.path(), |n| n == format!("{name}.biases"));
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("`{name}.biases`")) && e.contains("missing"),
        "{e}"
    );
    // Stacked experts and the (multimodal-prefixed) embedding too.
    let d = copy_fixture("mlx_qwen3_5_moe_q4");
    drop_tensors(d.path(), |n| {
        n.ends_with("layers.2.mlp.switch_mlp.down_proj.biases")
    });
    let e = load_err(d.path());
    assert!(
        e.contains("`model.layers.2.mlp.switch_mlp.down_proj.biases`"),
        "{e}"
    );
    let d = copy_fixture("mlx_qwen3_5_moe_q4");
    drop_tensors(d.path(), |n| {
        n == "language_model.model.embed_tokens.scales"
    });
    let e = load_err(d.path());
    assert!(e.contains("`model.embed_tokens.scales` is missing"), "{e}");
}

/// What a checkpoint says its weights take (the GPU's fit check before an upload) is within a
/// few percent of its files, and the routed experts are a share of it, for the HF and the MLX
/// fixtures alike.
#[test]
fn weight_bytes_match_the_files() {
    let mut dirs = mlx_fixtures();
    dirs.push(fixture("qwen3_5_moe"));
    for dir in dirs {
        let m = Qwen3Hybrid::load(&dir).unwrap();
        let (total, experts) = m.checkpoint().weight_bytes();
        let files = std::fs::metadata(dir.join("model.safetensors"))
            .unwrap()
            .len() as f64;
        let ratio = total as f64 / files;
        assert!(
            (0.9..1.1).contains(&ratio),
            "{}: {total} bytes for {files} in the file",
            dir.display()
        );
        assert!(
            experts > 0 && experts < total,
            "{}: experts {experts} of {total}",
            dir.display()
        );
    }
}
