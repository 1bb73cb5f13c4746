//! The HTTP endpoints: chat and text completions (JSON or server-sent events), models,
//! health and metrics. Every failure is answered in OpenAI's error shape.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json as JsonBody, Router};
use futures_util::Stream;
use serde_json::{json, Value as Json};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{parse_request, usage, ApiError, ChatRequest, CompletionRequest};
use crate::log::{log_request, LogFormat, RequestLog};
use crate::metrics::Metrics;
use crate::output::{Step, TextStream};
use crate::parse::{ChatParser, Delta};
use crate::request::{
    check_model, new_id, prepare_chat, prepare_completion, unix_now, ModelInfo, Prepared,
};
use crate::worker::{Job, Ticket};
use deltamoe_engine::scheduler::{Event, FinishReason};

/// State shared by the handlers.
pub struct App {
    pub info: ModelInfo,
    pub jobs: Sender<Job>,
    pub metrics: Arc<Metrics>,
    /// Requests submitted and not yet let go by the engine thread.
    pub load: Arc<AtomicUsize>,
    /// Requests running plus waiting at most; more get 429.
    pub max_load: usize,
    pub max_body: usize,
    /// False once the engine thread has stopped.
    pub alive: Arc<AtomicBool>,
    pub log_format: LogFormat,
}

impl App {
    /// Hands the prompt to the engine thread; 429 when full, 503 when the engine is gone.
    fn submit(&self, prep: &Prepared) -> Result<UnboundedReceiver<Event>, ApiError> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(ApiError::unavailable(
                "the engine has stopped; restart the server",
            ));
        }
        let ticket = Ticket::take(&self.load, self.max_load).ok_or_else(|| {
            ApiError::overloaded(format!(
                "the server is at capacity ({} requests running or queued); retry shortly",
                self.max_load
            ))
        })?;
        let (tx, rx) = unbounded_channel();
        let job = Job {
            prompt: prep.prompt.clone(),
            sampling: prep.sampling.clone(),
            max_tokens: prep.max_tokens,
            stop_ids: if prep.ignore_eos {
                Vec::new()
            } else {
                self.info.stop_ids.clone()
            },
            events: tx,
            arrived: Instant::now(),
            ticket,
        };
        self.jobs
            .send(job)
            .map_err(|_| ApiError::unavailable("the engine has stopped; restart the server"))?;
        Ok(rx)
    }
}

/// The router with every endpoint, the body limit and OpenAI-shaped 404s.
pub fn router(app: Arc<App>) -> Router {
    let (limit, format) = (app.max_body, app.log_format);
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit));
    let routes = match format {
        LogFormat::Off => routes,
        _ => routes.layer(axum::middleware::from_fn_with_state(format, log_request)),
    };
    routes.with_state(app)
}

/// A request's log entry, when the request log is on.
type Log = Option<Arc<RequestLog>>;

/// Notes the tokens generated so far on the request's log entry.
fn note(log: &Log, text: &TextStream) {
    if let Some(l) = log {
        l.generated(text.tokens, text.first);
    }
}

async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

/// 405 with the error body (axum's default has none).
async fn method_not_allowed(method: axum::http::Method, uri: Uri) -> Response {
    ApiError::method_not_allowed(method.as_str(), uri.path()).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.alive.load(Ordering::Acquire) {
        JsonBody(json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable("the engine has stopped").into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.metrics.render();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let info = &app.info;
    JsonBody(json!({"object": "list", "data": [{
        "id": info.name, "object": "model", "created": info.created, "owned_by": "deltamoe",
        "max_model_len": info.max_context,
    }]}))
    .into_response()
}

/// The body bytes, or the reason they could not be read (413 when over the limit, 408 when it
/// did not arrive within the body timeout).
fn body_bytes(app: &App, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&r);
        while let Some(e) = cause {
            if let Some(t) = e.downcast_ref::<crate::listen::BodyTimeout>() {
                return ApiError::body(StatusCode::REQUEST_TIMEOUT, t.to_string());
            }
            cause = e.source();
        }
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            let msg = format!(
                "the request body is larger than this server's limit of {} bytes",
                app.max_body
            );
            ApiError::body(status, msg)
        } else {
            ApiError::body(status, r.body_text())
        }
    })
}

/// The response (or the error's), counted by endpoint and status.
fn answered(app: &App, endpoint: &'static str, result: Result<Response, ApiError>) -> Response {
    let resp = result.unwrap_or_else(IntoResponse::into_response);
    app.metrics.request(endpoint, resp.status().as_u16());
    resp
}

async fn chat(
    State(app): State<Arc<App>>,
    log: Option<Extension<Arc<RequestLog>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = chat_response(&app, log.map(|Extension(l)| l), body).await;
    answered(&app, "chat", result)
}

async fn completions(
    State(app): State<Arc<App>>,
    log: Option<Extension<Arc<RequestLog>>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = completion_response(&app, log.map(|Extension(l)| l), body).await;
    answered(&app, "completions", result)
}

async fn chat_response(
    app: &Arc<App>,
    log: Log,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(app, body)?;
    let req: ChatRequest = parse_request(&bytes)?;
    check_model(req.model.as_deref(), &app.info)?;
    let prep = prepare_chat(req, &app.info)?;
    if let Some(l) = &log {
        l.prompt(prep.prompt.len());
    }
    let rx = app.submit(&prep)?;
    if prep.stream {
        return Ok(sse(chat_stream(app.clone(), prep, rx, log)));
    }
    Ok(JsonBody(chat_reply(app, &prep, rx, &log).await?).into_response())
}

async fn completion_response(
    app: &Arc<App>,
    log: Log,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let bytes = body_bytes(app, body)?;
    let req: CompletionRequest = parse_request(&bytes)?;
    check_model(req.model.as_deref(), &app.info)?;
    let prep = prepare_completion(req, &app.info)?;
    if let Some(l) = &log {
        l.prompt(prep.prompt.len());
    }
    let rx = app.submit(&prep)?;
    if prep.stream {
        return Ok(sse(completion_stream(app.clone(), prep, rx, log)));
    }
    Ok(JsonBody(completion_reply(app, &prep, rx, &log).await?).into_response())
}

fn sse(events: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static) -> Response {
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn data(v: &Json) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

/// The parts of an assistant message collected from the parser.
#[derive(Default)]
struct Reply {
    content: String,
    reasoning: String,
    calls: Vec<Json>,
}

impl Reply {
    fn add(&mut self, deltas: Vec<Delta>) {
        for d in deltas {
            match d {
                Delta::Content(t) => self.content.push_str(&t),
                Delta::Reasoning(t) => self.reasoning.push_str(&t),
                Delta::ToolCall(c) => self.calls.push(tool_call_json(&c, None)),
            }
        }
    }
}

/// OpenAI's tool call object; `index` for the streamed form.
fn tool_call_json(c: &crate::parse::ToolCall, index: Option<usize>) -> Json {
    let mut v = json!({"id": new_id("call"), "type": "function",
        "function": {"name": c.name, "arguments": c.arguments}});
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

fn finish_reason(reason: FinishReason, tool_calls: bool) -> &'static str {
    match (reason, tool_calls) {
        (FinishReason::Stop, true) => "tool_calls",
        (r, _) => r.as_str(),
    }
}

/// Collects a whole chat reply.
async fn chat_reply(
    app: &App,
    prep: &Prepared,
    mut rx: UnboundedReceiver<Event>,
    log: &Log,
) -> Result<Json, ApiError> {
    let mut text = TextStream::new(&app.info.tokenizer, prep.stops.clone());
    let mut parser = ChatParser::new(prep.starts_in_reasoning, prep.tools.clone());
    let mut reply = Reply::default();
    let reason = loop {
        match text.next(&mut rx).await? {
            Step::Text(t) => reply.add(parser.push(&t)),
            Step::Done(t, r) => {
                reply.add(parser.push(&t));
                reply.add(parser.finish());
                break r;
            }
        }
    };
    // Ends generation now when a stop string ended the reply.
    rx.close();
    note(log, &text);
    let content = if reply.content.trim().is_empty() && !reply.calls.is_empty() {
        Json::Null
    } else {
        json!(reply.content)
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !reply.reasoning.is_empty() {
        message["reasoning_content"] = json!(reply.reasoning);
    }
    if !reply.calls.is_empty() {
        message["tool_calls"] = json!(reply.calls);
    }
    Ok(json!({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": unix_now(),
        "model": app.info.name,
        "choices": [{"index": 0, "message": message, "logprobs": null,
            "finish_reason": finish_reason(reason, !reply.calls.is_empty())}],
        "usage": usage(prep.prompt.len(), text.cached, text.tokens),
    }))
}

/// Collects a whole text completion.
async fn completion_reply(
    app: &App,
    prep: &Prepared,
    mut rx: UnboundedReceiver<Event>,
    log: &Log,
) -> Result<Json, ApiError> {
    let mut text = TextStream::new(&app.info.tokenizer, prep.stops.clone());
    let mut out = String::new();
    let reason = loop {
        match text.next(&mut rx).await? {
            Step::Text(t) => out.push_str(&t),
            Step::Done(t, r) => {
                out.push_str(&t);
                break r;
            }
        }
    };
    rx.close();
    note(log, &text);
    Ok(json!({
        "id": new_id("cmpl"), "object": "text_completion", "created": unix_now(),
        "model": app.info.name,
        "choices": [{"index": 0, "text": out, "logprobs": null, "finish_reason": reason.as_str()}],
        "usage": usage(prep.prompt.len(), text.cached, text.tokens),
    }))
}

/// One `chat.completion.chunk`.
fn chat_chunk(id: &str, created: u64, model: &str, delta: Json, finish: Option<&str>) -> Json {
    json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
}

/// The final chunk with `usage` and no choices (`stream_options.include_usage`).
fn usage_chunk(id: &str, object: &str, created: u64, model: &str, usage: Json) -> Json {
    json!({"id": id, "object": object, "created": created, "model": model,
        "choices": [], "usage": usage})
}

/// The delta of one parsed piece; tool calls are numbered from `*calls`.
fn chat_delta(d: Delta, calls: &mut usize) -> Json {
    match d {
        Delta::Content(t) => json!({"content": t}),
        Delta::Reasoning(t) => json!({"reasoning_content": t}),
        Delta::ToolCall(c) => {
            *calls += 1;
            json!({"tool_calls": [tool_call_json(&c, Some(*calls - 1))]})
        }
    }
}

/// The server-sent events of a streamed chat reply, ending with `[DONE]`.
fn chat_stream(
    app: Arc<App>,
    prep: Prepared,
    mut rx: UnboundedReceiver<Event>,
    log: Log,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    async_stream::stream! {
        let (id, created, model) = (new_id("chatcmpl"), unix_now(), app.info.name.clone());
        let mut text = TextStream::new(&app.info.tokenizer, prep.stops.clone());
        let mut parser = ChatParser::new(prep.starts_in_reasoning, prep.tools.clone());
        let mut calls = 0;
        yield data(&chat_chunk(&id, created, &model, json!({"role": "assistant", "content": ""}), None));
        loop {
            let step = text.next(&mut rx).await;
            note(&log, &text);
            let (piece, done) = match step {
                Ok(Step::Text(t)) => (t, None),
                Ok(Step::Done(t, r)) => (t, Some(r)),
                Err(e) => {
                    yield data(&e.body_json());
                    break;
                }
            };
            let mut deltas = parser.push(&piece);
            if done.is_some() {
                deltas.extend(parser.finish());
            }
            for d in deltas {
                yield data(&chat_chunk(&id, created, &model, chat_delta(d, &mut calls), None));
            }
            if let Some(reason) = done {
                rx.close();
                let finish = finish_reason(reason, calls > 0);
                yield data(&chat_chunk(&id, created, &model, json!({}), Some(finish)));
                if prep.include_usage {
                    let u = usage(prep.prompt.len(), text.cached, text.tokens);
                    yield data(&usage_chunk(&id, "chat.completion.chunk", created, &model, u));
                }
                break;
            }
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    }
}

/// The server-sent events of a streamed text completion, ending with `[DONE]`.
fn completion_stream(
    app: Arc<App>,
    prep: Prepared,
    mut rx: UnboundedReceiver<Event>,
    log: Log,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    async_stream::stream! {
        let (id, created, model) = (new_id("cmpl"), unix_now(), app.info.name.clone());
        let mut text = TextStream::new(&app.info.tokenizer, prep.stops.clone());
        loop {
            let step = text.next(&mut rx).await;
            note(&log, &text);
            let (piece, done) = match step {
                Ok(Step::Text(t)) => (t, None),
                Ok(Step::Done(t, r)) => (t, Some(r)),
                Err(e) => {
                    yield data(&e.body_json());
                    break;
                }
            };
            let finish = done.map(FinishReason::as_str);
            if !piece.is_empty() || finish.is_some() {
                yield data(&json!({"id": id, "object": "text_completion", "created": created,
                    "model": model, "choices": [{"index": 0, "text": piece, "logprobs": null,
                    "finish_reason": finish}]}));
            }
            if done.is_some() {
                rx.close();
                if prep.include_usage {
                    let u = usage(prep.prompt.len(), text.cached, text.tokens);
                    yield data(&usage_chunk(&id, "text_completion", created, &model, u));
                }
                break;
            }
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    }
}
