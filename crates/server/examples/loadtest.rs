//! Load test for a running `deltamoe serve` on this machine (loopback only): at each
//! concurrency level (and, with `--prompt-tokens`, each prompt length), clients send streamed
//! completions until a fixed number of requests is done or the level's time limit passes, and
//! the run reports throughput (requests/s, output tokens/s) and p50/p99 of latency, time to
//! first token (TTFT) and time per output token after the first (TPOT).
//!
//!     cargo run --release -p deltamoe-server --example loadtest -- --url http://127.0.0.1:8080
//!
//! `--prompt-tokens 512,4096` sends ASCII prompts of exactly that many bytes: with the byte
//! tokenizer of `serve --synthetic` exactly that many prompt tokens. Every prompt starts with
//! a number unique to the run, level and request, so no prompt reuses another's cached state.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use deltamoe_server::metrics::quantile;
use futures_util::StreamExt;
use serde_json::{json, Value as Json};

#[derive(Parser, Clone)]
#[command(about = "Throughput and latency of a deltamoe server at several concurrency levels")]
struct Args {
    /// Server base URL (loopback addresses only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent clients per level.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    concurrency: Vec<usize>,
    /// Requests per level (at least the level's concurrency).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Tokens each request generates (end-of-sequence ignored, so every request is this long).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Words of filler in each prompt (each prompt also starts with its own number).
    #[arg(long, default_value_t = 64)]
    prompt_words: usize,
    /// Prompts of exactly this many bytes of ASCII text instead of --prompt-words (the prompt
    /// tokens with the byte tokenizer of `serve --synthetic`); each length is measured at
    /// every concurrency level.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt_words")]
    prompt_tokens: Vec<usize>,
    /// Wall-clock limit per level in seconds: no request starts after it.
    #[arg(long, default_value_t = 300)]
    level_timeout_s: u64,
    /// Wait up to this many seconds for /health before starting.
    #[arg(long, default_value_t = 300)]
    wait_s: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One finished request.
struct Sample {
    latency: f64,
    ttft: f64,
    tokens: usize,
}

impl Sample {
    /// Time per output token after the first: the stream's time after its first token over
    /// the tokens that followed; `None` for a reply of fewer than two tokens.
    fn tpot(&self) -> Option<f64> {
        (self.tokens >= 2).then(|| (self.latency - self.ttft) / (self.tokens - 1) as f64)
    }
}

/// The p50 and p99 (nearest rank) of `values`; NaN when there are none.
fn p50_p99(mut values: Vec<f64>) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    (quantile(&values, 0.5), quantile(&values, 0.99))
}

/// A level's outcome.
struct Level {
    concurrency: usize,
    /// Prompt bytes (`--prompt-tokens`), or `None` for `--prompt-words` prompts.
    prompt_tokens: Option<usize>,
    ok: Vec<Sample>,
    failed: usize,
    wall: f64,
}

impl Level {
    fn summary(&self) -> Json {
        let lat = p50_p99(self.ok.iter().map(|s| s.latency).collect());
        let ttft = p50_p99(self.ok.iter().map(|s| s.ttft).collect());
        let tpot = p50_p99(self.ok.iter().filter_map(Sample::tpot).collect());
        let tokens: usize = self.ok.iter().map(|s| s.tokens).sum();
        json!({
            "concurrency": self.concurrency,
            "prompt_tokens": self.prompt_tokens,
            "requests": self.ok.len(),
            "failed": self.failed,
            "wall_s": self.wall,
            "requests_per_s": self.ok.len() as f64 / self.wall,
            "generated_tokens_per_s": tokens as f64 / self.wall,
            "latency_p50_s": lat.0,
            "latency_p99_s": lat.1,
            "ttft_p50_s": ttft.0,
            "ttft_p99_s": ttft.1,
            "tpot_p50_s": tpot.0,
            "tpot_p99_s": tpot.1,
        })
    }
}

/// The prompt of request `id` (unique in the run): `id` first, then filler — `words` words of
/// it, or with `bytes` cut or padded to exactly that many bytes (all ASCII).
fn prompt(id: &str, words: usize, bytes: Option<usize>) -> String {
    const FILLER: &str = "the quick brown fox jumps over the lazy dog ";
    let Some(n) = bytes else {
        return format!("Request {id}: {}", FILLER.repeat(words / 9 + 1));
    };
    let mut text = format!("Request {id}: ");
    while text.len() < n {
        text.push_str(FILLER);
    }
    text.truncate(n);
    text
}

/// Refuses any host that is not a loopback address.
fn check_loopback(url: &str) -> Result<(), String> {
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let host = match host.rsplit_once(':') {
        Some((h, _)) => h,
        None => host,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback && url.starts_with("http://") {
        Ok(())
    } else {
        Err(format!(
            "--url {url}: only http:// on loopback (127.0.0.1, localhost, [::1]) is allowed"
        ))
    }
}

async fn wait_healthy(client: &reqwest::Client, url: &str, secs: u64) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            return Err(format!("{url}/health did not answer 200 within {secs} s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One streamed completion; returns latency, time to first token and generated tokens.
async fn one(client: &reqwest::Client, url: &str, body: &Json) -> Result<Sample, String> {
    let t0 = Instant::now();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let mut stream = resp.bytes_stream();
    let (mut ttft, mut tokens, mut buf) = (None, 0, Vec::new());
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                let ttft = ttft.unwrap_or_else(|| t0.elapsed().as_secs_f64());
                return Ok(Sample {
                    latency: t0.elapsed().as_secs_f64(),
                    ttft,
                    tokens,
                });
            }
            let v: Json = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            } else if ttft.is_none() {
                ttft = Some(t0.elapsed().as_secs_f64());
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}

/// One level: `concurrency` clients, prompts of `prompt_tokens` bytes (or `--prompt-words`);
/// `run_id` makes the prompts unique across levels and runs.
async fn level(
    client: &reqwest::Client,
    a: &Args,
    concurrency: usize,
    prompt_tokens: Option<usize>,
    run_id: &str,
) -> Level {
    let total = a.requests.max(concurrency);
    let deadline = Instant::now() + Duration::from_secs(a.level_timeout_s);
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new((Vec::new(), 0usize)));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, next, results) = (client.clone(), next.clone(), results.clone());
        let (url, max_tokens, words) = (a.url.clone(), a.max_tokens, a.prompt_words);
        let run_id = run_id.to_string();
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || Instant::now() > deadline {
                    return;
                }
                let text = prompt(&format!("{run_id}-{i}"), words, prompt_tokens);
                let body = json!({"prompt": text, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": true, "stream": true,
                    "stream_options": {"include_usage": true}});
                let r = one(&client, &url, &body).await;
                let mut res = results.lock().unwrap_or_else(|p| p.into_inner());
                match r {
                    Ok(s) => res.0.push(s),
                    Err(e) => {
                        eprintln!("request {i} failed: {e}");
                        res.1 += 1;
                    }
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let (ok, failed) = std::mem::take(&mut *results.lock().unwrap_or_else(|p| p.into_inner()));
    Level {
        concurrency,
        prompt_tokens,
        ok,
        failed,
        wall,
    }
}

async fn run(a: Args) -> Result<(), String> {
    check_loopback(&a.url)?;
    let a = Args {
        url: a.url.trim_end_matches('/').to_string(),
        ..a
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .map_err(|e| e.to_string())?;
    wait_healthy(&client, &a.url, a.wait_s).await?;
    if a.prompt_tokens.contains(&0) {
        return Err("--prompt-tokens: each length must be at least 1".into());
    }
    let lengths: Vec<Option<usize>> = match a.prompt_tokens.is_empty() {
        true => vec![None],
        false => a.prompt_tokens.iter().copied().map(Some).collect(),
    };
    // Unique to this run, so no prompt matches one a server cached from an earlier run.
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    println!(
        "{:>5} {:>7} {:>5} {:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "conc",
        "prompt",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "lat p50",
        "lat p99",
        "ttft p50",
        "ttft p99",
        "tpot p50",
        "tpot p99"
    );
    let mut all = Vec::new();
    for &c in &a.concurrency {
        for &len in &lengths {
            let run_id = format!("{nonce:x}-{}", all.len());
            let s = level(&client, &a, c.max(1), len, &run_id).await.summary();
            let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
            let shown = len.map_or("-".to_string(), |n| n.to_string());
            println!(
                "{:>5} {:>7} {:>5} {:>6} {:>8.2} {:>9.1} {:>8.3}s {:>8.3}s {:>8.3}s {:>8.3}s {:>8.2}ms {:>8.2}ms",
                c,
                shown,
                f("requests"),
                f("failed"),
                f("requests_per_s"),
                f("generated_tokens_per_s"),
                f("latency_p50_s"),
                f("latency_p99_s"),
                f("ttft_p50_s"),
                f("ttft_p99_s"),
                f("tpot_p50_s") * 1e3,
                f("tpot_p99_s") * 1e3
            );
            all.push(s);
        }
    }
    if let Some(path) = &a.json {
        let doc = json!({"url": a.url, "max_tokens": a.max_tokens, "prompt_words": a.prompt_words,
            "prompt_tokens": a.prompt_tokens, "levels": all});
        std::fs::write(path, doc.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_loopback() {
        assert!(super::check_loopback("http://127.0.0.1:8080").is_ok());
        assert!(super::check_loopback("http://localhost:1/").is_ok());
        assert!(super::check_loopback("http://[::1]:80").is_ok());
        assert!(super::check_loopback("http://10.0.0.1:8080").is_err());
        assert!(super::check_loopback("http://example.com").is_err());
    }

    #[test]
    fn percentiles_and_time_per_output_token() {
        let (p50, p99) = super::p50_p99((1..=100).rev().map(f64::from).collect());
        assert_eq!((p50, p99), (50.0, 99.0));
        let (p50, p99) = super::p50_p99(vec![3.0, 1.0, 2.0]);
        assert_eq!((p50, p99), (2.0, 3.0));
        assert!(super::p50_p99(Vec::new()).0.is_nan());
        let s = super::Sample {
            latency: 1.5,
            ttft: 0.5,
            tokens: 11,
        };
        assert!((s.tpot().unwrap() - 0.1).abs() < 1e-12);
        let one = super::Sample {
            latency: 0.5,
            ttft: 0.5,
            tokens: 1,
        };
        assert!(one.tpot().is_none());
    }

    #[test]
    fn prompts_have_exactly_the_asked_bytes() {
        for n in [1, 5, 512, 4096] {
            let p = super::prompt("ab12-3-17", 64, Some(n));
            assert_eq!(p.len(), n);
            assert!(p.is_ascii());
        }
        assert!(super::prompt("7", 64, Some(4096)).starts_with("Request 7: the quick"));
        assert_ne!(
            super::prompt("1-0", 64, Some(512)),
            super::prompt("1-1", 64, Some(512))
        );
        assert!(super::prompt("7", 18, None).split(' ').count() > 18);
    }
}
