//! Shared by the server's HTTP tests: a server on 127.0.0.1 with a random port serving a tiny
//! model on the CPU, a reqwest client, SSE parsing and metrics reading.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use deltamoe_engine::Engine;
use deltamoe_model::Qwen3Hybrid;
use deltamoe_server::{serve, EngineFactory, Server, ServerOptions};
use futures_util::StreamExt;
use serde_json::Value as Json;

/// A directory under the repository's fixtures/ (tiny random-weight models with tokenizers).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// The built-in 9M-parameter model (real text).
pub fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny")
}

pub struct TestServer {
    pub base: String,
    pub client: reqwest::Client,
}

/// Starts a CPU server for `dir`.
pub async fn start(dir: PathBuf, opts: ServerOptions) -> TestServer {
    let model_dir = dir.clone();
    let factory: EngineFactory = Box::new(move || Ok(Engine::new(Qwen3Hybrid::load(&model_dir)?)));
    start_with(dir, factory, opts).await
}

/// Starts a server on GPU 0 with `opts.max_seqs` state slots of 4096 tokens.
pub async fn start_cuda(dir: PathBuf, opts: ServerOptions) -> TestServer {
    let (model_dir, seqs) = (dir.clone(), opts.max_seqs);
    let factory: EngineFactory = Box::new(move || {
        let model = Qwen3Hybrid::load(&model_dir)?;
        let gpu = deltamoe_compute::cuda::Gpu::new(0)
            .map_err(|e| deltamoe_engine::EngineError::Input(e.to_string()))?;
        Engine::new_cuda(model, std::sync::Arc::new(gpu), 4096, seqs)
    });
    start_with(dir, factory, opts).await
}

/// Starts a server built by `factory` on 127.0.0.1 (any free port) in the current runtime.
pub async fn start_with(dir: PathBuf, factory: EngineFactory, opts: ServerOptions) -> TestServer {
    let server = tokio::task::spawn_blocking(move || {
        let text = deltamoe_engine::model_text::ModelText::load(&dir).unwrap();
        Server::start(text, factory, opts)
    })
    .await
    .unwrap()
    .unwrap();
    listen(server).await
}

/// Starts a server as `serve --synthetic` runs one (byte-level tokenizer, plain chat, no
/// model files), on the CPU with the built-in model's weights.
pub async fn start_synthetic(opts: ServerOptions) -> TestServer {
    let factory: EngineFactory = Box::new(|| Ok(Engine::new(Qwen3Hybrid::load(&tiny_model())?)));
    let server = tokio::task::spawn_blocking(move || Server::start_synthetic(factory, opts))
        .await
        .unwrap()
        .unwrap();
    listen(server).await
}

/// Serves `server` on 127.0.0.1 (any free port) in the current runtime.
async fn listen(server: Server) -> TestServer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = server.conn_limits();
    tokio::spawn(serve(
        listener,
        server.router(),
        limits,
        std::future::pending(),
    ));
    TestServer {
        base: format!("http://{addr}"),
        client: reqwest::Client::new(),
    }
}

/// Options for tests: fixture name, small limits.
pub fn options() -> ServerOptions {
    ServerOptions {
        api_name: "test-model".into(),
        max_seqs: 8,
        max_queue: 16,
        ..ServerOptions::default()
    }
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs JSON; returns the status and the JSON body.
    pub async fn post(&self, path: &str, body: &Json) -> (u16, Json) {
        let resp = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// POSTs raw bytes (a Vec, or shared Bytes) as JSON content; returns the status and the
    /// JSON body.
    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Json) {
        let resp = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap())
    }

    /// POSTs a streaming request and returns every `data:` JSON payload up to `[DONE]`.
    pub async fn stream(&self, path: &str, body: &Json) -> Vec<Json> {
        let resp = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let ctype = resp.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ctype.starts_with("text/event-stream"), "{ctype}");
        sse_events(resp).await
    }

    pub async fn metrics(&self) -> String {
        let resp = self.client.get(self.url("/metrics")).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        resp.text().await.unwrap()
    }

    /// One unlabelled metric.
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics().await;
        deltamoe_server::metrics::sample(&text, name)
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
    }

    /// Waits (at most 10 s) until `name` equals `want`.
    pub async fn wait_metric(&self, name: &str, want: f64) {
        let t0 = Instant::now();
        loop {
            let v = self.metric(name).await;
            if v == want {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{name} stayed {v}, want {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Reads server-sent events: the JSON of each `data:` line until `data: [DONE]`.
pub async fn sse_events(resp: reqwest::Response) -> Vec<Json> {
    let mut body = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        buf.extend_from_slice(&chunk.unwrap());
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = String::from_utf8(event).unwrap();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim_start();
                if data == "[DONE]" {
                    return out;
                }
                out.push(serde_json::from_str(data).unwrap());
            }
        }
    }
    panic!("the stream ended without data: [DONE]");
}

/// The text of a streamed chat reply (content deltas joined).
pub fn chat_text(events: &[Json]) -> String {
    events
        .iter()
        .filter_map(|e| {
            e["choices"].get(0)?["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

/// The error object of a failed request, checked for OpenAI's shape.
pub fn error_of(body: &Json) -> &Json {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "{body}"
    );
    e
}
