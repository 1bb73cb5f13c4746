//! The server's hardening over real HTTP on 127.0.0.1: unsupported or mistyped fields are
//! 400s naming the field, wrong methods are 405s with an error body, oversized prompts are
//! rejected early, special tokens in message content stay text, and idle or half-sent
//! connections are closed.

mod common;

use common::*;
use serde_json::json;

/// Each request is answered 400 (405 for the wrong method) with `param` naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_and_mistyped_fields_name_the_param() {
    let s = start(fixture("qwen3_5_moe"), options()).await;
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format",
        ),
        (
            json!({"messages": msgs, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": msgs, "tool_choice": "required", "tools": [{"type": "function",
            "function": {"name": "f", "parameters": {}}}]}),
            "tool_choice",
        ),
        (json!({"messages": msgs, "top_k": -5}), "top_k"),
        (json!({"messages": msgs, "seed": -7}), "seed"),
        (
            json!({"messages": msgs, "temperature": "hot"}),
            "temperature",
        ),
        (json!({"messages": msgs, "stream": "yes"}), "stream"),
        (
            json!({"messages": msgs, "presence_penalty": 0.5}),
            "presence_penalty",
        ),
        (
            json!({"messages": msgs, "logit_bias": {"1": 5}}),
            "logit_bias",
        ),
    ];
    for (body, param) in cases {
        let (status, reply) = s.post(chat, &body).await;
        assert_eq!(status, 400, "{body} -> {reply}");
        assert_eq!(error_of(&reply)["param"], param, "{body} -> {reply}");
    }
    let (status, reply) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hi", "temperature": [1]}),
        )
        .await;
    assert_eq!(
        (status, error_of(&reply)["param"].as_str()),
        (400, Some("temperature"))
    );

    // Accepted: a text response_format, top_k -1 (no limit), seed -1 (random), tool_choice auto.
    let ok = json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "text"},
        "top_k": -1, "seed": -1, "tool_choice": "auto", "presence_penalty": 0});
    let (status, reply) = s.post(chat, &ok).await;
    assert_eq!(status, 200, "{reply}");

    let resp = s.client.get(s.url(chat)).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 405);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(error_of(&body)["code"], "method_not_allowed");
}
