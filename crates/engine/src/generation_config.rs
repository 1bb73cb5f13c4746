//! Generation defaults from a model directory's `generation_config.json`: end-of-sequence ids
//! (merged with the model config's), BOS id and the recommended sampling parameters.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};
use crate::sampler::SamplingParams;

/// What `generation_config.json` recommends.
#[derive(Clone, Debug, Default)]
pub struct GenerationDefaults {
    /// Stop ids: generation_config.json's first, then the model config's, without duplicates.
    pub eos_token_ids: Vec<u32>,
    /// Sampling from do_sample/temperature/top_k/top_p/min_p/repetition_penalty; `None` when
    /// there is no generation_config.json.
    pub sampling: Option<SamplingParams>,
    /// BOS id, when given.
    pub bos_token_id: Option<u32>,
}

impl GenerationDefaults {
    /// Reads `dir/generation_config.json` (a missing file is fine) and merges its eos ids with
    /// `config_eos`, the ids the model config gave.
    pub fn from_dir(dir: &Path, config_eos: &[u32]) -> Result<GenerationDefaults> {
        let path = dir.join("generation_config.json");
        let out = if path.is_file() {
            parse_file(&path)?
        } else {
            Self::default()
        };
        Ok(out.with_eos(config_eos))
    }

    /// These defaults with the end-of-sequence ids `ids` added (each once).
    pub fn with_eos(mut self, ids: &[u32]) -> GenerationDefaults {
        for &id in ids {
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
        self
    }
}

/// Reads and interprets the file; every error names the file and key.
fn parse_file(path: &Path) -> Result<GenerationDefaults> {
    let fail = |msg: String| EngineError::File {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail(format!("cannot read: {e}; check permissions")))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| {
        fail(format!(
            "malformed JSON: {e}; fix or delete the file (it is optional)"
        ))
    })?;
    let obj = json.as_object().ok_or_else(|| {
        fail("expected a JSON object at the top level; fix or delete the file".into())
    })?;
    let mut eos = Vec::new();
    for id in token_ids(obj, "eos_token_id").map_err(&fail)? {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let bos = match obj.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(as_token_id(v, "bos_token_id").map_err(&fail)?),
    };
    let sampling = sampling(obj).map_err(&fail)?;
    sampling
        .validate()
        .map_err(|e| fail(format!("{e} (from this file)")))?;
    Ok(GenerationDefaults {
        eos_token_ids: eos,
        sampling: Some(sampling),
        bos_token_id: bos,
    })
}

/// A token id value: a non-negative integer that fits u32.
fn as_token_id(v: &Value, key: &str) -> std::result::Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("key {key} has {v}, expected a non-negative integer token id"))
}

/// `key` as an int or a list of ints; absent or null gives an empty list.
fn token_ids(obj: &Map<String, Value>, key: &str) -> std::result::Result<Vec<u32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(|v| as_token_id(v, key)).collect(),
        Some(v) => Ok(vec![as_token_id(v, key)?]),
    }
}

/// An optional number under `key`.
fn number(obj: &Map<String, Value>, key: &str) -> std::result::Result<Option<f32>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|n| Some(n as f32))
            .ok_or_else(|| format!("key {key} has {v}, expected a number; fix the value")),
    }
}

/// Sampling parameters. Greedy unless `do_sample` is true; when sampling, values not listed
/// take transformers' defaults (temperature 1, top_k 50, top_p 1). The repetition penalty
/// applies in both modes, as in transformers.
fn sampling(obj: &Map<String, Value>) -> std::result::Result<SamplingParams, String> {
    let do_sample = match obj.get("do_sample") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(format!("key do_sample has {v}, expected true or false")),
    };
    let mut p = SamplingParams::default();
    if let Some(r) = number(obj, "repetition_penalty")? {
        p.repetition_penalty = r;
    }
    if !do_sample {
        return Ok(p);
    }
    p.temperature = number(obj, "temperature")?.unwrap_or(1.0);
    p.top_p = number(obj, "top_p")?.unwrap_or(1.0);
    p.min_p = number(obj, "min_p")?.unwrap_or(0.0);
    p.top_k = match obj.get("top_k") {
        None | Some(Value::Null) => 50,
        Some(v) => v.as_u64().map(|k| k as usize).ok_or_else(|| {
            format!("key top_k has {v}, expected a non-negative integer (0 = off)")
        })?,
    };
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(json: Option<&str>, config_eos: &[u32]) -> Result<GenerationDefaults> {
        let dir = tempfile::tempdir().unwrap();
        if let Some(text) = json {
            std::fs::write(dir.path().join("generation_config.json"), text).unwrap();
        }
        GenerationDefaults::from_dir(dir.path(), config_eos)
    }

    #[test]
    fn int_eos_merges_with_config() {
        let g = load(Some(r#"{"eos_token_id": 7, "bos_token_id": 1}"#), &[5, 7]).unwrap();
        assert_eq!(g.eos_token_ids, vec![7, 5]);
        assert_eq!(g.bos_token_id, Some(1));
        let s = g.sampling.unwrap();
        assert!(s.is_greedy());
        assert_eq!(s.top_k, 0);
    }

    #[test]
    fn list_eos_and_sampling_values() {
        let text = r#"{"eos_token_id": [9, 3, 9], "do_sample": true, "temperature": 0.6,
            "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.1}"#;
        let g = load(Some(text), &[3, 4]).unwrap();
        assert_eq!(g.eos_token_ids, vec![9, 3, 4]);
        let s = g.sampling.unwrap();
        assert!(!s.is_greedy());
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.min_p),
            (0.6, 20, 0.95, 0.0)
        );
        assert!((s.repetition_penalty - 1.1).abs() < 1e-6);
    }

    #[test]
    fn do_sample_false_is_greedy_with_penalty() {
        let text = r#"{"do_sample": false, "temperature": 0.7, "repetition_penalty": 1.2}"#;
        let s = load(Some(text), &[]).unwrap().sampling.unwrap();
        assert!(s.is_greedy());
        assert!((s.repetition_penalty - 1.2).abs() < 1e-6);
    }

    #[test]
    fn missing_file_keeps_config_ids() {
        let g = load(None, &[2, 2, 1]).unwrap();
        assert_eq!(g.eos_token_ids, vec![2, 1]);
        assert!(g.sampling.is_none() && g.bos_token_id.is_none());
    }

    #[test]
    fn malformed_file_names_file_and_key() {
        let msg = load(Some("{ \"eos_token_id\": "), &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("generation_config.json") && msg.contains("malformed"),
            "{msg}"
        );
        let msg = load(Some(r#"{"eos_token_id": "x"}"#), &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("generation_config.json") && msg.contains("eos_token_id"),
            "{msg}"
        );
        let msg = load(Some(r#"{"do_sample": true, "top_p": 0}"#), &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("top_p"), "{msg}");
    }
}
