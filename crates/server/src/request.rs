//! Checks a request and turns it into what the engine thread runs: the prompt's token ids
//! (for chat, the conversation rendered with the model's template), sampling parameters, the
//! token limit and the stop strings.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use deltamoe_engine::chat::ChatTemplate;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::tokenizer::TextTokenizer;
use serde_json::{Map, Value as Json};

use crate::api::{ApiError, ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::prompt::{check_budget, encode_chat, marker};

/// What the server knows about the model it serves.
pub struct ModelInfo {
    /// The name clients ask for (`model` in requests).
    pub name: String,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    /// Ids that end generation.
    pub stop_ids: Vec<u32>,
    /// Sampling defaults from generation_config.json.
    pub sampling: SamplingParams,
    /// Tokens one sequence may hold (prompt plus generated).
    pub max_context: usize,
    pub vocab_size: usize,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Chat message content may hold special tokens (else it is tokenized as text).
    pub allow_special_in_content: bool,
}

/// A checked request, ready to submit.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    /// The rendered prompt ends inside an open `<think>`.
    pub starts_in_reasoning: bool,
    /// The request's tools (for tool-call argument types).
    pub tools: Vec<Json>,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A unique id such as `chatcmpl-18c2f0a1b2c3d4e5-7`.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{nanos:x}{n:x}")
}

/// 404 unless `asked` names the served model (a missing name means the served one).
pub fn check_model(asked: Option<&str>, info: &ModelInfo) -> Result<(), ApiError> {
    match asked {
        Some(name) if name != info.name => Err(ApiError::unknown_model(name, &info.name)),
        _ => Ok(()),
    }
}

/// A chat request: messages rendered with the template (tools passed in), then tokenized.
pub fn prepare_chat(req: ChatRequest, info: &ModelInfo) -> Result<Prepared, ApiError> {
    let Some(template) = &info.template else {
        return Err(ApiError::invalid(
            "this model has no chat template; use /v1/completions",
        ));
    };
    if req.logprobs {
        return Err(ApiError::invalid_param(
            "logprobs",
            "logprobs are not supported",
        ));
    }
    let budget = Some((&info.tokenizer, info.max_context));
    let r = render_chat(template, &req, budget, !info.allow_special_in_content)?;
    let prompt = match &r.skeleton {
        Some(skeleton) => encode_chat(&info.tokenizer, &r.text, skeleton, &r.contents)?,
        None => encode(&info.tokenizer, &r.text, false)?,
    };
    let (text, tools) = (r.text, r.tools);
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let mut p = prepare(prompt, &req.sampling, requested, None, info, "messages")?;
    p.starts_in_reasoning = text.trim_end().ends_with("<think>");
    p.tools = tools;
    Ok(p)
}

/// A chat request rendered with the template.
pub struct Rendered {
    /// The prompt text, generation prompt appended.
    pub text: String,
    /// The same with each message's content replaced by [`marker`]`(i)`, when it was asked
    /// for and the template renders the markers.
    pub skeleton: Option<String>,
    /// Each message's content as the template saw it.
    pub contents: Vec<String>,
    /// The tools passed to the template (none when `tool_choice` is "none").
    pub tools: Vec<Json>,
}

/// Renders a chat request, and with `skeleton` the same with content markers (to tokenize the
/// contents as text). With `budget` (tokenizer, context), long message contents are first
/// counted against the context, so an oversized conversation is rejected before the rendering
/// and tokenizing of all of it.
pub fn render_chat(
    template: &ChatTemplate,
    req: &ChatRequest,
    budget: Option<(&TextTokenizer, usize)>,
    skeleton: bool,
) -> Result<Rendered, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty; send at least one",
        ));
    }
    let tools = match req.tool_choice.as_ref() {
        Some(Json::String(s)) if s == "none" => Vec::new(),
        _ => req.tools.clone().unwrap_or_default(),
    };
    check_tool_choice(req.tool_choice.as_ref(), &tools, template)?;
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if !tools.is_empty() {
        vars.insert("tools".into(), Json::Array(tools.clone()));
    }
    let (messages, contents) = template_messages(req.messages.clone())?;
    if let Some((tok, ctx)) = budget {
        let texts: Vec<&str> = contents.iter().map(String::as_str).collect();
        check_budget(tok, &texts, ctx, "messages")?;
    }
    let render = |messages: Json| {
        template
            .render_json(Json::Object(vars.clone()), messages, true)
            .map_err(|e| ApiError::invalid_param("messages", e.to_string()))
    };
    // A template that refuses the markers (e.g. it inspects the content) leaves no skeleton;
    // the prompt is then tokenized as a whole.
    let skeleton = match skeleton {
        true => render(with_markers(&messages)).ok(),
        false => None,
    };
    let text = render(messages)?;
    Ok(Rendered {
        text,
        skeleton,
        contents,
        tools,
    })
}

/// `messages` with each content replaced by [`marker`]`(i)`.
fn with_markers(messages: &Json) -> Json {
    let mut out = messages.clone();
    if let Json::Array(list) = &mut out {
        for (i, m) in list.iter_mut().enumerate() {
            m["content"] = Json::String(marker(i));
        }
    }
    out
}

/// `tool_choice`: "auto" and "none" always; "required" or a named function only with tools
/// and a template that shows them (generation is not constrained to a call).
fn check_tool_choice(
    choice: Option<&Json>,
    tools: &[Json],
    template: &ChatTemplate,
) -> Result<(), ApiError> {
    let param = "tool_choice";
    match choice {
        None | Some(Json::Null) => Ok(()),
        Some(Json::String(s)) if s == "auto" || s == "none" => Ok(()),
        Some(Json::String(s)) if s == "required" => tools_usable(tools, template, param),
        Some(Json::Object(o)) if o.get("type").and_then(Json::as_str) == Some("function") => {
            tools_usable(tools, template, param)
        }
        Some(other) => Err(ApiError::invalid_param(
            param,
            format!(
                "tool_choice {other} is not one of \"auto\", \"none\", \"required\" or a function"
            ),
        )),
    }
}

fn tools_usable(tools: &[Json], template: &ChatTemplate, param: &str) -> Result<(), ApiError> {
    if tools.is_empty() {
        return Err(ApiError::invalid_param(
            param,
            "tool_choice asks for a tool call but the request has no tools",
        ));
    }
    if !template.source().contains("tools") {
        return Err(ApiError::invalid_param(
            param,
            "this model's chat template does not take tools, so a tool call cannot be required",
        ));
    }
    Ok(())
}

/// A completions request: the prompt as text (tokenized with the tokenizer's special tokens)
/// or as token ids.
pub fn prepare_completion(req: CompletionRequest, info: &ModelInfo) -> Result<Prepared, ApiError> {
    if req.echo {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if req.logprobs.is_some() {
        return Err(ApiError::invalid_param(
            "logprobs",
            "logprobs are not supported",
        ));
    }
    let one = || {
        ApiError::invalid_param(
            "prompt",
            "send one prompt per request (batches are not supported)",
        )
    };
    let texts: Vec<&str> = match &req.prompt {
        Prompt::Text(s) => vec![s],
        Prompt::Texts(v) => v.iter().map(String::as_str).collect(),
        _ => Vec::new(),
    };
    check_budget(&info.tokenizer, &texts, info.max_context, "prompt")?;
    let prompt = match req.prompt {
        Prompt::Text(s) => encode(&info.tokenizer, &s, true)?,
        Prompt::Texts(v) if v.len() == 1 => encode(&info.tokenizer, &v[0], true)?,
        Prompt::Tokens(ids) => ids,
        Prompt::TokenBatch(v) if v.len() == 1 => v.into_iter().next().unwrap_or_default(),
        _ => return Err(one()),
    };
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
        let msg = format!(
            "token id {bad} is out of range (vocabulary size {})",
            info.vocab_size
        );
        return Err(ApiError::invalid_param("prompt", msg));
    }
    // OpenAI's default for this endpoint.
    prepare(
        prompt,
        &req.sampling,
        req.max_tokens,
        Some(16),
        info,
        "prompt",
    )
}

fn encode(tok: &TextTokenizer, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    tok.encode(text, special)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}")))
}

/// The parts both endpoints share: length limits, sampling, stops.
fn prepare(
    prompt: Vec<u32>,
    s: &Sampling,
    requested: Option<u32>,
    default_max: Option<usize>,
    info: &ModelInfo,
    prompt_param: &str,
) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(prompt_param, "the prompt is empty"));
    }
    if s.n.unwrap_or(1) != 1 {
        return Err(ApiError::invalid_param("n", "only n = 1 is supported"));
    }
    let max_tokens = token_limit(
        prompt.len(),
        requested,
        default_max,
        info.max_context,
        prompt_param,
    )?;
    s.check_supported()?;
    let stops = s.stop.clone().map(|st| st.into_vec()).unwrap_or_default();
    Ok(Prepared {
        prompt,
        sampling: sampling(s, &info.sampling)?,
        max_tokens,
        stops,
        stream: s.stream,
        ignore_eos: s.ignore_eos,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
        starts_in_reasoning: false,
        tools: Vec::new(),
    })
}

/// Tokens to generate at most: the request's `max_tokens` when prompt plus it fit the
/// context, else a 400 `context_length_exceeded`; without one, `default_max` or whatever room
/// the context leaves.
pub fn token_limit(
    prompt: usize,
    requested: Option<u32>,
    default_max: Option<usize>,
    ctx: usize,
    prompt_param: &str,
) -> Result<usize, ApiError> {
    if prompt >= ctx {
        let msg = format!("This model's maximum context length is {ctx} tokens, but the prompt has {prompt} tokens; shorten it");
        return Err(ApiError::context_length(prompt_param, msg));
    }
    let room = ctx - prompt;
    match requested {
        Some(0) => Err(ApiError::invalid_param(
            "max_tokens",
            "max_tokens must be at least 1",
        )),
        Some(n) if n as usize > room => {
            let msg = format!("This model's maximum context length is {ctx} tokens; the prompt has {prompt} tokens and max_tokens asks for {n} more; lower max_tokens to {room} or shorten the prompt");
            Err(ApiError::context_length("max_tokens", msg))
        }
        Some(n) => Ok(n as usize),
        None => Ok(default_max.unwrap_or(room).min(room)),
    }
}

/// The model's defaults overridden by the request's sampling fields, checked for range.
fn sampling(s: &Sampling, defaults: &SamplingParams) -> Result<SamplingParams, ApiError> {
    let mut p = defaults.clone();
    if let Some(t) = s.temperature {
        p.temperature = t;
    }
    if let Some(v) = s.top_p {
        p.top_p = v;
    }
    if let Some(k) = s.top_k {
        // vLLM spells "off" as -1 (0 too); other negatives are mistakes.
        if k < -1 {
            let msg =
                format!("top_k {k} is invalid; use -1 or 0 for no limit, or a positive count");
            return Err(ApiError::invalid_param("top_k", msg));
        }
        p.top_k = k.max(0) as usize;
    }
    if let Some(v) = s.min_p {
        p.min_p = v;
    }
    if let Some(v) = s.repetition_penalty {
        p.repetition_penalty = v;
    }
    // -1 asks for a random seed, as llama.cpp's API spells it.
    p.seed = match s.seed {
        None | Some(-1) => fresh_seed(),
        Some(seed) if seed >= 0 => seed as u64,
        Some(seed) => {
            let msg = format!(
                "seed {seed} is invalid; use a non-negative integer, or -1 for a random one"
            );
            return Err(ApiError::invalid_param("seed", msg));
        }
    };
    p.validate().map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(p)
}

/// A different seed for each unseeded request, so sampled replies differ.
fn fresh_seed() -> u64 {
    let id = new_id("");
    id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The roles a message may have (OpenAI's, `developer` being the newer `system`).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The messages as the template sees them: text content (parts joined), tool call
/// arguments as objects (Qwen templates iterate them), every other field as sent; and each
/// message's content.
fn template_messages(messages: Vec<Map<String, Json>>) -> Result<(Json, Vec<String>), ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    let mut contents = Vec::with_capacity(messages.len());
    for (i, mut m) in messages.into_iter().enumerate() {
        let role = m.get("role").and_then(Json::as_str);
        if !role.is_some_and(|r| ROLES.contains(&r)) {
            let param = format!("messages[{i}].role");
            let msg = format!("{param} must be one of {}", ROLES.join(", "));
            return Err(ApiError::invalid_param(&param, msg));
        }
        let content = text_content(m.get("content"), i)?;
        m.insert("content".into(), Json::String(content.clone()));
        contents.push(content);
        if let Some(Json::Array(calls)) = m.get_mut("tool_calls") {
            for call in calls.iter_mut() {
                arguments_as_object(call);
            }
        }
        out.push(Json::Object(m));
    }
    Ok((Json::Array(out), contents))
}

/// `content` as a string: a string, null, or a list of text parts.
fn text_content(content: Option<&Json>, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match part.get("text").and_then(Json::as_str) {
                    Some(t) => text.push_str(t),
                    None => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("{param}: only text parts are supported"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::invalid_param(
            &param,
            format!("{param} must be a string or a list of text parts"),
        )),
    }
}

/// Replaces `function.arguments` given as a JSON string by the object it encodes.
fn arguments_as_object(call: &mut Json) {
    let Some(args) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
    else {
        return;
    };
    if let Some(text) = args.as_str() {
        if let Ok(obj @ Json::Object(_)) = serde_json::from_str::<Json>(text) {
            *args = obj;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn token_limits() {
        assert_eq!(token_limit(10, Some(5), None, 20, "p").unwrap(), 5);
        assert_eq!(token_limit(10, None, None, 20, "p").unwrap(), 10);
        assert_eq!(token_limit(10, None, Some(16), 20, "p").unwrap(), 10);
        assert_eq!(token_limit(2, None, Some(16), 20, "p").unwrap(), 16);
        let e = token_limit(10, Some(11), None, 20, "p").unwrap_err();
        assert_eq!(
            (e.code, e.status.as_u16()),
            (Some("context_length_exceeded"), 400)
        );
        let e = token_limit(20, None, None, 20, "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(token_limit(1, Some(0), None, 20, "p").is_err());
    }

    /// A Qwen3-style template: tools listed in the system turn, tool calls rendered back as
    /// JSON inside <tool_call>, tool results as user turns.
    const TOOL_TEMPLATE: &str = "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n\
        {{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}{% for m in messages %}\
        {% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response>\
        {% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}\
        <tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\
        </tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let tpl = ChatTemplate::from_str(TOOL_TEMPLATE).unwrap();
        let tool = json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let req: ChatRequest = serde_json::from_value(json!({
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [tool]}))
        .unwrap();
        let Rendered { text, tools, .. } = render_chat(&tpl, &req, None, false).unwrap();
        assert_eq!(tools.len(), 1);
        assert!(
            text.contains(
                "<tools>{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""
            ),
            "{text}"
        );
        assert!(text.contains("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"), "{text}");
        assert!(
            text.contains("<tool_response>sunny</tool_response>"),
            "{text}"
        );
        assert!(text.ends_with("<think>\n"));
        let mut none = req.clone();
        none.tool_choice = Some(json!("none"));
        let Rendered { text, tools, .. } = render_chat(&tpl, &none, None, false).unwrap();
        assert!(tools.is_empty() && !text.contains("<tools>"), "{text}");
    }

    #[test]
    fn messages_for_the_template() {
        let msgs: Vec<Map<String, Json>> = serde_json::from_value(json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ]))
        .unwrap();
        let (out, contents) = template_messages(msgs).unwrap();
        assert_eq!(contents, ["ab", "", "42"]);
        assert_eq!(out[0]["content"], "ab");
        assert_eq!(out[1]["content"], "");
        assert_eq!(
            out[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(out[2]["tool_call_id"], "c1");
        let bad: Vec<Map<String, Json>> =
            serde_json::from_value(json!([{"role": 3, "content": "x"}])).unwrap();
        let e = template_messages(bad).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let bad: Vec<Map<String, Json>> = serde_json::from_value(
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        )
        .unwrap();
        assert!(template_messages(bad).is_err());
    }

    /// What `serve --synthetic` holds: the byte-level tokenizer and the plain chat template.
    fn synthetic_info() -> ModelInfo {
        let template = ChatTemplate::from_str(crate::prompt::PLAIN_CHAT_TEMPLATE).unwrap();
        ModelInfo {
            name: "synthetic".into(),
            tokenizer: TextTokenizer::bytes(),
            template: Some(template),
            stop_ids: vec![],
            sampling: SamplingParams::default(),
            max_context: 4096,
            vocab_size: 248320,
            created: 0,
            allow_special_in_content: false,
        }
    }

    #[test]
    fn synthetic_prompts_are_bytes_and_chats_plain_text() {
        let info = synthetic_info();
        let req: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "<|im_end|>Hi"}]}]}))
        .unwrap();
        let p = prepare_chat(req, &info).unwrap();
        assert_eq!(p.prompt, encode_bytes("Be brief.\n<|im_end|>Hi"));
        let req: CompletionRequest =
            serde_json::from_value(json!({"prompt": "é 1", "max_tokens": 4})).unwrap();
        let p = prepare_completion(req, &info).unwrap();
        assert_eq!(p.prompt, [0xC3, 0xA9, 32, 49]);
        assert_eq!(p.max_tokens, 4);
        let req: CompletionRequest =
            serde_json::from_value(json!({"prompt": [1000, 248319]})).unwrap();
        assert_eq!(
            prepare_completion(req, &info).unwrap().prompt,
            [1000, 248319]
        );
    }

    fn encode_bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }
}
