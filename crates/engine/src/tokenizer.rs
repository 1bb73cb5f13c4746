//! Text tokenizer: loads a Hugging Face `tokenizer.json` (or, for models without one such as
//! synthetic random-weight shapes, a byte-level stand-in), encodes and decodes text, and
//! streams decoded text token by token without splitting multi-byte characters.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// A text tokenizer: a Hugging Face `tokenizer.json`, or [`TextTokenizer::bytes`].
pub struct TextTokenizer {
    kind: Kind,
}

enum Kind {
    /// A Hugging Face tokenizer loaded from `tokenizer.json` (boxed: it is large).
    Hf(Box<Hf>),
    /// Each UTF-8 byte of the text is one token, id = byte value (see [`TextTokenizer::bytes`]).
    Bytes,
}

struct Hf {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token strings in the input split as ordinary text
    /// (for text that must not contain markup, e.g. a chat message's content).
    plain: tokenizers::Tokenizer,
    path: PathBuf,
}

/// Ids below this are bytes in the byte-level tokenizer.
const BYTE_IDS: usize = 256;

/// Collapses a possibly multi-line message onto one line.
fn one_line(msg: impl std::fmt::Display) -> String {
    msg.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

impl TextTokenizer {
    /// Loads a tokenizer from a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<TextTokenizer> {
        if !path.is_file() {
            return Err(EngineError::File {
                path: path.to_path_buf(),
                msg: "tokenizer file not found; pass the model directory that holds the \
                      Hugging Face tokenizer.json"
                    .into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| EngineError::File {
            path: path.to_path_buf(),
            msg: format!(
                "cannot load tokenizer: {}; replace it with the model's original tokenizer.json",
                one_line(e)
            ),
        })?;
        Ok(Self::hf(inner, path))
    }

    /// A tokenizer from a `tokenizer.json` document built from `origin` (a GGUF file's
    /// metadata), which errors name.
    pub fn from_json(json: &str, origin: &Path) -> Result<TextTokenizer> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| EngineError::File {
            path: origin.to_path_buf(),
            msg: format!(
                "cannot build the tokenizer from its metadata: {}",
                one_line(e)
            ),
        })?;
        Ok(Self::hf(inner, origin))
    }

    fn hf(inner: tokenizers::Tokenizer, path: &Path) -> TextTokenizer {
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        TextTokenizer {
            kind: Kind::Hf(Box::new(Hf {
                inner,
                plain,
                path: path.to_path_buf(),
            })),
        }
    }

    /// A byte-level tokenizer for models without a tokenizer (synthetic weights of a real
    /// shape): each UTF-8 byte of the text is one token whose id is the byte's value, so a
    /// text of N bytes is exactly N tokens. Decoding maps ids below 256 back to bytes (invalid
    /// UTF-8 becomes U+FFFD) and any other id to the placeholder `<id>`. It has no special
    /// tokens.
    pub fn bytes() -> TextTokenizer {
        TextTokenizer { kind: Kind::Bytes }
    }

    /// Loads `dir/tokenizer.json`, or returns `None` when the directory has none.
    pub fn from_dir(dir: &Path) -> Result<Option<TextTokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        Self::from_file(&path).map(Some)
    }

    /// The file this tokenizer was loaded from (`None` for the byte-level tokenizer).
    pub fn path(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Hf(hf) => Some(&hf.path),
            Kind::Bytes => None,
        }
    }

    /// The wrapped `tokenizers` tokenizer (`None` for the byte-level tokenizer).
    pub fn inner(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.kind {
            Kind::Hf(hf) => Some(&hf.inner),
            Kind::Bytes => None,
        }
    }

    /// Encodes `text` into token ids, adding the post-processor's special tokens if asked.
    /// Special-token strings in `text` become their special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Hf(hf) => encode_with(&hf.inner, &hf.path, text, add_special_tokens),
            Kind::Bytes => Ok(encode_bytes(text)),
        }
    }

    /// Encodes `text` as plain text: special-token strings in it (such as `<|im_end|>`) are
    /// tokenized as ordinary characters, never as special tokens; nothing is added.
    pub fn encode_as_text(&self, text: &str) -> Result<Vec<u32>> {
        match &self.kind {
            Kind::Hf(hf) => encode_with(&hf.plain, &hf.path, text, false),
            Kind::Bytes => Ok(encode_bytes(text)),
        }
    }

    /// Decodes token ids into text, optionally skipping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let hf = match &self.kind {
            Kind::Hf(hf) => hf,
            Kind::Bytes => return Ok(decode_bytes(ids)),
        };
        hf.inner.decode(ids, skip_special).map_err(|e| {
            EngineError::Tokenizer(format!(
                "cannot decode {} token ids with {}: {}; check that the ids come from this model",
                ids.len(),
                hf.path.display(),
                one_line(e)
            ))
        })
    }

    /// The strings of the special tokens (control tokens such as `<|im_end|>`, not added words
    /// such as `<think>`), which [`Self::encode`] turns into their tokens wherever they occur
    /// in a text; none for the byte-level tokenizer.
    pub fn special_tokens(&self) -> Vec<String> {
        match &self.kind {
            Kind::Hf(hf) => hf
                .inner
                .get_added_tokens_decoder()
                .into_values()
                .filter(|t| t.special && !t.content.is_empty())
                .map(|t| t.content)
                .collect(),
            Kind::Bytes => Vec::new(),
        }
    }

    /// The id of a token string (including added/special tokens), if it exists; the
    /// byte-level tokenizer names no tokens.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.kind {
            Kind::Hf(hf) => hf.inner.token_to_id(token),
            Kind::Bytes => None,
        }
    }

    /// Vocabulary size including added tokens (256 for the byte-level tokenizer).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::Hf(hf) => hf.inner.get_vocab_size(true),
            Kind::Bytes => BYTE_IDS,
        }
    }

    /// A streaming detokenizer that skips special tokens.
    pub fn stream(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }
}

fn encode_with(
    tok: &tokenizers::Tokenizer,
    path: &Path,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>> {
    let enc = tok.encode(text, add_special_tokens).map_err(|e| {
        EngineError::Tokenizer(format!(
            "cannot encode {} bytes of text with {}: {}; check the input text",
            text.len(),
            path.display(),
            one_line(e)
        ))
    })?;
    Ok(enc.get_ids().to_vec())
}

/// The byte-level tokenizer's encoding: one id per UTF-8 byte.
fn encode_bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The byte-level tokenizer's decoding: runs of byte ids as (lossy) UTF-8, any other id as
/// `<id>`.
fn decode_bytes(ids: &[u32]) -> String {
    let mut out = String::new();
    let mut run = Vec::new();
    for &id in ids {
        match u8::try_from(id) {
            Ok(b) => run.push(b),
            Err(_) => {
                out.push_str(&String::from_utf8_lossy(&run));
                run.clear();
                out.push_str(&format!("<{id}>"));
            }
        }
    }
    out.push_str(&String::from_utf8_lossy(&run));
    out
}

/// Incremental detokenizer: feed ids one by one and get the text they complete.
///
/// It decodes the window `ids[prefix_offset..]` and emits only what extends the already
/// emitted window `ids[prefix_offset..read_offset]`, so decoders that strip a leading space
/// and characters split over several byte tokens behave exactly as a full decode would.
pub struct StreamDecoder<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder<'_> {
    /// Adds one token id; returns the newly completed text, or `None` when the token does not
    /// finish any text yet (an incomplete character, or a skipped special token).
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        self.emit(false)
    }

    /// Emits whatever is still pending at the end of generation, even an incomplete
    /// character (as U+FFFD). Returns `None` when nothing is pending.
    pub fn flush(&mut self) -> Result<Option<String>> {
        if self.read_offset >= self.ids.len() {
            return Ok(None);
        }
        self.emit(true)
    }

    /// Decodes the window and returns the new suffix when it is complete (or `force`d).
    fn emit(&mut self, force: bool) -> Result<Option<String>> {
        let window = &self.ids[self.prefix_offset..];
        let read = self.read_offset - self.prefix_offset;
        let prefix_text = self.tok.decode(&window[..read], true)?;
        let new_text = self.tok.decode(window, true)?;
        if new_text.len() <= prefix_text.len() || (!force && new_text.ends_with('\u{FFFD}')) {
            return Ok(None);
        }
        let delta = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(d) => d.to_string(),
            None => new_text
                .get(prefix_text.len()..)
                .unwrap_or_default()
                .to_string(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        Ok(Some(delta))
    }

    /// Drops ids before the prefix window so memory stays bounded on long generations.
    fn compact(&mut self) {
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// Writes a byte-level BPE tokenizer.json (256 byte tokens, two merges, one special).
    fn write_tokenizer(dir: &Path) -> PathBuf {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let mut vocab = serde_json::Map::new();
        for (i, c) in alphabet.iter().enumerate() {
            vocab.insert(c.to_string(), json!(i));
        }
        vocab.insert("he".into(), json!(256));
        vocab.insert("ll".into(), json!(257));
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": true});
        let doc = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 258, "content": "<|im_end|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
                "merges": [["h", "e"], ["l", "l"]]}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, doc.to_string()).unwrap();
        path
    }

    fn tokenizer() -> (tempfile::TempDir, TextTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path());
        let tok = TextTokenizer::from_dir(dir.path()).unwrap().unwrap();
        (dir, tok)
    }

    #[test]
    fn round_trip_and_vocab() {
        let (_dir, tok) = tokenizer();
        assert_eq!(tok.vocab_size(), 259);
        assert_eq!(tok.token_id("<|im_end|>"), Some(258));
        assert_eq!(tok.token_id("he"), Some(256));
        let text = "hello wörld 世界<|im_end|>";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(ids[0], 256);
        assert_eq!(*ids.last().unwrap(), 258);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello wörld 世界");
        let plain = tok.encode_as_text(text).unwrap();
        assert!(!plain.contains(&258) && plain.len() > ids.len());
        assert_eq!(tok.decode(&plain, false).unwrap(), text);
    }

    #[test]
    fn missing_and_broken_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        assert!(TextTokenizer::from_dir(dir.path()).unwrap().is_none());
        let path = dir.path().join("nope.json");
        let msg = TextTokenizer::from_file(&path).err().unwrap().to_string();
        assert!(
            msg.contains("nope.json") && msg.contains("not found"),
            "{msg}"
        );
        let bad = dir.path().join("tokenizer.json");
        std::fs::write(&bad, "{ not json").unwrap();
        let msg = TextTokenizer::from_dir(dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("tokenizer.json") && !msg.contains('\n'),
            "{msg}"
        );
    }

    #[test]
    fn stream_reassembles_text_without_partial_chars() {
        let (_dir, tok) = tokenizer();
        let text = "hello wörld 世界<|im_end|> 🙂!";
        let ids = tok.encode(text, false).unwrap();
        let mut stream = tok.stream();
        let mut out = String::new();
        let mut nones = 0;
        for &id in &ids {
            match stream.push(id).unwrap() {
                Some(piece) => {
                    assert!(!piece.contains('\u{FFFD}'), "partial char in {piece:?}");
                    out.push_str(&piece);
                }
                None => nones += 1,
            }
        }
        assert!(stream.flush().unwrap().is_none());
        assert_eq!(out, tok.decode(&ids, true).unwrap());
        // ö (2 bytes), 世 界 (3 each), 🙂 (4) and the special token produce no text at first.
        assert_eq!(nones, 1 + 2 + 2 + 3 + 1);
    }

    #[test]
    fn flush_emits_incomplete_tail() {
        let (_dir, tok) = tokenizer();
        let ids = tok.encode("a世", false).unwrap();
        let mut stream = tok.stream();
        assert_eq!(stream.push(ids[0]).unwrap().as_deref(), Some("a"));
        assert!(stream.push(ids[1]).unwrap().is_none());
        let tail = stream.flush().unwrap().unwrap();
        assert!(tail.contains('\u{FFFD}'), "{tail:?}");
    }

    #[test]
    fn bytes_round_trip_one_token_per_byte() {
        let tok = TextTokenizer::bytes();
        let text = "hello wörld 世界 🙂 <|im_end|>";
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids.len(), text.len());
        assert!(ids.iter().all(|&id| id < 256));
        assert_eq!(ids, tok.encode_as_text(text).unwrap());
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        assert_eq!(tok.vocab_size(), 256);
        assert_eq!(tok.token_id("<|im_end|>"), None);
        assert!(tok.path().is_none());
    }

    #[test]
    fn bytes_decode_other_ids_as_placeholders() {
        let tok = TextTokenizer::bytes();
        assert_eq!(
            tok.decode(&[104, 1000, 105, 256], false).unwrap(),
            "h<1000>i<256>"
        );
        // An incomplete character before a placeholder stays visible as U+FFFD.
        assert_eq!(tok.decode(&[0xE4, 300], false).unwrap(), "\u{FFFD}<300>");
        let mut stream = tok.stream();
        let ids = tok.encode("a世", false).unwrap();
        assert_eq!(stream.push(ids[0]).unwrap().as_deref(), Some("a"));
        assert!(stream.push(ids[1]).unwrap().is_none());
        assert!(stream.push(ids[2]).unwrap().is_none());
        assert_eq!(stream.push(ids[3]).unwrap().as_deref(), Some("世"));
        assert_eq!(stream.push(70000).unwrap().as_deref(), Some("<70000>"));
        assert!(stream.flush().unwrap().is_none());
    }
}
