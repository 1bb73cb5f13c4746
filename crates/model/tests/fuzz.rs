//! Bounded property tests ("fuzzing" in CI time): the safetensors header / index path of
//! `WeightStore::open`, `ModelConfig` parsing and loading a checkpoint whose tensors have other
//! shapes or dtypes must turn any input into `Ok` or `Err`, never a panic. Each property runs a
//! few hundred cases so the suite stays fast.

use std::path::Path;

use deltamoe_model::{ModelConfig, WeightStore};
use proptest::prelude::*;
use serde_json::Value;

fn fixture(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The header (8-byte length and JSON) of the fixture checkpoint, plus a little of its data.
fn valid_head() -> Vec<u8> {
    let bytes = std::fs::read(fixture("fixtures/qwen3_5_moe/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[..(8 + n + 64).min(bytes.len())].to_vec()
}

/// Opens `bytes` as a one-file checkpoint; the result only has to exist.
fn open_bytes(bytes: &[u8]) {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("model.safetensors"), bytes).unwrap();
    let _ = WeightStore::open(d.path());
}

/// Any JSON value, a few levels deep.
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z_]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Keys the parser reads, so mutations hit them rather than unknown keys.
const KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "layer_types",
    "full_attention_interval",
    "mlp_only_layers",
    "decoder_sparse_step",
    "eos_token_id",
    "max_position_embeddings",
    "rope_parameters",
    "text_config",
    "model_type",
    "tie_word_embeddings",
    "quantization",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        open_bytes(&bytes);
    }

    #[test]
    fn mutated_headers_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut b = valid_head();
        for (at, v) in edits {
            let i = at.index(b.len());
            b[i] = v;
        }
        let keep = cut.index(b.len() + 1);
        open_bytes(&b[..keep.max(b.len() / 2)]);
    }

    #[test]
    fn random_index_files_never_panic(v in json()) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("model.safetensors.index.json"), v.to_string()).unwrap();
        let _ = WeightStore::open(d.path());
    }

    #[test]
    fn random_configs_never_panic(v in json()) {
        check_config(&v);
    }

    #[test]
    fn mutated_fixture_configs_never_panic(
        fixture_name in prop::sample::select(vec!["qwen3_5_moe", "qwen3_next", "qwen3_5_dense", "qwen3_5_moe_text"]),
        key in prop::sample::select(KEYS),
        value in json(),
        nested in any::<bool>(),
    ) {
        let text = std::fs::read_to_string(fixture(&format!("fixtures/{fixture_name}/config.json"))).unwrap();
        let mut cfg: Value = serde_json::from_str(&text).unwrap();
        let target = match cfg.get_mut("text_config") {
            Some(t) if nested => t,
            _ => &mut cfg,
        };
        if let Some(obj) = target.as_object_mut() {
            obj.insert(key.to_string(), value);
        }
        check_config(&cfg);
    }
}

/// Parses `v`; a config that passes is sized as `bench` would size it.
fn check_config(v: &Value) {
    if let Ok(c) = ModelConfig::from_json_str(&v.to_string(), Path::new("config.json")) {
        let _ = (c.weight_params(), c.largest_tensor_params(), c.conv_dim());
    }
}

/// A layer count far past any model (the case the fuzzer met) is a one-line error, not an
/// allocation of that many layers.
#[test]
fn a_huge_layer_count_is_refused_before_anything_is_sized_by_it() {
    let text = std::fs::read_to_string(fixture("fixtures/qwen3_5_moe_text/config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["num_hidden_layers"] = Value::from(1u64 << 60);
    let err = ModelConfig::from_json_str(&v.to_string(), Path::new("config.json")).unwrap_err();
    assert!(err.to_string().contains("num_hidden_layers"), "{err}");
}

/// A fixture directory with `model.safetensors`'s header rewritten by `edit` (the data kept);
/// loading it ends in `Ok` or an `Err`, never a panic.
fn load_with_header(name: &str, edit: &dyn Fn(&mut serde_json::Map<String, Value>)) -> bool {
    let src = fixture(&format!("fixtures/{name}"));
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json" || x == "jinja") {
            std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(d.path().join("model.safetensors"), out).unwrap();
    std::panic::catch_unwind(|| {
        let _ = deltamoe_model::Qwen3Hybrid::load(d.path());
    })
    .is_ok()
}

/// Every tensor of a bf16 MoE, a Qwen3-Next and an MLX 4-bit fixture given in turn another shape
/// of the same size (flattened, its dims reversed, one more outer dim of 1) or another dtype of
/// the same width: loading ends in `Ok` or an `Err`, never a panic.
#[test]
fn reshaped_and_retyped_checkpoint_tensors_never_panic() {
    let mut tried = 0;
    for name in ["qwen3_5_moe", "qwen3_next", "mlx_qwen3_5_moe_q4"] {
        let bytes = std::fs::read(fixture(&format!("fixtures/{name}/model.safetensors"))).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (key, entry) in header.iter().filter(|(k, _)| *k != "__metadata__") {
            let shape: Vec<u64> = entry["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            let shapes = [
                vec![shape.iter().product()],
                shape.iter().rev().copied().collect(),
                shape.iter().copied().chain([1]).collect(),
            ];
            for s in shapes.into_iter().filter(|s| *s != shape) {
                let edit =
                    |h: &mut serde_json::Map<String, Value>| h[key]["shape"] = s.clone().into();
                assert!(
                    load_with_header(name, &edit),
                    "{name}: `{key}` as {s:?}: panicked"
                );
                tried += 1;
            }
            let other = match entry["dtype"].as_str().unwrap() {
                "BF16" => "F16",
                "F16" => "BF16",
                "F32" => "U32",
                "U32" => "F32",
                _ => continue,
            };
            let edit = |h: &mut serde_json::Map<String, Value>| h[key]["dtype"] = other.into();
            assert!(
                load_with_header(name, &edit),
                "{name}: `{key}` as {other}: panicked"
            );
            tried += 1;
        }
    }
    assert!(tried >= 100, "{tried} cases");
}
