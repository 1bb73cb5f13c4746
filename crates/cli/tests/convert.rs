//! `deltamoe convert` and `deltamoe info` on quantized checkpoints, end to end through the binary.

mod common;

use common::{expect_error, fixture, run};

#[test]
fn convert_then_info_and_score() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let (src, o) = (fixture("qwen3_5_moe"), out.to_str().unwrap().to_string());
    let (ok, _, err) = run(&[
        "convert",
        "--model",
        src.to_str().unwrap(),
        "--out",
        &o,
        "--bits",
        "4",
        "--group-size",
        "32",
        "--bits-for",
        "lm_head=8",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("linears quantized") && err.contains("tokenizer.json"),
        "{err}"
    );
    for f in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
    let (ok, info, err) = run(&["info", "--model", &o]);
    assert!(ok, "{err}");
    assert!(
        info.contains("MLX affine, default 4 bits, group size 32"),
        "{info}"
    );
    let line = |k: &str| info.lines().find(|l| l.starts_with(k)).unwrap().to_string();
    assert!(line("routed experts").ends_with("5.00"), "{info}");
    assert!(line("lm_head").ends_with("9.00"), "{info}");
    assert!(line("router").ends_with("8.50"), "{info}");
    let npy = tmp.path().join("l.npy");
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &o,
        "--tokens",
        "1,2,3,4",
        "--logits-out",
        npy.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    expect_error(
        &["convert", "--model", src.to_str().unwrap(), "--out", &o],
        &["--out", "not empty"],
    );
}

#[test]
fn convert_errors_are_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let (src, o) = (fixture("qwen3_next"), out.to_str().unwrap());
    let s = src.to_str().unwrap();
    expect_error(
        &["convert", "--model", s, "--out", o, "--bits", "7"],
        &["--bits 7", "not supported"],
    );
    expect_error(
        &["convert", "--model", s, "--out", o, "--group-size", "48"],
        &["group size 48"],
    );
    expect_error(
        &["convert", "--model", s, "--out", o, "--bits-for", "lm_head"],
        &["--bits-for `lm_head`", "PATTERN=BITS"],
    );
    expect_error(
        &["convert", "--model", "/nonexistent", "--out", o],
        &["--model /nonexistent"],
    );
    let mlx = fixture("mlx_qwen3_next_q4");
    expect_error(
        &["convert", "--model", mlx.to_str().unwrap(), "--out", o],
        &["already an mlx-lm"],
    );
    assert!(!out.exists());
}
