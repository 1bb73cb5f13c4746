//! Chat templates: finds a model's Jinja chat template (`chat_template.jinja`,
//! `tokenizer_config.json` or `chat_template.json`) and renders conversations with minijinja
//! configured like Hugging Face transformers (trim/lstrip blocks, Python string/dict methods,
//! `raise_exception`, a `json.dumps`-compatible `tojson`).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::ser::{Formatter, PrettyFormatter};
use serde_json::Value as Json;

use crate::error::{EngineError, Result};

const NAME: &str = "chat_template";
const TEMPLATE_KEY_ERR: &str = "key chat_template must be a string or a non-empty list of \
    {\"name\", \"template\"} objects; fix the key";
const CTX_ERR: &str = "chat template context must be a JSON object of variables \
    (e.g. {\"enable_thinking\": false}); pass an object or null";

/// One message of a conversation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template plus the BOS/EOS strings it may reference.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// Collapses a possibly multi-line message onto one line.
fn one_line(msg: impl std::fmt::Display) -> String {
    let text = msg.to_string();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A minijinja error and its causes, on one line.
fn describe(err: &Error) -> String {
    let mut msg = err.to_string();
    let mut cause = std::error::Error::source(err);
    while let Some(c) = cause {
        msg.push_str(&format!(": {c}"));
        cause = c.source();
    }
    one_line(msg)
}

fn render_err(e: Error) -> EngineError {
    let hint = "fix the template or the messages/variables given to it";
    EngineError::Template(format!("{}; {hint}", describe(&e)))
}

fn file_err(path: &Path, msg: String) -> EngineError {
    EngineError::File {
        path: path.to_path_buf(),
        msg,
    }
}

impl ChatTemplate {
    /// Compiles a template given as a string (no BOS/EOS tokens set).
    #[allow(clippy::should_implement_trait)] // fallible with our error type; name kept on purpose
    pub fn from_str(template: &str) -> Result<ChatTemplate> {
        Self::build(template.to_string(), None, None).map_err(|e| {
            EngineError::Template(format!("{}; fix the template syntax", describe(&e)))
        })
    }

    /// Loads the template of a model directory; `None` when it has no chat template.
    /// Precedence: `chat_template.jinja`, then `tokenizer_config.json` key `chat_template`,
    /// then `chat_template.json` key `chat_template`. BOS/EOS come from tokenizer_config.json.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json_opt(&cfg_path)?;
        let (bos, eos) = match &cfg {
            Some(c) => (special_token(c, "bos_token"), special_token(c, "eos_token")),
            None => (None, None),
        };
        let Some((source, path)) = find_source(dir, cfg.as_ref(), &cfg_path)? else {
            return Ok(None);
        };
        Self::build(source, bos, eos).map(Some).map_err(|e| {
            file_err(
                &path,
                format!("chat template does not compile: {}; fix it", describe(&e)),
            )
        })
    }

    /// Replaces the BOS/EOS strings exposed to the template as `bos_token` / `eos_token`.
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos_token = bos;
        self.eos_token = eos;
        self
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS string from tokenizer_config.json, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS string from tokenizer_config.json, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages`, appending the assistant prompt if `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(Json::Null, messages, add_generation_prompt)
    }

    /// Like [`render`](Self::render) with extra template variables (a JSON object such as
    /// `{"tools": [...], "enable_thinking": false}`; `null` for none).
    pub fn render_with(
        &self,
        ctx: Json,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let msgs = serde_json::to_value(messages)
            .map_err(|e| EngineError::Input(format!("cannot serialise chat messages: {e}")))?;
        self.render_json(ctx, msgs, add_generation_prompt)
    }

    /// Like [`render_with`](Self::render_with) with messages given as JSON objects, so fields
    /// beyond role and content (`tool_calls`, `tool_call_id`, `reasoning_content`, content
    /// parts) reach the template as they are.
    pub fn render_json(
        &self,
        ctx: Json,
        messages: Json,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut vars = match ctx {
            Json::Object(m) => m,
            Json::Null => serde_json::Map::new(),
            _ => return Err(EngineError::Input(CTX_ERR.into())),
        };
        let tokens = [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ];
        for (key, tok) in tokens {
            if let Some(t) = tok {
                vars.entry(key).or_insert_with(|| Json::String(t.clone()));
            }
        }
        vars.insert("messages".into(), messages);
        vars.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self.env.get_template(NAME).map_err(render_err)?;
        tmpl.render(Value::from_serialize(&vars))
            .map_err(render_err)
    }

    /// Builds the environment with HF-compatible settings and compiles `source`.
    fn build(
        source: String,
        bos: Option<String>,
        eos: Option<String>,
    ) -> std::result::Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Jinja2's default (used by transformers): the final newline is dropped.
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone())?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos,
            eos_token: eos,
        })
    }
}

/// `raise_exception(msg)`: aborts rendering with the template's message.
fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    let msg = format!("template raised: {msg}");
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` like transformers' (`json.dumps(x, ensure_ascii=False, indent=indent)`): Python's
/// `", "` / `": "` separators, optional indentation, no HTML escaping. Keys come out sorted
/// (maps are key-ordered in this build), so `sort_keys` is accepted as a no-op.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    if kwargs.get::<Option<bool>>("ensure_ascii")? == Some(true) {
        let msg = "tojson(ensure_ascii=true) is not supported; drop the argument";
        return Err(Error::new(ErrorKind::InvalidOperation, msg));
    }
    kwargs.assert_all_used()?;
    match indent {
        Some(n) => dump(
            value,
            PrettyFormatter::with_indent(" ".repeat(n).as_bytes()),
        ),
        None => dump(value, PyFormatter),
    }
}

/// Serialises `value` with a serde_json formatter into a safe (unescaped) string.
fn dump<F: Formatter>(value: &Value, fmt: F) -> std::result::Result<Value, Error> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(value, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// serde_json formatter with Python's default `json.dumps` separators `", "` and `": "`.
struct PyFormatter;

impl Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        w.write_all(if first { b"" } else { b", " })
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        w.write_all(if first { b"" } else { b", " })
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// Reads and parses a JSON file; `None` when it does not exist.
fn read_json_opt(path: &Path) -> Result<Option<Json>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| file_err(path, format!("cannot read: {e}; check permissions")))?;
    let json = serde_json::from_str(&text).map_err(|e| {
        file_err(
            path,
            format!("malformed JSON: {e}; restore the model's original file"),
        )
    })?;
    Ok(Some(json))
}

/// `bos_token` / `eos_token` given as a string or as an object with `content`.
fn special_token(cfg: &Json, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Finds the template source and the file it came from, by precedence.
fn find_source(
    dir: &Path,
    cfg: Option<&Json>,
    cfg_path: &Path,
) -> Result<Option<(String, PathBuf)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja)
            .map_err(|e| file_err(&jinja, format!("cannot read: {e}; check permissions")))?;
        return Ok(Some((text, jinja)));
    }
    let json_path = dir.join("chat_template.json");
    let fallback = read_json_opt(&json_path)?;
    let candidates = [(cfg, cfg_path), (fallback.as_ref(), json_path.as_path())];
    for (json, path) in candidates {
        match json.and_then(|c| c.get("chat_template")) {
            Some(t) if !t.is_null() => {
                return Ok(Some((template_from_json(t, path)?, path.into())))
            }
            _ => {}
        }
    }
    Ok(None)
}

/// A `chat_template` value: a string, or a list of `{name, template}` objects (the one named
/// "default", else the first).
fn template_from_json(value: &Json, path: &Path) -> Result<String> {
    let bad = || file_err(path, TEMPLATE_KEY_ERR.into());
    match value {
        Json::String(s) => Ok(s.clone()),
        Json::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|e| e.get("name").and_then(Json::as_str) == Some(n))
            };
            let entry = named("default").or_else(|| list.first()).ok_or_else(bad)?;
            let t = entry
                .get("template")
                .and_then(Json::as_str)
                .ok_or_else(bad)?;
            Ok(t.to_string())
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn chatml_renders_exactly() {
        let src = "{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' \
            + message.content + '<|im_end|>\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n\
            {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";
        let t = ChatTemplate::from_str(src).unwrap();
        let msgs = [
            msg("system", "Sys"),
            msg("user", "Hi"),
            msg("assistant", "Yo"),
        ];
        let want = "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\nYo<|im_end|>\n";
        assert_eq!(t.render(&msgs, false).unwrap(), want);
        let out = t.render(&msgs, true).unwrap();
        assert_eq!(out, format!("{want}<|im_start|>assistant\n"));
    }

    #[test]
    fn python_methods_namespace_loop_and_tojson() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}\
            {% if m.content.startswith('x') %}{% set ns.n = ns.n + 1 %}{% endif %}\
            {{ m.content.strip().upper() }}{% if not loop.last %},{% endif %}{% endfor %}\
            |{{ ns.n }}|{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ {'a': 'é'} | tojson }}";
        let t = ChatTemplate::from_str(src).unwrap();
        let ctx = json!({"tools": [{"name": "f", "args": [1, "<b>"]}]});
        let out = t.render_with(ctx, &[msg("user", "xa "), msg("user", " b")], false);
        // Keys keep their order, as Python's json.dumps does for HF templates.
        let want = "XA,B|1|[{\"name\": \"f\", \"args\": [1, \"<b>\"]}]|{\n  \"name\": \"f\",\n  \
                    \"args\": [\n    1,\n    \"<b>\"\n  ]\n}|{\"a\": \"é\"}";
        assert_eq!(out.unwrap(), want);
    }

    fn err_text<T>(r: Result<T>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn raise_exception_and_syntax_errors() {
        let t = ChatTemplate::from_str("{{ raise_exception('only user roles') }}").unwrap();
        let err = err_text(t.render(&[msg("user", "x")], false));
        assert!(
            err.contains("only user roles") && !err.contains('\n'),
            "{err}"
        );
        let err = err_text(ChatTemplate::from_str("\n{% if %}"));
        assert!(
            err.starts_with("chat template: syntax") && err.contains(":2)"),
            "{err}"
        );
        let err = err_text(t.render_with(json!([1]), &[], false));
        assert!(err.contains("JSON object"), "{err}");
    }

    #[test]
    fn from_dir_list_form_tokens_and_precedence() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        let list = [
            json!({"name": "tool_use", "template": "TOOLS"}),
            json!({"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}),
        ];
        let cfg =
            json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": list});
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!((t.bos_token(), t.eos_token()), (Some("<s>"), Some("</s>")));
        assert_eq!(t.render(&[msg("user", "hi")], false).unwrap(), "<s>hi");
        let jinja = dir.path().join("chat_template.jinja");
        std::fs::write(&jinja, "J{{ eos_token }}\n").unwrap();
        let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "J</s>");
        std::fs::write(&jinja, "{% for %}").unwrap();
        let err = err_text(ChatTemplate::from_dir(dir.path()));
        assert!(
            err.contains("chat_template.jinja") && err.contains("syntax"),
            "{err}"
        );
    }
}
