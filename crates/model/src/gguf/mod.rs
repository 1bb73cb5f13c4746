//! GGUF files (version 3), memory-mapped: the metadata key-value pairs, the tensor table and
//! each tensor's bytes, dequantized to f32 on request ([`blocks`]). A GGUF file is a header
//! (`GGUF`, version, tensor count, key-value count), the key-value pairs (a string key, a value
//! type, the value; arrays carry their element type and count), the tensor infos (name, dims
//! innermost first, type, offset), then the tensor data from the next multiple of
//! `general.alignment` (default 32), each tensor at its offset from there.

pub mod blocks;
pub mod config;
pub mod repack;
pub mod tensors;
pub mod vocab;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use blocks::BlockType;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::quant::Layout;
use crate::weights::WeightStore;
use crate::Progress;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor of the file: its dims (innermost first, as ggml writes them), type and bytes'
/// place in the data section.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dims: Vec<usize>,
    pub kind: BlockType,
    /// The file of a split model that holds it (0: the first).
    part: usize,
    offset: usize,
    /// Bytes of its data in the file.
    pub bytes: usize,
}

impl TensorInfo {
    /// Values in the tensor.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape outermost first, as safetensors and PyTorch write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A memory-mapped GGUF file, or the parts of a split model (`NAME-0000k-of-0000n.gguf`, made
/// by llama.cpp's `gguf-split`: the first part holds the metadata, each part some tensors).
pub struct GgufFile {
    path: PathBuf,
    parts: Vec<Part>,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// One mapped file and where its tensor data starts.
struct Part {
    map: Mmap,
    data: usize,
}

/// Most entries an array or the file's tables may hold: beyond any real model (a 250k-token
/// vocabulary), so a corrupt count fails at once instead of allocating.
const MAX_ENTRIES: u64 = 1 << 26;

/// A reader over the file's bytes that fails, naming the file, where they run out.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: String) -> ModelError {
        ModelError::Input(format!(
            "{}: not a valid GGUF file ({msg} at byte {}); the file may be truncated or corrupt",
            self.path.display(),
            self.at
        ))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(self.err(format!("{n} bytes past the end")));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn count(&mut self, what: &str) -> Result<u64> {
        let n = self.u64()?;
        if n > MAX_ENTRIES {
            return Err(self.err(format!("{what} count {n}")));
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        let n = usize::try_from(n).map_err(|_| self.err(format!("string of {n} bytes")))?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err("a string that is not UTF-8".into()))
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 if depth == 0 => {
                let elem = self.u32()?;
                let n = self.count("array")?;
                let items = (0..n).map(|_| self.value(elem, depth + 1));
                Value::Array(items.collect::<Result<_>>()?)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            k => return Err(self.err(format!("metadata value type {k}"))),
        })
    }
}

impl GgufFile {
    /// Maps `path` (with the other parts of a split model) and reads the header, metadata and
    /// tensor table, checking that every tensor lies inside its file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let (first, (metadata, mut tensors)) = read_part(path, 0)?;
        let mut parts = vec![first];
        let count = metadata
            .get("split.count")
            .and_then(Value::as_u64)
            .unwrap_or(1) as usize;
        for k in 2..=count {
            let p = part_path(path, k, count)?;
            let (part, (_, more)) = read_part(&p, k - 1)?;
            for (name, info) in more {
                if tensors.insert(name.clone(), info).is_some() {
                    return Err(ModelError::Input(format!(
                        "{}: tensor `{name}` is in more than one part of the split model",
                        p.display()
                    )));
                }
            }
            parts.push(part);
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            parts,
            metadata,
            tensors,
        })
    }
}

/// The path of part `k` of `n` beside `first` (`NAME-00001-of-0000n.gguf`), which must exist.
fn part_path(first: &Path, k: usize, n: usize) -> Result<PathBuf> {
    let name = first.file_name().map(|s| s.to_string_lossy().into_owned());
    let suffix = format!("-00001-of-{n:05}.gguf");
    let Some(stem) = name.as_deref().and_then(|s| s.strip_suffix(&suffix)) else {
        return Err(ModelError::Input(format!(
            "{}: a split model's first part (split.count {n}) but not named `NAME{suffix}`; \
             keep the names gguf-split gave the parts",
            first.display()
        )));
    };
    let p = first.with_file_name(format!("{stem}-{k:05}-of-{n:05}.gguf"));
    if !p.is_file() {
        return Err(ModelError::Input(format!(
            "{}: part {k} of the split model {} is missing; download every part into one directory",
            p.display(),
            first.display()
        )));
    }
    Ok(p)
}

/// Metadata and tensor table of one file.
type Tables = (BTreeMap<String, Value>, BTreeMap<String, TensorInfo>);

/// Maps the file `path` (part `part` of its model) and reads its header, metadata and tensor
/// table, checking that every tensor lies inside it.
fn read_part(path: &Path, part: usize) -> Result<(Part, Tables)> {
    let io = |err| ModelError::Io {
        path: path.to_path_buf(),
        err,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and lives with the struct; a file changed underneath
    // while mapped is outside what any reader of model files can guard against.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let mut c = Cursor {
        b: &map,
        at: 0,
        path,
    };
    if c.take(4).ok() != Some(b"GGUF".as_slice()) {
        return Err(ModelError::Input(format!(
            "{}: not a GGUF file (it does not start with `GGUF`)",
            path.display()
        )));
    }
    let version = c.u32()?;
    if version != 3 {
        return Err(ModelError::Input(format!(
            "{}: GGUF version {version}; only version 3 is read (convert it again with a \
                 current llama.cpp)",
            path.display()
        )));
    }
    let n_tensors = c.count("tensor")?;
    let n_kv = c.count("metadata")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string()?;
        let kind = c.u32()?;
        metadata.insert(key, c.value(kind, 0)?);
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        infos.push(tensor_info(&mut c, part)?);
    }
    let align = metadata
        .get("general.alignment")
        .and_then(Value::as_u64)
        .unwrap_or(32)
        .max(1) as usize;
    let data = c.at.div_ceil(align) * align;
    let mut tensors = BTreeMap::new();
    for (name, info) in infos {
        let end = data
            .checked_add(info.offset)
            .and_then(|o| o.checked_add(info.bytes));
        if end.is_none_or(|e| e > map.len()) {
            return Err(ModelError::Input(format!(
                "{}: tensor `{name}` ({} bytes at offset {}) runs past the end of the file; \
                     the file may be truncated, download it again",
                path.display(),
                info.bytes,
                info.offset
            )));
        }
        tensors.insert(name, info);
    }
    Ok((Part { map, data }, (metadata, tensors)))
}

/// One tensor info: name, dims, type, offset; the type must be one [`BlockType`] takes and
/// the innermost dim a whole number of its blocks.
fn tensor_info(c: &mut Cursor, part: usize) -> Result<(String, TensorInfo)> {
    let name = c.string()?;
    let n_dims = c.u32()?;
    if n_dims > 8 {
        return Err(c.err(format!("tensor `{name}` with {n_dims} dims")));
    }
    let dims = (0..n_dims)
        .map(|_| Ok(c.u64()? as usize))
        .collect::<Result<Vec<_>>>()?;
    let id = c.u32()?;
    let offset = c.u64()? as usize;
    let Some(kind) = BlockType::from_id(id) else {
        return Err(ModelError::Input(format!(
            "{}: tensor `{name}` has type {} ({id}), which deltamoe does not read (it reads \
                 F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)",
            c.path.display(),
            BlockType::id_name(id)
        )));
    };
    let inner = dims.first().copied().unwrap_or(1);
    let n: Option<usize> = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let Some(n) = n.filter(|_| inner % kind.block() == 0) else {
        return Err(c.err(format!(
            "tensor `{name}` of dims {dims:?} is not whole {kind:?} blocks of {}",
            kind.block()
        )));
    };
    let Some(bytes) = (n / kind.block()).checked_mul(kind.bytes()) else {
        return Err(c.err(format!(
            "tensor `{name}` of dims {dims:?}: more bytes than memory holds"
        )));
    };
    let info = TensorInfo {
        bytes,
        dims,
        kind,
        part,
        offset,
    };
    Ok((name, info))
}

impl GgufFile {
    /// The file (of a split model, the first part).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.info(name)?;
        let p = &self.parts[t.part];
        let at = p.data + t.offset;
        Ok(&p.map[at..at + t.bytes])
    }

    /// Let the kernel drop the mapped pages of tensor `name` once its values have been copied
    /// out (a later read faults them in again from the file): a load then holds one tensor of the
    /// file at a time beside what it made, not the whole file. Advice only; a failure is ignored.
    pub fn release(&self, name: &str) {
        let Ok(t) = self.info(name) else {
            return;
        };
        let p = &self.parts[t.part];
        // SAFETY: the map is read-only and file-backed, so dropping its pages loses nothing: any
        // later access reads the same bytes from the file again.
        let _ = unsafe {
            p.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                p.data + t.offset,
                t.bytes,
            )
        };
    }

    /// Tensor `name` dequantized to f32, values in file order (innermost dim fastest).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        let mut out = vec![0.0f32; t.len()];
        t.kind.dequantize(self.bytes(name)?, &mut out);
        Ok(out)
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
            })
    }
}

/// The config of the GGUF model at `path` and its tensors as a store in mlx-lm's layout (see
/// [`tensors`]).
pub fn load(path: &Path) -> Result<(ModelConfig, WeightStore)> {
    load_with_progress(path, &mut |_| {})
}

/// The model config of GGUF file `f` and its tensors as loading would list them
/// ([`tensors::summary`]: from the tensor table, nothing unpacked).
pub fn summary(f: &GgufFile) -> Result<(ModelConfig, Vec<crate::weights::TensorInfo>)> {
    let c = config::config(f)?;
    let t = tensors::summary(f, &c)?;
    Ok((c, t))
}

/// [`load`], reporting each tensor as it is unpacked.
pub fn load_with_progress(
    path: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<(ModelConfig, WeightStore)> {
    let f = GgufFile::open(path)?;
    let c = config::config(&f)?;
    let t = tensors::tensors(&f, &c, progress)?;
    Ok((c, WeightStore::from_tensors(path, t, Layout::Mlx)))
}
