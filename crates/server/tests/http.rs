//! The server over real HTTP on 127.0.0.1: chat and text completions (JSON and SSE), models,
//! health, metrics, continuous batching, prompt reuse, stop strings, admission and cancellation.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value as Json};

fn chat_body(messages: Json, max_tokens: u32) -> Json {
    json!({"model": "test-model", "messages": messages, "max_tokens": max_tokens,
        "temperature": 0})
}

fn user(text: &str) -> Json {
    json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_json_and_stream_agree() {
    let s = start(fixture("qwen3_5_moe"), options()).await;
    let body = chat_body(user("Hello there!"), 12);
    let (status, reply) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "chat.completion");
    assert_eq!(reply["model"], "test-model");
    let choice = &reply["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    let usage = &reply["usage"];
    let generated = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&generated), "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + generated
    );
    let want_finish = if generated == 12 { "length" } else { "stop" };
    assert_eq!(choice["finish_reason"], want_finish);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/chat/completions", &stream_body).await;
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    // The reply's text trimmed as the JSON form trims it.
    assert_eq!(chat_text(&events), text);
    let last_choice = &events[events.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], want_finish);
    let usage_event = events.last().unwrap();
    assert_eq!(usage_event["choices"], json!([]));
    assert_eq!(usage_event["usage"]["completion_tokens"], generated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_models_health_metrics() {
    let s = start(fixture("qwen3_5_moe"), options()).await;
    let body = json!({"model": "test-model", "prompt": "Once upon a time", "max_tokens": 10,
        "temperature": 0});
    let (status, reply) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "text_completion");
    let text = reply["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(reply["usage"]["completion_tokens"], 10);
    assert_eq!(reply["choices"][0]["finish_reason"], "length");

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let events = s.stream("/v1/completions", &stream_body).await;
    let streamed: String = events
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );

    // Token ids as the prompt.
    let ids = json!({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0});
    let (status, reply) = s.post("/v1/completions", &ids).await;
    assert_eq!(
        (status, reply["usage"]["prompt_tokens"].as_u64()),
        (200, Some(3))
    );

    let models: Json = s
        .client
        .get(s.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "test-model");
    let health = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);

    let text = s.metrics().await;
    for name in [
        "deltamoe_requests_total{endpoint=\"completions\",status=\"200\"} 3",
        "deltamoe_generation_tokens_total 22",
        "deltamoe_time_to_first_token_seconds_count 3",
        "# TYPE deltamoe_prompt_cache_hits_total counter",
    ] {
        assert!(text.contains(name), "{name} not in\n{text}");
    }
}

/// Eight different prompts at once give the same greedy text as one at a time, and the
/// decode steps were shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_greedy_equals_single() {
    let s = start(fixture("qwen3_5_moe"), batching_options()).await;
    concurrent_equals_single(&s).await;
}

/// The same on CUDA, where the eight sequences run as one batched step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU"]
async fn cuda_concurrent_greedy_equals_single() {
    if let Some(why) = deltamoe_compute::cuda::unavailable_reason() {
        panic!("no usable GPU: {why}");
    }
    let s = start_cuda(fixture("qwen3_5_moe"), batching_options()).await;
    concurrent_equals_single(&s).await;
}

fn batching_options() -> deltamoe_server::ServerOptions {
    deltamoe_server::ServerOptions {
        prompt_cache_bytes: 0,
        prefill_chunk: 8,
        ..options()
    }
}

async fn concurrent_equals_single(s: &TestServer) {
    let bodies: Vec<Json> = (0..8)
        .map(|i| {
            let prompt = format!("Request number {i}: {}", "tell me a story ".repeat(i + 1));
            json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "seed": i})
        })
        .collect();
    let mut single = Vec::new();
    for b in &bodies {
        let (status, reply) = s.post("/v1/completions", b).await;
        assert_eq!(status, 200, "{reply}");
        single.push(reply["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let steps0 = s.metric("deltamoe_decode_steps_total").await;
    let rows0 = s.metric("deltamoe_decode_rows_total").await;
    let together =
        futures_util::future::join_all(bodies.iter().map(|b| s.post("/v1/completions", b))).await;
    for (i, (status, reply)) in together.iter().enumerate() {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(
            reply["choices"][0]["text"].as_str().unwrap(),
            single[i],
            "request {i}"
        );
    }
    let steps = s.metric("deltamoe_decode_steps_total").await - steps0;
    let rows = s.metric("deltamoe_decode_rows_total").await - rows0;
    assert!(
        rows >= 1.5 * steps,
        "no batching: {rows} rows in {steps} steps"
    );
}

/// The second turn of a conversation starts from the first turn's state: only the tokens the
/// conversation added are prefilled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_prefills_only_new_tokens() {
    let s = start(tiny_model(), options()).await;
    let mut messages = vec![
        json!({"role": "system", "content": "You are a character in a novel."}),
        json!({"role": "user", "content": "What do you think of Mr. Darcy?"}),
    ];
    let (status, first) = s
        .post("/v1/chat/completions", &chat_body(json!(messages), 24))
        .await;
    assert_eq!(status, 200, "{first}");
    let turn1_prompt = first["usage"]["prompt_tokens"].as_f64().unwrap();
    let turn1_reply = first["usage"]["completion_tokens"].as_f64().unwrap();
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And of his sister?"}));

    let before = [
        s.metric("deltamoe_prompt_tokens_total").await,
        s.metric("deltamoe_prompt_tokens_prefilled_total").await,
        s.metric("deltamoe_prompt_tokens_cached_total").await,
        s.metric("deltamoe_prompt_cache_hits_total").await,
    ];
    let (status, second) = s
        .post("/v1/chat/completions", &chat_body(json!(messages), 8))
        .await;
    assert_eq!(status, 200, "{second}");
    let after = [
        s.metric("deltamoe_prompt_tokens_total").await,
        s.metric("deltamoe_prompt_tokens_prefilled_total").await,
        s.metric("deltamoe_prompt_tokens_cached_total").await,
        s.metric("deltamoe_prompt_cache_hits_total").await,
    ];
    let [prompt, prefilled, cached, hits] = [0, 1, 2, 3].map(|i| after[i] - before[i]);
    let turn2_prompt = second["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(prompt, turn2_prompt);
    assert_eq!(hits, 1.0);
    // Turn 1's prompt and reply (its last token is fed with turn 2 when it ended at the limit).
    assert!(
        cached >= turn1_prompt + turn1_reply - 1.0,
        "reused only {cached} tokens"
    );
    eprintln!("turn 2: {prompt} prompt tokens, {cached} reused, {prefilled} prefilled");
    assert_eq!(prefilled, prompt - cached);
    let usage_cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_f64();
    assert_eq!(usage_cached, Some(cached));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text() {
    let s = start(tiny_model(), options()).await;
    let body = json!({"prompt": "It is a truth universally acknowledged", "max_tokens": 24,
        "temperature": 0});
    let (_, reply) = s.post("/v1/completions", &body).await;
    let full = reply["choices"][0]["text"].as_str().unwrap().to_string();
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() > 4, "{full:?}");
    let stop = words[3];
    let want = &full[..full.find(stop).unwrap()];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!(["@@never@@", stop]);
        b["stream"] = json!(stream);
        let (text, finish) = if stream {
            let events = s.stream("/v1/completions", &b).await;
            let text: String = events
                .iter()
                .map(|e| e["choices"][0]["text"].as_str().unwrap())
                .collect();
            (
                text,
                events.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let (_, r) = s.post("/v1/completions", &b).await;
            (
                r["choices"][0]["text"].as_str().unwrap().to_string(),
                r["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(text, want, "stream {stream}");
        assert_eq!(finish, "stop");
    }
    s.wait_metric("deltamoe_sequences_running", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let opts = deltamoe_server::ServerOptions {
        max_context: Some(64),
        max_body_bytes: 4096,
        ..options()
    };
    let s = start(fixture("qwen3_5_moe"), opts).await;
    let chat = "/v1/chat/completions";
    let (status, body) = s.post_raw(chat, b"{\"messages\": [".to_vec()).await;
    assert_eq!(status, 400);
    assert!(
        error_of(&body)["message"]
            .as_str()
            .unwrap()
            .contains("JSON"),
        "{body}"
    );

    let wrong = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"});
    let (status, body) = s.post(chat, &wrong).await;
    assert_eq!(
        (status, error_of(&body)["param"].as_str()),
        (400, Some("max_tokens")),
        "{body}"
    );
    let (status, body) = s.post(chat, &json!({"messages": "hi"})).await;
    assert_eq!(
        (status, error_of(&body)["param"].as_str()),
        (400, Some("messages")),
        "{body}"
    );

    let big = json!({"messages": [{"role": "user", "content": "x".repeat(10_000)}]});
    let (status, body) = s.post(chat, &big).await;
    assert_eq!(
        (status, error_of(&body)["code"].as_str()),
        (413, Some("request_too_large"))
    );

    let unknown = json!({"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]});
    let (status, body) = s.post(chat, &unknown).await;
    assert_eq!(
        (status, error_of(&body)["code"].as_str()),
        (404, Some("model_not_found"))
    );

    let long = json!({"messages": [{"role": "user", "content": "a b c d e f g h ".repeat(20)}]});
    let (status, body) = s.post(chat, &long).await;
    assert_eq!(
        (status, error_of(&body)["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
    let over = json!({"prompt": "hi", "max_tokens": 1000});
    let (status, body) = s.post("/v1/completions", &over).await;
    assert_eq!(
        (status, error_of(&body)["param"].as_str()),
        (400, Some("max_tokens"))
    );

    let bad_sampling = json!({"prompt": "hi", "top_p": 0});
    let (status, body) = s.post("/v1/completions", &bad_sampling).await;
    assert_eq!(status, 400, "{body}");
    error_of(&body);
    let (status, body) = s.post("/v1/nothing", &json!({})).await;
    assert_eq!(status, 404);
    error_of(&body);

    let ok = chat_body(user("still there?"), 4);
    let (status, body) = s.post(chat, &ok).await;
    assert_eq!(status, 200, "{body}");
    let text = s.metrics().await;
    assert!(
        text.contains("deltamoe_requests_total{endpoint=\"chat\",status=\"400\"} 4"),
        "{text}"
    );
}

/// With every slot and the queue taken a request gets 429 and Retry-After; a client that goes
/// away mid-stream frees its sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_server_answers_429_and_disconnect_cancels() {
    let opts = deltamoe_server::ServerOptions {
        max_seqs: 1,
        max_queue: 0,
        ..options()
    };
    let s = start(fixture("qwen3_5_moe"), opts).await;
    let long = json!({"prompt": "Once", "max_tokens": 4000, "temperature": 0, "stream": true,
        "ignore_eos": true});
    let resp = s
        .client
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    use futures_util::StreamExt;
    body.next().await.unwrap().unwrap();
    s.wait_metric("deltamoe_sequences_running", 1.0).await;

    let resp = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    let err: Json = resp.json().await.unwrap();
    assert_eq!(error_of(&err)["code"], "rate_limit_exceeded");

    drop(body);
    s.wait_metric("deltamoe_sequences_running", 0.0).await;
    assert!(s.metric("deltamoe_requests_cancelled_total").await >= 1.0);
    assert!(s.metric("deltamoe_generation_tokens_total").await < 4000.0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, reply) = s
        .post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{reply}");
}

/// Checkpoints every N prompt tokens let a prompt that shares only a head with an earlier one
/// start from that head; the cache keeps to its byte budget by evicting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_every_n_tokens_and_eviction() {
    let budget = 200_000;
    let opts = deltamoe_server::ServerOptions {
        checkpoint_every: 16,
        prefill_chunk: 64,
        prompt_cache_bytes: budget,
        ..options()
    };
    let s = start(fixture("qwen3_5_moe"), opts).await;
    let first: Vec<u32> = (1..=60).collect();
    let (status, reply) = s
        .post(
            "/v1/completions",
            &json!({"prompt": first, "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    let mut other: Vec<u32> = (1..=40).collect();
    other.extend([300, 301, 302]);
    let (_, reply) = s
        .post(
            "/v1/completions",
            &json!({"prompt": other, "max_tokens": 1}),
        )
        .await;
    assert_eq!(reply["usage"]["prompt_tokens_details"]["cached_tokens"], 32);

    for i in 0..12u32 {
        let ids: Vec<u32> = (0..50).map(|k| 100 + (i * 7 + k) % 300).collect();
        let (status, _) = s
            .post("/v1/completions", &json!({"prompt": ids, "max_tokens": 2}))
            .await;
        assert_eq!(status, 200);
    }
    assert!(s.metric("deltamoe_prompt_cache_evictions_total").await > 0.0);
    assert!(s.metric("deltamoe_prompt_cache_bytes").await <= budget as f64);
}

/// A template that opens `<think>` in the generation prompt: the reply (which never closes
/// it) comes back as reasoning_content, in the JSON and the streamed form alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_think_in_the_prompt_gives_reasoning_content() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::os::unix::fs::symlink(tiny_model().join(name), dir.path().join(name)).unwrap();
    }
    let template =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    let s = start(dir.path().to_path_buf(), options()).await;
    let body = chat_body(user("Think about Bath."), 12);
    let (status, reply) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{reply}");
    let message = &reply["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap();
    assert!(
        !reasoning.is_empty() && !reasoning.contains("</think>"),
        "{message}"
    );
    assert_eq!(message["content"], "");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", &stream_body).await;
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(streamed, reasoning);
    assert_eq!(chat_text(&events), "");
}

/// Without model files (`serve --synthetic`): a text prompt is one token per byte, a chat's
/// contents are joined as plain text, replies decode ids past 255 as `<id>`, and a stream
/// gives the same text as the JSON reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_tokenizer_server() {
    let s = common::start_synthetic(common::options()).await;
    let body = json!({"model": "test-model", "prompt": "héllo", "max_tokens": 6,
        "temperature": 0, "ignore_eos": true});
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 6, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty(), "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.stream("/v1/completions", &streamed).await;
    let joined: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(joined, text);

    let body = json!({"messages": [{"role": "system", "content": "a"},
        {"role": "user", "content": "bc"}], "max_tokens": 3, "ignore_eos": true});
    let (status, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
}
