//! Routed experts read from the safetensors files with positioned reads (`pread`), for expert
//! offload on the CPU.
//!
//! For each MoE layer and routed expert the store holds where each of its three matrices
//! (gate, up, down) lies in the checkpoint: one byte range for a dense matrix, three (packed
//! words, scales, biases) for an MLX affine-quantized one (packed words, zero points, scales for a
//! GPTQ/AWQ one, repacked when read). Expert `e` of each layout:
//! - per expert: the whole tensors `experts.{e}.{gate,up,down}_proj.weight` (and `.scales`,
//!   `.biases` when quantized);
//! - fused: matrices `2e` (gate) and `2e + 1` (up) of `experts.gate_up_proj [E, 2I, H]` seen as
//!   `2E` matrices `[I, H]`, matrix `e` of `experts.down_proj [E, H, I]`;
//! - mlx-lm stacked: matrix `e` of `switch_mlp.{gate,up,down}_proj.weight` `[E, out, in]`, and
//!   when quantized of its packed words `[E, out, in·bits/32]`, scales and biases
//!   `[E, out, in/group_size]`.
//!
//! The formats (dtype, bits, group size) come from the experts as the loader built them, so a
//! read expert is the same [`LinearWeight`]s over owned buffers instead of the mapping, and runs
//! through the same kernels bit for bit. Files are opened once; reads go straight into the
//! buffers the weights then own.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{AffineWeight, DType, Fp8Weight, PackedWords, Tensor};

use crate::error::{ModelError, Result};
use crate::gptq::{repack, Packing};
use crate::layers::{LinearWeight, Mlp};
use crate::weights::WeightStore;

/// `len` bytes at `offset` of the store's file number `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
}

/// One `[out, inp]` matrix of an expert: its format and where its bytes lie.
#[derive(Clone, Debug, PartialEq)]
pub enum MatrixBytes {
    Dense {
        dtype: DType,
        out: usize,
        inp: usize,
        data: ByteRange,
    },
    Affine {
        bits: u32,
        group_size: usize,
        out: usize,
        inp: usize,
        /// Dtype of the scales and biases.
        dtype: DType,
        words: ByteRange,
        scales: ByteRange,
        biases: ByteRange,
    },
    /// GPTQ/AWQ: repacked into the affine form when read ([`crate::gptq::repack`]).
    Gptq {
        packing: (Packing, u32),
        out: usize,
        inp: usize,
        groups: usize,
        /// Dtype of the scales.
        dtype: DType,
        qweight: ByteRange,
        qzeros: ByteRange,
        scales: ByteRange,
    },
    Fp8 {
        out: usize,
        inp: usize,
        block: [usize; 2],
        /// Dtype of the scales.
        dtype: DType,
        codes: ByteRange,
        scales: ByteRange,
    },
}

impl MatrixBytes {
    fn ranges(&self) -> Vec<ByteRange> {
        match self {
            MatrixBytes::Dense { data, .. } => vec![*data],
            MatrixBytes::Affine {
                words,
                scales,
                biases,
                ..
            } => vec![*words, *scales, *biases],
            MatrixBytes::Fp8 { codes, scales, .. } => vec![*codes, *scales],
            MatrixBytes::Gptq {
                qweight,
                qzeros,
                scales,
                ..
            } => vec![*qweight, *qzeros, *scales],
        }
    }
}

/// The three matrices of one routed expert.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertBytes {
    pub gate: MatrixBytes,
    pub up: MatrixBytes,
    pub down: MatrixBytes,
}

impl ExpertBytes {
    /// Every byte range, in the order gate, up, down.
    pub fn ranges(&self) -> Vec<ByteRange> {
        [&self.gate, &self.up, &self.down]
            .iter()
            .flat_map(|m| m.ranges())
            .collect()
    }

    /// Bytes one read of the expert moves.
    pub fn len(&self) -> usize {
        self.ranges().iter().map(|r| r.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One MoE layer to index: its prefix (`model.layers.{i}.mlp`) and its routed experts as
/// [`crate::layers::Moe::load`] built them from the same store.
pub struct MoeLayer<'a> {
    pub prefix: String,
    pub experts: &'a [Mlp],
}

/// The checkpoint files and, per indexed MoE layer, the byte ranges of every routed expert.
#[derive(Debug)]
pub struct ExpertStore {
    files: Vec<(PathBuf, File)>,
    layers: Vec<Vec<ExpertBytes>>,
}

impl ExpertStore {
    /// Index the experts of `layers` (in order: layer `k` of the store is `layers[k]`) and open
    /// the files holding them.
    pub fn open(store: &WeightStore, layers: &[MoeLayer]) -> Result<ExpertStore> {
        let mut ix = Indexer {
            store,
            files: Vec::new(),
        };
        let layers = layers
            .iter()
            .map(|l| ix.layer(l))
            .collect::<Result<Vec<_>>>()?;
        let files = ix
            .files
            .into_iter()
            .map(|path| match File::open(&path) {
                Ok(f) => Ok((path, f)),
                Err(source) => Err(ModelError::Io { path, err: source }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertStore { files, layers })
    }

    /// The experts of indexed layer `layer`.
    pub fn layer(&self, layer: usize) -> &[ExpertBytes] {
        &self.layers[layer]
    }

    /// The file of [`ByteRange::file`] `file`.
    pub fn file(&self, file: usize) -> &std::path::Path {
        &self.files[file].0
    }

    /// The error for expert weights of `file` that do not form a matrix.
    fn bad_expert(&self, file: usize, e: impl std::fmt::Display) -> ModelError {
        ModelError::Input(format!(
            "{}: expert weights: {e}",
            self.file(file).display()
        ))
    }

    /// Read expert `expert` of indexed layer `layer` into owned weights.
    pub fn read(&self, layer: usize, expert: usize) -> Result<Mlp> {
        let b = &self.layers[layer][expert];
        Ok(Mlp::from_weights(
            self.matrix(&b.gate)?,
            self.matrix(&b.up)?,
            self.matrix(&b.down)?,
        ))
    }

    fn matrix(&self, m: &MatrixBytes) -> Result<LinearWeight> {
        match *m {
            MatrixBytes::Dense {
                dtype,
                out,
                inp,
                data,
            } => Ok(self.tensor(dtype, vec![out, inp], data)?.into()),
            MatrixBytes::Affine {
                bits,
                group_size,
                out,
                inp,
                dtype,
                words,
                scales,
                biases,
            } => {
                let groups = vec![out, inp / group_size];
                let w = AffineWeight::new(
                    bits,
                    group_size,
                    out,
                    inp,
                    PackedWords::from_vec(self.read_range(words)?),
                    self.tensor(dtype, groups.clone(), scales)?,
                    self.tensor(dtype, groups, biases)?,
                )
                .map_err(|e| self.bad_expert(words.file, e))?;
                Ok(w.into())
            }
            MatrixBytes::Gptq {
                packing,
                out,
                inp,
                groups,
                dtype,
                qweight,
                qzeros,
                scales,
            } => {
                let w = repack(
                    packing,
                    [out, inp],
                    &self.read_range::<u32>(qweight)?,
                    &self.read_range::<u32>(qzeros)?,
                    &self.tensor(dtype, vec![groups, out], scales)?,
                )
                .map_err(|e| self.bad_expert(qweight.file, e))?;
                Ok(w.into())
            }
            MatrixBytes::Fp8 {
                out,
                inp,
                block,
                dtype,
                codes,
                scales,
            } => {
                let grid = vec![out.div_ceil(block[0]), inp.div_ceil(block[1])];
                let w = Fp8Weight::new(
                    out,
                    inp,
                    block,
                    Bytes::from_vec(self.read_range(codes)?),
                    self.tensor(dtype, grid, scales)?.to_f32_vec(),
                    dtype,
                )
                .map_err(|e| self.bad_expert(codes.file, e))?;
                Ok(w.into())
            }
        }
    }

    fn tensor(&self, dtype: DType, shape: Vec<usize>, r: ByteRange) -> Result<Tensor> {
        Ok(match dtype {
            DType::F32 => Tensor::from_f32(shape, self.read_range(r)?),
            DType::BF16 | DType::F16 => Tensor::from_half_bits(dtype, shape, self.read_range(r)?),
        })
    }

    /// The bytes of `r` as little-endian values of `T`, read straight into the buffer.
    fn read_range<T: bytemuck::Pod>(&self, r: ByteRange) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); r.len / std::mem::size_of::<T>()];
        let (path, file) = &self.files[r.file];
        file.read_exact_at(bytemuck::cast_slice_mut(&mut v), r.offset)
            .map_err(|source| ModelError::Io {
                path: path.clone(),
                err: source,
            })?;
        Ok(v)
    }
}

/// Computes byte ranges from the store's tensor locations, numbering files as it meets them.
struct Indexer<'a> {
    store: &'a WeightStore,
    files: Vec<PathBuf>,
}

impl Indexer<'_> {
    fn layer(&mut self, l: &MoeLayer) -> Result<Vec<ExpertBytes>> {
        let p = &l.prefix;
        let switch = format!("{p}.switch_mlp");
        let fused = format!("{p}.experts.gate_up_proj");
        let mut out = Vec::with_capacity(l.experts.len());
        for (e, x) in l.experts.iter().enumerate() {
            let (gate, up, down) = (&x.gate.weight, &x.up.weight, &x.down.weight);
            let b = if self.store.contains(&format!("{switch}.gate_proj.weight")) {
                ExpertBytes {
                    gate: self.matrix(&format!("{switch}.gate_proj"), true, e, gate)?,
                    up: self.matrix(&format!("{switch}.up_proj"), true, e, up)?,
                    down: self.matrix(&format!("{switch}.down_proj"), true, e, down)?,
                }
            } else if self.store.contains(&fused) {
                ExpertBytes {
                    gate: self.matrix(&fused, false, 2 * e, gate)?,
                    up: self.matrix(&fused, false, 2 * e + 1, up)?,
                    down: self.matrix(&format!("{p}.experts.down_proj"), false, e, down)?,
                }
            } else {
                let m = |proj: &str| format!("{p}.experts.{e}.{proj}");
                ExpertBytes {
                    gate: self.matrix(&m("gate_proj"), true, 0, gate)?,
                    up: self.matrix(&m("up_proj"), true, 0, up)?,
                    down: self.matrix(&m("down_proj"), true, 0, down)?,
                }
            };
            out.push(b);
        }
        Ok(out)
    }

    /// Matrix `index` (counted in matrices of `w`'s size) of `module`: its tensor is
    /// `{module}.weight` when `suffixed` (with `.scales` and `.biases` when quantized), else
    /// `module` itself (fused experts, always dense).
    fn matrix(
        &mut self,
        module: &str,
        suffixed: bool,
        index: usize,
        w: &LinearWeight,
    ) -> Result<MatrixBytes> {
        let [out, inp] = w.shape();
        let weight = if suffixed {
            format!("{module}.weight")
        } else {
            module.to_string()
        };
        match w {
            LinearWeight::Dense(t) => {
                let n = t.nbytes();
                Ok(MatrixBytes::Dense {
                    dtype: t.dtype(),
                    out,
                    inp,
                    data: self.part(&weight, index * n, n)?,
                })
            }
            LinearWeight::Affine(_) if self.store.contains(&format!("{module}.qweight")) => {
                let Some(cfg) = self.store.gptq() else {
                    return Err(ModelError::Input(format!(
                        "`{module}.qweight`: no GPTQ/AWQ quantization block"
                    )));
                };
                let sn = format!("{module}.scales");
                let groups = self.store.shape_of(&sn).map_or(1, |s| s[0]);
                let dtype = self.store.get(&sn, &[groups, out])?.dtype();
                let mut whole = |t: &str| -> Result<ByteRange> {
                    let n = format!("{module}.{t}");
                    let len = self.store.bytes_of(&n).map_or(0, |b| b.len);
                    self.part(&n, 0, len)
                };
                if !suffixed {
                    return Err(ModelError::Input(format!(
                        "`{module}`: GPTQ/AWQ experts must be one tensor each"
                    )));
                }
                Ok(MatrixBytes::Gptq {
                    packing: (cfg.packing, cfg.bits),
                    out,
                    inp,
                    groups,
                    dtype,
                    qweight: whole("qweight")?,
                    qzeros: whole("qzeros")?,
                    scales: whole("scales")?,
                })
            }
            LinearWeight::Affine(a) => {
                let nw = out * a.words_per_row() * 4;
                let ns = out * a.groups_per_row() * a.scales().dtype().size();
                Ok(MatrixBytes::Affine {
                    bits: a.bits(),
                    group_size: a.group_size(),
                    out,
                    inp,
                    dtype: a.scales().dtype(),
                    words: self.part(&weight, index * nw, nw)?,
                    scales: self.part(&format!("{module}.scales"), index * ns, ns)?,
                    biases: self.part(&format!("{module}.biases"), index * ns, ns)?,
                })
            }
            LinearWeight::Fp8(f) => {
                let sn = format!("{module}.weight_scale_inv");
                let ns = f.grid_cols() * out.div_ceil(f.block()[0]) * f.scale_dtype().size();
                if !suffixed || f.scale_rows().1 != 0 {
                    return Err(ModelError::Input(format!(
                        "`{weight}`: FP8 experts read from the files must be one tensor each \
                         (`experts.{{e}}.{{proj}}.weight` with its `weight_scale_inv`)"
                    )));
                }
                Ok(MatrixBytes::Fp8 {
                    out,
                    inp,
                    block: f.block(),
                    dtype: f.scale_dtype(),
                    codes: self.part(&weight, index * out * inp, out * inp)?,
                    scales: self.part(&sn, index * ns, ns)?,
                })
            }
        }
    }

    /// Bytes `start..start + n` of tensor `name`.
    fn part(&mut self, name: &str, start: usize, n: usize) -> Result<ByteRange> {
        let Some(t) = self.store.bytes_of(name) else {
            return Err(ModelError::MissingTensor {
                name: self.store.stored_name(name),
                dir: self.store.dir().to_path_buf(),
            });
        };
        if start + n > t.len {
            return Err(ModelError::Input(format!(
                "tensor `{name}` in {}: holds {} bytes, an expert needs bytes {start}..{}; the \
                 checkpoint does not match its config",
                t.file.display(),
                t.len,
                start + n
            )));
        }
        let file = match self.files.iter().position(|f| *f == t.file) {
            Some(i) => i,
            None => {
                self.files.push(t.file);
                self.files.len() - 1
            }
        };
        Ok(ByteRange {
            file,
            offset: t.offset + start as u64,
            len: n,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use safetensors::Dtype;

    use super::*;
    use crate::checkpoint::moe::load_experts;
    use crate::layers::Products;

    const E: usize = 3;
    const H: usize = 64;
    const I: usize = 32;

    struct Raw {
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    }

    /// `n` values in ±0.5 (scales: in 0.01..0.02) as little-endian f32 or bf16 bytes.
    fn floats(n: usize, dtype: Dtype, seed: u64, scale: bool) -> Vec<u8> {
        let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .flat_map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                let u = (z >> 40) as f32 / (1u64 << 24) as f32;
                let v = if scale { 0.01 + 0.01 * u } else { u - 0.5 };
                match dtype {
                    Dtype::F32 => v.to_le_bytes().to_vec(),
                    _ => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                }
            })
            .collect()
    }

    /// The tensors of a matrix `[lead.., out, inp]` of `module`: `{module}.weight` dense, or
    /// 4-bit words with bf16 scales and biases (group 32) when `quant`.
    fn matrix(
        module: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        dtype: Dtype,
        quant: bool,
    ) -> Vec<Raw> {
        let seed = module.len() as u64 * 31 + out as u64;
        let shape = |last: usize| lead.iter().copied().chain([out, last]).collect::<Vec<_>>();
        let n = |s: &[usize]| s.iter().product::<usize>();
        if !quant {
            let s = shape(inp);
            return vec![Raw {
                name: format!("{module}.weight"),
                dtype,
                data: floats(n(&s), dtype, seed, false),
                shape: s,
            }];
        }
        let (ws, gs) = (shape(inp * 4 / 32), shape(inp / 32));
        let words: Vec<u8> = floats(n(&ws) * 2, Dtype::BF16, seed, false);
        vec![
            Raw {
                name: format!("{module}.weight"),
                dtype: Dtype::U32,
                data: words,
                shape: ws,
            },
            Raw {
                name: format!("{module}.scales"),
                dtype: Dtype::BF16,
                data: floats(n(&gs), Dtype::BF16, seed + 1, true),
                shape: gs.clone(),
            },
            Raw {
                name: format!("{module}.biases"),
                dtype: Dtype::BF16,
                data: floats(n(&gs), Dtype::BF16, seed + 2, false),
                shape: gs,
            },
        ]
    }

    fn write(dir: &Path, tensors: &[Raw]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|t| {
                let v = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data);
                (t.name.clone(), v.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let config = r#"{"quantization": {"group_size": 32, "bits": 4}}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
    }

    /// The checkpoint of one layout: per expert, fused or stacked; dense in `dtype` or quantized.
    fn layout(kind: &str, dtype: Dtype, quant: bool) -> Vec<Raw> {
        let p = "model.layers.0.mlp";
        match kind {
            "per_expert" => (0..E)
                .flat_map(|e| {
                    let m = |proj: &str| format!("{p}.experts.{e}.{proj}");
                    let mut v = matrix(&m("gate_proj"), &[], I, H, dtype, quant);
                    v.extend(matrix(&m("up_proj"), &[], I, H, dtype, quant));
                    v.extend(matrix(&m("down_proj"), &[], H, I, dtype, quant));
                    v
                })
                .collect(),
            "fused" => {
                let mut gu = matrix(
                    &format!("{p}.experts.gate_up_proj"),
                    &[E],
                    2 * I,
                    H,
                    dtype,
                    false,
                );
                let mut d = matrix(&format!("{p}.experts.down_proj"), &[E], H, I, dtype, false);
                for t in gu.iter_mut().chain(d.iter_mut()) {
                    t.name = t.name.trim_end_matches(".weight").to_string();
                }
                gu.into_iter().chain(d).collect()
            }
            _ => {
                let m = |proj: &str| format!("{p}.switch_mlp.{proj}");
                let mut v = matrix(&m("gate_proj"), &[E], I, H, dtype, quant);
                v.extend(matrix(&m("up_proj"), &[E], I, H, dtype, quant));
                v.extend(matrix(&m("down_proj"), &[E], H, I, dtype, quant));
                v
            }
        }
    }

    /// Start of tensor `name` in its file.
    fn base(store: &WeightStore, name: &str) -> u64 {
        store.bytes_of(name).unwrap().offset
    }

    #[test]
    fn ranges_and_reads_match_the_mapped_experts_in_every_layout() {
        let p = "model.layers.0.mlp";
        let cases = [
            ("per_expert", Dtype::F32, false),
            ("per_expert", Dtype::BF16, true),
            ("fused", Dtype::BF16, false),
            ("fused", Dtype::F32, false),
            ("stacked", Dtype::BF16, false),
            ("stacked", Dtype::F32, false),
            ("stacked", Dtype::BF16, true),
        ];
        for (kind, dtype, quant) in cases {
            let name = format!("{kind} {dtype:?} quant {quant}");
            let d = tempfile::tempdir().unwrap();
            write(d.path(), &layout(kind, dtype, quant));
            let store = WeightStore::open(d.path()).unwrap();
            let experts = load_experts(&store, p, E, H, I).unwrap();
            let layer = MoeLayer {
                prefix: p.to_string(),
                experts: &experts,
            };
            let es = ExpertStore::open(&store, &[layer]).unwrap();
            let file = std::fs::read(d.path().join("model.safetensors")).unwrap();
            let sz = if dtype == Dtype::F32 { 4 } else { 2 };
            let x: Vec<f32> = floats(2 * H, Dtype::F32, 9, false)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            for (e, mapped) in experts.iter().enumerate() {
                let b = &es.layer(0)[e];
                let ranges = b.ranges();
                assert_eq!(ranges.len(), if quant { 9 } else { 3 }, "{name}");
                let want_len = mapped.nbytes();
                assert_eq!(b.len(), want_len, "{name} expert {e}");
                for r in &ranges {
                    assert!(r.offset as usize + r.len <= file.len(), "{name}");
                }
                let gate = ranges[0].offset;
                let up = ranges[if quant { 3 } else { 1 }].offset;
                let (g0, u0) = match kind {
                    "per_expert" => {
                        let m = |proj: &str| format!("{p}.experts.{e}.{proj}.weight");
                        (base(&store, &m("gate_proj")), base(&store, &m("up_proj")))
                    }
                    "fused" => {
                        let gu = base(&store, &format!("{p}.experts.gate_up_proj"));
                        let n = (I * H * sz) as u64;
                        (gu + 2 * e as u64 * n, gu + (2 * e as u64 + 1) * n)
                    }
                    _ => {
                        let m = |proj: &str| format!("{p}.switch_mlp.{proj}.weight");
                        let n = (ranges[0].len * e) as u64;
                        (
                            base(&store, &m("gate_proj")) + n,
                            base(&store, &m("up_proj")) + n,
                        )
                    }
                };
                assert_eq!((gate, up), (g0, u0), "{name} expert {e}");
                let read = es.read(0, e).unwrap();
                let (a, w) = (
                    read.forward(&x, 2, Products::Exact),
                    mapped.forward(&x, 2, Products::Exact),
                );
                assert!(
                    a.iter().zip(&w).all(|(a, w)| a.to_bits() == w.to_bits()),
                    "{name} expert {e}: the read expert's output differs from the mapped one"
                );
                assert!(w.iter().any(|v| *v != 0.0), "{name}");
            }
        }
    }

    #[test]
    fn a_truncated_file_fails_naming_it() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &layout("fused", Dtype::BF16, false));
        let store = WeightStore::open(d.path()).unwrap();
        let experts = load_experts(&store, "model.layers.0.mlp", E, H, I).unwrap();
        let layer = MoeLayer {
            prefix: "model.layers.0.mlp".to_string(),
            experts: &experts,
        };
        let es = ExpertStore::open(&store, &[layer]).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.path().join("model.safetensors"))
            .unwrap();
        let ranges = es.layer(0)[E - 1].ranges();
        let end = ranges
            .iter()
            .map(|r| r.offset + r.len as u64)
            .max()
            .unwrap();
        f.set_len(end - 1).unwrap();
        let e = es.read(0, E - 1).unwrap_err().to_string();
        assert!(e.contains("model.safetensors"), "{e}");
    }
}
