//! Safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`, memory
//! mapped. Tensor names are normalised: the multimodal prefix `model.language_model.` (HF) or
//! `language_model.model.` (mlx-lm) becomes `model.`, `language_model.lm_head.` becomes
//! `lm_head.`, the multi-token-prediction layer's `model.mtp.` or `language_model.mtp.` becomes
//! `mtp.`; vision tensors (`model.visual.*`, `visual.*`, `vision_tower.*`) are ignored. Packed `uint32` tensors of MLX affine-quantized checkpoints are
//! kept as words; `config.json`'s `quantization` block and the tensor layout (HF or mlx-lm, see
//! [`crate::quant`]) are read at open. Every lookup states the shape the config implies and
//! fails with the tensor's name when the checkpoint disagrees.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{AffineWeight, DType, PackedWords, Tensor};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};
use crate::fp8::Fp8Config;
use crate::gptq::GptqConfig;
use crate::quant::{config_json, Layout, QuantConfig};

/// What `summary` reports of a tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub bytes: usize,
    /// Weights the tensor stores: its element count for float tensors, the unpacked count for
    /// packed quantized ones, 0 for their scales and biases.
    pub params: usize,
}

/// A tensor another format's loader made, for [`WeightStore::from_tensors`].
pub enum Prepared {
    Dense(Tensor),
    /// A quantized matrix in the affine form, with its shape (`[out, in]`, or `[E, out, in]`
    /// for stacked experts stored as one weight of `E·out` rows).
    Affine(AffineWeight, Vec<usize>),
}

/// What a tensor entry holds.
enum Stored {
    Float(Tensor),
    /// A quantized matrix already in the affine form (from a GGUF file), with its shape.
    Affine(AffineWeight, Vec<usize>),
    /// Packed `uint32` words of a quantized weight, with the stored shape.
    Words(PackedWords, Vec<usize>),
    /// float8 e4m3 bytes of an FP8 weight, with the stored shape.
    Fp8(Bytes, Vec<usize>),
    /// int32 values (GPTQ/AWQ packed weights, zero points, group indices) as their `u32` bits,
    /// with the stored shape.
    Int(PackedWords, Vec<usize>),
    /// An unsupported dtype, by name.
    Other(String),
}

/// One tensor entry, its name as the file spells it, its file and where its bytes lie in that
/// file.
struct Entry {
    tensor: Stored,
    /// The name in the file (before [`normalise`]), for error messages.
    stored: String,
    file: PathBuf,
    offset: u64,
    len: usize,
}

/// Where a tensor's bytes lie: `len` bytes at `offset` of `file`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorBytes {
    pub file: PathBuf,
    pub offset: u64,
    pub len: usize,
}

/// All tensors of a checkpoint directory, by normalised name; or, for benchmarks, a source of
/// random tensors of whatever shape the model asks for.
pub struct WeightStore {
    dir: PathBuf,
    entries: HashMap<String, Entry>,
    /// The multimodal prefix the file gives language-model tensors (`model.language_model.` or
    /// `language_model.model.`), so an absent tensor is named as this checkpoint would spell it.
    file_prefix: Option<&'static str>,
    synthetic: Option<Synthetic>,
    quant: Option<QuantConfig>,
    fp8: Option<Fp8Config>,
    gptq: Option<GptqConfig>,
    layout: Layout,
}

/// Prefixes of the text model's `model.*` tensors in multimodal checkpoints: HF's and mlx-lm's.
const MULTIMODAL_PREFIXES: [&str; 2] = ["model.language_model.", "language_model.model."];

/// Normalised name (of a tensor or, for quantization overrides, a module), or `None` for
/// tensors this engine does not use.
pub(crate) fn normalise(name: &str) -> Option<String> {
    const IGNORED: [&str; 3] = ["model.visual.", "visual.", "vision_tower."];
    if IGNORED.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    for (prefix, to) in [
        (MULTIMODAL_PREFIXES[0], "model."),
        (MULTIMODAL_PREFIXES[1], "model."),
        ("language_model.lm_head", "lm_head"),
        ("model.mtp.", "mtp."),
        ("language_model.mtp.", "mtp."),
    ] {
        if let Some(rest) = name.strip_prefix(prefix) {
            return Some(format!("{to}{rest}"));
        }
    }
    Some(name.to_string())
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
            file_prefix: None,
            synthetic: None,
            quant: None,
            fp8: None,
            gptq: None,
            layout: Layout::Hf,
        };
        for f in files {
            store.add_file(&dir.join(f))?;
        }
        if let Some((root, path)) = config_json(dir)? {
            store.quant = QuantConfig::from_json(&root, &path)?;
            store.fp8 = Fp8Config::from_json(&root, &path)?;
            store.gptq = GptqConfig::from_json(&root, &path)?;
        }
        if store.gptq.is_none() && store.quant.is_none() && store.fp8.is_none() {
            store.gptq = GptqConfig::from_quantize_config(dir)?;
        }
        store.layout = Layout::detect(&store);
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            err: source,
        })?;
        let bad = |msg: String| ModelError::Safetensors {
            path: path.to_path_buf(),
            msg,
        };
        let len = file
            .metadata()
            .map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                err: source,
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
                err: source,
            })?,
        );
        let st = SafeTensors::deserialize(&map).map_err(|e| match e {
            // The crate's message names no tensor; find the one whose bytes disagree.
            safetensors::SafeTensorError::TensorInvalidInfo => {
                bad(mismatched_tensor(&map).unwrap_or_else(|| e.to_string()))
            }
            e => bad(e.to_string()),
        })?;
        let base = map.as_ptr() as usize;
        for (name, view) in st.tensors() {
            let Some(key) = normalise(&name) else {
                continue;
            };
            if let Some(p) = MULTIMODAL_PREFIXES.iter().find(|p| name.starts_with(*p)) {
                self.file_prefix.get_or_insert(p);
            }
            let shape = view.shape().to_vec();
            let off = view.data().as_ptr() as usize - base;
            let float = |dt| {
                Stored::Float(
                    Tensor::from_mmap(map.clone(), off, dt, shape.clone())
                        .unwrap_or_else(|| Tensor::from_le_bytes(dt, shape.clone(), view.data())),
                )
            };
            let tensor = match view.dtype() {
                safetensors::Dtype::BF16 => float(DType::BF16),
                safetensors::Dtype::F16 => float(DType::F16),
                safetensors::Dtype::F32 => float(DType::F32),
                safetensors::Dtype::U32 => Stored::Words(
                    PackedWords::from_mmap(map.clone(), off, view.data().len() / 4)
                        .unwrap_or_else(|| PackedWords::from_le_bytes(view.data())),
                    shape.clone(),
                ),
                safetensors::Dtype::F8_E4M3 => Stored::Fp8(
                    Bytes::from_mmap(map.clone(), off, view.data().len())
                        .unwrap_or_else(|| Bytes::from_vec(view.data().to_vec())),
                    shape.clone(),
                ),
                safetensors::Dtype::I32 => Stored::Int(
                    PackedWords::from_mmap(map.clone(), off, view.data().len() / 4)
                        .unwrap_or_else(|| PackedWords::from_le_bytes(view.data())),
                    shape.clone(),
                ),
                other => Stored::Other(format!("{other:?}")),
            };
            self.entries.insert(
                key,
                Entry {
                    tensor,
                    stored: name.clone(),
                    file: path.to_path_buf(),
                    offset: off as u64,
                    len: view.data().len(),
                },
            );
        }
        Ok(())
    }

    /// A store of tensors already in memory (named as this store normalises them, in `layout`),
    /// read from `file`: the tensors of another format mapped to these names.
    pub fn from_tensors(
        file: &Path,
        tensors: Vec<(String, Prepared)>,
        layout: Layout,
    ) -> WeightStore {
        let entries = tensors
            .into_iter()
            .map(|(name, t)| {
                let tensor = match t {
                    Prepared::Dense(t) => Stored::Float(t),
                    Prepared::Affine(w, shape) => Stored::Affine(w, shape),
                };
                let e = Entry {
                    tensor,
                    stored: name.clone(),
                    file: file.to_path_buf(),
                    offset: 0,
                    len: 0,
                };
                (name, e)
            })
            .collect();
        WeightStore {
            dir: file.to_path_buf(),
            entries,
            file_prefix: None,
            synthetic: None,
            quant: None,
            fp8: None,
            gptq: None,
            layout,
        }
    }

    /// A store that makes a random tensor (seeded by `seed` and the tensor's name) for every
    /// lookup, in `dtype`: a model of any config without files, for benchmarks.
    pub fn synthetic(dtype: DType, seed: u64) -> WeightStore {
        WeightStore {
            dir: PathBuf::from("<synthetic>"),
            entries: HashMap::new(),
            file_prefix: None,
            synthetic: Some(Synthetic { dtype, seed }),
            quant: None,
            fp8: None,
            gptq: None,
            layout: Layout::Hf,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Whether any tensor's (normalised) name starts with `prefix` (a synthetic store makes
    /// every tensor asked for, so it holds every prefix).
    pub fn contains_prefix(&self, prefix: &str) -> bool {
        self.synthetic.is_some() || self.names().any(|n| n.starts_with(prefix))
    }

    /// Whether the linear `module` is stored: `{module}.weight`, or GPTQ/AWQ `{module}.qweight`.
    pub fn has_linear(&self, module: &str) -> bool {
        self.contains(&format!("{module}.weight")) || self.contains(&format!("{module}.qweight"))
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
                Stored::Float(t) => TensorInfo {
                    name: name.clone(),
                    shape: t.shape().to_vec(),
                    dtype: t.dtype().to_string(),
                    bytes: t.nbytes(),
                    params: if [".scales", ".biases", ".weight_scale_inv"]
                        .iter()
                        .any(|s| name.ends_with(s))
                    {
                        0
                    } else {
                        t.len()
                    },
                },
                Stored::Words(w, shape) => TensorInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: "U32".into(),
                    bytes: w.len() * 4,
                    params: w.len() * 32 / self.packed_bits(name).unwrap_or(32) as usize,
                },
                Stored::Affine(w, shape) => TensorInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: format!("affine {}-bit", w.bits()),
                    bytes: w.nbytes(),
                    params: w.out_features() * w.in_features(),
                },
                Stored::Fp8(b, shape) => TensorInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: "F8_E4M3".into(),
                    bytes: b.len(),
                    params: b.len(),
                },
                Stored::Int(w, shape) => TensorInfo {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: "I32".into(),
                    bytes: w.len() * 4,
                    params: match (name.ends_with(".qweight"), &self.gptq) {
                        (true, Some(c)) => w.len() * 32 / c.bits as usize,
                        _ => 0,
                    },
                },
                Stored::Other(dt) => TensorInfo {
                    name: name.clone(),
                    shape: vec![],
                    dtype: dt.clone(),
                    bytes: 0,
                    params: 0,
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
                name: self.stored_name(name),
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
        let t = match &e.tensor {
            Stored::Float(t) => t,
            Stored::Words(..) => return Err(ModelError::Quant {
                name: e.stored.clone(),
                file: e.file.clone(),
                msg: "is packed uint32 (quantized) where a bf16/f16/f32 tensor is expected; a quantized linear needs its `.scales` and `.biases` beside it, only linears and the embedding can be quantized".into(),
            }),
            Stored::Affine(..) => return Err(ModelError::Quant {
                name: e.stored.clone(),
                file: e.file.clone(),
                msg: "is quantized where a float tensor is expected; only matrices can be quantized".into(),
            }),
            Stored::Fp8(..) => return Err(ModelError::Quant {
                name: e.stored.clone(),
                file: e.file.clone(),
                msg: "is float8 (FP8-quantized) where a bf16/f16/f32 tensor is expected; only linears can be FP8, with their `.weight_scale_inv` beside them".into(),
            }),
            Stored::Int(..) => return Err(ModelError::Quant {
                name: e.stored.clone(),
                file: e.file.clone(),
                msg: "is int32 (GPTQ/AWQ-packed) where a bf16/f16/f32 tensor is expected; a GPTQ/AWQ linear is `.qweight` with `.qzeros` and `.scales` beside it".into(),
            }),
            Stored::Other(dtype) => return Err(ModelError::DType {
                name: e.stored.clone(),
                file: e.file.clone(),
                dtype: dtype.clone(),
            }),
        };
        if t.shape() != shape {
            return Err(ModelError::Shape {
                name: e.stored.clone(),
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

    /// The effective scale `1 + w` of a zero-centred RMSNorm weight: computed here for HF
    /// checkpoints, stored already shifted in mlx-lm ones (see [`Layout`]).
    pub fn zero_centred_norm(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let w = self.vec_f32(name, len)?;
        Ok(match self.layout {
            Layout::Hf => w.iter().map(|v| 1.0 + v).collect(),
            Layout::Mlx => w,
        })
    }

    /// Packed words of a quantized tensor, or `None` when `name` is absent or not `uint32`.
    pub fn words(&self, name: &str) -> Option<(PackedWords, &[usize])> {
        match self.entries.get(name).map(|e| &e.tensor) {
            Some(Stored::Words(w, shape)) => Some((w.clone(), shape)),
            _ => None,
        }
    }

    /// A matrix stored in the affine form (from a GGUF file) with its shape, or `None`.
    pub fn affine(&self, name: &str) -> Option<(&AffineWeight, &[usize])> {
        match self.entries.get(name).map(|e| &e.tensor) {
            Some(Stored::Affine(w, shape)) => Some((w, shape)),
            _ => None,
        }
    }

    /// The e4m3 bytes of an FP8 weight, or `None` when `name` is absent or not `F8_E4M3`.
    pub fn fp8_codes(&self, name: &str) -> Option<(Bytes, &[usize])> {
        match self.entries.get(name).map(|e| &e.tensor) {
            Some(Stored::Fp8(b, shape)) => Some((b.clone(), shape)),
            _ => None,
        }
    }

    /// The int32 values of `name` as `u32` bits, or `None` when absent or not `I32`.
    pub fn ints(&self, name: &str) -> Option<(PackedWords, &[usize])> {
        match self.entries.get(name).map(|e| &e.tensor) {
            Some(Stored::Int(w, shape)) => Some((w.clone(), shape)),
            _ => None,
        }
    }

    /// The GPTQ/AWQ quantization block, when the checkpoint has one.
    pub fn gptq(&self) -> Option<&GptqConfig> {
        self.gptq.as_ref()
    }

    /// `config.json`'s FP8 quantization block, when it has one.
    pub fn fp8(&self) -> Option<&Fp8Config> {
        self.fp8.as_ref()
    }

    /// Stored shape of `name`, whatever its dtype.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.entries.get(name).map(|e| match &e.tensor {
            Stored::Float(t) => t.shape().to_vec(),
            Stored::Words(_, s) | Stored::Fp8(_, s) | Stored::Int(_, s) => s.clone(),
            Stored::Affine(_, s) => s.clone(),
            Stored::Other(_) => vec![],
        })
    }

    /// The name of `name` as its file spells it, for messages; an absent `model.*` tensor gets
    /// the checkpoint's multimodal prefix, if it has one.
    pub fn stored_name(&self, name: &str) -> String {
        if let Some(e) = self.entries.get(name) {
            return e.stored.clone();
        }
        match (self.file_prefix, name.strip_prefix("model.")) {
            (Some(p), Some(rest)) => format!("{p}{rest}"),
            _ => name.to_string(),
        }
    }

    /// File holding `name` (the directory for lookups of absent tensors).
    pub fn file_of(&self, name: &str) -> PathBuf {
        self.entries
            .get(name)
            .map_or_else(|| self.dir.clone(), |e| e.file.clone())
    }

    /// Where the bytes of `name` lie in its file, or `None` when absent.
    pub fn bytes_of(&self, name: &str) -> Option<TensorBytes> {
        self.entries.get(name).map(|e| TensorBytes {
            file: e.file.clone(),
            offset: e.offset,
            len: e.len,
        })
    }

    /// `config.json`'s quantization block, when there is one.
    pub fn quantization(&self) -> Option<&QuantConfig> {
        self.quant.as_ref()
    }

    /// Tensor layout: HF or mlx-lm.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Bits of the packed weight `name` (`{module}.weight`) per the quantization config.
    fn packed_bits(&self, name: &str) -> Option<u32> {
        let module = name.strip_suffix(".weight")?;
        Some(self.quant.as_ref()?.spec_for(module)?.bits)
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

/// The first tensor in a safetensors file's header whose `data_offsets` span a different number
/// of bytes than its shape and dtype need, described; `None` when none is found (the header is
/// read leniently: this only explains an error the safetensors crate already reported).
fn mismatched_tensor(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..end)?).ok()?;
    header.as_object()?.iter().find_map(|(name, info)| {
        if name == "__metadata__" {
            return None;
        }
        let dtype = info.get("dtype")?.as_str()?;
        let size: usize = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
            "U16" | "I16" | "F16" | "BF16" => 2,
            "U32" | "I32" | "F32" => 4,
            "U64" | "I64" | "F64" => 8,
            _ => return None,
        };
        let shape: Vec<usize> = info
            .get("shape")?
            .as_array()?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()?;
        let offsets: Vec<u64> = info
            .get("data_offsets")?
            .as_array()?
            .iter()
            .map(|d| d.as_u64())
            .collect::<Option<_>>()?;
        let [start, stop] = offsets[..] else {
            return None;
        };
        let need = shape
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .map_or("more than 2^64".to_string(), |b| b.to_string());
        let have = stop.checked_sub(start).map(|b| b.to_string());
        (have.as_deref() != Some(need.as_str())).then(|| {
            format!(
                "tensor `{name}`: shape {shape:?} of dtype {dtype} needs {need} bytes but its data_offsets [{start}, {stop}] hold {}",
                have.unwrap_or_else(|| "a negative number of".into())
            )
        })
    })
}

/// Distinct shard file names of an index, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
        path: index.to_path_buf(),
        err: source,
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
                ("model.mtp.fc.weight", vec![1], vec![0.0]),
                ("lm_head.weight", vec![1, 2], vec![3.0, 4.0]),
            ],
        );
        let s = WeightStore::open(d.path()).unwrap();
        assert_eq!(s.vec_f32("model.norm.weight", 2).unwrap(), vec![1.0, 2.0]);
        assert!(!s.contains("model.visual.x") && s.contains("mtp.fc.weight"));
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

    #[test]
    fn errors_name_tensors_as_the_file_spells_them() {
        let d = tempfile::tempdir().unwrap();
        write_st(
            &d.path().join("model.safetensors"),
            &[("model.language_model.norm.weight", vec![2], vec![1.0, 2.0])],
        );
        let s = WeightStore::open(d.path()).unwrap();
        let e = s.get("model.norm.weight", &[3]).unwrap_err().to_string();
        assert!(e.contains("`model.language_model.norm.weight`"), "{e}");
        // An absent tensor is named with the checkpoint's prefix too.
        let e = s.get("model.embed_tokens.weight", &[3]).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("`model.language_model.embed_tokens.weight`") && e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn inconsistent_offsets_name_the_tensor() {
        let d = tempfile::tempdir().unwrap();
        let header = br#"{"ok":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"bad":{"dtype":"F32","shape":[2,2],"data_offsets":[4,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0; 8]);
        std::fs::write(d.path().join("model.safetensors"), &bytes).unwrap();
        let e = WeightStore::open(d.path()).err().unwrap().to_string();
        assert!(
            e.contains("tensor `bad`") && e.contains("needs 16 bytes") && e.contains("hold 4"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_shard_says_why_once() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001.safetensors"}}"#,
        )
        .unwrap();
        let e = WeightStore::open(d.path()).err().unwrap();
        // Printed with its chain of causes (as the CLI does), the reason appears once.
        assert!(std::error::Error::source(&e).is_none());
        let msg = e.to_string();
        assert!(msg.contains("model-00001.safetensors"), "{msg}");
        assert_eq!(msg.matches("No such file").count(), 1, "{msg}");
    }
}
