//! `deltamoe convert --model x.gguf`: a GGUF model (one file or a split one) to an mlx-lm
//! checkpoint directory, tensor by tensor.
//!
//! The tensors are those the GGUF loader gives ([`crate::gguf::tensors`]): mlx-lm's names and
//! layout, llama.cpp's converter undone. Each quantized matrix is written in the affine form it
//! was repacked into, with the same values (`m.weight` uint32 codes, `m.scales` and `m.biases`
//! f32, each module's bits and group size in the config's `quantization` block), or with
//! [`GgufOutput::Bf16`] dequantized to bf16 (one rounding of gguf-py's value). Tensors stored as
//! floats keep their dtype. Q6_K's groups of 16, which deltamoe reads, are below mlx-lm's
//! smallest group of 32.
//!
//! Beside the shards: `config.json` from the metadata ([`ModelConfig::to_hf_json`]),
//! `tokenizer.json`, `tokenizer_config.json` (chat template, BOS and EOS strings) and
//! `generation_config.json` (end ids, recommended sampling).

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use super::writer::{encode, raw, safetensors_header, shard_name, write_index};
use super::{io_err, prepare_dst, write_file, write_json, ConvertReport};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::{config, tensors, vocab, GgufFile};
use crate::weights::Prepared;
use crate::Progress;
use deltamoe_compute::{AffineWeight, Tensor};

/// How a GGUF's quantized matrices are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufOutput {
    /// In the affine form, exactly.
    Affine,
    /// Dequantized to bf16.
    Bf16,
}

/// One output tensor with its bytes.
struct Out {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Convert the GGUF model at `src` (a .gguf file, the first part of a split one) into `dst`
/// (created; must not exist or be empty), shards of at most `max_shard_bytes`.
pub fn convert_gguf(
    src: &Path,
    dst: &Path,
    output: GgufOutput,
    max_shard_bytes: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<ConvertReport> {
    let f = GgufFile::open(src)?;
    let c = config::config(&f)?;
    let v = vocab::vocab(&f)?;
    prepare_dst(dst)?;
    let written = write_tensors(&f, &c, dst, output, max_shard_bytes, progress);
    let (report, quant) = match written {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_dir_all(dst);
            return Err(e);
        }
    };
    let mut root = c.to_hf_json();
    if let (Some(obj), Some(q)) = (root.as_object_mut(), quant) {
        obj.insert("quantization".into(), q.clone());
        obj.insert("quantization_config".into(), q);
    }
    write_json(&dst.join("config.json"), &root)?;
    write_file(&dst.join("tokenizer.json"), v.tokenizer_json.as_bytes())?;
    let mut tok = Map::new();
    tok.insert("tokenizer_class".into(), "Qwen2Tokenizer".into());
    let strings = [
        ("chat_template", &v.chat_template),
        ("bos_token", &v.bos_token),
        ("eos_token", &v.eos_token),
    ];
    for (k, s) in strings {
        if let Some(s) = s {
            tok.insert(k.into(), s.clone().into());
        }
    }
    write_json(&dst.join("tokenizer_config.json"), &Value::Object(tok))?;
    let mut gen = Map::new();
    gen.insert("eos_token_id".into(), v.eos_ids.clone().into());
    if let Some(id) = v.bos_id {
        gen.insert("bos_token_id".into(), id.into());
    }
    if let Some(s) = &v.sampling {
        gen.insert("do_sample".into(), true.into());
        let numbers = [
            ("temperature", s.temperature),
            ("top_p", s.top_p),
            ("min_p", s.min_p),
            ("repetition_penalty", s.repetition_penalty),
        ];
        for (k, x) in numbers {
            if let Some(x) = x {
                gen.insert(k.into(), f64::from(x).into());
            }
        }
        if let Some(k) = s.top_k {
            gen.insert("top_k".into(), k.into());
        }
    }
    write_json(&dst.join("generation_config.json"), &Value::Object(gen))?;
    let copied = [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ];
    Ok(ConvertReport {
        copied: copied.map(String::from).to_vec(),
        ..report
    })
}

/// Every tensor of `f` into shards in `dst`; the report and the `quantization` block (`None`
/// when nothing is quantized).
fn write_tensors(
    f: &GgufFile,
    c: &ModelConfig,
    dst: &Path,
    output: GgufOutput,
    max_shard_bytes: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<(ConvertReport, Option<Value>)> {
    let nested = matches!(c.model_type.as_str(), "qwen3_5_moe" | "qwen3_5");
    let total: u64 = f.tensors.values().map(|t| t.bytes as u64).sum();
    let mut shards = Shards::new(dst, max_shard_bytes);
    let mut quant = Map::new();
    let mut report = ConvertReport {
        tensors_in: f.tensors.len(),
        bytes_in: total,
        ..ConvertReport::default()
    };
    tensors::each_tensor(f, c, progress, &mut |to, t| {
        let to = if nested {
            format!("language_model.{to}")
        } else {
            to
        };
        let module = to.strip_suffix(".weight").unwrap_or(&to).to_string();
        let outs = match t {
            Prepared::Affine(w, shape) if output == GgufOutput::Affine => {
                let spec = json!({"group_size": w.group_size(), "bits": w.bits()});
                quant.insert(module.clone(), spec);
                report.quantized_modules += 1;
                affine_outs(&module, &w, shape)
            }
            Prepared::Affine(w, shape) => {
                report.dense_modules += 1;
                vec![Out {
                    name: to,
                    dtype: "BF16",
                    bytes: encode(&w.dequantize(), "BF16"),
                    shape,
                }]
            }
            Prepared::Dense(t) => {
                if t.shape().len() >= 2 && !to.ends_with("conv1d.weight") {
                    quant.insert(module, false.into());
                    report.dense_modules += 1;
                }
                vec![dense_out(to, &t)]
            }
        };
        for o in outs {
            report.bytes_out += o.bytes.len() as u64;
            report.tensors_out += 1;
            shards.push(o)?;
        }
        Ok(())
    })?;
    report.shards = shards.finish()?;
    let q = (report.quantized_modules > 0).then(|| quant_block(quant));
    Ok((report, q))
}

/// The `quantization` block: the first quantized module's bits and group as the default, an
/// entry for every linear module.
fn quant_block(mut modules: Map<String, Value>) -> Value {
    let first = modules.values().find(|v| v.is_object()).cloned();
    let mut q = Map::new();
    if let Some(Value::Object(d)) = first {
        q.extend(d);
    }
    q.insert("mode".into(), "affine".into());
    q.append(&mut modules);
    Value::Object(q)
}

/// An affine weight of logical `shape` as mlx-lm's three tensors.
fn affine_outs(module: &str, w: &AffineWeight, shape: Vec<usize>) -> Vec<Out> {
    let lead = &shape[..shape.len() - 1];
    let with = |last: usize| lead.iter().copied().chain([last]).collect::<Vec<_>>();
    let groups = w.groups_per_row();
    let f32_bytes = |t: &Tensor| {
        t.to_f32_vec()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    };
    vec![
        Out {
            name: format!("{module}.weight"),
            dtype: "U32",
            shape: with(w.words_per_row()),
            bytes: w.words().iter().flat_map(|v| v.to_le_bytes()).collect(),
        },
        Out {
            name: format!("{module}.scales"),
            dtype: "F32",
            shape: with(groups),
            bytes: f32_bytes(w.scales()),
        },
        Out {
            name: format!("{module}.biases"),
            dtype: "F32",
            shape: with(groups),
            bytes: f32_bytes(w.biases()),
        },
    ]
}

fn dense_out(name: String, t: &Tensor) -> Out {
    let data = t.data();
    Out {
        name,
        dtype: t.dtype().name(),
        shape: t.shape().to_vec(),
        bytes: raw(&data, 0, t.len()),
    }
}

/// safetensors shards written as they fill: `model-{i}.part` until the count is known, then
/// renamed `model.safetensors` or `model-0000i-of-0000N.safetensors` with an index.
struct Shards {
    dst: PathBuf,
    max: u64,
    open: Vec<Out>,
    open_bytes: u64,
    /// Each written shard's tensor names and byte count.
    written: Vec<(Vec<String>, u64)>,
}

impl Shards {
    fn new(dst: &Path, max: u64) -> Shards {
        Shards {
            dst: dst.to_path_buf(),
            max,
            open: Vec::new(),
            open_bytes: 0,
            written: Vec::new(),
        }
    }

    fn push(&mut self, o: Out) -> Result<()> {
        if !self.open.is_empty() && self.open_bytes + o.bytes.len() as u64 > self.max {
            self.flush()?;
        }
        self.open_bytes += o.bytes.len() as u64;
        self.open.push(o);
        Ok(())
    }

    fn part(&self, i: usize) -> PathBuf {
        self.dst.join(format!("model-{i}.part"))
    }

    fn flush(&mut self) -> Result<()> {
        let mut open = std::mem::take(&mut self.open);
        open.sort_by(|a, b| a.name.cmp(&b.name));
        let mut at = 0u64;
        let mut entries = Vec::with_capacity(open.len());
        for o in &open {
            let end = at + o.bytes.len() as u64;
            entries.push((o.name.as_str(), o.dtype, o.shape.as_slice(), at, end));
            at = end;
        }
        let h = safetensors_header(entries);
        let path = self.part(self.written.len());
        let mut bytes = Vec::with_capacity(8 + h.len() + at as usize);
        bytes.extend((h.len() as u64).to_le_bytes());
        bytes.extend(h);
        for o in &open {
            bytes.extend(&o.bytes);
        }
        write_file(&path, &bytes)?;
        let names = open.into_iter().map(|o| o.name).collect();
        self.written.push((names, at));
        self.open_bytes = 0;
        Ok(())
    }

    /// Write the last shard, name them all and write the index; the shard count.
    fn finish(mut self) -> Result<usize> {
        if !self.open.is_empty() || self.written.is_empty() {
            self.flush()?;
        }
        let n = self.written.len();
        let mut map = Map::new();
        for (i, (names, _)) in self.written.iter().enumerate() {
            let file = shard_name(i, n);
            let to = self.dst.join(&file);
            std::fs::rename(self.part(i), &to).map_err(io_err(&to))?;
            for name in names {
                map.insert(name.clone(), file.clone().into());
            }
        }
        if n > 1 {
            let total = self.written.iter().map(|(_, b)| b).sum();
            write_index(&self.dst, map, total)?;
        }
        Ok(n)
    }
}
