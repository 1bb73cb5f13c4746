//! `deltamoe serve` as a process: it prints its URL, answers /health, and the official openai
//! Python client (scripts/openai_client_check.py) works against it.

mod common;

use std::io::Write;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running `deltamoe serve`, killed when dropped.
struct Serve {
    child: Child,
    base: String,
    /// Its stderr lines after the `listening on` line.
    log: Arc<Mutex<Vec<String>>>,
}

impl Serve {
    /// Waits (at most 5 s) for a log line containing every needle.
    fn log_line(&self, needles: &[&str]) -> String {
        let t0 = Instant::now();
        loop {
            let lines = self.log.lock().unwrap().clone();
            if let Some(l) = lines.iter().find(|l| needles.iter().all(|n| l.contains(n))) {
                return l.clone();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no line with {needles:?} in:\n{}",
                lines.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` (e.g. "INT") to the server.
    fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-s", signal, &pid])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for the server to exit; the seconds it took, or None after `limit` seconds.
    fn exit_within(&mut self, limit: f64) -> Option<f64> {
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < limit {
            if self.child.try_wait().unwrap().is_some() {
                return Some(t0.elapsed().as_secs_f64());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the server on the CPU on a free port and waits for its `listening on http://…` line.
fn serve(args: &[&str]) -> Serve {
    serve_on("cpu", args)
}

/// As [`serve`], on `device`.
fn serve_on(device: &str, args: &[&str]) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            device,
        ])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    let base = loop {
        let Some(Ok(line)) = lines.next() else {
            let _ = child.kill();
            panic!("serve exited before listening:\n{seen}");
        };
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    Serve { child, base, log }
}

/// A bare HTTP/1.1 GET; returns the whole response.
fn get(base: &str, path: &str) -> String {
    let addr = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn serve_prints_its_url_and_answers_health() {
    let model = common::fixture("qwen3_5_moe");
    let s = serve(&["--model", model.to_str().unwrap(), "--api-name", "fixture"]);
    let health = get(&s.base, "/health");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let models = get(&s.base, "/v1/models");
    assert!(models.contains("\"id\":\"fixture\""), "{models}");
}

#[test]
fn serve_rejects_bad_flags_in_one_line() {
    common::expect_error(
        &["serve", "--max-seqs", "0", "--device", "cpu"],
        &["--max-seqs"],
    );
}

#[test]
fn serve_synthetic_rejects_bad_flags_in_one_line() {
    let shape = "qwen3.6-35b-a3b";
    common::expect_error(
        &["serve", "--synthetic", "x"],
        &["--synthetic x", "unknown shape", shape],
    );
    common::expect_error(
        &["serve", "--synthetic", shape, "--device", "cpu"],
        &["--synthetic", "GPU only", "--device cuda"],
    );
    common::expect_error(
        &[
            "serve",
            "--synthetic",
            shape,
            "--bits",
            "3",
            "--device",
            "cpu",
        ],
        &["--bits 3"],
    );
    common::expect_error(
        &["serve", "--synthetic", shape, "--model", "models/tiny"],
        &["--synthetic", "--model"],
    );
    // clap names the missing --synthetic on the line after its one error line.
    common::expect_error(
        &["serve", "--bits", "4", "--device", "cpu"],
        &["required arguments"],
    );
}

/// A synthetic shape served on the GPU: a text prompt of N bytes is N prompt tokens, random
/// replies run to max_tokens, and chat works without a template of the model's own.
#[test]
#[ignore = "needs a CUDA GPU"]
fn serve_synthetic_on_cuda() {
    let s = serve_on(
        "cuda",
        &[
            "--synthetic",
            "qwen3.6-35b-a3b",
            "--bits",
            "4",
            "--max-seqs",
            "2",
            "--ctx",
            "2048",
        ],
    );
    let body = r#"{"prompt": "hello world", "max_tokens": 8, "ignore_eos": true}"#;
    let reply = post(&s.base, "/v1/completions", body);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains(r#""prompt_tokens":11"#), "{reply}");
    assert!(reply.contains(r#""completion_tokens":8"#), "{reply}");
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": true}"#;
    let reply = post(&s.base, "/v1/chat/completions", body);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains(r#""completion_tokens":4"#), "{reply}");
}

/// The official `openai` package against the server. Skipped with a notice when the package
/// is missing, unless DELTAMOE_REQUIRE_OPENAI is set (CI sets it and installs the package).
#[test]
fn openai_python_client() {
    let have = Command::new("python3")
        .args(["-c", "import openai"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        assert!(
            std::env::var_os("DELTAMOE_REQUIRE_OPENAI").is_none(),
            "DELTAMOE_REQUIRE_OPENAI is set but `import openai` fails: pip install openai"
        );
        eprintln!("skipped: the openai Python package is not installed (pip install openai)");
        return;
    }
    let model = common::fixture("qwen3_5_moe");
    let s = serve(&["--model", model.to_str().unwrap()]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai_client_check.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("{}/v1", s.base)])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "openai client check failed:\n{text}");
    assert!(text.contains("openai client check passed"), "{text}");
}

/// One log line per request on stderr, as text by default and as JSON with --log-format json.
#[test]
fn serve_logs_each_request() {
    let model = common::fixture("qwen3_5_moe");
    let s = serve(&["--model", model.to_str().unwrap()]);
    get(&s.base, "/health");
    let line = s.log_line(&["GET /health 200", "prompt=-", "duration="]);
    assert!(line.contains('Z'), "{line}");

    let s = serve(&["--model", model.to_str().unwrap(), "--log-format", "json"]);
    post(
        &s.base,
        "/v1/completions",
        r#"{"prompt": "Once upon", "max_tokens": 3, "ignore_eos": true}"#,
    );
    let line = s.log_line(&["\"/v1/completions\""]);
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["status"], 200, "{line}");
    assert_eq!(v["completion_tokens"], 3, "{line}");
    assert!(
        v["prompt_tokens"].as_u64().unwrap() > 0 && v["ttft_s"].is_number(),
        "{line}"
    );
}

/// The built-in model served with speculative decoding gives the greedy completion it gives
/// without, and counts the drafts it kept.
#[test]
fn serve_with_speculative_decoding_gives_the_same_completion() {
    let body = r#"{"prompt": "It is a truth universally acknowledged", "max_tokens": 40, "temperature": 0}"#;
    let text = |args: &[&str]| {
        let s = serve(args);
        let r = post(&s.base, "/v1/completions", body);
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let json = &r[r.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            get(&s.base, "/metrics"),
        )
    };
    let (plain, _) = text(&[]);
    let (spec, metrics) = text(&["--speculative-tokens", "2"]);
    assert_eq!(spec, plain);
    let kept = metrics
        .lines()
        .find_map(|l| l.strip_prefix("deltamoe_speculative_drafts_accepted_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(kept.is_some_and(|k| k > 0), "{metrics}");
}

/// A bare HTTP/1.1 POST of JSON; returns the whole response.
fn post(base: &str, path: &str, body: &str) -> String {
    let mut s = open_post(base, path, body);
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn open_post(base: &str, path: &str, body: &str) -> TcpStream {
    let addr = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// A long stream in flight: the first bytes of its reply have arrived.
fn long_stream(base: &str) -> TcpStream {
    let body = r#"{"prompt": "Once", "max_tokens": 4000, "ignore_eos": true, "stream": true}"#;
    let mut s = open_post(base, "/v1/completions", body);
    let mut first = [0u8; 512];
    let n = s.read(&mut first).unwrap();
    let head = String::from_utf8_lossy(&first[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    s
}

/// A server with `--shutdown-timeout secs` and a long stream in flight.
fn streaming(model: &Path, secs: &str) -> (Serve, TcpStream) {
    let model = model.to_str().unwrap();
    let s = serve(&["--model", model, "--shutdown-timeout", secs]);
    let stream = long_stream(&s.base);
    (s, stream)
}

/// Ctrl-C with a stream in flight: the server exits once --shutdown-timeout has passed,
/// cutting the stream; a second Ctrl-C exits at once.
#[test]
fn shutdown_cuts_streams_after_the_deadline_and_a_second_signal_exits() {
    let model = common::fixture("qwen3_5_moe");
    let (mut s, _stream) = streaming(&model, "1");
    s.signal("INT");
    let took = s.exit_within(4.0).expect("still running 4 s after Ctrl-C");
    assert!(took >= 0.8, "exited after {took} s, before the deadline");

    let (mut s, _stream) = streaming(&model, "60");
    s.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "exited before its deadline"
    );
    s.signal("INT");
    s.exit_within(2.0)
        .expect("still running 2 s after the second signal");
}
