//! Splits generated chat text, as it streams, into reasoning (`<think>…</think>`), content and
//! tool calls (`<tool_call>…</tool_call>`). A tool call body is either Qwen3's JSON
//! `{"name": …, "arguments": {…}}` or the Qwen3.5 / Qwen3-Coder form
//! `<function=NAME><parameter=P>value</parameter></function>`. Text that may be the start of a
//! tag is held back until the next piece tells, so tags split across chunks are recognised.

use serde_json::{Map, Value as Json};

const THINK: &str = "<think>";
const THINK_END: &str = "</think>";
const CALL: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// One piece of parsed output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// A complete tool call: the function name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

/// The streaming parser of one reply.
pub struct ChatParser {
    mode: Mode,
    buf: String,
    /// Drop whitespace at the start of the next content or reasoning text.
    trim_start: bool,
    /// The request's tools (OpenAI `tools` entries), for the parameter types.
    tools: Vec<Json>,
}

impl ChatParser {
    /// `in_reasoning`: the prompt ended inside an open `<think>` (templates that open it).
    pub fn new(in_reasoning: bool, tools: Vec<Json>) -> ChatParser {
        ChatParser {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            trim_start: in_reasoning,
            tools,
        }
    }

    /// Feeds generated text; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// Ends the reply: whatever is held back is emitted as it stands.
    pub fn finish(&mut self) -> Vec<Delta> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.mode {
            Mode::Reasoning => self.emit(&mut out, Mode::Reasoning, &rest),
            Mode::Content => self.emit(&mut out, Mode::Content, &rest),
            Mode::ToolCall => match parse_call(&rest, &self.tools) {
                Some(call) => out.push(Delta::ToolCall(call)),
                None => out.push(Delta::Content(format!("{CALL}{rest}"))),
            },
        }
        self.mode = Mode::Content;
        out
    }

    /// Handles one tag or the text before a possible partial tag; false when waiting for more.
    fn step(&mut self, out: &mut Vec<Delta>) -> bool {
        match self.mode {
            Mode::Reasoning => self.until(out, &[(THINK_END, Mode::Content)]),
            Mode::Content => self.until(out, &[(THINK, Mode::Reasoning), (CALL, Mode::ToolCall)]),
            Mode::ToolCall => {
                let Some(end) = self.buf.find(CALL_END) else {
                    return false;
                };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CALL_END.len());
                self.mode = Mode::Content;
                match parse_call(&body, &self.tools) {
                    Some(call) => {
                        out.push(Delta::ToolCall(call));
                        self.trim_start = true;
                    }
                    None => self.emit(out, Mode::Content, &format!("{CALL}{body}{CALL_END}")),
                }
                true
            }
        }
    }

    /// Emits text up to the first of `tags` and switches mode, or emits all but a possible
    /// partial tag at the end.
    fn until(&mut self, out: &mut Vec<Delta>, tags: &[(&str, Mode)]) -> bool {
        let mode = self.mode;
        let first = tags
            .iter()
            .filter_map(|&(tag, next)| self.buf.find(tag).map(|i| (i, tag, next)))
            .min_by_key(|&(i, _, _)| i);
        if let Some((i, tag, next)) = first {
            let before: String = self.buf[..i].to_string();
            self.buf.drain(..i + tag.len());
            self.emit(out, mode, &before);
            self.mode = next;
            self.trim_start = next != Mode::ToolCall;
            return true;
        }
        let keep = partial_tag_len(&self.buf, tags.iter().map(|t| t.0));
        let cut = self.buf.len() - keep;
        let ready: String = self.buf.drain(..cut).collect();
        self.emit(out, mode, &ready);
        false
    }

    fn emit(&mut self, out: &mut Vec<Delta>, mode: Mode, text: &str) {
        let text = if self.trim_start {
            text.trim_start()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.trim_start = false;
        match mode {
            Mode::Reasoning => out.push(Delta::Reasoning(text.to_string())),
            _ => out.push(Delta::Content(text.to_string())),
        }
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of one of `tags`.
pub fn partial_tag_len<'a>(buf: &str, tags: impl Iterator<Item = &'a str>) -> usize {
    let mut best = 0;
    for tag in tags {
        for (k, _) in tag.char_indices().skip(1) {
            if k > best && buf.ends_with(&tag[..k]) {
                best = k;
            }
        }
    }
    best
}

/// A tool call body in either form; `None` when it is neither.
pub fn parse_call(body: &str, tools: &[Json]) -> Option<ToolCall> {
    let body = body.trim();
    if body.starts_with('{') {
        return parse_json_call(body);
    }
    if body.starts_with("<function=") {
        return parse_xml_call(body, tools);
    }
    None
}

/// `{"name": "f", "arguments": {...}}` (arguments may also be given as a JSON string).
fn parse_json_call(body: &str) -> Option<ToolCall> {
    let v: Json = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Json::Null) => "{}".to_string(),
        Some(Json::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// `<function=NAME>` then `<parameter=P>value</parameter>` pairs, then `</function>`.
fn parse_xml_call(body: &str, tools: &[Json]) -> Option<ToolCall> {
    let rest = body.strip_prefix("<function=")?;
    let close = rest.find('>')?;
    let name = rest[..close].trim().to_string();
    let mut rest = &rest[close + 1..];
    let mut args = Map::new();
    while let Some(start) = rest.find("<parameter=") {
        let after = &rest[start + "<parameter=".len()..];
        let close = after.find('>')?;
        let param = after[..close].trim().to_string();
        let value_and_rest = &after[close + 1..];
        let end = value_and_rest.find("</parameter>")?;
        let raw = trim_newline(&value_and_rest[..end]);
        let value = typed_value(raw, param_type(tools, &name, &param));
        args.insert(param, value);
        rest = &value_and_rest[end + "</parameter>".len()..];
    }
    if name.is_empty() {
        return None;
    }
    Some(ToolCall {
        name,
        arguments: Json::Object(args).to_string(),
    })
}

/// Drops one leading and one trailing newline (the template writes the value on its own line).
fn trim_newline(s: &str) -> &str {
    let s = s.strip_prefix('\n').unwrap_or(s);
    s.strip_suffix('\n').unwrap_or(s)
}

/// The JSON-schema type of parameter `param` of tool `name`, if the request declared it.
fn param_type<'a>(tools: &'a [Json], name: &str, param: &str) -> Option<&'a str> {
    let f = tools
        .iter()
        .filter_map(|t| t.get("function"))
        .find(|f| f.get("name").and_then(Json::as_str) == Some(name))?;
    f.get("parameters")?
        .get("properties")?
        .get(param)?
        .get("type")?
        .as_str()
}

/// A parameter value: kept as a string when declared a string, else read as JSON when it is.
fn typed_value(raw: &str, declared: Option<&str>) -> Json {
    if declared == Some("string") {
        return Json::String(raw.to_string());
    }
    serde_json::from_str(raw.trim()).unwrap_or_else(|_| Json::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `text` in pieces of `n` chars and merges adjacent deltas of the same kind.
    fn run(text: &str, n: usize, in_reasoning: bool, tools: Vec<Json>) -> Vec<Delta> {
        let mut p = ChatParser::new(in_reasoning, tools);
        let chars: Vec<char> = text.chars().collect();
        let mut all = Vec::new();
        for piece in chars.chunks(n) {
            all.extend(p.push(&piece.iter().collect::<String>()));
        }
        all.extend(p.finish());
        let mut merged: Vec<Delta> = Vec::new();
        for d in all {
            match (merged.last_mut(), d) {
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (_, d) => merged.push(d),
            }
        }
        merged
    }

    fn every_split(text: &str, in_reasoning: bool, tools: Vec<Json>) -> Vec<Delta> {
        let whole = run(text, usize::MAX, in_reasoning, tools.clone());
        for n in 1..12 {
            assert_eq!(
                run(text, n, in_reasoning, tools.clone()),
                whole,
                "split {n}"
            );
        }
        whole
    }

    #[test]
    fn think_then_content_at_any_split() {
        let out = every_split("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", false, vec![]);
        assert_eq!(
            out,
            vec![
                Delta::Reasoning("hmm, 2+2\n".into()),
                Delta::Content("It is 4.".into())
            ]
        );
        // The template opened <think> in the prompt.
        let out = every_split("plan</think>answer", true, vec![]);
        assert_eq!(
            out,
            vec![
                Delta::Reasoning("plan".into()),
                Delta::Content("answer".into())
            ]
        );
    }

    #[test]
    fn json_tool_call_at_any_split() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let out = every_split(text, false, vec![]);
        assert_eq!(
            out,
            vec![
                Delta::Content("Let me look.\n".into()),
                Delta::ToolCall(ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                })
            ]
        );
    }

    #[test]
    fn xml_tool_calls_with_schema_types() {
        let tools = vec![json!({"type": "function", "function": {"name": "add",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "label": {"type": "string"}}}}})];
        let text = "<think>\nadd them\n</think>\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n\
                    </parameter>\n<parameter=label>\n42\n</parameter>\n<parameter=extra>\n{\"x\": [1]}\n\
                    </parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n</function>\n</tool_call>";
        let out = every_split(text, false, tools);
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(out[0], Delta::Reasoning("add them\n".into()));
        let Delta::ToolCall(call) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(call.name, "add");
        let args: Json = serde_json::from_str(&call.arguments).unwrap();
        assert_eq!(args, json!({"a": 2, "label": "42", "extra": {"x": [1]}}));
        assert_eq!(
            out[2],
            Delta::ToolCall(ToolCall {
                name: "add".into(),
                arguments: "{}".into()
            })
        );
    }

    #[test]
    fn broken_or_unclosed_calls_stay_content() {
        let out = every_split("a <tool_call>not a call</tool_call> b", false, vec![]);
        assert_eq!(
            out,
            vec![Delta::Content(
                "a <tool_call>not a call</tool_call> b".into()
            )]
        );
        let out = every_split("x <tool_call>{\"name\": \"f\"", false, vec![]);
        assert_eq!(
            out,
            vec![Delta::Content("x <tool_call>{\"name\": \"f\"".into())]
        );
        // A lone '<' that never becomes a tag is emitted at the end.
        assert_eq!(
            every_split("1 < 2 <", false, vec![]),
            vec![Delta::Content("1 < 2 <".into())]
        );
    }

    #[test]
    fn partial_tags_are_held_back() {
        assert_eq!(partial_tag_len("abc <too", [CALL, THINK].into_iter()), 4);
        assert_eq!(partial_tag_len("abc <", [CALL].into_iter()), 1);
        assert_eq!(partial_tag_len("abc", [CALL].into_iter()), 0);
        let mut p = ChatParser::new(false, vec![]);
        assert_eq!(p.push("hi <thi"), vec![Delta::Content("hi ".into())]);
        assert_eq!(p.push("nk>r"), vec![Delta::Reasoning("r".into())]);
    }
}
