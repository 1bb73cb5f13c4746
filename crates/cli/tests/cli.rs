//! The `deltamoe` binary end to end: outputs on a fixture, and one-line errors (non-zero exit,
//! no panic) for each kind of bad input.

mod common;

use common::{copy_fixture, edit_config, expect_error, fixture, run};

fn score_args<'a>(dir: &'a str, tokens: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "score",
        "--model",
        dir,
        "--tokens",
        tokens,
        "--logits-out",
        out,
        "--device",
        "cpu",
    ]
}

#[test]
fn score_writes_logits_npy() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("l.npy");
    let dir = fixture("qwen3_5_dense");
    let (ok, _, err) = run(&score_args(
        dir.to_str().unwrap(),
        "1,2,3,4,5",
        out.to_str().unwrap(),
    ));
    assert!(ok, "{err}");
    let b = std::fs::read(&out).unwrap();
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert!(std::str::from_utf8(&b[10..10 + hl])
        .unwrap()
        .contains("(5, 512)"));
    assert_eq!(b.len(), 10 + hl + 5 * 512 * 4);
}

#[test]
fn generate_streams_text_and_reports_speed() {
    let dir = fixture("qwen3_5_moe");
    let (ok, out, err) = run(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--chat",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    assert!(!out.trim().is_empty());
    assert!(
        err.contains("prefill:") && err.contains("tok/s") && err.contains("decode:"),
        "{err}"
    );
    // Without a tokenizer, ids in and ids out.
    let dir = fixture("qwen3_next");
    let (ok, out, err) = run(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.trim().split(',').count(), 4, "{out}");
}

#[test]
fn generate_offloads_experts_on_the_cpu() {
    // Greedy ids with every expert use read from disk equal the all-resident ones.
    let dir = fixture("qwen3_next");
    let args = |cache: Option<&'static str>| {
        let mut a = vec![
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-tokens",
            "5,17,42,7",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ];
        a.extend(cache.map(|c| ["--expert-cache", c]).into_iter().flatten());
        a
    };
    let (ok, want, err) = run(&args(None));
    assert!(ok, "{err}");
    assert!(!err.contains("cache hit rate"), "{err}");
    let (ok, out, err) = run(&args(Some("0")));
    assert!(ok, "{err}");
    assert_eq!(out, want);
    assert!(
        err.contains("0 of 8 cached")
            && err.contains("cache hit rate 0.000")
            && err.contains("MB read from disk"),
        "{err}"
    );
}

#[test]
fn info_reports_parameters_and_memory() {
    let dir = fixture("qwen3_5_moe");
    let (ok, out, err) = run(&[
        "info",
        "--model",
        dir.to_str().unwrap(),
        "--context",
        "1024",
    ]);
    assert!(ok, "{err}");
    for s in [
        "pattern LLLF",
        "routed experts",
        "active per token",
        "memory per sequence at 1024 tokens",
        "--expert-cache GB",
    ] {
        assert!(out.contains(s), "`{s}` missing from:\n{out}");
    }
}

#[test]
fn bad_safetensors_files_are_named() {
    let d = copy_fixture("qwen3_5_dense");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let dir = d.path().to_str().unwrap();
    expect_error(
        &score_args(dir, "1,2", "/dev/null"),
        &["model.safetensors", "truncated"],
    );
    let mut corrupt = bytes.clone();
    corrupt[8..16].copy_from_slice(b"\xff\xfe{garb!");
    std::fs::write(&p, &corrupt).unwrap();
    expect_error(
        &score_args(dir, "1,2", "/dev/null"),
        &["model.safetensors", "not a valid safetensors"],
    );
}

#[test]
fn config_errors_name_the_key() {
    let d = copy_fixture("qwen3_5_dense");
    let dir = d.path().to_str().unwrap().to_string();
    edit_config(d.path(), |v| {
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("hidden_size");
    });
    expect_error(
        &score_args(&dir, "1", "/dev/null"),
        &["config.json", "text_config.hidden_size", "missing"],
    );

    let d = copy_fixture("qwen3_next");
    let dir = d.path().to_str().unwrap().to_string();
    edit_config(d.path(), |v| v["model_type"] = "llama".into());
    expect_error(
        &score_args(&dir, "1", "/dev/null"),
        &["model_type `llama`", "not supported"],
    );

    std::fs::write(d.path().join("config.json"), "{ not json").unwrap();
    expect_error(
        &score_args(&dir, "1", "/dev/null"),
        &["config.json", "not valid JSON"],
    );
}

#[test]
fn shape_mismatch_and_missing_tensor_are_named() {
    let d = copy_fixture("qwen3_5_dense");
    let dir = d.path().to_str().unwrap().to_string();
    edit_config(d.path(), |v| {
        v["text_config"]["intermediate_size"] = 97.into()
    });
    expect_error(
        &score_args(&dir, "1", "/dev/null"),
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "[97, 64]",
            "[96, 64]",
        ],
    );

    // Untying the embeddings asks for an lm_head the checkpoint does not have.
    edit_config(d.path(), |v| {
        v["text_config"]["intermediate_size"] = 96.into();
        v["tie_word_embeddings"] = false.into();
    });
    expect_error(
        &score_args(&dir, "1", "/dev/null"),
        &["lm_head.weight", "missing"],
    );
}

#[test]
fn bad_tokens_and_prompts_are_rejected() {
    let dir = fixture("qwen3_next");
    let dir = dir.to_str().unwrap();
    expect_error(
        &score_args(dir, "1,99999", "/dev/null"),
        &["token id 99999", "vocab_size is 512"],
    );
    expect_error(&score_args(dir, "1,x", "/dev/null"), &["--tokens", "`x`"]);
    expect_error(&score_args(dir, "", "/dev/null"), &["--tokens", "empty"]);
    expect_error(
        &["generate", "--model", dir, "--prompt-tokens", " "],
        &["empty"],
    );
    expect_error(
        &["generate", "--model", dir, "--prompt", "hi"],
        &["no tokenizer.json", "--prompt-tokens"],
    );
    let moe = fixture("qwen3_5_moe");
    expect_error(
        &["generate", "--model", moe.to_str().unwrap(), "--prompt", ""],
        &["--prompt", "empty"],
    );
    let dense = fixture("qwen3_5_dense");
    expect_error(
        &[
            "generate",
            "--model",
            dense.to_str().unwrap(),
            "--device",
            "cpu",
            "--expert-cache",
            "1",
            "--prompt-tokens",
            "1,2",
        ],
        &["--expert-cache", "no MoE layers"],
    );
    expect_error(
        &["generate", "--expert-cache=-2", "--prompt", "hi"],
        &["--expert-cache", "GB"],
    );
    expect_error(
        &[
            "score",
            "--model",
            "/nonexistent",
            "--tokens",
            "1",
            "--logits-out",
            "/dev/null",
        ],
        &["/nonexistent", "no such file or directory"],
    );
    expect_error(
        &[
            "score",
            "--model",
            dir,
            "--tokens",
            "1",
            "--logits-out",
            "/dev/null",
            "--device",
            "cuda",
        ],
        &["--device cuda"],
    );
}

#[test]
fn speculative_generation_of_the_built_in_model_is_plain_generation() {
    let args = |n: &'static str| {
        [
            "generate",
            "--prompt",
            "It is a truth universally acknowledged",
            "--max-tokens",
            "48",
            "--temperature",
            "0",
            "--device",
            "cpu",
            "--speculative-tokens",
            n,
        ]
    };
    let (ok, plain, err) = run(&args("0"));
    assert!(ok, "{err}");
    let (ok, spec, err) = run(&args("3"));
    assert!(ok, "{err}");
    assert_eq!(spec, plain);
    assert!(err.contains("tokens/step"), "{err}");
}

#[test]
fn speculative_tokens_need_an_mtp_layer_and_a_range() {
    for (model, n, want) in [
        ("qwen3_next", "2", "MTP layer"),
        ("mtp_qwen3_next", "5", "1 to 4"),
    ] {
        let dir = fixture(model);
        let args = [
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-tokens",
            "1,2",
            "--device",
            "cpu",
            "--speculative-tokens",
            n,
        ];
        expect_error(&args, &[want]);
    }
}

/// A GGUF file runs every command that reads a model, with its tokenizer and chat template from
/// the metadata: `generate --chat`, `score` (the file's logits as the library gives them),
/// `perplexity` and `info`; paths that are not one model are named.
#[test]
fn gguf_files_run_every_command() {
    let file = fixture("gguf_quant/qwen3_5_moe_q.q4_k_m.gguf");
    let f = file.to_str().unwrap();
    let (ok, out, err) = run(&[
        "generate",
        "--model",
        f,
        "--prompt",
        "Hello",
        "--chat",
        "--max-tokens",
        "4",
        "--device",
        "cpu",
    ]);
    assert!(ok && !out.trim().is_empty(), "{err}");
    let d = tempfile::tempdir().unwrap();
    let npy = d.path().join("l.npy");
    let (ok, _, err) = run(&score_args(f, "1,2,3", npy.to_str().unwrap()));
    assert!(ok, "{err}");
    let text = d.path().join("t.txt");
    std::fs::write(
        &text,
        "The capital of France is Paris. A small model tells a story.",
    )
    .unwrap();
    let (ok, out, err) = run(&[
        "perplexity",
        "--model",
        f,
        "--text",
        text.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(ok && out.contains("ppl="), "{err}");
    let (ok, out, err) = run(&["info", "--model", f]);
    assert!(ok && out.contains("Q4_K ×13"), "{err}");
    let conv = d.path().join("converted");
    let (ok, _, err) = run(&["convert", "--model", f, "--out", conv.to_str().unwrap()]);
    assert!(ok && conv.join("model.safetensors").is_file(), "{err}");
    let (ok, out, err) = run(&["info", "--model", conv.to_str().unwrap()]);
    assert!(ok && out.contains("qwen3_5_moe"), "{err}");
    let again = d.path().join("again");
    expect_error(
        &[
            "convert",
            "--model",
            f,
            "--out",
            again.to_str().unwrap(),
            "--bits",
            "4",
        ],
        &["--bits", "not re-quantized"],
    );
    let all = fixture("gguf_quant");
    expect_error(
        &["info", "--model", all.to_str().unwrap()],
        &["several GGUF models"],
    );
    std::fs::write(d.path().join("m-00002-of-00002.gguf"), b"GGUF").unwrap();
    let part = d.path().join("m-00002-of-00002.gguf");
    expect_error(
        &["info", "--model", part.to_str().unwrap()],
        &["first part"],
    );
}
