use super::*;

fn text_fields() -> serde_json::Map<String, Value> {
    serde_json::from_str(
        r#"{"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "intermediate_size": 96,
            "rms_norm_eps": 1e-6, "hidden_act": "silu"}"#,
    )
    .unwrap()
}

fn parse(v: Value) -> Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string(), Path::new("config.json"))
}

#[test]
fn hub_and_transformers5_spellings_agree() {
    let mut hub = text_fields();
    hub.insert("model_type".into(), "qwen3_5_moe_text".into());
    hub.insert("rope_theta".into(), 1e7.into());
    hub.insert("partial_rotary_factor".into(), 0.25.into());
    let a = parse(Value::Object(hub)).unwrap();

    let mut t5 = text_fields();
    t5.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                           "mrope_section": [11, 11, 10], "mrope_interleaved": true}),
    );
    t5.insert("model_type".into(), "qwen3_5_moe_text".into());
    let nested = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": t5,
                                    "tie_word_embeddings": false});
    let b = parse(nested).unwrap();
    assert_eq!((a.rope_theta, a.rotary_dim), (b.rope_theta, b.rotary_dim));
    assert_eq!(a.rotary_dim, 8);
    assert_eq!(a.layer_pattern(), "LLLFLLLF");
    assert_eq!(b.family, Family::Qwen35Moe);
    assert!(b.norm_topk_prob);
    assert!(b.ffn_kinds.iter().all(|k| *k == FfnKind::Moe));
}

#[test]
fn qwen3_next_dense_layers_and_layer_types() {
    let mut c = text_fields();
    c.insert("model_type".into(), "qwen3_next".into());
    c.insert("rope_theta".into(), 1e7.into());
    c.insert("num_hidden_layers".into(), 4.into());
    c.insert("mlp_only_layers".into(), serde_json::json!([1]));
    c.insert("norm_topk_prob".into(), false.into());
    c.insert(
        "layer_types".into(),
        serde_json::json!([
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention"
        ]),
    );
    let m = parse(Value::Object(c)).unwrap();
    assert_eq!(m.layer_pattern(), "LFLF");
    assert_eq!(
        m.ffn_kinds,
        vec![FfnKind::Moe, FfnKind::Dense, FfnKind::Moe, FfnKind::Moe]
    );
    assert!(!m.norm_topk_prob);
}

#[test]
fn errors_name_the_key() {
    let mut c = text_fields();
    c.insert("model_type".into(), "qwen3_5_text".into());
    c.insert("rope_theta".into(), 1e7.into());
    c.remove("hidden_size");
    let e = parse(Value::Object(c.clone())).unwrap_err().to_string();
    assert!(e.contains("`hidden_size`") && e.contains("missing"), "{e}");

    c.insert("hidden_size".into(), "big".into());
    let e = parse(Value::Object(c.clone())).unwrap_err().to_string();
    assert!(e.contains("`hidden_size`") && e.contains("integer"), "{e}");

    c.insert("hidden_size".into(), 64.into());
    c.insert("model_type".into(), "llama".into());
    let e = parse(Value::Object(c)).unwrap_err().to_string();
    assert!(e.contains("llama") && e.contains("not supported"), "{e}");

    let e = parse(serde_json::json!({"model_type": "qwen3_5_moe"}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`text_config`"), "{e}");

    let e = ModelConfig::from_json_str("{not json", Path::new("x/config.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("x/config.json") && e.contains("JSON"), "{e}");
}

/// A valid hub-style MoE config with `key` set to `v` (dotted keys reach into objects).
fn with(key: &str, v: Value) -> Result<ModelConfig> {
    let mut c = text_fields();
    c.insert("model_type".into(), "qwen3_5_moe_text".into());
    c.insert("rope_theta".into(), 1e7.into());
    match key.split_once('.') {
        Some((outer, inner)) => {
            let mut o = serde_json::Map::new();
            o.insert(inner.into(), v);
            c.insert(outer.into(), Value::Object(o));
        }
        None => {
            c.insert(key.into(), v);
        }
    }
    parse(Value::Object(c))
}

#[test]
fn out_of_range_values_name_the_key_and_range() {
    let cases: [(&str, Value, &str); 12] = [
        ("rope_theta", 0.into(), "above 0"),
        ("rope_parameters.rope_theta", (-5.0).into(), "above 0"),
        ("rms_norm_eps", (-1).into(), "(0, 1)"),
        ("rms_norm_eps", 0.into(), "(0, 1)"),
        ("partial_rotary_factor", 0.into(), "(0, 1]"),
        ("partial_rotary_factor", 1.5.into(), "(0, 1]"),
        ("vocab_size", 1_000_000_000_000u64.into(), "1..="),
        ("max_position_embeddings", 0.into(), "1..="),
        ("num_key_value_heads", 3.into(), "does not divide"),
        ("linear_num_key_heads", 3.into(), "does not divide"),
        ("num_experts_per_tok", 9.into(), "1..=num_experts"),
        ("moe_intermediate_size", 0.into(), "1..="),
    ];
    for (key, v, range) in cases {
        let e = with(key, v.clone()).unwrap_err().to_string();
        let leaf = key.rsplit('.').next().unwrap_or(key);
        let shown = if key.contains('.') { key } else { leaf };
        assert!(
            (e.contains(&format!("`{shown}`")) || e.contains(leaf)) && e.contains(range),
            "{key} = {v}: {e}"
        );
    }
    assert!(with("rms_norm_eps", 1e-5.into()).is_ok());
}

#[test]
fn weight_params_match_the_built_in_checkpoint() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
    let c = ModelConfig::from_dir(&dir).unwrap();
    let store = crate::WeightStore::open(&dir).unwrap();
    // The MTP layer is not part of the model a step runs (nor of synthetic shapes).
    let main = store
        .summary()
        .into_iter()
        .filter(|t| !t.name.starts_with("mtp."));
    let stored: usize = main.map(|t| t.params).sum();
    assert_eq!(c.weight_params(), stored as u64);
    assert_eq!(
        c.largest_tensor_params(),
        (c.vocab_size * c.hidden_size) as u64
    );
}

#[test]
fn hf_json_reads_back_as_the_same_config() {
    let mut moe = serde_json::Map::new();
    moe.insert("model_type".into(), "qwen3_5_moe".into());
    let mut text = text_fields();
    text.insert("rope_theta".into(), 1e7.into());
    text.insert("mtp_num_hidden_layers".into(), 1.into());
    text.insert("eos_token_id".into(), 7.into());
    moe.insert("text_config".into(), Value::Object(text.clone()));
    moe.insert("tie_word_embeddings".into(), true.into());
    let mut dense = moe.clone();
    dense.insert("model_type".into(), "qwen3_5".into());
    let mut next = text;
    next.insert("model_type".into(), "qwen3_next".into());
    next.insert("mlp_only_layers".into(), vec![1, 6].into());
    next.insert("norm_topk_prob".into(), false.into());
    next.insert("partial_rotary_factor".into(), 0.375.into());
    next.insert("rms_norm_eps".into(), 1e-5.into());
    for v in [moe, dense, next] {
        let c = parse(Value::Object(v)).unwrap();
        let back = parse(c.to_hf_json()).unwrap();
        assert_eq!(format!("{back:?}"), format!("{c:?}"));
    }
}
