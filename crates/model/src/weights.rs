//! Safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`, memory
//! mapped. Tensor names are normalised: the multimodal prefix `model.language_model.` becomes
//! `model.`; vision (`model.visual.*`, `visual.*`) and multi-token-prediction (`mtp.*`) tensors
//! are ignored. Every lookup states the shape the config implies and fails with the tensor's
//! name when the checkpoint disagrees.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::{DType, Tensor};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};

/// What `summary` reports of a tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub bytes: usize,
}

/// One tensor entry: the tensor, or the unsupported dtype it has, and its file.
struct Entry {
    tensor: std::result::Result<Tensor, String>,
    file: PathBuf,
}

/// All tensors of a checkpoint directory, by normalised name; or, for benchmarks, a source of
/// random tensors of whatever shape the model asks for.
pub struct WeightStore {
    dir: PathBuf,
    entries: HashMap<String, Entry>,
    synthetic: Option<Synthetic>,
}

/// Normalised name, or `None` for tensors this engine does not use.
fn normalise(name: &str) -> Option<String> {
    const IGNORED: [&str; 4] = ["model.visual.", "visual.", "mtp.", "model.mtp."];
    if IGNORED.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    match name.strip_prefix("model.language_model.") {
        Some(rest) => Some(format!("model.{rest}")),
        None => Some(name.to_string()),
    }
}

impl WeightStore {
    /// Open `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<WeightStore> {
        let index = dir.join("model.safetensors.index.json");
        let files = if index.exists() {
            shard_files(&index)?
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        let mut store = WeightStore {
            dir: dir.to_path_buf(),
            entries: HashMap::new(),
            synthetic: None,
        };
        for f in files {
            store.add_file(&dir.join(f))?;
        }
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |msg: String| ModelError::Safetensors {
            path: path.to_path_buf(),
            msg,
        };
        let len = file
            .metadata()
            .map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len < 8 {
            return Err(bad(format!(
                "file is {len} bytes, shorter than the 8-byte header length"
            )));
        }
        // SAFETY: the map is read-only; checkpoints are not expected to change while loaded (the
        // same assumption every mmap-based loader makes).
        let map = Arc::new(
            unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })?,
        );
        let st = SafeTensors::deserialize(&map).map_err(|e| bad(e.to_string()))?;
        let base = map.as_ptr() as usize;
        for (name, view) in st.tensors() {
            let Some(key) = normalise(&name) else {
                continue;
            };
            let shape = view.shape().to_vec();
            let dtype = match view.dtype() {
                safetensors::Dtype::BF16 => Ok(DType::BF16),
                safetensors::Dtype::F16 => Ok(DType::F16),
                safetensors::Dtype::F32 => Ok(DType::F32),
                other => Err(format!("{other:?}")),
            };
            let tensor = dtype.map(|dt| {
                let off = view.data().as_ptr() as usize - base;
                Tensor::from_mmap(map.clone(), off, dt, shape.clone())
                    .unwrap_or_else(|| Tensor::from_le_bytes(dt, shape.clone(), view.data()))
            });
            self.entries.insert(
                key,
                Entry {
                    tensor,
                    file: path.to_path_buf(),
                },
            );
        }
        Ok(())
    }

    /// A store that makes a random tensor (seeded by `seed` and the tensor's name) for every
    /// lookup, in `dtype`: a model of any config without files, for benchmarks.
    pub fn synthetic(dtype: DType, seed: u64) -> WeightStore {
        WeightStore {
            dir: PathBuf::from("<synthetic>"),
            entries: HashMap::new(),
            synthetic: Some(Synthetic { dtype, seed }),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Normalised names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    /// Name, shape, dtype name and bytes of every tensor (for `info`), sorted by name.
    pub fn summary(&self) -> Vec<TensorInfo> {
        let mut v: Vec<TensorInfo> = self
            .entries
            .iter()
            .map(|(name, e)| match &e.tensor {
                Ok(t) => TensorInfo {
                    name: name.clone(),
                    shape: t.shape().to_vec(),
                    dtype: t.dtype().to_string(),
                    bytes: t.nbytes(),
                },
                Err(dt) => TensorInfo {
                    name: name.clone(),
                    shape: vec![],
                    dtype: dt.clone(),
                    bytes: 0,
                },
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The tensor `name` with exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get_opt(name, shape)?
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })
    }

    /// The tensor `name` with exactly `shape`, or `None` when absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if let Some(syn) = &self.synthetic {
            return Ok(Some(syn.tensor(name, shape)));
        }
        let Some(e) = self.entries.get(name) else {
            return Ok(None);
        };
        let t = e.tensor.as_ref().map_err(|dtype| ModelError::DType {
            name: name.to_string(),
            file: e.file.clone(),
            dtype: dtype.clone(),
        })?;
        if t.shape() != shape {
            return Err(ModelError::Shape {
                name: name.to_string(),
                file: e.file.clone(),
                expected: shape.to_vec(),
                found: t.shape().to_vec(),
            });
        }
        Ok(Some(t.clone()))
    }

    /// A 1-D tensor as f32 values (norm weights, A_log, dt_bias, biases).
    pub fn vec_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.get(name, &[len])?.to_f32_vec())
    }
}

/// Random weights: uniform in ±1/sqrt(fan_in) for matrices, ±0.1 for vectors.
struct Synthetic {
    dtype: DType,
    seed: u64,
}

impl Synthetic {
    fn tensor(&self, name: &str, shape: &[usize]) -> Tensor {
        let len: usize = shape.iter().product();
        let scale = match shape {
            [_] => 0.1,
            _ => 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt(),
        };
        let seed = name
            .bytes()
            .fold(self.seed ^ 0x9E37_79B9_7F4A_7C15, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
            });
        let values: Vec<f32> = (0..len)
            .into_par_iter()
            .map(|i| {
                // splitmix64 of (seed, index) mapped to [-1, 1).
                let mut z = seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect();
        match self.dtype {
            DType::F32 => Tensor::from_f32(shape.to_vec(), values),
            DType::BF16 => Tensor::from_half_bits(
                DType::BF16,
                shape.to_vec(),
                values.iter().map(|&v| f32_to_bf16(v)).collect(),
            ),
            DType::F16 => Tensor::from_half_bits(
                DType::F16,
                shape.to_vec(),
                values
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect(),
            ),
        }
    }
}

/// Distinct shard file names of an index, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: index.to_path_buf(),
        msg: e.to_string(),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Config {
            path: index.to_path_buf(),
            key: "weight_map".into(),
            msg: "missing or not an object of tensor name to file name".into(),
        })?;
    let mut files: Vec<String> = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| ModelError::Config {
            path: index.to_path_buf(),
            key: format!("weight_map.{name}"),
            msg: "expected a file name".into(),
        })?;
        if !files.iter().any(|x| x == f) {
            files.push(f.to_string());
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_st(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, s, v)| {
                (
                    n.to_string(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    s.clone(),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(n, b, s)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn prefixes_are_normalised_and_shapes_checked() {
        let d = tempfile::tempdir().unwrap();
        write_st(
            &d.path().join("model.safetensors"),
            &[
                ("model.language_model.norm.weight", vec![2], vec![1.0, 2.0]),
                ("model.visual.x", vec![1], vec![0.0]),
                ("mtp.fc.weight", vec![1], vec![0.0]),
                ("lm_head.weight", vec![1, 2], vec![3.0, 4.0]),
            ],
        );
        let s = WeightStore::open(d.path()).unwrap();
        assert_eq!(s.vec_f32("model.norm.weight", 2).unwrap(), vec![1.0, 2.0]);
        assert!(!s.contains("model.visual.x") && !s.contains("mtp.fc.weight"));
        let e = s.get("lm_head.weight", &[2, 2]).unwrap_err().to_string();
        assert!(
            e.contains("lm_head.weight") && e.contains("[1, 2]") && e.contains("[2, 2]"),
            "{e}"
        );
        let e = s
            .get("model.embed_tokens.weight", &[2])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.embed_tokens.weight") && e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn truncated_and_missing_files_name_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("model.safetensors");
        write_st(&p, &[("a", vec![4], vec![1.0; 4])]);
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let e = WeightStore::open(d.path()).err().unwrap().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("truncated"),
            "{e}"
        );
        std::fs::write(&p, b"abc").unwrap();
        assert!(WeightStore::open(d.path())
            .err()
            .unwrap()
            .to_string()
            .contains("3 bytes"));
        std::fs::remove_file(&p).unwrap();
        let e = WeightStore::open(d.path()).err().unwrap().to_string();
        assert!(e.contains("no weights found"), "{e}");
    }
}
