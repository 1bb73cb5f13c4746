//! Bounded property tests of the chat request path without HTTP: any body (random JSON, or a
//! valid request with one field replaced by a random value) must parse and prepare to `Ok` or
//! to an OpenAI error with a 4xx status, never panic. A few hundred cases keep CI fast.

mod common;

use deltamoe_engine::chat::ChatTemplate;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::tokenizer::TextTokenizer;
use deltamoe_server::api::{parse_body, ApiError, ChatRequest};
use deltamoe_server::request::{check_model, prepare_chat, ModelInfo};
use proptest::prelude::*;
use serde_json::{json, Value as Json};

/// The built-in model's tokenizer and template, as `serve` would hold them.
fn info() -> ModelInfo {
    let dir = common::tiny_model();
    ModelInfo {
        name: "tiny".into(),
        tokenizer: TextTokenizer::from_dir(&dir).unwrap().unwrap(),
        template: ChatTemplate::from_dir(&dir).unwrap(),
        stop_ids: vec![4093],
        sampling: SamplingParams::default(),
        max_context: 4096,
        vocab_size: 4096,
        created: 0,
        allow_special_in_content: false,
    }
}

thread_local! {
    /// Loaded once per test thread (the tokenizer takes a moment to build).
    static INFO: ModelInfo = info();
}

/// The server's handling of a chat body up to submission.
fn handle(body: &[u8], info: &ModelInfo) -> Result<(), ApiError> {
    let req: ChatRequest = parse_body(body)?;
    check_model(req.model.as_deref(), info)?;
    prepare_chat(req, info).map(|_| ())
}

fn check(body: &[u8], info: &ModelInfo) {
    if let Err(e) = handle(body, info) {
        assert!(
            e.status.is_client_error(),
            "{} for {}",
            e.status,
            String::from_utf8_lossy(body)
        );
        assert!(e.body_json()["error"]["message"].is_string());
    }
}

/// The request the mutations start from.
fn valid_request() -> Json {
    json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hello"}],
        "max_tokens": 8,
    })
}

#[test]
fn the_unmutated_request_is_accepted() {
    INFO.with(|i| handle(valid_request().to_string().as_bytes(), i))
        .unwrap();
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        any::<i64>().prop_map(Json::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number)),
        ".{0,16}".prop_map(Json::from),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "tool",
            "none",
            "auto",
            "text"
        ])
        .prop_map(Json::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "role", "content", "type", "text", "name", "function", "x"
                ]),
                inner,
                0..5,
            )
            .prop_map(|m| Json::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// Fields a chat request carries, where replacements are most likely to reach the checks.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "logprobs",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "ignore_eos",
    "stream",
    "stream_options",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bodies_get_ok_or_an_openai_error(
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..64),
            json_value().prop_map(|v| v.to_string().into_bytes()),
        ]
    ) {
        INFO.with(|i| check(&body, i));
    }

    #[test]
    fn mutated_requests_get_ok_or_an_openai_error(
        field in prop::sample::select(FIELDS),
        value in json_value(),
        in_message in any::<bool>(),
    ) {
        let mut req = valid_request();
        if in_message {
            req["messages"][1][field] = value;
        } else {
            req[field] = value;
        }
        INFO.with(|i| check(req.to_string().as_bytes(), i));
    }
}
