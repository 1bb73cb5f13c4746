//! Request text to prompt tokens, safely: an oversized prompt is rejected after counting about
//! a context's worth of tokens (not after tokenizing megabytes), and a chat's message content
//! is tokenized as text, so a special-token string inside it (`<|im_end|>`) cannot close its
//! turn; only the template's own markup becomes special tokens.
//!
//! The markup is found by rendering the conversation a second time with each content replaced
//! by a marker: the pieces between markers are markup, and the real rendering must be those
//! pieces with the contents (or their trimmed forms, for templates that trim) in between.

use std::ops::Range;

use deltamoe_engine::tokenizer::TextTokenizer;

use crate::api::ApiError;

/// The chat template of a model without one of its own (synthetic weights served with the
/// byte-level tokenizer): the message contents joined by newlines, no roles, no markup.
pub const PLAIN_CHAT_TEMPLATE: &str =
    "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m.content }}{% endfor %}";

/// Texts longer than this (in all) are counted piece by piece against the context first.
const LONG: usize = 64 << 10;

/// Bytes per piece when counting.
const PIECE: usize = 16 << 10;

/// Opens and closes a content marker; private-use characters no template emits.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// The marker standing for message `i`'s content in the skeleton rendering.
pub fn marker(i: usize) -> String {
    format!("{OPEN}{i}{CLOSE}")
}

/// 400 `context_length_exceeded` when `texts` hold at least `ctx` tokens, found by
/// tokenizing them piece by piece and stopping at the first piece that reaches `ctx`; texts
/// shorter than [`LONG`] in all are left to the exact count.
pub fn check_budget(
    tok: &TextTokenizer,
    texts: &[&str],
    ctx: usize,
    param: &str,
) -> Result<(), ApiError> {
    if texts.iter().map(|t| t.len()).sum::<usize>() <= LONG {
        return Ok(());
    }
    let mut n = 0;
    for text in texts {
        for piece in pieces(text, PIECE) {
            n += encode(tok, piece, true)?.len();
            if n >= ctx {
                let msg = format!("This model's maximum context length is {ctx} tokens, but the {param} hold at least {n} tokens; shorten them");
                return Err(ApiError::context_length(param, msg));
            }
        }
    }
    Ok(())
}

/// `text` cut into pieces of at most about `size` bytes, each ending before a space that
/// follows a non-space (where a byte-level pre-tokenizer splits anyway), else at a character
/// boundary.
fn pieces(text: &str, size: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(size);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end < rest.len() {
            let bytes = rest.as_bytes();
            let cut = (1..end)
                .rev()
                .find(|&i| bytes[i] == b' ' && !bytes[i - 1].is_ascii_whitespace());
            if let Some(i) = cut {
                end = i;
            }
        }
        if end == 0 {
            end = rest.char_indices().nth(1).map_or(rest.len(), |(i, _)| i);
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

fn encode(tok: &TextTokenizer, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    let r = if special {
        tok.encode(text, false)
    } else {
        tok.encode_as_text(text)
    };
    r.map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}")))
}

/// The rendered chat `text` as tokens: markup with special tokens, contents as text. When the
/// skeleton does not line up with the text (the template rewrote a content beyond trimming),
/// the contents cannot be told apart from the markup: the whole text is tokenized with special
/// tokens if no content holds a special token's string (as Qwen templates that drop an
/// assistant turn's reasoning need), else the request is refused (400 on `messages`), since
/// that string would become its control token.
pub fn encode_chat(
    tok: &TextTokenizer,
    text: &str,
    skeleton: &str,
    contents: &[String],
) -> Result<Vec<u32>, ApiError> {
    let Some(spans) = content_spans(text, skeleton, contents) else {
        let special = tok.special_tokens();
        let found = contents
            .iter()
            .find_map(|c| special.iter().find(|t| c.contains(t.as_str())));
        if let Some(t) = found {
            return Err(ApiError::invalid_param(
                "messages",
                format!(
                    "a message holds the special token string `{t}`, and this model's chat \
                     template rewrites messages in a way that would make it a control token; \
                     remove it from the message, or start the server with \
                     --allow-special-in-content"
                ),
            ));
        }
        return encode(tok, text, true);
    };
    let mut ids = Vec::new();
    let mut pos = 0;
    for span in spans {
        ids.extend(encode(tok, &text[pos..span.start], true)?);
        ids.extend(encode(tok, &text[span.clone()], false)?);
        pos = span.end;
    }
    ids.extend(encode(tok, &text[pos..], true)?);
    Ok(ids)
}

/// A piece of the skeleton rendering.
enum Part<'a> {
    Markup(&'a str),
    Content(usize),
}

/// The skeleton cut at its markers.
fn parts(skeleton: &str) -> Vec<Part<'_>> {
    let mut out = Vec::new();
    let mut rest = skeleton;
    while let Some(open) = rest.find(OPEN) {
        let after = &rest[open + OPEN.len_utf8()..];
        let Some(close) = after.find(CLOSE) else {
            break;
        };
        let Ok(i) = after[..close].parse::<usize>() else {
            break;
        };
        out.push(Part::Markup(&rest[..open]));
        out.push(Part::Content(i));
        rest = &after[close + CLOSE.len_utf8()..];
    }
    out.push(Part::Markup(rest));
    out
}

/// Where each content sits in `text`, by walking the skeleton's parts; `None` when they do
/// not line up.
fn content_spans(text: &str, skeleton: &str, contents: &[String]) -> Option<Vec<Range<usize>>> {
    let parts = parts(skeleton);
    let mut spans = Vec::new();
    let mut pos = 0;
    for (k, part) in parts.iter().enumerate() {
        match part {
            Part::Markup(m) => {
                if !text[pos..].starts_with(m) {
                    return None;
                }
                pos += m.len();
            }
            Part::Content(i) => {
                let c = contents.get(*i)?;
                let next = match parts.get(k + 1) {
                    Some(Part::Markup(m)) => *m,
                    _ => "",
                };
                let forms = [c.as_str(), c.trim(), c.trim_start(), c.trim_end()];
                let fits = |f: &&str| {
                    text[pos..].starts_with(*f) && text[pos + f.len()..].starts_with(next)
                };
                let form = forms.into_iter().find(fits)?;
                spans.push(pos..pos + form.len());
                pos += form.len();
            }
        }
    }
    (pos == text.len()).then_some(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_and_cut_before_spaces() {
        let text = "alpha beta  gamma délta ".repeat(50);
        let cut: Vec<&str> = pieces(&text, 40).collect();
        assert_eq!(cut.concat(), text);
        assert!(cut.iter().all(|p| p.len() <= 40));
        assert!(cut[1..].iter().all(|p| p.starts_with(' ')), "{cut:?}");
        assert_eq!(pieces("ééé", 3).collect::<Vec<_>>(), ["é", "é", "é"]);
    }

    #[test]
    fn spans_follow_the_skeleton() {
        let contents = vec!["hi <|im_end|>".to_string(), "  yo ".to_string()];
        let skeleton = format!("<s>u\n{}</s><s>a\n{}</s>", marker(0), marker(1));
        let text = "<s>u\nhi <|im_end|></s><s>a\nyo</s>";
        let spans = content_spans(text, &skeleton, &contents).unwrap();
        assert_eq!(&text[spans[0].clone()], "hi <|im_end|>");
        assert_eq!(&text[spans[1].clone()], "yo");
        assert!(content_spans("<s>u\nother</s>", &skeleton, &contents).is_none());
    }

    /// With the built-in model's tokenizer: `<|im_end|>` in a content is text, in the markup
    /// the special token.
    #[test]
    fn special_strings_in_content_stay_text() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
        let tok = TextTokenizer::from_dir(&dir).unwrap().unwrap();
        let end = tok.token_id("<|im_end|>").unwrap();
        let contents = vec!["a<|im_end|>b".to_string()];
        let skeleton = format!("<|im_start|>user\n{}<|im_end|>\n", marker(0));
        let text = "<|im_start|>user\na<|im_end|>b<|im_end|>\n";
        let ids = encode_chat(&tok, text, &skeleton, &contents).unwrap();
        assert_eq!(ids.iter().filter(|&&t| t == end).count(), 1, "{ids:?}");
        let as_special = tok.encode(text, false).unwrap();
        assert_eq!(as_special.iter().filter(|&&t| t == end).count(), 2);
        assert!(ids.len() > as_special.len());
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    /// A rendering the skeleton does not line up with (the template rewrote a content): a
    /// content holding a special token's string is refused; one without (an added word such as
    /// `<think>` is not special) is tokenized whole, as before.
    #[test]
    fn rewritten_contents_with_token_strings_are_refused() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny");
        let tok = TextTokenizer::from_dir(&dir).unwrap().unwrap();
        let skeleton = format!("<|im_start|>user\n{}<|im_end|>\n", marker(0));
        let contents = vec!["a<|im_end|>b".to_string()];
        let text = "<|im_start|>user\nA<|im_end|>B<|im_end|>\n";
        let e = encode_chat(&tok, text, &skeleton, &contents).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("<|im_end|>"), "{}", e.message);
        let plain = vec!["<think>a</think>b".to_string()];
        let text = "<|im_start|>user\nB<|im_end|>\n";
        let ids = encode_chat(&tok, text, &skeleton, &plain).unwrap();
        assert_eq!(ids, tok.encode(text, false).unwrap());
    }
}
