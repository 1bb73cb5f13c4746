//! Fine-grained FP8 checkpoints in the layout of Qwen's `*-FP8` repos (`fixtures/fp8_*`, made by
//! scripts/make_fp8_fixtures.py: e4m3 weights in 128 × 128 blocks with partial edge blocks, f32
//! or bf16 scales, per-expert experts, a scale in another shard than its weight): deltamoe's
//! logits against transformers' float32 logits on the same weights dequantized in f32, for one
//! prefill and for splits (pure decode and chunks of 37), at the foundation tolerance
//! (5e-3·max|ref|, ≥ 98% argmax). Also: bad checkpoints fail with one-line errors naming the
//! tensor or key.

mod common;

use std::path::Path;

use deltamoe_model::WeightStore;

use common::{check_fixture, copy_fixture, drop_tensors, edit_quantization, fixture, load_err};

const FIXTURES: [&str; 3] = ["fp8_qwen3_5_dense", "fp8_qwen3_5_moe", "fp8_qwen3_next"];

#[test]
fn fp8_checkpoints_match_transformers_on_dequantized_weights() {
    for name in FIXTURES {
        let dir = fixture(name);
        let store = WeightStore::open(&dir).unwrap();
        assert_eq!(store.fp8().map(|c| c.block), Some([128, 128]), "{name}");
        check_fixture(name);
    }
}

fn edit_fp8(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    edit_quantization(dir, |v| f(&mut v["quantization_config"]));
}

#[test]
fn bad_fp8_checkpoints_are_one_line_errors_naming_the_tensor() {
    let qkv = "model.language_model.layers.0.linear_attn.in_proj_qkv";
    // A weight without its scales.
    let d = copy_fixture("fp8_qwen3_5_moe");
    drop_tensors(d.path(), |n| n == format!("{qkv}.weight_scale_inv"));
    let e = load_err(d.path());
    assert!(
        e.contains(&format!("`{qkv}.weight`")) && e.contains("weight_scale_inv` is missing"),
        "{e}"
    );
    // Blocks that disagree with the scales' shape.
    let d = copy_fixture("fp8_qwen3_5_moe");
    edit_fp8(d.path(), |q| {
        q["weight_block_size"] = serde_json::json!([64, 128])
    });
    let e = load_err(d.path());
    assert!(
        e.contains("weight_scale_inv`") && e.contains("blocks of [64, 128]"),
        "{e}"
    );
    // No FP8 block in config.json.
    let d = copy_fixture("fp8_qwen3_5_moe");
    edit_quantization(d.path(), |v| {
        v.as_object_mut().unwrap().remove("quantization_config");
    });
    let e = load_err(d.path());
    assert!(
        e.contains("weight_scale_inv`") && e.contains("no FP8 `quantization_config`"),
        "{e}"
    );
    // Formats other than e4m3 blocks.
    let d = copy_fixture("fp8_qwen3_5_moe");
    edit_fp8(d.path(), |q| q["fmt"] = "e5m2".into());
    let e = load_err(d.path());
    assert!(
        e.contains("quantization_config.fmt") && e.contains("e5m2"),
        "{e}"
    );
    let d = copy_fixture("fp8_qwen3_5_moe");
    edit_fp8(d.path(), |q| {
        q.as_object_mut().unwrap().remove("weight_block_size");
    });
    let e = load_err(d.path());
    assert!(
        e.contains("weight_block_size") && e.contains("per-tensor"),
        "{e}"
    );
}
