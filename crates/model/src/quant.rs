//! MLX affine-quantized checkpoints, as mlx-lm writes them (and `deltamoe convert`).
//!
//! Weights: a quantized linear `{m}` stores `{m}.weight` (`uint32 [out, in·bits/32]`),
//! `{m}.scales` and `{m}.biases` (`[out, in/group_size]`, model dtype), stacked experts add a
//! leading `[E]`; `w = q·scale + bias` per group of `group_size` inputs (format in
//! [`deltamoe_compute::quant`]). A linear is quantized exactly when `{m}.scales` exists — mlx-lm
//! leaves a module unquantized when its input dim is not a multiple of the group size.
//!
//! Config: `config.json` `quantization` (mlx-lm also writes the same object as
//! `quantization_config`; either is read, also inside `text_config`) holds the default
//! `{"group_size": G, "bits": B, "mode": "affine"}` and per-module overrides keyed by the module
//! path, e.g. `"language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}` (module
//! paths are normalised like tensor names). The shapes must agree with the config: a mismatch is
//! an error naming the tensor and the bits/group size the tensors imply.
//!
//! Layout ([`Layout`]): mlx-lm renames and reshapes on conversion (its `sanitize`): experts are
//! stacked as `mlp.switch_mlp.{gate,up,down}_proj` `[E, out, in]`, the zero-centred RMSNorm
//! weights (input/post-attention/final/q/k norms, not the GDN gated norm) are stored already
//! shifted as `1 + w`, conv1d weights are `[C, K, 1]` instead of HF's `[C, 1, K]`, and
//! multimodal models get the prefix `language_model.`. mlx-lm recognises a converted Qwen3.5
//! checkpoint by its conv1d weights ending in 1; the same test decides [`Layout::Mlx`] here,
//! together with `switch_mlp` tensors or packed `uint32` weights.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use deltamoe_compute::AffineWeight;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::weights::{normalise, WeightStore};

/// Bits and group size of one quantized module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The `quantization` block of `config.json`.
#[derive(Clone, Debug)]
pub struct QuantConfig {
    path: PathBuf,
    default: QuantSpec,
    /// Normalised module path → its spec, or `None` for a module marked unquantized (`false`).
    overrides: HashMap<String, Option<QuantSpec>>,
}

/// How a checkpoint's tensors are named and laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Hugging Face: per-expert or fused experts, norms as `w` (used as `1 + w`), conv1d
    /// `[C, 1, K]`.
    Hf,
    /// mlx-lm: `switch_mlp` stacked experts, norms stored as `1 + w`, conv1d `[C, K, 1]`.
    Mlx,
}

impl Layout {
    pub(crate) fn detect(store: &WeightStore) -> Layout {
        let mlx = store.names().any(|n| {
            n.contains(".switch_mlp.")
                || store.words(n).is_some()
                || (n.ends_with("conv1d.weight")
                    && matches!(store.shape_of(n).as_deref(), Some([_, k, 1]) if *k > 1))
        });
        if mlx {
            Layout::Mlx
        } else {
            Layout::Hf
        }
    }
}

fn spec_of(v: &Value, key: &str, path: &Path) -> Result<QuantSpec> {
    let err = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        key: key.to_string(),
        msg,
    };
    if let Some(mode) = v.get("mode").and_then(|m| m.as_str()) {
        if mode != "affine" {
            return Err(err(format!(
                "mode `{mode}` is not supported; deltamoe reads MLX affine quantization (re-convert with `deltamoe convert`)"
            )));
        }
    }
    let int = |k: &str| {
        v.get(k).and_then(|x| x.as_u64()).ok_or_else(|| {
            err(format!(
                "`{k}` missing or not an integer; expected e.g. {{\"group_size\": 64, \"bits\": 4}}"
            ))
        })
    };
    let spec = QuantSpec {
        bits: int("bits")? as u32,
        group_size: int("group_size")? as usize,
    };
    deltamoe_compute::quant::check_params(spec.bits, spec.group_size)
        .map_err(|e| err(e.to_string()))?;
    Ok(spec)
}

/// `dir/config.json` parsed, and its path; `None` when the file cannot be read.
pub(crate) fn config_json(dir: &Path) -> Result<Option<(Value, PathBuf)>> {
    let path = dir.join("config.json");
    Ok(read_json(&path)?.map(|root| (root, path)))
}

/// A JSON file parsed; `None` when it cannot be read, an error naming it when it does not parse.
pub(crate) fn read_json(path: &Path) -> Result<Option<Value>> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })
}

/// `quant_method` of a quantization block.
pub(crate) fn quant_method(block: &Value) -> Option<&str> {
    block.get("quant_method").and_then(Value::as_str)
}

/// The `quantization_config` block of a parsed `config.json` (at the top level or in
/// `text_config`) when its `quant_method` is one of `methods`.
pub(crate) fn method_block<'a>(root: &'a Value, methods: &[&str]) -> Option<&'a Value> {
    let scopes = [Some(root), root.get("text_config")];
    scopes
        .into_iter()
        .flatten()
        .find_map(|o| o.get("quantization_config"))
        .filter(|b| quant_method(b).is_some_and(|m| methods.contains(&m)))
}

impl QuantConfig {
    /// Read the block from a parsed config; `path` names the file in errors.
    pub fn from_json(root: &Value, path: &Path) -> Result<Option<QuantConfig>> {
        let scopes = [Some(root), root.get("text_config")];
        let found = scopes.iter().flatten().find_map(|obj| {
            ["quantization", "quantization_config"]
                .iter()
                .find_map(|k| obj.get(*k).filter(|v| v.is_object()).map(|v| (*k, v)))
        });
        let Some((key, block)) = found else {
            return Ok(None);
        };
        // FP8, GPTQ and AWQ have their own blocks ([`crate::fp8::Fp8Config`],
        // [`crate::gptq::GptqConfig`]).
        if let Some("fp8" | "gptq" | "awq") = quant_method(block) {
            return Ok(None);
        }
        if block.get("bits").is_none() {
            let method = quant_method(block).unwrap_or("unknown");
            return Err(ModelError::Config {
                path: path.to_path_buf(),
                key: key.to_string(),
                msg: format!("quantization method `{method}` is not supported; deltamoe reads MLX affine quantization (mlx-lm checkpoints or `deltamoe convert` output), fine-grained FP8, GPTQ and AWQ"),
            });
        }
        let default = spec_of(block, key, path)?;
        let mut overrides = HashMap::new();
        for (module, v) in block.as_object().into_iter().flatten() {
            let spec = match v {
                Value::Object(_) => Some(spec_of(v, &format!("{key}.{module}"), path)?),
                Value::Bool(false) => None,
                Value::Bool(true) => Some(default),
                _ => continue, // bits, group_size, mode, ...
            };
            if let Some(name) = normalise(module) {
                overrides.insert(name, spec);
            }
        }
        Ok(Some(QuantConfig {
            path: path.to_path_buf(),
            default,
            overrides,
        }))
    }

    /// The default bits and group size.
    pub fn default_spec(&self) -> QuantSpec {
        self.default
    }

    /// Spec of a module (normalised path, e.g. `model.layers.0.mlp.gate`); `None` when the
    /// config marks it unquantized.
    pub fn spec_for(&self, module: &str) -> Option<QuantSpec> {
        match self.overrides.get(module) {
            Some(s) => *s,
            None => Some(self.default),
        }
    }

    /// Whether `module` has its own entry.
    pub fn has_override(&self, module: &str) -> bool {
        self.overrides.contains_key(module)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Quantized weight(s) of `prefix` when `{prefix}.scales` exists: `lead` is `[]` for one
/// `[out, inp]` matrix or `[E]` for stacked experts (one [`AffineWeight`] view per expert).
pub(crate) fn load_affine(
    store: &WeightStore,
    prefix: &str,
    lead: &[usize],
    out: usize,
    inp: usize,
) -> Result<Option<Vec<AffineWeight>>> {
    let (wn, sn, bn) = (
        format!("{prefix}.weight"),
        format!("{prefix}.scales"),
        format!("{prefix}.biases"),
    );
    let qerr = |name: &str, msg: String| ModelError::Quant {
        name: store.stored_name(name),
        file: store.file_of(name),
        msg,
    };
    if let Some((w, shape)) = store.affine(&wn) {
        return prepared(store, &wn, w, shape, lead, out, inp).map(Some);
    }
    let needs = format!("a quantized linear needs `{wn}`, `{sn}` and `{bn}`");
    if !store.contains(&sn) {
        if store.words(&wn).is_some() {
            return Err(qerr(
                &wn,
                format!("is packed uint32 (quantized) but `{sn}` is missing; {needs}"),
            ));
        }
        return Ok(None);
    }
    let Some((words, wshape)) = store.words(&wn) else {
        if !store.contains(&wn) {
            return Err(ModelError::MissingTensor {
                name: store.stored_name(&wn),
                dir: store.dir().to_path_buf(),
            });
        }
        return Err(qerr(&wn, format!("is not uint32 but `{sn}` marks it as quantized; the packed weight of a quantized linear is uint32 ({needs})")));
    };
    if !store.contains(&bn) {
        return Err(qerr(&bn, format!("is missing; {needs}")));
    }
    let sshape = store.shape_of(&sn).unwrap_or_default();
    let implied = || {
        let wl = wshape.last().copied().unwrap_or(0);
        let sl = sshape.last().copied().unwrap_or(0);
        match (wl * 32 % inp.max(1), inp % sl.max(1)) {
            (0, 0) if sl > 0 => format!("bits {}, group_size {}", wl * 32 / inp, inp / sl),
            _ => "no valid bits/group_size".to_string(),
        }
    };
    let Some(q) = store.quantization() else {
        return Err(qerr(&sn, format!("exists, but config.json has no `quantization` block; add one, e.g. \"quantization\": {{\"group_size\": G, \"bits\": B}} (these tensors imply {})", implied())));
    };
    let Some(spec) = q.spec_for(prefix) else {
        return Err(qerr(&sn, format!("exists, but {}'s quantization block marks `{prefix}` as not quantized; remove that entry", q.path().display())));
    };
    let (g, bits) = (spec.group_size, spec.bits as usize);
    let with = |last: usize| -> Vec<usize> { lead.iter().copied().chain([out, last]).collect() };
    let (want_w, want_s) = (with(inp * bits / 32), with(inp / g));
    if !inp.is_multiple_of(g) || wshape != want_w.as_slice() || sshape != want_s {
        let whose = if q.has_override(prefix) {
            format!("its entry `{prefix}`")
        } else {
            "the default".to_string()
        };
        return Err(qerr(&wn, format!(
            "shape {wshape:?} with `{sn}` {sshape:?} does not match [out, in] = [{out}, {inp}] at bits {bits}, group_size {g} ({} quantization block, {whose}), which needs {want_w:?} and {want_s:?}; the tensors imply {}: fix config.json",
            q.path().display(), implied()
        )));
    }
    let scales = store.get(&sn, &want_s)?;
    let biases = store.get(&bn, &want_s)?;
    let n = lead.iter().product::<usize>();
    let wpe = out * inp * bits / 32;
    let flat = |t: &deltamoe_compute::Tensor| t.reshape(vec![n * out, inp / g]);
    let (sf, bf) = (flat(&scales), flat(&biases));
    (0..n)
        .map(|e| {
            AffineWeight::new(
                spec.bits,
                g,
                out,
                inp,
                words.slice(e * wpe, wpe),
                sf.narrow(e * out, out),
                bf.narrow(e * out, out),
            )
            .map_err(|err| qerr(&wn, err.to_string()))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// A weight the store holds in the affine form already (from a GGUF file), checked against the
/// shape the config implies and cut into one view per expert.
fn prepared(
    store: &WeightStore,
    name: &str,
    w: &AffineWeight,
    shape: &[usize],
    lead: &[usize],
    out: usize,
    inp: usize,
) -> Result<Vec<AffineWeight>> {
    let want: Vec<usize> = lead.iter().copied().chain([out, inp]).collect();
    if shape != want.as_slice() {
        return Err(ModelError::Shape {
            name: store.stored_name(name),
            file: store.file_of(name),
            expected: want,
            found: shape.to_vec(),
        });
    }
    let n = lead.iter().product::<usize>();
    Ok((0..n).map(|e| w.rows(e * out, out)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_block_defaults_overrides_and_errors() {
        let p = Path::new("config.json");
        let v: Value = serde_json::from_str(
            r#"{"text_config": {}, "quantization_config": {"group_size": 32, "bits": 4, "mode": "affine",
                "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                "model.layers.1.mlp.gate": false}}"#,
        )
        .unwrap();
        let q = QuantConfig::from_json(&v, p).unwrap().unwrap();
        assert_eq!(
            q.spec_for("model.layers.0.mlp.gate"),
            Some(QuantSpec {
                bits: 8,
                group_size: 64
            })
        );
        assert_eq!(q.spec_for("model.layers.1.mlp.gate"), None);
        assert_eq!(q.spec_for("lm_head"), Some(q.default_spec()));
        assert!(QuantConfig::from_json(&serde_json::json!({}), p)
            .unwrap()
            .is_none());
        let bad =
            serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}});
        let e = QuantConfig::from_json(&bad, p).unwrap_err().to_string();
        assert!(e.contains("mxfp4") && e.contains("quantization"), "{e}");
        let bad = serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes"}});
        let e = QuantConfig::from_json(&bad, p).unwrap_err().to_string();
        assert!(e.contains("bitsandbytes"), "{e}");
        let gptq = serde_json::json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        assert!(QuantConfig::from_json(&gptq, p).unwrap().is_none());
        let bad = serde_json::json!({"quantization": {"group_size": 48, "bits": 4}});
        let e = QuantConfig::from_json(&bad, p).unwrap_err().to_string();
        assert!(e.contains("group size 48"), "{e}");
    }
}
