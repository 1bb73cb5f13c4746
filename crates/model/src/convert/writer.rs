//! Sharded safetensors output for `convert`, written with bounded memory.
//!
//! Jobs go to shards in plan order, a new shard starting when the next job would push the
//! current one past the size limit (a single job larger than the limit gets a shard of its
//! own). Within a shard the 4-byte tensors (U32 words, F32) come first and the 2-byte ones
//! after, and the header is padded to a multiple of 8 bytes, so every tensor's data is aligned
//! for its dtype and loads by memory map without copies. The header is computed from the shapes
//! up front; each job then reads its source rows a block at a time from the memory map and
//! writes its outputs at their offsets in the file.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use deltamoe_compute::cpu::quant::quantize;
use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::fp8::quantize_blocks;
use deltamoe_compute::{Tensor, TensorData};
use serde_json::{json, Map, Value};

use super::fp8::FP8_BLOCK;
use super::gptq::quantize_gptq;
use super::{write_json, Job, OutTensor, Part, Plan};
use crate::error::{ModelError, Result};
use crate::fp8::load_fp8;
use crate::gptq::{load_gptq, logical_shape};
use crate::weights::WeightStore;
use crate::Progress;

/// Rows per block: about this many bytes of f32.
const BLOCK_BYTES: usize = 64 << 20;

fn job_outputs(job: &Job) -> Vec<usize> {
    match job {
        Job::Dense { out, .. } => vec![*out],
        Job::Quantize { out, .. } => out.to_vec(),
        Job::Fp8 { out, .. } => out.to_vec(),
        Job::Gptq { out, .. } => out.to_vec(),
    }
}

fn job_parts(job: &Job) -> (&[Part], usize) {
    match job {
        Job::Dense { parts, cols, .. } | Job::Quantize { parts, cols, .. } => (parts, *cols),
        Job::Fp8 { part, cols, .. } | Job::Gptq { part, cols, .. } => {
            (std::slice::from_ref(part), *cols)
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        err: source,
    }
}

/// One shard: its jobs (indices into the plan) and each output's data offset.
struct Shard {
    jobs: Vec<usize>,
    offsets: Vec<(usize, u64)>,
    data_len: u64,
}

fn assign(plan: &Plan, max: u64) -> Vec<Shard> {
    let mut shards: Vec<Vec<usize>> = vec![];
    let mut cur = u64::MAX;
    for (j, job) in plan.jobs.iter().enumerate() {
        let bytes: u64 = job_outputs(job)
            .iter()
            .map(|&o| plan.outs[o].nbytes())
            .sum();
        if shards.is_empty() || (cur > 0 && cur + bytes > max) {
            shards.push(vec![]);
            cur = 0;
        }
        if let Some(s) = shards.last_mut() {
            s.push(j);
        }
        cur += bytes;
    }
    shards
        .into_iter()
        .map(|jobs| {
            let mut outs: Vec<usize> = jobs
                .iter()
                .flat_map(|&j| job_outputs(&plan.jobs[j]))
                .collect();
            // Wider dtypes first so every tensor is aligned for its dtype.
            outs.sort_by_key(|&o| (std::cmp::Reverse(plan.outs[o].elem_bytes()), o));
            let mut offsets = Vec::with_capacity(outs.len());
            let mut at = 0u64;
            for o in outs {
                offsets.push((o, at));
                at += plan.outs[o].nbytes();
            }
            Shard {
                jobs,
                offsets,
                data_len: at,
            }
        })
        .collect()
}

fn header(outs: &[OutTensor], shard: &Shard) -> Vec<u8> {
    let entries = shard.offsets.iter().map(|&(o, off)| {
        let t = &outs[o];
        (
            t.name.as_str(),
            t.dtype,
            t.shape.as_slice(),
            off,
            off + t.nbytes(),
        )
    });
    safetensors_header(entries.collect())
}

/// A safetensors header (without its 8-byte length) for `(name, dtype, shape, start, end)`
/// entries, listed by name, padded with spaces so the data starts 8-byte aligned.
pub(crate) fn safetensors_header(mut entries: Vec<(&str, &str, &[usize], u64, u64)>) -> Vec<u8> {
    entries.sort_by(|a, b| a.0.cmp(b.0));
    let mut m = Map::new();
    m.insert("__metadata__".into(), json!({"format": "mlx"}));
    for (name, dtype, shape, start, end) in entries {
        m.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, end]}),
        );
    }
    let mut h = Value::Object(m).to_string().into_bytes();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    h
}

/// The file name of shard `i` of `n`.
pub(crate) fn shard_name(i: usize, n: usize) -> String {
    match n {
        1 => "model.safetensors".to_string(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
    }
}

/// `model.safetensors.index.json`: each tensor's shard (listed by name) and the data bytes of
/// all shards.
pub(crate) fn write_index(
    dst: &Path,
    weight_map: Map<String, Value>,
    total_size: u64,
) -> Result<()> {
    let mut sorted: Vec<(String, Value)> = weight_map.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let index =
        json!({"metadata": {"total_size": total_size}, "weight_map": Map::from_iter(sorted)});
    write_json(&dst.join("model.safetensors.index.json"), &index)
}

/// Write every shard and the index; returns (shards, source bytes, output bytes).
pub(crate) fn write_shards(
    store: &WeightStore,
    plan: &Plan,
    dst: &Path,
    max_shard: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<(usize, u64, u64)> {
    let shards = assign(plan, max_shard);
    let n = shards.len();
    let file_name = |i: usize| shard_name(i, n);
    let mut src_bytes = 0u64;
    for job in &plan.jobs {
        let (parts, cols) = job_parts(job);
        for p in parts {
            src_bytes += (p.rows * cols * file_elem_bytes(store, &p.src)?) as u64;
        }
    }
    let mut ctx = Ctx {
        store,
        plan,
        progress,
        done: 0,
        total: src_bytes,
    };
    let mut weight_map = Map::new();
    let mut total_size = 0u64;
    let mut bytes_out = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let path = dst.join(file_name(i));
        let h = header(&plan.outs, shard);
        let base = 8 + h.len() as u64;
        let mut f = File::create(&path).map_err(io_err(&path))?;
        f.set_len(base + shard.data_len).map_err(io_err(&path))?;
        f.write_all(&(h.len() as u64).to_le_bytes())
            .and_then(|_| f.write_all(&h))
            .map_err(io_err(&path))?;
        let mut out = ShardFile {
            f,
            path: &path,
            base,
            offsets: &shard.offsets,
        };
        for &j in &shard.jobs {
            ctx.run(&plan.jobs[j], &mut out)?;
        }
        out.f.sync_all().map_err(io_err(&path))?;
        for (o, _) in &shard.offsets {
            weight_map.insert(plan.outs[*o].name.clone(), file_name(i).into());
        }
        total_size += shard.data_len;
        bytes_out += base + shard.data_len;
    }
    write_index(dst, weight_map, total_size)?;
    Ok((n, src_bytes, bytes_out))
}

/// Bytes an element of source tensor `name` takes in its file (progress counts file bytes).
fn file_elem_bytes(store: &WeightStore, name: &str) -> Result<usize> {
    if gptq_module(store, name).is_some() {
        return Ok(1);
    }
    match store.fp8_codes(name) {
        Some(_) => Ok(1),
        None => Ok(source(store, name)?.dtype().size()),
    }
}

/// The module and `[out, in]` of `name` when it is the logical `.weight` of a GPTQ/AWQ linear.
fn gptq_module<'a>(store: &WeightStore, name: &'a str) -> Option<(&'a str, [usize; 2])> {
    let m = name.strip_suffix(".weight")?;
    Some((m, logical_shape(store, m)?))
}

/// Tensor `name` of the source: as stored, or for an FP8 or GPTQ/AWQ weight its f32
/// dequantization.
fn source(store: &WeightStore, name: &str) -> Result<Tensor> {
    if let Some((m, [out, inp])) = gptq_module(store, name) {
        if let Some(w) = load_gptq(store, m, out, inp)? {
            return Ok(Tensor::from_f32(vec![out, inp], w.dequantize()));
        }
    }
    let shape = store.shape_of(name).unwrap_or_default();
    if let (Some(module), [out, inp]) = (name.strip_suffix(".weight"), shape.as_slice()) {
        if let Some(w) = load_fp8(store, module, &[], *out, *inp)? {
            return Ok(Tensor::from_f32(shape.clone(), w[0].dequantize()));
        }
    }
    store.get(name, &shape)
}

struct ShardFile<'a> {
    f: File,
    path: &'a Path,
    base: u64,
    offsets: &'a [(usize, u64)],
}

impl ShardFile<'_> {
    /// Write `bytes` at byte `at` of output tensor `out`'s data.
    fn write(&mut self, out: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let off = self
            .offsets
            .iter()
            .find(|(o, _)| *o == out)
            .map_or(0, |(_, off)| *off);
        self.f
            .seek(SeekFrom::Start(self.base + off + at))
            .and_then(|_| self.f.write_all(bytes))
            .map_err(io_err(self.path))
    }
}

/// f32 values to little-endian bytes of a safetensors dtype (round to nearest even).
pub(crate) fn encode(vals: &[f32], dtype: &str) -> Vec<u8> {
    match dtype {
        "BF16" => vals
            .iter()
            .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
            .collect(),
        "F16" => vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Elements `a..b` of a tensor as their stored little-endian bytes.
pub(crate) fn raw(data: &TensorData, a: usize, b: usize) -> Vec<u8> {
    match data {
        TensorData::BF16(s) => s[a..b]
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        TensorData::F16(s) => s[a..b]
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        TensorData::F32(s) => s[a..b].iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

struct Ctx<'a> {
    store: &'a WeightStore,
    plan: &'a Plan,
    progress: &'a mut dyn FnMut(Progress),
    done: u64,
    total: u64,
}

impl Ctx<'_> {
    fn run(&mut self, job: &Job, out: &mut ShardFile) -> Result<()> {
        let (parts, cols) = job_parts(job);
        let mut block = (BLOCK_BYTES / (cols * 4)).max(1);
        if let Job::Fp8 { .. } = job {
            // Whole block rows: each chunk's scales are its own.
            block = block.next_multiple_of(FP8_BLOCK[0]);
        }
        if let Job::Gptq { .. } = job {
            // Whole matrices: GPTQ's layout is transposed.
            block = usize::MAX;
        }
        let mut row = 0usize; // output row (across parts)
        for p in parts {
            let t = source(self.store, &p.src)?;
            let data = t.data();
            let el_in = file_elem_bytes(self.store, &p.src)?;
            let mut r = 0;
            while r < p.rows {
                let n = block.min(p.rows - r);
                let (a, b) = ((p.row0 + r) * cols, (p.row0 + r + n) * cols);
                match job {
                    Job::Dense {
                        add_one, out: o, ..
                    } => {
                        let dtype = self.plan.outs[*o].dtype;
                        let bytes = if *add_one || t.dtype().name() != dtype {
                            let mut v = vec![0.0f32; b - a];
                            data.read_f32(a, &mut v);
                            if *add_one {
                                v.iter_mut().for_each(|x| *x += 1.0);
                            }
                            encode(&v, dtype)
                        } else {
                            raw(&data, a, b)
                        };
                        let el = if dtype.ends_with("16") { 2 } else { 4 };
                        out.write(*o, (row * cols * el) as u64, &bytes)?;
                    }
                    Job::Quantize {
                        spec,
                        out: [w, s, bi],
                        ..
                    } => {
                        let mut v = vec![0.0f32; b - a];
                        data.read_f32(a, &mut v);
                        let q = quantize(&v, cols, spec.group_size, spec.bits).map_err(|e| {
                            ModelError::Quant {
                                name: p.src.clone(),
                                file: self.store.file_of(&p.src),
                                msg: format!(
                                    "cannot quantize rows {}..{}: {e}",
                                    p.row0 + r,
                                    p.row0 + r + n
                                ),
                            }
                        })?;
                        let wpr = cols * spec.bits as usize / 32;
                        let gpr = cols / spec.group_size;
                        let dtype = self.plan.outs[*s].dtype;
                        let el = if dtype.ends_with("16") { 2 } else { 4 };
                        let words: Vec<u8> = q.words.iter().flat_map(|x| x.to_le_bytes()).collect();
                        out.write(*w, (row * wpr * 4) as u64, &words)?;
                        out.write(*s, (row * gpr * el) as u64, &encode(&q.scales, dtype))?;
                        out.write(*bi, (row * gpr * el) as u64, &encode(&q.biases, dtype))?;
                    }
                    Job::Fp8 {
                        out: [codes, scales],
                        ..
                    } => {
                        let mut v = vec![0.0f32; b - a];
                        data.read_f32(a, &mut v);
                        let (c, s) = quantize_blocks(&v, cols, FP8_BLOCK);
                        let gc = cols.div_ceil(FP8_BLOCK[1]);
                        out.write(*codes, (row * cols) as u64, &c)?;
                        let at = (row / FP8_BLOCK[0] * gc * 4) as u64;
                        let sb: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
                        out.write(*scales, at, &sb)?;
                    }
                    Job::Gptq {
                        group,
                        out: [qw, qz, sc, gi],
                        ..
                    } => {
                        let mut v = vec![0.0f32; b - a];
                        data.read_f32(a, &mut v);
                        let g = quantize_gptq(&v, n, cols, *group);
                        let le = |w: &[u32]| -> Vec<u8> {
                            w.iter().flat_map(|x| x.to_le_bytes()).collect()
                        };
                        out.write(*qw, 0, &le(&g.qweight))?;
                        out.write(*qz, 0, &le(&g.qzeros))?;
                        let s: Vec<u8> = g.scales.iter().flat_map(|x| x.to_le_bytes()).collect();
                        out.write(*sc, 0, &s)?;
                        out.write(*gi, 0, &le(&g.g_idx))?;
                    }
                }
                row += n;
                r += n;
                self.done += ((b - a) * el_in) as u64;
                let first = job_outputs(job)[0];
                (self.progress)(Progress {
                    done: self.done,
                    total: self.total,
                    tensor: &self.plan.outs[first].name,
                });
            }
        }
        Ok(())
    }
}
