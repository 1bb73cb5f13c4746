//! GPTQ and AWQ int4 checkpoints (`fixtures/gptq_*`, `fixtures/awq_*`, made by
//! scripts/make_gptq_fixtures.py: GPTQ v1 sym with groups of 128, GPTQ v1 asym with groups of 64
//! in two shards, AWQ gemm with groups of 32): deltamoe's logits against transformers' float32
//! logits on the same weights dequantized in f32, for one prefill and for splits (pure decode and
//! chunks of 37), at the foundation tolerance (5e-3·max|ref|, ≥ 98% argmax). The repacking is
//! bit-exact against the field's own dequantization (`fixtures/quant/gptq_cases.safetensors`),
//! and bad checkpoints fail with one-line errors naming the tensor or key.

mod common;

use std::path::Path;

use deltamoe_model::checkpoint::LinearWeight;
use deltamoe_model::WeightStore;
use safetensors::SafeTensors;

use common::{check_fixture, copy_fixture, drop_tensors, edit_quantization, fixture, load_err};

const FIXTURES: [&str; 3] = ["awq_qwen3_5_dense", "gptq_qwen3_5_moe", "gptq_qwen3_next"];

#[test]
fn gptq_and_awq_checkpoints_match_transformers_on_dequantized_weights() {
    for name in FIXTURES {
        let dir = fixture(name);
        let store = WeightStore::open(&dir).unwrap();
        assert!(store.gptq().is_some(), "{name}");
        check_fixture(name);
    }
}

/// Each case of `gptq_cases.safetensors` written as a one-linear checkpoint `m` with its
/// quantization config, loaded, and dequantized: bit for bit the field's dequantization.
#[test]
fn repacking_is_bit_exact_against_the_fields_dequantization() {
    let path = fixture("quant").join("gptq_cases.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["cases"]).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let cases = cases.as_object().unwrap();
    assert!(cases.len() >= 6);
    for (case, info) in cases {
        let d = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, safetensors::tensor::TensorView)> = st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| {
                let t = n.strip_prefix(&format!("{case}."))?;
                let stored = ["qweight", "qzeros", "scales", "g_idx"].contains(&t);
                stored.then(|| (format!("m.{t}"), v))
            })
            .collect();
        let out = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(d.path().join("model.safetensors"), out).unwrap();
        let q = case_config(info);
        let cfg = serde_json::json!({ "quantization_config": q });
        std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
        let want = st.tensor(&format!("{case}.dequant")).unwrap();
        let [out, inp] = [want.shape()[0], want.shape()[1]];
        let out_meta = info["out_features"].as_u64().unwrap() as usize;
        assert_eq!(out, out_meta, "{case}");
        let store = WeightStore::open(d.path()).unwrap();
        let w = LinearWeight::load(&store, "m", out, inp).unwrap();
        let got = w.dequantize().unwrap();
        let want: Vec<f32> = want
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let bad = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(bad, 0, "{case}: {bad} of {} values differ", want.len());
        let a = w.as_affine().unwrap();
        assert!(a.has_zero_points(), "{case}");
    }
}

/// The `quantization_config` of a case: its metadata entry's quantization fields.
fn case_config(info: &serde_json::Value) -> serde_json::Value {
    let mut q = info.clone();
    let o = q.as_object_mut().unwrap();
    o.retain(|k, _| {
        [
            "quant_method",
            "bits",
            "group_size",
            "sym",
            "desc_act",
            "checkpoint_format",
            "zero_point",
            "version",
        ]
        .contains(&k.as_str())
    });
    q
}

fn edit_q(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    edit_quantization(dir, |v| {
        let q = match v.get_mut("text_config") {
            Some(t) if t.get("quantization_config").is_some() => &mut t["quantization_config"],
            _ => &mut v["quantization_config"],
        };
        f(q)
    });
}

#[test]
fn bad_gptq_checkpoints_are_one_line_errors_naming_the_tensor() {
    let o = "model.language_model.layers.0.mlp.experts.0.down_proj";
    // Zero points missing.
    let d = copy_fixture("gptq_qwen3_5_moe");
    drop_tensors(d.path(), |n| n == format!("{o}.qzeros"));
    let e = load_err(d.path());
    assert!(e.contains(&format!("{o}.qzeros")), "{e}");
    // An act-order permutation.
    let d = copy_fixture("gptq_qwen3_5_moe");
    permute_g_idx(d.path(), &format!("{o}.g_idx"));
    let e = load_err(d.path());
    assert!(e.contains("g_idx") && e.contains("desc_act"), "{e}");
    // No quantization block.
    let d = copy_fixture("gptq_qwen3_5_moe");
    edit_quantization(d.path(), |v| {
        v.as_object_mut().unwrap().remove("quantization_config");
        if let Some(t) = v.get_mut("text_config").and_then(|t| t.as_object_mut()) {
            t.remove("quantization_config");
        }
    });
    let e = load_err(d.path());
    assert!(
        e.contains("qweight`") && e.contains("no GPTQ or AWQ"),
        "{e}"
    );
    // Unsupported packings.
    let d = copy_fixture("awq_qwen3_5_dense");
    edit_q(d.path(), |q| q["version"] = "gemv".into());
    let e = load_err(d.path());
    assert!(
        e.contains("quantization_config.version") && e.contains("gemv"),
        "{e}"
    );
    let d = copy_fixture("gptq_qwen3_5_moe");
    edit_q(d.path(), |q| q["checkpoint_format"] = "marlin".into());
    let e = load_err(d.path());
    assert!(
        e.contains("checkpoint_format") && e.contains("marlin"),
        "{e}"
    );
}

/// Swap the first two group indices of different groups in tensor `name`.
fn permute_g_idx(dir: &Path, name: &str) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let g = st.tensor(name).unwrap();
    let mut v: Vec<i32> = g
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let j = v.iter().position(|&x| x != v[0]).unwrap();
    v.swap(0, j);
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let shape = g.shape().to_vec();
    let mut kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, shape, &data).unwrap();
    kept.push((name.to_string(), view));
    std::fs::write(&p, safetensors::serialize(kept, None).unwrap()).unwrap();
}
