//! `deltamoe serve` as a process: it prints its URL, answers /health, and the official openai
//! Python client (scripts/openai_client_check.py) works against it.

mod common;

use std::io::Write;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running `deltamoe serve`, killed when dropped.
struct Serve {
    child: Child,
    base: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the server on a free port and waits for its `listening on http://…` line.
fn serve(args: &[&str]) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltamoe"))
        .args([
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            "cpu",
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
    std::thread::spawn(move || for _ in lines {});
    Serve { child, base }
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
