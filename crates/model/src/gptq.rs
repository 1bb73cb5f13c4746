//! GPTQ and AWQ int4 checkpoints (AutoGPTQ / GPTQModel / optimum and AutoAWQ "gemm" layouts),
//! repacked at load into the engine's affine form ([`AffineWeight`]) exactly.
//!
//! Config: `quantization_config` (also inside `text_config`, or AutoGPTQ's separate
//! `quantize_config.json`) with `quant_method` "gptq" {bits, group_size (−1: one group per row),
//! sym, desc_act, checkpoint_format "gptq" | "gptq_v2"} or "awq" {bits 4, group_size,
//! zero_point, version "gemm"}. A linear `{m}` is quantized exactly when `{m}.qweight` exists;
//! any other module is read as it is stored.
//!
//! Tensors (K inputs, N outputs, G the group size, P = 32/bits values a word, LSB first):
//! - GPTQ: `qweight` int32 `[K/P, N]` packed along K (value k of column n at bits
//!   `(k % P)·bits` of row `k / P`), `qzeros` int32 `[K/G, N/P]` packed along N the same way,
//!   `scales` f16 `[K/G, N]`, `g_idx` int32 `[K]` (must be `k / G`: act-order permutations are
//!   not supported). The v1 format (`checkpoint_format` "gptq", what the hub holds) stores each
//!   word of zero points minus a one in every slot, as one 32-bit subtraction; v2 stores them
//!   as they are.
//! - AWQ gemm: `qweight` int32 `[K, N/8]` packed along N in the order 0 2 4 6 1 3 5 7 (column
//!   `8j + c` at bits `4·slot(c)` of word `j`), `qzeros` int32 `[K/G, N/8]` the same, `scales`
//!   f16 `[K/G, N]`.
//!
//! In both `w[n, k] = (q[n, k] − z[n, g]) · s[n, g]` with `g = k / G`. The affine form
//! `w = q·scale + bias` holds it exactly with f32 scales `s` and f32 biases `−z·s` (the product
//! of an integer below 2^8 and an f16 is exact in f32). A GPTQ `qweight` is MLX's row layout
//! transposed; AWQ's is re-packed along K. The group size is read off the scales' shape; groups
//! wider than the engine's (e.g. 256, or −1: one per row) are split into groups of 128, 64 or 32
//! that repeat the scale and zero point.

use std::path::{Path, PathBuf};

use deltamoe_compute::{AffineWeight, PackedWords, QuantError, Tensor};
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::quant::{method_block, quant_method, read_json};
use crate::weights::WeightStore;

/// Which packing a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// GPTQ; `v1`: zero points stored minus one.
    Gptq { v1: bool },
    /// AWQ gemm.
    Awq,
}

/// The GPTQ/AWQ `quantization_config` block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GptqConfig {
    pub path: PathBuf,
    pub packing: Packing,
    pub bits: u32,
    /// Inputs a scale covers; `None` for one group per row (`group_size` −1).
    pub group_size: Option<usize>,
}

/// AWQ's slot of column `c` of a group of 8 (the inverse of its order 0 2 4 6 1 3 5 7).
const AWQ_SLOT: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

impl GptqConfig {
    /// The block of a parsed `config.json` when its method is `gptq` or `awq`; `None` for any
    /// other or no block.
    pub fn from_json(root: &Value, path: &Path) -> Result<Option<GptqConfig>> {
        let Some(block) = method_block(root, &["gptq", "awq"]) else {
            return Ok(None);
        };
        GptqConfig::from_block(block, path, "quantization_config.").map(Some)
    }

    /// AutoGPTQ's `quantize_config.json` (GPTQ without `quant_method`).
    pub fn from_quantize_config(dir: &Path) -> Result<Option<GptqConfig>> {
        let path = dir.join("quantize_config.json");
        let Some(block) = read_json(&path)? else {
            return Ok(None);
        };
        GptqConfig::from_block(&block, &path, "").map(Some)
    }

    fn from_block(block: &Value, path: &Path, scope: &str) -> Result<GptqConfig> {
        let err = |key: &str, msg: String| ModelError::Config {
            path: path.to_path_buf(),
            key: format!("{scope}{key}"),
            msg,
        };
        let awq = quant_method(block) == Some("awq");
        let bits = block.get("bits").or_else(|| block.get("w_bit"));
        let bits = match bits.and_then(Value::as_u64) {
            Some(b @ (2 | 4 | 8)) if !awq || b == 4 => b as u32,
            _ => {
                let want = if awq { "4" } else { "2, 4 or 8" };
                return Err(err(
                    "bits",
                    format!(
                        "missing or not {want}; deltamoe reads GPTQ at 2, 4 or 8 bits and AWQ at 4"
                    ),
                ));
            }
        };
        let group = block
            .get("group_size")
            .or_else(|| block.get("q_group_size"));
        let group_size = match group.and_then(Value::as_i64) {
            Some(-1) => None,
            Some(g) if g > 0 && (g % 32 == 0) => Some(g as usize),
            _ => {
                return Err(err(
                    "group_size",
                    "missing or not −1 or a multiple of 32 (e.g. 128)".into(),
                ))
            }
        };
        let packing = if awq {
            let version = block.get("version").and_then(Value::as_str);
            let version = version.unwrap_or("gemm").to_ascii_lowercase();
            if version != "gemm" {
                return Err(err("version", format!("AWQ `{version}` packing is not supported; deltamoe reads AWQ \"gemm\" checkpoints")));
            }
            if block.get("zero_point").and_then(Value::as_bool) == Some(false) {
                return Err(err(
                    "zero_point",
                    "false is not supported; AWQ checkpoints with zero points are read".into(),
                ));
            }
            Packing::Awq
        } else {
            // `desc_act` is not refused here: each `g_idx` is checked at load, and an act-order
            // checkpoint whose groups stayed in input order reads as is.
            let format = block
                .get("checkpoint_format")
                .or_else(|| block.get("format"))
                .and_then(Value::as_str)
                .unwrap_or("gptq");
            match format {
                "gptq" => Packing::Gptq { v1: true },
                "gptq_v2" => Packing::Gptq { v1: false },
                other => {
                    return Err(err(
                        "checkpoint_format",
                        format!(
                            "`{other}` is not supported; deltamoe reads \"gptq\" and \"gptq_v2\""
                        ),
                    ))
                }
            }
        };
        Ok(GptqConfig {
            path: path.to_path_buf(),
            packing,
            bits,
            group_size,
        })
    }
}

/// The GPTQ/AWQ weight of `prefix` when `{prefix}.qweight` exists, repacked into the affine form
/// (`[out, inp]`).
pub(crate) fn load_gptq(
    store: &WeightStore,
    prefix: &str,
    out: usize,
    inp: usize,
) -> Result<Option<AffineWeight>> {
    let name = |t: &str| format!("{prefix}.{t}");
    let (qn, zn, sn, gn) = (
        name("qweight"),
        name("qzeros"),
        name("scales"),
        name("g_idx"),
    );
    if !store.contains(&qn) {
        return Ok(None);
    }
    let qerr = |t: &str, msg: String| ModelError::Quant {
        name: store.stored_name(t),
        file: store.file_of(t),
        msg,
    };
    let Some(cfg) = store.gptq() else {
        return Err(qerr(&qn, "exists, but config.json has no GPTQ or AWQ `quantization_config` (quant_method \"gptq\" or \"awq\")".into()));
    };
    let bits = cfg.bits as usize;
    let pack = 32 / bits;
    // The group size is read off the scales (GPTQModel's `dynamic` overrides it per module).
    let groups = match store.shape_of(&sn).as_deref() {
        Some([gr, _]) => *gr,
        _ => cfg.group_size.map_or(1, |g| inp.div_ceil(g)),
    };
    let g = inp / groups.max(1);
    if groups == 0 || !inp.is_multiple_of(groups) || engine_group(g).is_none() {
        return Err(qerr(&sn, format!("has {groups} groups for {inp} inputs: deltamoe reads whole groups of a multiple of 32 inputs (config group_size {:?} in {})", cfg.group_size, cfg.path.display())));
    }
    let (qshape, zshape) = match cfg.packing {
        Packing::Gptq { .. } => ([inp / pack, out], [groups, out / pack]),
        Packing::Awq => ([inp, out / pack], [groups, out / pack]),
    };
    if !inp.is_multiple_of(pack) || !out.is_multiple_of(pack) {
        return Err(qerr(&qn, format!("[out, in] = [{out}, {inp}] is not a multiple of {pack} in both dims, as {bits}-bit packing needs")));
    }
    let qweight = ints(store, &qn, &qshape)?;
    let qzeros = ints(store, &zn, &zshape)?;
    let scales = store.get(&sn, &[groups, out])?;
    if let Packing::Gptq { .. } = cfg.packing {
        if store.contains(&gn) {
            let g_idx = ints(store, &gn, &[inp])?;
            check_g_idx(&g_idx.to_slice(), g).map_err(|m| qerr(&gn, m))?;
        }
    }
    let w = repack(
        (cfg.packing, cfg.bits),
        [out, inp],
        &qweight.to_slice(),
        &qzeros.to_slice(),
        &scales,
    );
    w.map(Some).map_err(|e| qerr(&qn, e.to_string()))
}

/// A GPTQ/AWQ matrix `[out, inp]` in the affine form, from its packed words, zero-point words
/// and scales `[groups, out]` (layouts in the module doc; shapes checked by the caller).
pub(crate) fn repack(
    (packing, bits): (Packing, u32),
    [out, inp]: [usize; 2],
    qweight: &[u32],
    qzeros: &[u32],
    scales: &Tensor,
) -> std::result::Result<AffineWeight, QuantError> {
    let groups = scales.len() / out;
    let g = inp / groups;
    let zeros = unpack_zeros(qzeros, (packing, bits), out, groups);
    let words = match packing {
        Packing::Gptq { .. } => transpose(qweight, inp * bits as usize / 32, out),
        Packing::Awq => awq_rows(qweight, out, inp),
    };
    let f16_exact = scales.dtype() == deltamoe_compute::DType::F16;
    let (s, b, eg) = group_params(&scales.to_f32_vec(), &zeros, out, inp, g);
    let w = AffineWeight::new(
        bits,
        eg,
        out,
        inp,
        PackedWords::from_vec(words),
        Tensor::from_f32(vec![out, inp / eg], s),
        Tensor::from_f32(vec![out, inp / eg], b),
    )?;
    Ok(if f16_exact { w.with_zero_points() } else { w })
}

/// `[out, in]` of the GPTQ/AWQ linear `module` (`None` when it has no `qweight`, or the store
/// no GPTQ/AWQ config).
pub(crate) fn logical_shape(store: &WeightStore, module: &str) -> Option<[usize; 2]> {
    let cfg = store.gptq()?;
    let q = store.shape_of(&format!("{module}.qweight"))?;
    let [rows, cols] = q.as_slice() else {
        return None;
    };
    Some(match cfg.packing {
        Packing::Gptq { .. } => [*cols, rows * 32 / cfg.bits as usize],
        Packing::Awq => [cols * 8, *rows],
    })
}

/// The store's tensor names and shapes as a dense checkpoint would have them, sorted: each
/// GPTQ/AWQ linear `m` as `m.weight` `[out, in]`, its packed tensors, zero points, scales and
/// group indices left out.
pub(crate) fn logical_names(store: &WeightStore) -> Vec<(String, Vec<usize>)> {
    let packed = |m: &str| store.contains(&format!("{m}.qweight"));
    let mut v: Vec<(String, Vec<usize>)> = store
        .names()
        .filter_map(|n| {
            if let Some(m) = n.strip_suffix(".qweight") {
                let shape = logical_shape(store, m).map_or_else(Vec::new, |s| s.to_vec());
                return Some((format!("{m}.weight"), shape));
            }
            let aux = [".qzeros", ".scales", ".g_idx"]
                .iter()
                .any(|s| n.strip_suffix(s).is_some_and(packed));
            (!aux).then(|| (n.to_string(), store.shape_of(n).unwrap_or_default()))
        })
        .collect();
    v.sort();
    v
}

/// The int32 tensor `name` (as `u32` bits), which must have `shape`.
fn ints(store: &WeightStore, name: &str, shape: &[usize]) -> Result<PackedWords> {
    let Some((w, found)) = store.ints(name) else {
        if !store.contains(name) {
            return Err(ModelError::MissingTensor {
                name: store.stored_name(name),
                dir: store.dir().to_path_buf(),
            });
        }
        return Err(ModelError::Quant {
            name: store.stored_name(name),
            file: store.file_of(name),
            msg: "is not int32; GPTQ/AWQ packed tensors are int32".into(),
        });
    };
    if found != shape {
        return Err(ModelError::Shape {
            name: store.stored_name(name),
            file: store.file_of(name),
            expected: shape.to_vec(),
            found: found.to_vec(),
        });
    }
    Ok(w)
}

/// `g_idx` must put input `k` in group `k / g`: act-order checkpoints permute it.
fn check_g_idx(g_idx: &[u32], g: usize) -> std::result::Result<(), String> {
    match g_idx.iter().enumerate().find(|(k, &v)| v as usize != k / g) {
        None => Ok(()),
        Some((k, v)) => Err(format!("puts input {k} in group {v}, not {}: act-order (desc_act) GPTQ with a permuted g_idx is not supported; use a checkpoint quantized with desc_act false", k / g)),
    }
}

/// Zero points `[out, groups]` from the packed `[groups, out/P]` words. GPTQ v1 stores each word
/// as the word of the zero points minus one in every slot, subtracted as one 32-bit integer
/// (GPTQModel's packer; a zero point 0 borrows from the next slot): adding the same constant
/// back to the whole word, as GPTQModel's loader does, recovers them exactly.
fn unpack_zeros(
    qzeros: &[u32],
    (packing, bits): (Packing, u32),
    out: usize,
    groups: usize,
) -> Vec<u32> {
    let (pack, mask) = (32 / bits as usize, (1u32 << bits) - 1);
    let ones = (0..pack).fold(0u32, |w, i| w | 1 << (i as u32 * bits));
    let mut z = vec![0u32; out * groups];
    for gi in 0..groups {
        for n in 0..out {
            let mut word = qzeros[gi * (out / pack) + n / pack];
            if let Packing::Gptq { v1: true } = packing {
                word = word.wrapping_add(ones);
            }
            let slot = match packing {
                Packing::Awq => AWQ_SLOT[n % 8],
                Packing::Gptq { .. } => (n % pack) as u32,
            };
            z[n * groups + gi] = (word >> (slot * bits)) & mask;
        }
    }
    z
}

/// `[rows, cols]` words transposed to `[cols, rows]`.
fn transpose(w: &[u32], rows: usize, cols: usize) -> Vec<u32> {
    let mut t = vec![0u32; rows * cols];
    for (r, row) in w.chunks_exact(cols).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            t[c * rows + r] = v;
        }
    }
    t
}

/// AWQ's `[inp, out/8]` words as affine rows `[out, inp/8]`.
fn awq_rows(w: &[u32], out: usize, inp: usize) -> Vec<u32> {
    let mut rows = vec![0u32; out * inp / 8];
    for k in 0..inp {
        for n in 0..out {
            let q = (w[k * (out / 8) + n / 8] >> (4 * AWQ_SLOT[n % 8])) & 15;
            rows[n * (inp / 8) + k / 8] |= q << (4 * (k % 8));
        }
    }
    rows
}

/// The affine group for GPTQ groups of `g`: the largest of 128, 64, 32 dividing it (each GPTQ
/// group's parameters repeated over its affine groups).
fn engine_group(g: usize) -> Option<usize> {
    [128, 64, 32].into_iter().find(|e| g.is_multiple_of(*e))
}

/// Affine scales and biases `[out, inp/eg]` (f32, exact) for GPTQ scales `[groups, out]` and
/// zero points `[out, groups]` of groups of `g`, and the engine group `eg` ([`engine_group`];
/// `g` a multiple of 32).
fn group_params(
    scales: &[f32],
    zeros: &[u32],
    out: usize,
    inp: usize,
    g: usize,
) -> (Vec<f32>, Vec<f32>, usize) {
    let eg = engine_group(g).unwrap_or(g);
    let (groups, per_row) = (inp / g, inp / eg);
    let mut s = vec![0.0f32; out * per_row];
    let mut b = vec![0.0f32; out * per_row];
    for n in 0..out {
        for j in 0..per_row {
            let gi = j * eg / g;
            let sc = scales[gi * out + n];
            s[n * per_row + j] = sc;
            b[n * per_row + j] = -(zeros[n * groups + gi] as f32) * sc;
        }
    }
    (s, b, eg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(packing: Packing, bits: u32) -> (Packing, u32) {
        (packing, bits)
    }

    #[test]
    fn config_blocks() {
        let p = Path::new("config.json");
        let v = serde_json::json!({"quantization_config": {"quant_method": "gptq", "bits": 4,
            "group_size": 128, "sym": true, "desc_act": false, "checkpoint_format": "gptq"}});
        let c = GptqConfig::from_json(&v, p).unwrap().unwrap();
        assert_eq!(
            (c.packing, c.bits, c.group_size),
            (Packing::Gptq { v1: true }, 4, Some(128))
        );
        let v = serde_json::json!({"text_config": {"quantization_config": {"quant_method": "gptq",
            "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}}});
        let c = GptqConfig::from_json(&v, p).unwrap().unwrap();
        assert_eq!(
            (c.packing, c.group_size),
            (Packing::Gptq { v1: false }, None)
        );
        let v = serde_json::json!({"quantization_config": {"quant_method": "awq", "bits": 4,
            "group_size": 64, "zero_point": true, "version": "gemm"}});
        let c = GptqConfig::from_json(&v, p).unwrap().unwrap();
        assert_eq!(c.packing, Packing::Awq);
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8"}});
        assert!(GptqConfig::from_json(&fp8, p).unwrap().is_none());
        for (bad, key) in [
            (
                serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}),
                "version",
            ),
            (
                serde_json::json!({"quant_method": "awq", "bits": 8, "group_size": 64}),
                "bits",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 3, "group_size": 64}),
                "bits",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 48}),
                "group_size",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"}),
                "checkpoint_format",
            ),
        ] {
            let v = serde_json::json!({ "quantization_config": bad });
            let e = GptqConfig::from_json(&v, p).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn v1_zero_points_are_the_word_minus_ones() {
        // Zero points 8, 8, ... (sym) are stored as 0x77777777.
        let z = unpack_zeros(&[0x7777_7777], cfg(Packing::Gptq { v1: true }, 4), 8, 1);
        assert_eq!(z, vec![8; 8]);
        // Zero points [0, 3, 8, ...]: 0x8888_8830 − 0x1111_1111 borrows from slot 1.
        let real = 0x8888_8830u32;
        let stored = real.wrapping_sub(0x1111_1111);
        let z = unpack_zeros(&[stored], cfg(Packing::Gptq { v1: true }, 4), 8, 1);
        assert_eq!(z, vec![0, 3, 8, 8, 8, 8, 8, 8]);
        let z = unpack_zeros(&[real], cfg(Packing::Gptq { v1: false }, 4), 8, 1);
        assert_eq!(z, vec![0, 3, 8, 8, 8, 8, 8, 8]);
    }

    #[test]
    fn awq_columns_follow_its_interleaved_order() {
        // Slot i of the word holds column [0, 2, 4, 6, 1, 3, 5, 7][i].
        let word = (0..8u32).fold(0, |w, i| {
            w | ([0, 2, 4, 6, 1, 3, 5, 7][i as usize] << (4 * i))
        });
        let z = unpack_zeros(&[word], cfg(Packing::Awq, 4), 8, 1);
        assert_eq!(z, (0..8).collect::<Vec<_>>());
        // One input row of 8 columns: each column's value becomes value 0 of its row.
        let w = vec![word; 8];
        let rows = awq_rows(&w, 8, 8);
        for (n, &r) in rows.iter().enumerate() {
            assert_eq!(r, (n as u32) * 0x1111_1111);
        }
    }

    #[test]
    fn wide_groups_repeat_their_parameters_in_groups_of_128() {
        let (s, b, eg) = group_params(&[0.5, 2.0], &[3, 1], 2, 256, 256);
        assert_eq!(eg, 128);
        assert_eq!(s, vec![0.5, 0.5, 2.0, 2.0]);
        assert_eq!(b, vec![-1.5, -1.5, -2.0, -2.0]);
    }

    #[test]
    fn permuted_g_idx_is_refused() {
        assert!(check_g_idx(&[0, 0, 1, 1], 2).is_ok());
        let e = check_g_idx(&[0, 1, 0, 1], 2).unwrap_err();
        assert!(e.contains("desc_act"), "{e}");
    }
}
