//! Fine-grained FP8 checkpoints (Qwen's official `*-FP8` repos; format in
//! [`deltamoe_compute::fp8`]).
//!
//! Config: `config.json` `quantization_config` (also inside `text_config`) = {"quant_method":
//! "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
//! "modules_to_not_convert": [...]}. A linear `{m}` is FP8 exactly when `{m}.weight_scale_inv`
//! exists: `{m}.weight` is `F8_E4M3 [out, in]` and the scales `[⌈out/bn⌉, ⌈in/bk⌉]` in any
//! float dtype. The modules the list names (router, shared-expert gate, GDN `a`/`b`
//! projections, embeddings, lm_head, ...) are stored as they are and read as such. Activations
//! are never quantized here: `activation_scheme` only says how an FP8 matmul would scale them.

use std::path::{Path, PathBuf};

use deltamoe_compute::fp8::blocks;
use deltamoe_compute::Fp8Weight;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::quant::method_block;
use crate::weights::WeightStore;

/// The FP8 `quantization_config` block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Config {
    pub path: PathBuf,
    /// `[bn, bk]`: rows and inputs one scale covers.
    pub block: [usize; 2],
    /// `modules_to_not_convert` as written.
    pub not_converted: Vec<String>,
}

impl Fp8Config {
    /// The block of a parsed `config.json` when its quantization method is `fp8`; `None` for
    /// any other or no quantization block.
    pub fn from_json(root: &Value, path: &Path) -> Result<Option<Fp8Config>> {
        let Some(block) = method_block(root, &["fp8"]) else {
            return Ok(None);
        };
        let err = |key: &str, msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: format!("quantization_config.{key}"),
            msg,
        };
        let fmt = block.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
        if fmt != "e4m3" {
            return Err(err(
                "fmt",
                format!("`{fmt}` is not supported; deltamoe reads FP8 weights in e4m3"),
            ));
        }
        let sizes = block
            .get("weight_block_size")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>());
        let block_size =
            match sizes {
                Some(Some(v)) if v.len() == 2 && v.iter().all(|&b| (1..=4096).contains(&b)) => {
                    [v[0] as usize, v[1] as usize]
                }
                _ => return Err(err(
                    "weight_block_size",
                    "missing or not two sizes in 1..=4096; Qwen's FP8 checkpoints have [128, 128] \
                     (per-tensor FP8 is not supported)"
                        .into(),
                )),
            };
        let not_converted = block
            .get("modules_to_not_convert")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Some(Fp8Config {
            path: path.to_path_buf(),
            block: block_size,
            not_converted,
        }))
    }
}

/// FP8 weight(s) of `prefix` when `{prefix}.weight_scale_inv` exists: `lead` is `[]` for one
/// `[out, inp]` matrix or `[E]` for stacked experts (one view per expert).
pub(crate) fn load_fp8(
    store: &WeightStore,
    prefix: &str,
    lead: &[usize],
    out: usize,
    inp: usize,
) -> Result<Option<Vec<Fp8Weight>>> {
    let (wn, sn) = (
        format!("{prefix}.weight"),
        format!("{prefix}.weight_scale_inv"),
    );
    let qerr = |name: &str, msg: String| ModelError::Quant {
        name: store.stored_name(name),
        file: store.file_of(name),
        msg,
    };
    if !store.contains(&sn) {
        if store.fp8_codes(&wn).is_some() {
            return Err(qerr(&wn, format!("is float8 but `{sn}` is missing; an FP8 linear needs its block scales beside it")));
        }
        return Ok(None);
    }
    let Some(cfg) = store.fp8() else {
        return Err(qerr(&sn, "exists, but config.json has no FP8 `quantization_config` (quant_method \"fp8\", weight_block_size [128, 128])".into()));
    };
    let Some((codes, wshape)) = store.fp8_codes(&wn) else {
        if !store.contains(&wn) {
            return Err(ModelError::MissingTensor {
                name: store.stored_name(&wn),
                dir: store.dir().to_path_buf(),
            });
        }
        return Err(qerr(
            &wn,
            format!("is not F8_E4M3 but `{sn}` marks it as FP8"),
        ));
    };
    let [bn, bk] = cfg.block;
    let with = |a: usize, b: usize| -> Vec<usize> { lead.iter().copied().chain([a, b]).collect() };
    let (want_w, want_s) = (with(out, inp), with(blocks(out, bn), blocks(inp, bk)));
    if wshape != want_w.as_slice() {
        return Err(ModelError::Shape {
            name: store.stored_name(&wn),
            file: store.file_of(&wn),
            expected: want_w,
            found: wshape.to_vec(),
        });
    }
    let scales = store.get(&sn, &want_s).map_err(|e| match e {
        ModelError::Shape { found, .. } => qerr(&sn, format!("shape {found:?} does not match [out, in] = [{out}, {inp}] in blocks of [{bn}, {bk}] ({}'s weight_block_size), which needs {want_s:?}", cfg.path.display())),
        e => e,
    })?;
    let (dtype, s) = (scales.dtype(), scales.to_f32_vec());
    let n = lead.iter().product::<usize>();
    let per = blocks(out, bn) * blocks(inp, bk);
    (0..n)
        .map(|e| {
            Fp8Weight::new(
                out,
                inp,
                cfg.block,
                codes.slice(e * out * inp, out * inp),
                s[e * per..(e + 1) * per].to_vec(),
                dtype,
            )
            .map_err(|err| qerr(&wn, err.to_string()))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_block() {
        let p = Path::new("config.json");
        let v = serde_json::json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}});
        let c = Fp8Config::from_json(&v, p).unwrap().unwrap();
        assert_eq!(c.block, [128, 128]);
        assert_eq!(c.not_converted.len(), 2);
        let nested = serde_json::json!({"text_config": v});
        assert!(Fp8Config::from_json(&nested, p).unwrap().is_some());
        let mlx = serde_json::json!({"quantization_config": {"bits": 4, "group_size": 64}});
        assert!(Fp8Config::from_json(&mlx, p).unwrap().is_none());
        let bad = serde_json::json!({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}});
        let e = Fp8Config::from_json(&bad, p).unwrap_err().to_string();
        assert!(e.contains("fmt") && e.contains("e5m2"), "{e}");
        let bad = serde_json::json!({"quantization_config": {"quant_method": "fp8"}});
        let e = Fp8Config::from_json(&bad, p).unwrap_err().to_string();
        assert!(e.contains("weight_block_size"), "{e}");
    }
}
