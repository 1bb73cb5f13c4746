//! The text side of a GGUF model from its `tokenizer.*` and `general.sampling.*` metadata: the
//! tokenizer as the Hugging Face `tokenizer.json` it was converted from (byte-level BPE with
//! the Qwen pre-tokenizer the file names), the chat template, the special tokens and the
//! sampling defaults.
//!
//! llama.cpp's converter writes every token of the HF tokenizer in id order with a type:
//! normal tokens are the BPE vocabulary, control tokens HF's special added tokens,
//! user-defined ones its other added tokens, and unused ones the padding up to the model's
//! vocabulary (`[PAD{id}]`, never produced). The merges are the BPE merges as `"a b"`.

use serde_json::{json, Map, Value as Json};

use super::{GgufFile, Value};
use crate::error::{ModelError, Result};

/// Qwen2's split regex, as in its `tokenizer.json`.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5's: combining marks (`\p{M}`) count as letters.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers (`tokenizer.ggml.pre`) read, with their split regexes.
const PRE_TOKENIZERS: [(&str, &str); 3] = [
    ("qwen35", QWEN35),
    ("qwen2", QWEN2),
    ("deepseek-r1-qwen", QWEN2),
];

/// Token types (`tokenizer.ggml.token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Control tokens that end a turn in the Qwen chat format, stops as in HF's generation config.
const END_OF_TURN: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// Sampling defaults a GGUF file recommends (`general.sampling.*`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// A GGUF model's tokenizer, chat template and generation defaults.
#[derive(Clone, Debug)]
pub struct Vocab {
    /// The tokenizer as a Hugging Face `tokenizer.json` document.
    pub tokenizer_json: String,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub bos_id: Option<u32>,
    /// Ids that end generation: the EOS, EOT and EOM ids and the end-of-turn control tokens.
    pub eos_ids: Vec<u32>,
    /// `None` when the file recommends no sampling (greedy).
    pub sampling: Option<Sampling>,
}

/// Metadata lookups that fail naming the file and the key.
struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    fn err(&self, key: &str, msg: &str) -> ModelError {
        ModelError::Input(format!(
            "{}: metadata `{key}` {msg}",
            self.0.path().display()
        ))
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.0.metadata.get(key)
    }

    fn str(&self, key: &str) -> Result<&str> {
        let v = self.get(key).ok_or_else(|| self.err(key, "is missing"))?;
        v.as_str().ok_or_else(|| self.err(key, "is not a string"))
    }

    fn array(&self, key: &str) -> Result<&[Value]> {
        match self.get(key) {
            Some(Value::Array(a)) => Ok(a),
            Some(_) => Err(self.err(key, "is not an array")),
            None => Err(self.err(key, "is missing")),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let a = self.array(key)?;
        let s: Option<Vec<&str>> = a.iter().map(Value::as_str).collect();
        s.ok_or_else(|| self.err(key, "holds a value that is not a string"))
    }

    fn id(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u64().and_then(|v| u32::try_from(v).ok())
    }

    fn f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f64().map(|v| v as f32)
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some(Value::Bool(true)))
    }
}

/// The tokenizer, template and defaults of `f`; fails naming the key for a tokenizer deltamoe
/// does not build (not byte-level BPE, or a pre-tokenizer it does not know).
pub fn vocab(f: &GgufFile) -> Result<Vocab> {
    let m = Meta(f);
    let model = m.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        let msg = format!("is `{model}`; deltamoe reads byte-level BPE tokenizers (`gpt2`)");
        return Err(m.err("tokenizer.ggml.model", &msg));
    }
    let pre = m.str("tokenizer.ggml.pre")?;
    let Some((_, regex)) = PRE_TOKENIZERS.iter().find(|(n, _)| *n == pre) else {
        let known: Vec<_> = PRE_TOKENIZERS.iter().map(|(n, _)| *n).collect();
        let msg = format!("is `{pre}`, not one deltamoe knows ({})", known.join(", "));
        return Err(m.err("tokenizer.ggml.pre", &msg));
    };
    let tokens = m.strings("tokenizer.ggml.tokens")?;
    let types = m.array("tokenizer.ggml.token_type")?;
    if types.len() != tokens.len() {
        return Err(m.err(
            "tokenizer.ggml.token_type",
            "does not hold one type per token",
        ));
    }
    let types: Vec<i64> = types.iter().map(token_type).collect();
    let merges = m.strings("tokenizer.ggml.merges")?;
    let text = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let bos_id = m.id("tokenizer.ggml.bos_token_id");
    let add_bos = m.flag("tokenizer.ggml.add_bos_token");
    let json = tokenizer_json(&tokens, &types, &merges, regex, bos_id.filter(|_| add_bos));
    let stated = ["eos", "eot", "eom"]
        .iter()
        .filter_map(|k| m.id(&format!("tokenizer.ggml.{k}_token_id")));
    let turn_ends = (0..tokens.len())
        .filter(|&i| types[i] == CONTROL && END_OF_TURN.contains(&tokens[i]))
        .map(|i| i as u32);
    let mut eos_ids = Vec::new();
    for id in stated.chain(turn_ends) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    Ok(Vocab {
        tokenizer_json: json.to_string(),
        chat_template: m
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map(String::from),
        bos_token: text(bos_id),
        eos_token: text(m.id("tokenizer.ggml.eos_token_id")),
        bos_id,
        eos_ids,
        sampling: sampling(&m),
    })
}

/// A token type value as an integer (the converter writes i32).
fn token_type(v: &Value) -> i64 {
    match v {
        Value::I32(t) => *t as i64,
        other => other.as_u64().map_or(0, |t| t as i64),
    }
}

/// The recommended sampling, when the file has any of its keys.
fn sampling(m: &Meta) -> Option<Sampling> {
    let key = |k: &str| format!("general.sampling.{k}");
    let s = Sampling {
        temperature: m.f32(&key("temp")),
        top_p: m.f32(&key("top_p")),
        top_k: m
            .get(&key("top_k"))
            .and_then(Value::as_u64)
            .map(|k| k as usize),
        min_p: m.f32(&key("min_p")),
        repetition_penalty: m.f32(&key("penalty_repeat")),
    };
    (s != Sampling::default()).then_some(s)
}

/// The `tokenizer.json` of a byte-level BPE tokenizer: normal tokens as the vocabulary, control
/// and user-defined ones as added tokens (special and not), NFC normalization as Qwen's, a BOS
/// prepended when `bos` is given.
fn tokenizer_json(
    tokens: &[&str],
    types: &[i64],
    merges: &[&str],
    regex: &str,
    bos: Option<u32>,
) -> Json {
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
        match ty {
            NORMAL => {
                vocab.insert(t.to_string(), json!(id));
            }
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL,
            })),
            _ => {}
        }
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false,
    });
    let post = match bos.and_then(|id| Some((id, *tokens.get(id as usize)?))) {
        Some((id, t)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [id], "tokens": [t]}},
        }),
        None => byte_level.clone(),
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level,
        ]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    })
}
