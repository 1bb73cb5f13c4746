//! `generate --prompts-file`: many prompts through the engine's scheduler as one batch, on the
//! built-in model on the CPU; each JSON line equals a run of that prompt alone.

mod common;

use std::process::Command;

use serde_json::Value as Json;

/// Runs the binary on the built-in model with its cache under `cache`.
fn run(cache: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .args(args)
        .args([
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
        ])
        .env("XDG_CACHE_HOME", cache)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const PROMPTS: [&str; 3] = [
    "It is a truth universally acknowledged",
    "Mr. Darcy said",
    "Emma Woodhouse, handsome, clever, and rich,",
];

#[test]
fn prompts_file_runs_as_one_batch_in_input_order() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("prompts.jsonl");
    let lines: Vec<String> = PROMPTS.iter().map(|p| Json::from(*p).to_string()).collect();
    std::fs::write(&file, lines.join("\n\n") + "\n").unwrap();
    let file = file.to_str().unwrap();
    let (ok, out, err) = run(
        d.path(),
        &["generate", "--prompts-file", file, "--max-seqs", "2"],
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("batch:") && err.contains("decode steps"),
        "{err}"
    );
    let got: Vec<Json> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), PROMPTS.len(), "{out}");
    for (i, (line, prompt)) in got.iter().zip(PROMPTS).enumerate() {
        assert_eq!(line["index"], i, "{line}");
        assert!(line["prompt_tokens"].as_u64().unwrap() > 0, "{line}");
        let reason = line["finish_reason"].as_str().unwrap();
        assert!(reason == "length" || reason == "stop", "{line}");
        // The same prompt alone: the prompt echoed, then the continuation.
        let (ok, alone, err) = run(d.path(), &["generate", "--prompt", prompt]);
        assert!(ok, "{err}");
        let text = alone.strip_prefix(prompt).unwrap().trim_end_matches('\n');
        assert_eq!(line["text"], text, "prompt {i}");
    }
}

#[test]
fn bad_prompts_files_are_named() {
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("p.jsonl");
    std::fs::write(&file, "\"fine\"\nnot json\n").unwrap();
    let (ok, _, err) = run(
        d.path(),
        &["generate", "--prompts-file", file.to_str().unwrap()],
    );
    assert!(
        !ok && err.contains("line 2") && err.contains("JSON string"),
        "{err}"
    );
    std::fs::write(&file, "\n").unwrap();
    let (ok, _, err) = run(
        d.path(),
        &["generate", "--prompts-file", file.to_str().unwrap()],
    );
    assert!(!ok && err.contains("no prompts"), "{err}");
    common::expect_error(
        &["generate", "--prompts-file", "/nonexistent.jsonl"],
        &["--prompts-file", "/nonexistent.jsonl"],
    );
}
