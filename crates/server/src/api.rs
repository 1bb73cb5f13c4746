//! OpenAI API shapes: the request bodies of /v1/chat/completions and /v1/completions, and the
//! error body `{"error": {"message", "type", "param", "code"}}` every failure is answered with.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

/// A request failure, answered as OpenAI's error object with an HTTP status.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a Retry-After header (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or asks for something unsupported.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the request field at fault.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = Self::invalid(message);
        e.param = Some(param.to_string());
        e
    }

    /// 400 with code `context_length_exceeded`.
    pub fn context_length(param: &str, message: impl Into<String>) -> ApiError {
        let mut e = Self::invalid_param(param, message);
        e.code = Some("context_length_exceeded");
        e
    }

    /// 404 for a model name the server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        let msg = format!("The model `{asked}` does not exist; this server serves `{served}`");
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", msg);
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    /// 404 for a path the server does not have.
    pub fn not_found(path: &str) -> ApiError {
        let msg = format!("no endpoint {path}; see GET /v1/models, POST /v1/chat/completions, POST /v1/completions");
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", msg);
        e.code = Some("unknown_url");
        e
    }

    /// 405 for a known path asked with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        let msg = format!("{method} is not allowed on {path}; see the API's methods");
        let mut e = Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", msg);
        e.code = Some("method_not_allowed");
        e
    }

    /// 429: every sequence slot and the waiting queue are full.
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
        e.code = Some("rate_limit_exceeded");
        e.retry_after = Some(1);
        e
    }

    /// 503: the engine is not running.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.retry_after = Some(5);
        e
    }

    /// 500: the engine failed on an accepted request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// A body the request could not be read from, e.g. too large (413).
    pub fn body(status: StatusCode, message: impl Into<String>) -> ApiError {
        let mut e = Self::new(status, "invalid_request_error", message);
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            e.code = Some("request_too_large");
        }
        e
    }

    /// The error object as JSON.
    pub fn body_json(&self) -> Json {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body_json())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// Parses a JSON body into `T`; type errors name the field (`param`) at fault.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(ApiError::invalid(format!(
            "the body is not valid JSON ({e}); send a JSON object"
        )));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::invalid(format!("invalid request body: {inner}"))
        } else {
            ApiError::invalid_param(&path, format!("invalid value for `{path}`: {inner}"))
        }
    })
}

/// A request body with its [`Sampling`] fields: each parsed on its own so that a type error
/// names its field.
pub fn parse_request<T: serde::de::DeserializeOwned + WithSampling>(
    bytes: &[u8],
) -> Result<T, ApiError> {
    let mut req: T = parse_body(bytes)?;
    *req.sampling_mut() = parse_body(bytes)?;
    Ok(req)
}

/// A request that carries [`Sampling`] fields.
pub trait WithSampling {
    fn sampling_mut(&mut self) -> &mut Sampling;
}

impl WithSampling for ChatRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.sampling
    }
}

impl WithSampling for CompletionRequest {
    fn sampling_mut(&mut self) -> &mut Sampling {
        &mut self.sampling
    }
}

/// `stop`: one string or a list of them.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and length fields shared by both endpoints, parsed from the same body as the
/// request (not `#[serde(flatten)]`, which would lose the field name of a type error).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    /// Keep generating past end-of-sequence ids (vLLM's extension; for benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Only `{"type": "text"}` is supported (no constrained decoding).
    pub response_format: Option<Json>,
    /// Not supported; accepted only when empty.
    pub logit_bias: Option<Map<String, Json>>,
    /// Not supported; accepted only when 0 (use `repetition_penalty`).
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

impl Sampling {
    /// 400 naming the first field that asks for something this server does not do, rather
    /// than ignoring it silently.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if let Some(f) = &self.response_format {
            let kind = f.get("type").and_then(Json::as_str);
            if kind != Some("text") {
                let msg = format!("response_format {f} is not supported (no constrained decoding); only {{\"type\": \"text\"}} is");
                return Err(ApiError::invalid_param("response_format", msg));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::invalid_param(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        let penalties = [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ];
        for (name, v) in penalties {
            if v.is_some_and(|v| v != 0.0) {
                let msg = format!("{name} is not supported; use repetition_penalty");
                return Err(ApiError::invalid_param(name, msg));
            }
        }
        Ok(())
    }
}

/// POST /v1/chat/completions.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Map<String, Json>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    /// Extra template variables, e.g. `{"enable_thinking": false}` (as vLLM and SGLang take).
    pub chat_template_kwargs: Option<Map<String, Json>>,
    #[serde(default)]
    pub logprobs: bool,
    /// Parsed separately by [`parse_request`].
    #[serde(skip)]
    pub sampling: Sampling,
}

/// `prompt` of /v1/completions: text or token ids, alone or as a one-element batch.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatch(Vec<Vec<u32>>),
}

/// POST /v1/completions.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<u32>,
    /// Parsed separately by [`parse_request`].
    #[serde(skip)]
    pub sampling: Sampling,
}

/// `usage` of a response: prompt tokens, the part served from the prompt cache, generated.
pub fn usage(prompt: usize, cached: usize, completion: usize) -> Json {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}
