//! A GGUF file's tensors under the names and in the layout of an mlx-lm checkpoint (affine block
//! types as affine weights, others dequantized), undoing what llama.cpp's converter did to the HF
//! tensors of `qwen35moe`, `qwen35` and `qwen3next`:
//! - names: `blk.{i}.*` to `model.layers.{i}.*` (the MTP layer, block `n` past the main ones,
//!   to `mtp.layers.0.*`, its `nextn.*` to `mtp.*`), experts stacked as mlx-lm's `switch_mlp`;
//! - norms are stored as `1 + w` (but the GDN output norm), as mlx-lm stores them;
//! - `ssm_a` = −exp(A_log): `A_log` = ln(−ssm_a);
//! - the conv kernel `[C, K]` gains mlx-lm's trailing axis;
//! - Qwen3-Next's `in_proj_qkvz` is in the file as `[q; k; v]` (`attn_qkv`) and `z` (`attn_gate`),
//!   the split form's `in_proj_qkv` and `in_proj_z`; its `in_proj_ba` is split into `b` and `a`;
//! - value heads (`qwen35moe`, `qwen35`): the converter orders them tiled (head j of key head k
//!   at j·Hk + k) where HF groups them (k·(Hv/Hk) + j), in the V rows of `in_proj_qkv` and the
//!   conv, the rows of `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log`, `dt_bias`, and the
//!   columns of `out_proj`.

use super::{repack, BlockType, GgufFile};
use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::weights::{Prepared, TensorInfo};
use crate::Progress;
use deltamoe_compute::{DType, Tensor};

/// GGUF tensor names (after `blk.{i}.`) and the mlx-lm names they take (after the layer prefix).
const LAYER_NAMES: [(&str, &str); 27] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
    ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
    ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
    ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
    ("ssm_a", "linear_attn.A_log"),
    ("ssm_dt.bias", "linear_attn.dt_bias"),
    ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    ("ssm_norm.weight", "linear_attn.norm.weight"),
    ("ssm_out.weight", "linear_attn.out_proj.weight"),
    ("ffn_gate_inp.weight", "mlp.gate.weight"),
    ("ffn_gate_exps.weight", "mlp.switch_mlp.gate_proj.weight"),
    ("ffn_up_exps.weight", "mlp.switch_mlp.up_proj.weight"),
    ("ffn_down_exps.weight", "mlp.switch_mlp.down_proj.weight"),
    ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
    (
        "ffn_gate_shexp.weight",
        "mlp.shared_expert.gate_proj.weight",
    ),
    ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
];

/// The rest of a layer's names: shared expert down, dense MLP, Qwen3-Next's packed `[b | a]`
/// rows (split by [`split_ba`]), the MTP layer's own.
const MORE_NAMES: [(&str, &str); 9] = [
    (
        "ffn_down_shexp.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("ssm_ba.weight", "linear_attn.in_proj_ba.weight"),
    ("nextn.eh_proj.weight", "fc.weight"),
    ("nextn.enorm.weight", "pre_fc_norm_embedding.weight"),
    ("nextn.hnorm.weight", "pre_fc_norm_hidden.weight"),
    ("nextn.shared_head_norm.weight", "norm.weight"),
];

/// The file's tensors under their mlx-lm names, for a model of config `c` (from
/// [`super::config::config`]): matrices of an affine block type as affine weights with the same
/// values ([`super::repack`]), the rest dequantized (f16 and bf16 kept as they are); `progress`
/// hears of each tensor before it is unpacked.
pub fn tensors(
    f: &GgufFile,
    c: &ModelConfig,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<(String, Prepared)>> {
    let mut out = Vec::with_capacity(f.tensors.len());
    each_tensor(f, c, progress, &mut |name, t| {
        out.push((name, t));
        Ok(())
    })?;
    Ok(out)
}

/// [`tensors`] one at a time into `visit`, each file tensor's mapped pages released once it
/// is unpacked ([`GgufFile::release`]), `progress` told before each and at the end.
pub fn each_tensor(
    f: &GgufFile,
    c: &ModelConfig,
    progress: &mut dyn FnMut(Progress),
    visit: &mut dyn FnMut(String, Prepared) -> Result<()>,
) -> Result<()> {
    let total = f.tensors.values().map(|t| t.bytes as u64).sum();
    let mut done = 0u64;
    for (name, info) in &f.tensors {
        progress(Progress {
            done,
            total,
            tensor: name,
        });
        for (to, t) in tensor(f, name, c)? {
            visit(to, t)?;
        }
        f.release(name);
        done += info.bytes as u64;
    }
    progress(Progress {
        done,
        total,
        tensor: "",
    });
    Ok(())
}

/// What [`tensors`] gives for each file tensor, from the tensor table alone (nothing is read or
/// unpacked): names, shapes, dtypes and bytes as the loaded store lists them, sorted by name.
pub fn summary(f: &GgufFile, c: &ModelConfig) -> Result<Vec<TensorInfo>> {
    let mut out = Vec::with_capacity(f.tensors.len());
    for name in f.tensors.keys() {
        let (to, leaf) = mapped(f, name, c)?;
        let info = f.info(name)?;
        let shape = dense_shape(leaf, info.shape());
        if leaf == "ssm_ba.weight" {
            let h = ba_width(f, name, &shape, c)?;
            for part in ["in_proj_b", "in_proj_a"] {
                let shape = vec![c.linear_v_heads, h];
                out.push(dense_info(
                    to.replace("in_proj_ba", part),
                    shape,
                    DType::F32,
                ));
            }
            continue;
        }
        out.push(match affine_spec(f, name, leaf, c)? {
            Some((bits, group)) => {
                let n = info.len();
                TensorInfo {
                    name: to,
                    shape: info.shape(),
                    dtype: format!("affine {bits}-bit"),
                    bytes: n * bits as usize / 8 + 2 * 4 * (n / group),
                    params: n,
                }
            }
            None => {
                let dtype = kept_half(info.kind, leaf).unwrap_or(DType::F32);
                dense_info(to, shape, dtype)
            }
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn dense_info(name: String, shape: Vec<usize>, dtype: DType) -> TensorInfo {
    let params = shape.iter().product::<usize>();
    TensorInfo {
        name,
        shape,
        dtype: dtype.to_string(),
        bytes: params * dtype.size(),
        params,
    }
}

/// The mlx-lm name of file tensor `name` and its name within its block; an error for a tensor
/// deltamoe does not map.
fn mapped<'n>(f: &GgufFile, name: &'n str, c: &ModelConfig) -> Result<(String, &'n str)> {
    hf_name(name, c.num_layers).ok_or_else(|| {
        ModelError::Input(format!(
            "{}: tensor `{name}` is not one deltamoe maps for {}",
            f.path().display(),
            c.model_type
        ))
    })
}

/// The width of Qwen3-Next's `in_proj_ba` tensor `name` of `shape`: `[2·Hv, H]`, or an error
/// naming it.
fn ba_width(f: &GgufFile, name: &str, shape: &[usize], c: &ModelConfig) -> Result<usize> {
    match shape {
        [rows, h] if *rows == 2 * c.linear_v_heads && c.linear_k_heads > 0 => Ok(*h),
        _ => Err(ModelError::Input(format!(
            "{}: tensor `{name}` has shape {shape:?}, expected [{}, hidden] (two rows per value \
             head)",
            f.path().display(),
            2 * c.linear_v_heads
        ))),
    }
}

/// File tensor `name` as [`tensors`] gives it: one tensor, or two for Qwen3-Next's `ssm_ba`.
fn tensor(f: &GgufFile, name: &str, c: &ModelConfig) -> Result<Vec<(String, Prepared)>> {
    let (to, leaf) = mapped(f, name, c)?;
    if leaf == "ssm_ba.weight" {
        let ba = dense(f, name, leaf, c)?;
        ba_width(f, name, ba.shape(), c)?;
        return Ok(split_ba(&to, ba, c).into());
    }
    let t = match affine(f, name, leaf, c)? {
        Some(w) => w,
        None => Prepared::Dense(dense(f, name, leaf, c)?),
    };
    Ok(vec![(to, t)])
}

/// Qwen3-Next's `in_proj_ba` `[2·Hv, H]` (per key head, the `b` rows of its value heads, then
/// their `a` rows) as the `in_proj_b` and `in_proj_a` `[Hv, H]` of the split form.
fn split_ba(name: &str, ba: Tensor, c: &ModelConfig) -> [(String, Prepared); 2] {
    let (hk, hv) = (c.linear_k_heads, c.linear_v_heads);
    let (r, h) = (hv / hk.max(1), ba.shape()[1]);
    let v = ba.to_f32_vec();
    let half = |at: usize| -> Vec<f32> {
        (0..hk)
            .flat_map(|k| {
                v[(2 * k + at) * r * h..(2 * k + at + 1) * r * h]
                    .iter()
                    .copied()
            })
            .collect()
    };
    let part = |at: usize, to: &str| {
        let t = Tensor::from_f32(vec![hv, h], half(at));
        (name.replace("in_proj_ba", to), Prepared::Dense(t))
    };
    [part(0, "in_proj_b"), part(1, "in_proj_a")]
}

/// Matrix `name` of an affine block type as an affine weight (stacked experts as one of
/// `E·out` rows), or `None` for other types, vectors and a reorder that would cut a group.
fn affine(f: &GgufFile, name: &str, leaf: &str, c: &ModelConfig) -> Result<Option<Prepared>> {
    let Some((_, group)) = affine_spec(f, name, leaf, c)? else {
        return Ok(None);
    };
    let info = f.info(name)?;
    let shape = info.shape();
    let Some(mut g) = repack::Groups::of(info.kind, f.bytes(name)?, info.len()) else {
        return Ok(None);
    };
    let cols = shape[shape.len() - 1];
    reorder(leaf, c, &mut g.codes, cols, 1);
    reorder(leaf, c, &mut g.scales, cols / group, group);
    reorder(leaf, c, &mut g.biases, cols / group, group);
    let rows = info.len() / cols;
    let w = g
        .into_weight(rows)
        .map_err(|e| ModelError::Input(format!("{}: tensor `{name}`: {e}", f.path().display())))?;
    Ok(Some(Prepared::Affine(w, shape)))
}

/// The bits and group of matrix `name` (block name `leaf`) when [`affine`] takes it.
fn affine_spec(
    f: &GgufFile,
    name: &str,
    leaf: &str,
    c: &ModelConfig,
) -> Result<Option<(u32, usize)>> {
    let info = f.info(name)?;
    let Some((bits, group, _)) = repack::affine_form(info.kind) else {
        return Ok(None);
    };
    let taken = info.shape().len() >= 2 && reorders_whole(leaf, c, group);
    Ok(taken.then_some((bits, group)))
}

/// The dtype [`dense`] keeps tensor `leaf` of block type `kind` in: f16 and bf16 as stored (but
/// `ssm_a` and the conv kernel), None for f32.
fn kept_half(kind: BlockType, leaf: &str) -> Option<DType> {
    let half = match kind {
        BlockType::F16 => Some(DType::F16),
        BlockType::BF16 => Some(DType::BF16),
        _ => None,
    };
    half.filter(|_| !matches!(leaf, "ssm_a" | "ssm_conv1d.weight"))
}

/// The shape [`dense`] gives tensor `leaf` stored as `shape`: ggml drops outer dims of 1
/// (llama-quantize writes the shared expert's gate [1, H] as [H]); the conv kernel gains
/// mlx-lm's trailing axis.
fn dense_shape(leaf: &str, mut shape: Vec<usize>) -> Vec<usize> {
    if leaf == "ffn_gate_inp_shexp.weight" && shape.len() == 1 {
        shape.insert(0, 1);
    }
    if leaf == "ssm_conv1d.weight" {
        shape.push(1);
    }
    shape
}

/// Tensor `name` as a dense tensor in mlx-lm's layout ([`dense_shape`]): f16 and bf16 as stored,
/// other types dequantized to f32 ([`kept_half`]); `ssm_a` becomes `A_log`.
fn dense(f: &GgufFile, name: &str, leaf: &str, c: &ModelConfig) -> Result<Tensor> {
    let info = f.info(name)?;
    let shape = dense_shape(leaf, info.shape());
    let row = shape.iter().skip(1).product::<usize>();
    if let Some(dtype) = kept_half(info.kind, leaf) {
        let b = f.bytes(name)?;
        let mut bits: Vec<u16> = b
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]))
            .collect();
        reorder(leaf, c, &mut bits, row, 1);
        return Ok(Tensor::from_half_bits(dtype, shape, bits));
    }
    let mut v = f.f32(name)?;
    if leaf == "ssm_a" {
        v.iter_mut().for_each(|a| *a = (-*a).ln());
    }
    reorder(leaf, c, &mut v, row, 1);
    Ok(Tensor::from_f32(shape, v))
}

/// The mlx-lm name of GGUF tensor `name` in a model of `n` main layers, and its name within its
/// block.
fn hf_name(name: &str, n: usize) -> Option<(String, &str)> {
    match name {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), name)),
        "output.weight" => return Some(("lm_head.weight".into(), name)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), name)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (i, leaf) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let to = LAYER_NAMES
        .iter()
        .chain(&MORE_NAMES)
        .find(|(g, _)| *g == leaf)?
        .1;
    let mtp_own = leaf.starts_with("nextn.");
    let prefix = match (i >= n, mtp_own) {
        (false, false) => format!("model.layers.{i}."),
        (true, false) => "mtp.layers.0.".to_string(),
        (true, true) => "mtp.".to_string(),
        (false, true) => return None,
    };
    Some((format!("{prefix}{to}"), leaf))
}

/// Whether [`reorder`] moves whole groups of `group` columns in tensor `leaf`: it moves the
/// columns of `ssm_out` in blocks of a value head's width.
fn reorders_whole(leaf: &str, c: &ModelConfig, group: usize) -> bool {
    let moved = tiled(c) && c.linear_k_heads != 0 && c.linear_v_heads != c.linear_k_heads;
    !(moved && leaf == "ssm_out.weight") || c.linear_v_dim.is_multiple_of(group)
}

/// Whether the converter wrote the value heads in tiled order: for `qwen35moe` and `qwen35`; its
/// `qwen3next` keeps HF's grouped order (splitting `in_proj_qkvz` into `[q; k; v]` and `z`).
fn tiled(c: &ModelConfig) -> bool {
    c.family != Family::Qwen3Next
}

/// Puts the value heads of tensor `leaf` (its name after `blk.{i}.`) of config `c` back from the
/// converter's tiled order to HF's grouped one, in `v`: rows of `row` elements, each element
/// standing for `unit` columns (1 for values and codes, the group size for scales and biases).
fn reorder<T: Copy>(leaf: &str, c: &ModelConfig, v: &mut [T], row: usize, unit: usize) {
    let (hk, hv, dk, dv) = (
        c.linear_k_heads,
        c.linear_v_heads,
        c.linear_k_dim,
        c.linear_v_dim,
    );
    if !tiled(c) || hk == 0 || hv == hk {
        return;
    }
    let qk = 2 * hk * dk;
    match leaf {
        "attn_qkv.weight" | "ssm_conv1d.weight" => {
            if let Some(v) = v.get_mut(qk * row..) {
                group_rows(v, (hk, hv), dv * row)
            }
        }
        "attn_gate.weight" => group_rows(v, (hk, hv), dv * row),
        "ssm_beta.weight" | "ssm_alpha.weight" | "ssm_a" | "ssm_dt.bias" => {
            group_rows(v, (hk, hv), row)
        }
        "ssm_out.weight" => {
            for r in v.chunks_exact_mut(row) {
                group_rows(r, (hk, hv), dv / unit);
            }
        }
        _ => {}
    }
}

/// Reorders `hv` blocks of `block` values from tiled order (block of value head j of key head k
/// at j·hk + k) to grouped order (at k·(hv/hk) + j). Values too few for the heads (a tensor of
/// another shape than the config implies) are left as they are: the checkpoint's shape check
/// then names the tensor.
fn group_rows<T: Copy>(v: &mut [T], (hk, hv): (usize, usize), block: usize) {
    if hk == 0 || v.len() < hv * block {
        return;
    }
    let r = hv / hk;
    let tiled = v[..hv * block].to_vec();
    for k in 0..hk {
        for j in 0..r {
            let (to, from) = ((k * r + j) * block, (j * hk + k) * block);
            v[to..to + block].copy_from_slice(&tiled[from..from + block]);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tiled_value_heads_go_back_to_grouped_order() {
        // 2 key heads, 4 value heads: tiled [j0k0, j0k1, j1k0, j1k1] → grouped [k0j0, k0j1, k1j0, k1j1].
        let mut v = vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5];
        super::group_rows(&mut v, (2, 4), 2);
        assert_eq!(v, vec![0.0, 0.5, 2.0, 2.5, 1.0, 1.5, 3.0, 3.5]);
    }

    #[test]
    fn names_map_to_mlx_lm_ones() {
        let f = |n: &str| super::hf_name(n, 4).map(|p| p.0);
        assert_eq!(
            f("blk.2.ssm_a").as_deref(),
            Some("model.layers.2.linear_attn.A_log")
        );
        assert_eq!(
            f("blk.4.attn_q.weight").as_deref(),
            Some("mtp.layers.0.self_attn.q_proj.weight")
        );
        assert_eq!(
            f("blk.4.nextn.eh_proj.weight").as_deref(),
            Some("mtp.fc.weight")
        );
        assert_eq!(f("blk.1.nextn.eh_proj.weight"), None);
        assert_eq!(f("blk.0.unknown.weight"), None);
    }
}
