//! Load test for a running `deltamoe serve` on this machine (loopback only): at each
//! concurrency level, clients send streamed completions until a fixed number of requests is
//! done or the level's time limit passes, and the run reports throughput (requests/s,
//! generated tokens/s) and p50/p99 of latency and time to first token.
//!
//!     cargo run --release -p deltamoe-server --example loadtest -- --url http://127.0.0.1:8080

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
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

/// A level's outcome.
struct Level {
    concurrency: usize,
    ok: Vec<Sample>,
    failed: usize,
    wall: f64,
}

impl Level {
    fn summary(&self) -> Json {
        let mut lat: Vec<f64> = self.ok.iter().map(|s| s.latency).collect();
        let mut ttft: Vec<f64> = self.ok.iter().map(|s| s.ttft).collect();
        lat.sort_by(f64::total_cmp);
        ttft.sort_by(f64::total_cmp);
        let tokens: usize = self.ok.iter().map(|s| s.tokens).sum();
        json!({
            "concurrency": self.concurrency,
            "requests": self.ok.len(),
            "failed": self.failed,
            "wall_s": self.wall,
            "requests_per_s": self.ok.len() as f64 / self.wall,
            "generated_tokens_per_s": tokens as f64 / self.wall,
            "latency_p50_s": quantile(&lat, 0.5),
            "latency_p99_s": quantile(&lat, 0.99),
            "ttft_p50_s": quantile(&ttft, 0.5),
            "ttft_p99_s": quantile(&ttft, 0.99),
        })
    }
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

async fn level(client: &reqwest::Client, a: &Args, concurrency: usize) -> Level {
    let total = a.requests.max(concurrency);
    let deadline = Instant::now() + Duration::from_secs(a.level_timeout_s);
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new((Vec::new(), 0usize)));
    let filler = "the quick brown fox jumps over the lazy dog ".repeat(a.prompt_words / 9 + 1);
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, next, results) = (client.clone(), next.clone(), results.clone());
        let (url, filler, max_tokens) = (a.url.clone(), filler.clone(), a.max_tokens);
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || Instant::now() > deadline {
                    return;
                }
                let body = json!({"prompt": format!("Request {i}: {filler}"), "max_tokens": max_tokens,
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
    println!(
        "{:>5} {:>5} {:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "conc", "ok", "failed", "req/s", "gen tok/s", "lat p50", "lat p99", "ttft p50", "ttft p99"
    );
    let mut all = Vec::new();
    for &c in &a.concurrency {
        let s = level(&client, &a, c.max(1)).await.summary();
        let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:>5} {:>5} {:>6} {:>8.2} {:>9.1} {:>8.3}s {:>8.3}s {:>8.3}s {:>8.3}s",
            c,
            f("requests"),
            f("failed"),
            f("requests_per_s"),
            f("generated_tokens_per_s"),
            f("latency_p50_s"),
            f("latency_p99_s"),
            f("ttft_p50_s"),
            f("ttft_p99_s")
        );
        all.push(s);
    }
    if let Some(path) = &a.json {
        let doc = json!({"url": a.url, "max_tokens": a.max_tokens, "prompt_words": a.prompt_words,
            "levels": all});
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
}
