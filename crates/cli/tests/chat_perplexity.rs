//! `deltamoe perplexity` and `deltamoe chat` end to end on the qwen3_5_moe fixture (which ships
//! a tokenizer and a ChatML template). Chat reads stdin, which is a pipe here, so the line
//! editor falls back to plain line reading.

mod common;

use common::{expect_error, fixture, run_with_stdin};

fn moe() -> String {
    fixture("qwen3_5_moe").to_string_lossy().into_owned()
}

/// `key=value` from a line of `k=v` pairs.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
}

#[test]
fn perplexity_prints_ppl_tokens_and_windows() {
    let d = tempfile::tempdir().unwrap();
    let text = d.path().join("t.txt");
    let body = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    std::fs::write(&text, &body).unwrap();
    let t = text.to_str().unwrap();
    let m = moe();
    let (ok, out, err) = run_with_stdin(
        &["perplexity", "--model", &m, "--text", t, "--ctx", "16"],
        "",
    );
    assert!(ok, "{err}");
    let line = out.trim();
    assert!(line.starts_with("ppl="), "{out}");
    let ppl: f64 = field(line, "ppl").parse().unwrap();
    let tokens: usize = field(line, "tokens").parse().unwrap();
    let windows: usize = field(line, "windows").parse().unwrap();
    // Random weights over a 512-token vocabulary: finite, above 1.
    assert!(ppl.is_finite() && ppl > 1.0, "{line}");
    // n tokens in windows of 16: every window scores all but its first token.
    let n = tokens + windows;
    let want_windows = n / 16 + usize::from(n % 16 >= 2);
    assert_eq!(windows, want_windows, "{line}");
    assert!(windows > 1, "{line}");
    assert!(err.contains("tok/s"), "{err}");

    // One big window scores all tokens but the first (the windows of 16 may have dropped a
    // one-token tail).
    let (ok, out, err) = run_with_stdin(&["perplexity", "--model", &m, "--text", t], "");
    assert!(ok, "{err}");
    assert_eq!(field(out.trim(), "windows"), "1");
    let all: usize = field(out.trim(), "tokens").parse().unwrap();
    assert!(all + 1 == n || all == n, "{out} vs {line}");
}

#[test]
fn perplexity_errors_name_the_flag() {
    let d = tempfile::tempdir().unwrap();
    let m = moe();
    let missing = d.path().join("nope.txt");
    let missing = missing.to_str().unwrap();
    expect_error(
        &["perplexity", "--model", &m, "--text", missing],
        &["--text", "nope.txt"],
    );
    let empty = d.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let empty = empty.to_str().unwrap();
    expect_error(
        &["perplexity", "--model", &m, "--text", empty],
        &["--text", "empty"],
    );
    let one = d.path().join("one.txt");
    std::fs::write(&one, "a").unwrap();
    let one = one.to_str().unwrap();
    expect_error(
        &["perplexity", "--model", &m, "--text", one],
        &["--text", "at least 2"],
    );
    expect_error(
        &["perplexity", "--model", &m, "--text", one, "--ctx", "1"],
        &["--ctx 1"],
    );
    let next = fixture("qwen3_next");
    let next = next.to_str().unwrap();
    expect_error(
        &["perplexity", "--model", next, "--text", one],
        &["--model", "tokenizer.json"],
    );
}

/// The `prefill: N new tokens (...)` stats lines of a chat session's stderr.
fn prefills(err: &str) -> Vec<(usize, String)> {
    err.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("prefill: ")?;
            let (n, rest) = rest.split_once(" new tokens (")?;
            let (cache, _) = rest.split_once(')')?;
            Some((n.parse().ok()?, cache.to_string()))
        })
        .collect()
}

#[test]
fn chat_reuses_the_sequence_and_resets() {
    let m = moe();
    // Empty replies (--max-tokens 0) keep the history exactly as fed, so turn 2 must extend.
    let args = [
        "chat",
        "--model",
        &m,
        "--max-tokens",
        "0",
        "--system",
        "Be terse.",
    ];
    let input = "hello\nhow are you?\n/reset\nhello\n/bogus\n/quit\nnever read\n";
    let (ok, out, err) = run_with_stdin(&args, input);
    assert!(ok, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let p = prefills(&err);
    assert_eq!(p.len(), 3, "{err}");
    let (n1, c1) = &p[0];
    assert_eq!(c1, "fresh sequence", "{err}");
    // Second turn: only the new user message and the assistant prompt are fed.
    assert_eq!(p[1].1, format!("reused {n1}"), "{err}");
    assert!(p[1].0 > 0 && p[1].0 < *n1 + 8, "{err}");
    // After /reset the same first message costs the same full prefill again.
    assert_eq!(p[2], (*n1, "fresh sequence".to_string()), "{err}");
    assert!(err.contains("(conversation reset)"), "{err}");
    assert!(err.contains("unknown command /bogus"), "{err}");
    assert_eq!(
        out.lines().count(),
        3,
        "one (empty) reply line per turn: {out:?}"
    );
}

#[test]
fn chat_streams_replies_and_ends_at_eof() {
    let m = moe();
    let args = [
        "chat",
        "--model",
        &m,
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    ];
    let (ok, out, err) = run_with_stdin(&args, "Once upon a time\nand then?\n");
    assert!(ok, "{err}");
    let p = prefills(&err);
    assert_eq!(p.len(), 2, "{err}");
    assert!(err.contains("decode: "), "{err}");
    // Turn 2 either extends the sequence (the reply re-tokenized the same) or starts a fresh
    // one because the noise reply of the random weights re-tokenized differently.
    let (n1, _) = p[0];
    let (n2, c2) = &p[1];
    match c2.strip_prefix("reused ") {
        Some(r) => {
            let r: usize = r.parse().unwrap();
            assert!(r >= n1 && r <= n1 + 6, "{err}");
        }
        None => {
            assert_eq!(
                c2, "fresh sequence: the history rendered differently",
                "{err}"
            );
            assert!(*n2 > n1, "{err}");
        }
    }
    assert_eq!(out.lines().count(), 2, "{out:?}");
}

#[test]
fn chat_errors_without_template_or_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("qwen3_5_moe")).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap() != "tokenizer_config.json" {
            std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let dir = d.path().to_str().unwrap();
    expect_error(&["chat", "--model", dir], &["--model", "chat template"]);
    let next = fixture("qwen3_next");
    expect_error(
        &["chat", "--model", next.to_str().unwrap()],
        &["--model", "tokenizer.json"],
    );
    expect_error(
        &["chat", "--model", &moe(), "--temperature=-1"],
        &["--temperature", "out of range"],
    );
}

/// Chat with the built-in model's MTP layer drafting: the same replies, and the same reuse of the
/// sequence from turn to turn, as without (the kept drafts are part of the fed history).
#[test]
fn chat_with_speculative_decoding_is_chat_without() {
    let input = "Who is Mr. Darcy?\nAnd Elizabeth?\nTell me more.\n";
    let chat = |n: &str| {
        let args = [
            "chat",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--device",
            "cpu",
            "--speculative-tokens",
            n,
        ];
        let (ok, out, err) = run_with_stdin(&args, input);
        assert!(ok, "{err}");
        (out, prefills(&err))
    };
    let (plain, plain_prefills) = chat("0");
    let (spec, spec_prefills) = chat("2");
    assert_eq!(spec, plain);
    assert_eq!(spec_prefills, plain_prefills);
    assert_eq!(plain_prefills.len(), 3);
}
