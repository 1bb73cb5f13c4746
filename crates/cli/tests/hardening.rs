//! Limits the CLI enforces up front and the state it keeps healthy: the context limit of
//! `generate`, conflicting flags, `--threads` beyond the cores, `bench` memory estimates, Ctrl-C
//! during a chat reply, the repair of a damaged built-in model in the cache, and a reader that
//! closes the pipe early.

mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{copy_fixture, edit_config, expect_error, fixture, run};

/// Runs the binary with `XDG_CACHE_HOME` set to `cache`; returns (success, stdout, stderr).
fn run_cached(cache: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn generate_stops_at_the_context_and_checks_up_front() {
    let d = copy_fixture("qwen3_next");
    edit_config(d.path(), |v| v["max_position_embeddings"] = 8.into());
    let dir = d.path().to_str().unwrap();
    let gen = |prompt: &'static str| {
        let args = [
            "generate",
            "--model",
            dir,
            "--prompt-tokens",
            prompt,
            "--max-tokens",
            "50",
            "--device",
            "cpu",
        ];
        run(&args)
    };
    // 3 prompt tokens in an 8-token context leave room for 6 generated ones.
    let (ok, out, err) = gen("1,2,3");
    assert!(ok, "{err}");
    assert!(
        err.contains("note:") && err.contains("generating at most 6"),
        "{err}"
    );
    assert_eq!(out.trim().split(',').count(), 6, "{out}");
    // A prompt longer than the context fails before any output.
    let (ok, out, err) = gen("1,2,3,4,5,6,7,8,9");
    assert!(!ok && out.is_empty(), "{out}");
    assert!(err.contains("9 tokens") && err.contains("holds 8"), "{err}");
}

#[test]
fn chat_with_token_ids_is_an_error() {
    let cmd = format!(
        "generate --model {} --chat --prompt-tokens 1,2",
        fixture("qwen3_5_moe").display()
    );
    expect_error(
        &cmd.split(' ').collect::<Vec<_>>(),
        &["--chat", "--prompt-tokens"],
    );
}

/// `--gpus` is checked before anything loads: a device named twice, the one-GPU option
/// (`--cpu-experts`) with several, GPUs with the CPU backend and `--tensor-parallel` without
/// several GPUs are one-line errors naming the flags.
#[test]
fn gpus_are_checked_up_front() {
    let model = fixture("qwen3_5_moe");
    let m = model.to_str().unwrap();
    let gen = [
        "generate",
        "--model",
        m,
        "--prompt-tokens",
        "1,2",
        "--max-tokens",
        "1",
    ];
    let with = |more: &[&'static str]| {
        gen.iter()
            .copied()
            .chain(more.iter().copied())
            .collect::<Vec<_>>()
    };
    expect_error(
        &with(&["--gpus", "0,1,0"]),
        &["--gpus 0,1,0", "GPU 0 is named twice"],
    );
    expect_error(
        &with(&["--gpus", "0,1", "--expert-cache", "1", "--cpu-experts"]),
        &["--gpus 0,1", "--cpu-experts", "one GPU"],
    );
    expect_error(
        &with(&["--gpus", "0,1", "--device", "cpu"]),
        &["--gpus", "CPU"],
    );
    expect_error(
        &with(&["--tensor-parallel"]),
        &["--tensor-parallel", "two or more"],
    );
    expect_error(
        &["info", "--model", m, "--gpus", "1,1"],
        &["GPU 1 is named twice"],
    );
    expect_error(
        &["info", "--model", m, "--gpus", "0,1,2", "--tensor-parallel"],
        &["tensor parallel over 3 GPUs", "4 attention heads"],
    );
    let (ok, out, err) = run(&["info", "--model", m, "--gpus", "0,1"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("GPU 0 holds routed experts 0..4")
            && out.contains("GPU 1 holds routed experts 4..8"),
        "{out}"
    );
    // A dense model's GPUs each hold their share of the mixers and the MLPs.
    let dense = fixture("qwen3_5_dense");
    let d = dense.to_str().unwrap();
    let (ok, out, err) = run(&["info", "--model", d, "--gpus", "0,1", "--tensor-parallel"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("GPU 1 holds every other weight") && out.contains("dense MLPs only its share"),
        "{out}"
    );
}

#[test]
fn threads_are_capped_at_the_cores() {
    let dir = fixture("qwen3_next");
    let cores = std::thread::available_parallelism().unwrap().get();
    let t0 = Instant::now();
    let (ok, _, err) = run(&[
        "--threads",
        "10000",
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-tokens",
        "1,2",
        "--max-tokens",
        "2",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("warning: --threads 10000"), "{err}");
    assert!(
        err.contains(&format!("backend: cpu, {cores} threads")),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(60));
    expect_error(
        &["--threads", "0", "info", "--model", "."],
        &["--threads 0"],
    );
}

#[test]
fn bench_refuses_a_synthetic_model_that_does_not_fit() {
    let Some(available) = deltamoe_model::host_memory::available() else {
        return;
    };
    // qwen3.6-35b-a3b needs about 65 GiB of bf16 weights; qwen3.5-397b-a17b far more than any
    // host. A 4 GiB address-space limit makes sure a missed check cannot eat the machine.
    let mut shapes = vec!["qwen3.5-397b-a17b"];
    if available < 60 << 30 {
        shapes.push("qwen3.6-35b-a3b");
    }
    for shape in shapes {
        let t0 = Instant::now();
        let cmd = format!(
            "ulimit -v 4194304; exec '{}' bench --synthetic {shape} --device cpu",
            env!("CARGO_BIN_EXE_deltamoe")
        );
        let out = Command::new("sh").args(["-c", &cmd]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or("");
        assert!(
            line.contains(shape) && line.contains("GiB of memory") && line.contains("available"),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(30));
    }
}

#[test]
fn ctrl_c_ends_a_chat_reply_and_returns_to_the_prompt() {
    let m = fixture("qwen3_5_moe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .args([
            "chat",
            "--model",
            m.to_str().unwrap(),
            "--max-tokens",
            "4000",
        ])
        .args(["--temperature", "1", "--seed", "7", "--device", "cpu"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Tell me a long story\n").unwrap();
    // Wait for the reply to start streaming, then press Ctrl-C.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Back at the prompt: a command is still read and obeyed.
    stdin.write_all(b"/quit\n").unwrap();
    drop(stdin);
    let t0 = Instant::now();
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            panic!("chat did not exit after Ctrl-C and /quit");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(exit.success(), "{exit:?}: {err}");
    assert!(err.contains("interrupted (Ctrl-C)"), "{err}");
}

#[test]
fn a_damaged_built_in_model_is_repaired() {
    let cache = tempfile::tempdir().unwrap();
    let args: Vec<&str> = "generate --prompt Truth --max-tokens 8 --temperature 0 --device cpu"
        .split(' ')
        .collect();
    let (ok, clean, err) = run_cached(cache.path(), &args);
    assert!(ok, "{err}");
    let models = cache.path().join("deltamoe/models");
    let dir = std::fs::read_dir(&models)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("tiny-")
        })
        .unwrap();
    let weights = dir.join("model.safetensors");
    let reference = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny/model.safetensors"),
    )
    .unwrap();
    // Flip a byte in the middle of the tensor data and truncate the config.
    let mut bytes = std::fs::read(&weights).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&weights, &bytes).unwrap();
    std::fs::write(dir.join("config.json"), b"{").unwrap();
    let (ok, out, err) = run_cached(cache.path(), &args);
    assert!(ok, "{err}");
    assert!(err.contains("rewriting"), "{err}");
    assert_eq!(out, clean);
    assert!(std::fs::read(&weights).unwrap() == reference);
    // Intact files are left alone.
    let (ok, _, err) = run_cached(cache.path(), &args);
    assert!(ok && !err.contains("rewriting"), "{err}");
}

#[test]
fn info_and_generate_reject_the_same_bad_configs() {
    let cases: [(&str, serde_json::Value, &str); 3] = [
        ("rope_theta", 0.into(), "above 0"),
        ("rms_norm_eps", (-1).into(), "(0, 1)"),
        ("vocab_size", 1_000_000_000_000u64.into(), "1..="),
    ];
    for (key, value, range) in cases {
        let d = copy_fixture("qwen3_next");
        edit_config(d.path(), |v| v[key] = value);
        let dir = d.path().to_str().unwrap();
        let needles = [format!("`{key}`"), range.to_string()];
        let needles: Vec<&str> = needles.iter().map(|s| s.as_str()).collect();
        expect_error(&["info", "--model", dir], &needles);
        expect_error(
            &[
                "generate",
                "--model",
                dir,
                "--prompt-tokens",
                "1",
                "--device",
                "cpu",
            ],
            &needles,
        );
    }
}

#[test]
fn a_reader_that_goes_away_ends_a_command_quietly() {
    // `deltamoe info | head -1`: the pipe closes before the output is written.
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .arg("info")
        .arg("--model")
        .arg(fixture("qwen3_5_moe"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(status.code(), Some(101), "{err}");
}
