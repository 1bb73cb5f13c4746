//! Tensor parallel over the token mixers' heads: GPU `rank` of `world` keeps an equal contiguous
//! share of every attention layer's query and KV heads and of every GDN layer's key heads (with
//! the value heads that read them), the input projections' rows and the output projections'
//! columns of those heads, and the per-head conv channels, decays and biases. Its output
//! projection then gives a partial sum of the layer's output, which the GPUs add (one all-reduce
//! per mixer, `gpu::layers`). Dense MLP layers are divided the same way, by their intermediate
//! rows. The config it returns counts this GPU's heads and rows, so every layer and state
//! buffer is sized for them. Everything else (norms, MoE blocks, whose experts expert parallel
//! divides, the embedding and head) is kept whole.
//!
//! Head layouts (HF's, which every checkpoint format is loaded into): attention `q_proj` rows are
//! per head `[q_h | gate_h]`, `o_proj` columns per head; GDN `in_proj_qkv` rows (and conv
//! channels) are `[q (key heads) | k (key heads) | v (value heads)]`, value head j reading key
//! head j / (value heads / key heads); Qwen3-Next's `in_proj_qkvz` packs `[q_h | k_h | v | z]`
//! per key head and `in_proj_ba` `[b | a]` per key head.

use std::ops::Range;

use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{AffineWeight, Fp8Weight, PackedWords, Tensor};

use super::gdn::InProj;
use super::{Attention, Checkpoint, Ffn, GatedDeltaNet, Layer, Linear, LinearWeight, Mixer, Mlp};
use crate::config::{FfnKind, ModelConfig};
use crate::error::{ModelError, Result};

/// GPU `rank`'s part of `ckpt` when `world` GPUs divide the mixers' heads (see the module doc).
pub fn heads_share(ckpt: &Checkpoint, rank: usize, world: usize) -> Result<Checkpoint> {
    let mut out = ckpt.clone();
    out.config = heads_config(&ckpt.config, world)?;
    let part = Part { rank, world };
    for l in &mut out.layers {
        share_layer(l, part)?;
    }
    if let Some(m) = &mut out.mtp {
        share_layer(&mut m.layer, part)?;
    }
    Ok(out)
}

/// Config `c` with each mixer's head counts (and the dense MLP layers' intermediate size) those
/// one of `world` GPUs keeps; an error naming the count that does not divide among them.
pub fn heads_config(c: &ModelConfig, world: usize) -> Result<ModelConfig> {
    let dense = c.ffn_kinds.contains(&FfnKind::Dense);
    let counts = [
        ("attention heads", c.num_heads),
        ("KV heads", c.num_kv_heads),
        ("GDN key heads", c.linear_k_heads),
        ("GDN value heads", c.linear_v_heads),
        (
            "dense MLP rows",
            if dense { c.intermediate_size } else { 0 },
        ),
    ];
    if let Some((what, n)) = counts.iter().find(|(_, n)| !n.is_multiple_of(world)) {
        return Err(ModelError::Input(format!(
            "tensor parallel over {world} GPUs: the model's {n} {what} do not divide among them; \
             name a number of GPUs that divides it or drop --tensor-parallel"
        )));
    }
    let mut out = c.clone();
    out.num_heads /= world;
    out.num_kv_heads /= world;
    out.linear_k_heads /= world;
    out.linear_v_heads /= world;
    if dense {
        out.intermediate_size /= world;
    }
    Ok(out)
}

/// Part `rank` of `world` equal parts.
#[derive(Clone, Copy)]
struct Part {
    rank: usize,
    world: usize,
}

impl Part {
    /// This part of `n` things, in units of `unit`.
    fn of(self, n: usize, unit: usize) -> Range<usize> {
        let each = n / self.world;
        (self.rank * each * unit)..((self.rank + 1) * each * unit)
    }
}

fn share_layer(l: &mut Layer, part: Part) -> Result<()> {
    match &mut l.mixer {
        Mixer::Full(a) => share_attention(a, part)?,
        Mixer::Linear(g) => share_gdn(g, part)?,
    }
    match &mut l.ffn {
        Ffn::Dense(m) => share_mlp(m, part),
        Ffn::Moe(_) => Ok(()),
    }
}

/// A dense MLP's share: its part of the intermediate rows of gate and up, and those columns of
/// down (whose output is then a partial sum, as a mixer's), cut at down's groups or blocks
/// ([`mlp_cuts`]).
fn share_mlp(m: &mut Mlp, part: Part) -> Result<()> {
    let i = m.gate.weight.shape()[0];
    let unit = match &m.down.weight {
        LinearWeight::Dense(_) => 1,
        LinearWeight::Affine(a) => a.group_size(),
        LinearWeight::Fp8(f) => f.block()[1],
    };
    let cuts = mlp_cuts(i, unit, part.world);
    let mine = cuts[part.rank]..cuts[part.rank + 1];
    if mine.is_empty() {
        return Err(indivisible(
            format!("dense MLP's {i} rows in blocks of {unit}"),
            part.world,
        ));
    }
    m.gate = rows(&m.gate, std::slice::from_ref(&mine))?;
    m.up = rows(&m.up, std::slice::from_ref(&mine))?;
    m.down = col_range(&m.down, mine, part.world)?;
    Ok(())
}

/// Where `world` parts of `i` intermediate rows begin (and the last ends): the multiples of
/// `unit` nearest to equal parts, so that no part cuts a group or block of down's inputs (the
/// parts may then differ in size; each GPU sizes its MLP by its own rows).
pub fn mlp_cuts(i: usize, unit: usize, world: usize) -> Vec<usize> {
    let span = world * unit;
    let mut cuts: Vec<usize> = (0..world)
        .map(|r| ((r * i + span / 2) / span * unit).min(i))
        .collect();
    cuts.push(i);
    cuts
}

fn share_attention(a: &mut Attention, part: Part) -> Result<()> {
    let (nq, nkv, d) = (a.shape.n_heads, a.shape.n_kv_heads, a.shape.head_dim);
    a.q_proj = rows(&a.q_proj, &[part.of(nq, 2 * d)])?;
    a.k_proj = rows(&a.k_proj, &[part.of(nkv, d)])?;
    a.v_proj = rows(&a.v_proj, &[part.of(nkv, d)])?;
    a.o_proj = cols(&a.o_proj, part)?;
    a.shape.n_heads = nq / part.world;
    a.shape.n_kv_heads = nkv / part.world;
    Ok(())
}

fn share_gdn(g: &mut GatedDeltaNet, part: Part) -> Result<()> {
    let s = g.shape;
    let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.k_dim, s.v_dim);
    let r = nv / nk.max(1);
    let keys = part.of(nk, 1);
    let values = part.of(nv, 1);
    let per = |h: &Range<usize>, unit: usize| h.start * unit..h.end * unit;
    let shift = |h: Range<usize>, by: usize| h.start + by..h.end + by;
    // The conv channels, as the rows of in_proj_qkv.
    let qkv = [
        per(&keys, dk),
        shift(per(&keys, dk), nk * dk),
        shift(per(&values, dv), 2 * nk * dk),
    ];
    g.proj = match &g.proj {
        InProj::Split { qkv: w, z, b, a } => InProj::Split {
            qkv: rows(w, &qkv)?,
            z: rows(z, &[per(&values, dv)])?,
            b: rows(b, std::slice::from_ref(&values))?,
            a: rows(a, std::slice::from_ref(&values))?,
        },
        InProj::Packed { qkvz, ba } => InProj::Packed {
            qkvz: rows(qkvz, &[per(&keys, 2 * dk + 2 * r * dv)])?,
            ba: rows(ba, &[per(&keys, 2 * r)])?,
        },
    };
    let k = g.conv_kernel;
    g.conv_w = qkv
        .iter()
        .flat_map(|ch| g.conv_w[ch.start * k..ch.end * k].iter().copied())
        .collect();
    g.neg_a = g.neg_a[values.clone()].to_vec();
    g.dt_bias = g.dt_bias[values].to_vec();
    g.out_proj = cols(&g.out_proj, part)?;
    g.shape.n_k_heads = nk / part.world;
    g.shape.n_v_heads = nv / part.world;
    Ok(())
}

/// The rows `ranges` of `l` (weight and bias), in order.
fn rows(l: &Linear, ranges: &[Range<usize>]) -> Result<Linear> {
    let idx: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
    let weight = match &l.weight {
        LinearWeight::Dense(t) => LinearWeight::Dense(t.gather_rows(&idx)),
        LinearWeight::Affine(a) => affine_rows(a, &idx)?.into(),
        LinearWeight::Fp8(f) => fp8_rows(f, ranges)?.into(),
    };
    let bias = l.bias.as_ref().map(|b| idx.iter().map(|&i| b[i]).collect());
    Ok(Linear { weight, bias })
}

/// Part `part`'s equal share of the columns of `l` (`k` inputs, which must divide among the
/// parts); the bias stays with part 0 (the parts' outputs are summed).
fn cols(l: &Linear, part: Part) -> Result<Linear> {
    let k = l.weight.shape()[1];
    if !k.is_multiple_of(part.world) {
        return Err(indivisible(format!("{k} inputs"), part.world));
    }
    col_range(l, part.of(k, 1), part.world)
}

/// The columns `r` of `l` (one of `world` parts' inputs); the bias stays with the part that
/// starts at 0.
fn col_range(l: &Linear, r: Range<usize>, world: usize) -> Result<Linear> {
    let bias = l.bias.clone().filter(|_| r.start == 0);
    let weight = match &l.weight {
        LinearWeight::Dense(t) => {
            let [n, k] = l.weight.shape();
            let t = t.reshape(vec![n * k, 1]);
            let idx: Vec<usize> = (0..n)
                .flat_map(|i| r.clone().map(move |c| i * k + c))
                .collect();
            LinearWeight::Dense(t.gather_rows(&idx).reshape(vec![n, r.len()]))
        }
        LinearWeight::Affine(a) => affine_cols(a, r, world)?.into(),
        LinearWeight::Fp8(f) => fp8_cols(f, r, world)?.into(),
    };
    Ok(Linear { weight, bias })
}

fn indivisible(what: String, world: usize) -> ModelError {
    ModelError::Input(format!(
        "tensor parallel over {world} GPUs: a projection's {what} do not divide among them; \
         drop --tensor-parallel"
    ))
}

fn quant_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Input(format!("tensor parallel: {e}"))
}

fn affine_rows(a: &AffineWeight, idx: &[usize]) -> Result<AffineWeight> {
    let (wpr, gpr) = (a.words_per_row(), a.groups_per_row());
    let words = a.words();
    let w: Vec<u32> = idx
        .iter()
        .flat_map(|&r| words[r * wpr..(r + 1) * wpr].iter().copied())
        .collect();
    let params = |t: &Tensor| t.reshape(vec![a.out_features(), gpr]).gather_rows(idx);
    let (s, b) = (params(a.scales()), params(a.biases()));
    let bits = (a.bits(), a.group_size());
    affine(
        bits,
        (idx.len(), a.in_features()),
        w,
        (s, b),
        a.has_zero_points(),
    )
}

/// Affine columns `r`: in groups of the widest size that divides the group, the start and the
/// width (each inside one of the whole's groups, with its scale and bias), of whole words and
/// at least the 16 inputs the CUDA kernels' smallest groups hold.
fn affine_cols(a: &AffineWeight, r: Range<usize>, world: usize) -> Result<AffineWeight> {
    let (n, g, bits) = (a.out_features(), a.group_size(), a.bits() as usize);
    let (k, wpr, gpr) = (a.in_features(), a.words_per_row(), a.groups_per_row());
    let size = gcd(g, gcd(r.start, r.len()));
    if size < 16 || !(size * bits).is_multiple_of(32) {
        return Err(indivisible(format!("{k} inputs in groups of {g}"), world));
    }
    let (w0, w1) = (r.start * bits / 32, r.end * bits / 32);
    let words = a.words();
    let w: Vec<u32> = (0..n)
        .flat_map(|i| words[i * wpr + w0..i * wpr + w1].iter().copied())
        .collect();
    let groups = r.len() / size;
    let idx: Vec<usize> = (0..n)
        .flat_map(|i| (0..groups).map(move |j| i * gpr + (r.start + j * size) / g))
        .collect();
    let params = |t: &Tensor| {
        t.reshape(vec![n * gpr, 1])
            .gather_rows(&idx)
            .reshape(vec![n, groups])
    };
    let (s, b) = (params(a.scales()), params(a.biases()));
    affine(
        (a.bits(), size),
        (n, r.len()),
        w,
        (s, b),
        a.has_zero_points(),
    )
}

fn affine(
    (bits, group): (u32, usize),
    (n, k): (usize, usize),
    words: Vec<u32>,
    (s, b): (Tensor, Tensor),
    zero_points: bool,
) -> Result<AffineWeight> {
    let w = AffineWeight::new(bits, group, n, k, PackedWords::from_vec(words), s, b)
        .map_err(quant_err)?;
    Ok(match zero_points {
        true => w.with_zero_points(),
        false => w,
    })
}

/// FP8 rows: the same blocks when every range holds whole blocks of rows (a range may end at the
/// last row); else blocks of one row, each row with its block row's scales (the same values).
fn fp8_rows(f: &Fp8Weight, ranges: &[Range<usize>]) -> Result<Fp8Weight> {
    let (out, inp, [br, bc]) = (f.out_features(), f.in_features(), f.block());
    let aligned = |r: &Range<usize>| {
        r.start.is_multiple_of(br) && (r.len().is_multiple_of(br) || r.end == out)
    };
    let step = match ranges.iter().all(aligned) {
        true => br,
        false => 1,
    };
    let codes = f.codes();
    let mut c = Vec::new();
    let mut s = Vec::new();
    for r in ranges {
        c.extend_from_slice(&codes[r.start * inp..r.end * inp]);
        for b in (r.start..r.end).step_by(step) {
            s.extend_from_slice(f.row_scales(b));
        }
    }
    let n = ranges.iter().map(Range::len).sum();
    let block = [step, bc];
    Fp8Weight::new(n, inp, block, Bytes::from_vec(c), s, f.scale_dtype()).map_err(quant_err)
}

/// FP8 columns `r`: in blocks of the widest width that divides both the blocks and the start
/// (so each of its blocks lies in one of the whole's and keeps that block's scale), a multiple
/// of 8 as the CUDA kernels read them, as is the number of columns.
fn fp8_cols(f: &Fp8Weight, r: Range<usize>, world: usize) -> Result<Fp8Weight> {
    let (out, inp, [br, bc]) = (f.out_features(), f.in_features(), f.block());
    let (k0, k) = (r.start, r.len());
    let width = gcd(bc, k0);
    if !width.is_multiple_of(8) || !k.is_multiple_of(8) {
        return Err(indivisible(
            format!("{inp} inputs in FP8 blocks of {bc}"),
            world,
        ));
    }
    let blocks = k.div_ceil(width);
    let codes = f.codes();
    let c: Vec<u8> = (0..out)
        .flat_map(|i| codes[i * inp + k0..i * inp + k0 + k].iter().copied())
        .collect();
    let s: Vec<f32> = (0..out)
        .step_by(br)
        .flat_map(|b| {
            let row = f.row_scales(b);
            (0..blocks).map(move |j| row[(k0 + j * width) / bc])
        })
        .collect();
    let block = [br, width];
    Fp8Weight::new(out, k, block, Bytes::from_vec(c), s, f.scale_dtype()).map_err(quant_err)
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

#[cfg(test)]
mod tests {
    use super::{cols, mlp_cuts, rows, Part};
    use crate::checkpoint::{Linear, LinearWeight};
    use deltamoe_compute::cpu::quant::quantize;
    use deltamoe_compute::fp8::Bytes;
    use deltamoe_compute::{AffineWeight, DType, Fp8Weight, PackedWords, Tensor};

    /// A seeded value in [−1, 1).
    fn val(i: usize) -> f32 {
        let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
        x as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn dense(n: usize, k: usize) -> Vec<f32> {
        (0..n * k).map(val).collect()
    }

    /// The same `[n, k]` matrix as f32, 4-bit affine (g32, with and without zero points) and
    /// FP8 (blocks of 4 × 8), each with a bias.
    fn formats(n: usize, k: usize) -> Vec<Linear> {
        let t = Tensor::from_f32(vec![n, k], dense(n, k));
        let a = affine_weight(n, k, 32, 4);
        let bias: Vec<f32> = (0..n).map(|i| i as f32).collect();
        [
            LinearWeight::Dense(t),
            LinearWeight::Affine(Box::new(a.clone())),
            LinearWeight::Affine(Box::new(a.with_zero_points())),
            fp8(n, k, 8).weight,
        ]
        .into_iter()
        .map(|weight| Linear {
            weight,
            bias: Some(bias.clone()),
        })
        .collect()
    }

    /// The `[n, k]` matrix of [`dense`] quantized to `bits` in groups of `group`.
    fn affine_weight(n: usize, k: usize, group: usize, bits: u32) -> AffineWeight {
        let q = quantize(&dense(n, k), k, group, bits).unwrap();
        let g = vec![n, k / group];
        let (s, b) = (
            Tensor::from_f32(g.clone(), q.scales),
            Tensor::from_f32(g, q.biases),
        );
        AffineWeight::new(bits, group, n, k, PackedWords::from_vec(q.words), s, b).unwrap()
    }

    /// FP8 blocks of `[4, bc]` over an `[n, k]` matrix, without a bias.
    fn fp8(n: usize, k: usize, bc: usize) -> Linear {
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 37 % 120) as u8).collect();
        let grid = n.div_ceil(4) * k.div_ceil(bc);
        let scales: Vec<f32> = (0..grid).map(|i| 0.5 + i as f32).collect();
        let f = Fp8Weight::new(n, k, [4, bc], Bytes::from_vec(codes), scales, DType::F32).unwrap();
        Linear {
            weight: LinearWeight::Fp8(Box::new(f)),
            bias: None,
        }
    }

    /// Rows `ranges` of the values `full` of a matrix of `k` inputs.
    fn rows_of_values(full: &[f32], k: usize, ranges: &[std::ops::Range<usize>]) -> Vec<f32> {
        ranges
            .iter()
            .flat_map(|r| full[r.start * k..r.end * k].to_vec())
            .collect()
    }

    /// Columns `[c0, c1)` of the `[n, k]` values `full`.
    fn cols_of_values(full: &[f32], (n, k): (usize, usize), c0: usize, c1: usize) -> Vec<f32> {
        (0..n)
            .flat_map(|r| full[r * k + c0..r * k + c1].to_vec())
            .collect()
    }

    fn values(l: &Linear) -> Vec<f32> {
        l.weight
            .dequantize()
            .unwrap_or_else(|| l.weight.to_dense().to_f32_vec())
    }

    #[test]
    fn row_and_column_shares_hold_the_same_values() {
        let (n, k) = (16, 128);
        for l in formats(n, k) {
            let full = values(&l);
            let picked = rows(&l, &[4..8, 12..16]).unwrap();
            assert_eq!(values(&picked), rows_of_values(&full, k, &[4..8, 12..16]));
            assert_eq!(
                picked.bias.as_deref(),
                Some(&[4.0, 5.0, 6.0, 7.0, 12.0, 13.0, 14.0, 15.0][..])
            );
            for rank in 0..2 {
                let c = cols(&l, Part { rank, world: 2 }).unwrap();
                let want = cols_of_values(&full, (n, k), rank * 64, rank * 64 + 64);
                assert_eq!(values(&c), want, "rank {rank}");
                assert_eq!(c.bias.is_some(), rank == 0);
            }
        }
    }

    #[test]
    fn fp8_shares_that_cut_blocks_are_reblocked_to_the_same_values() {
        // Rows 2..6 cut blocks of 4 rows: blocks of one row.
        let l = fp8(16, 128, 8);
        let full = values(&l);
        let picked = rows(&l, &[2..6, 9..10]).unwrap();
        assert_eq!(values(&picked), rows_of_values(&full, 128, &[2..6, 9..10]));
        // 24 inputs a part: the first inside the first block of 32, the second across two, in
        // blocks of 8.
        let (l, k) = (fp8(16, 48, 32), 48);
        let full = values(&l);
        for rank in 0..2 {
            let c = cols(&l, Part { rank, world: 2 }).unwrap();
            let LinearWeight::Fp8(f) = &c.weight else {
                panic!("FP8 share");
            };
            assert_eq!(f.block(), [4, [32, 8][rank]]);
            let want = cols_of_values(&full, (16, k), rank * 24, rank * 24 + 24);
            assert_eq!(values(&c), want, "rank {rank}");
        }
    }

    #[test]
    fn dense_mlp_cuts_fall_on_down_blocks() {
        assert_eq!(mlp_cuts(200, 1, 2), [0, 100, 200]);
        assert_eq!(mlp_cuts(200, 128, 2), [0, 128, 200]);
        assert_eq!(mlp_cuts(17408, 128, 4), [0, 4352, 8704, 13056, 17408]);
        assert_eq!(mlp_cuts(64, 64, 2), [0, 64, 64]);
    }

    #[test]
    fn affine_shares_that_cut_groups_are_regrouped_to_the_same_values() {
        // 48 inputs a part of groups of 32: the second part starts inside a group; groups of 16.
        let (n, k) = (16, 96);
        for l in &formats(n, k)[1..3] {
            let full = values(l);
            for rank in 0..2 {
                let c = cols(l, Part { rank, world: 2 }).unwrap();
                let LinearWeight::Affine(a) = &c.weight else {
                    panic!("affine share");
                };
                assert_eq!(a.group_size(), 16);
                let want = cols_of_values(&full, (n, k), rank * 48, rank * 48 + 48);
                assert_eq!(values(&c), want, "rank {rank}");
            }
        }
    }

    #[test]
    fn shares_that_split_a_group_or_a_kernel_width_are_refused() {
        // 24 inputs a part of groups of 32: groups of 8, under the kernels' 16.
        let l = &formats(16, 96)[1];
        let e = cols(l, Part { rank: 1, world: 4 }).unwrap_err().to_string();
        assert!(
            e.contains("groups of 32") && e.contains("--tensor-parallel"),
            "{e}"
        );
        // 12 inputs a part in blocks of 8: blocks of 4, narrower than the kernels read.
        let e = cols(&fp8(16, 24, 8), Part { rank: 1, world: 2 })
            .unwrap_err()
            .to_string();
        assert!(e.contains("FP8 blocks of 8"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Every column range an affine or FP8 matrix gives holds the whole's values there,
        /// and the ranges refused are those whose groups or blocks would be too narrow.
        #[test]
        fn column_ranges_hold_the_same_values(
            n in 1usize..6,
            groups in 1usize..6,
            g in proptest::sample::select(vec![16usize, 32, 64]),
            bits in proptest::sample::select(vec![4u32, 8]),
            bc in proptest::sample::select(vec![8usize, 16, 24, 128]),
            cut in 0usize..64,
        ) {
            let k = groups * g;
            let c = cut * 8 % k;
            let l = Linear {
                weight: LinearWeight::Affine(Box::new(affine_weight(n, k, g, bits))),
                bias: None,
            };
            let full = values(&l);
            for r in [0..c, c..k] {
                if r.is_empty() {
                    continue;
                }
                let size = super::gcd(g, super::gcd(r.start, r.len()));
                match super::col_range(&l, r.clone(), 2) {
                    Ok(p) => {
                        proptest::prop_assert!(size >= 16);
                        proptest::prop_assert_eq!(values(&p), cols_of_values(&full, (n, k), r.start, r.end));
                    }
                    Err(_) => proptest::prop_assert!(size < 16 || !(size * bits as usize).is_multiple_of(32)),
                }
            }
            let f = fp8(16, k, bc);
            let full = values(&f);
            for r in [0..c, c..k] {
                if r.is_empty() {
                    continue;
                }
                match super::col_range(&f, r.clone(), 2) {
                    Ok(p) => proptest::prop_assert_eq!(values(&p), cols_of_values(&full, (16, k), r.start, r.end)),
                    Err(_) => proptest::prop_assert!(!super::gcd(bc, r.start).is_multiple_of(8) || !r.len().is_multiple_of(8)),
                }
            }
        }

        /// The dense MLP's cuts run from 0 to its rows, in order, on multiples of the unit.
        #[test]
        fn mlp_cuts_are_ordered_multiples(i in 1usize..5000, unit in 1usize..200, world in 1usize..9) {
            let c = mlp_cuts(i, unit, world);
            proptest::prop_assert_eq!(c.len(), world + 1);
            proptest::prop_assert_eq!((c[0], c[world]), (0, i));
            proptest::prop_assert!(c.windows(2).all(|w| w[0] <= w[1]));
            proptest::prop_assert!(c[..world].iter().all(|&x| x % unit == 0 || x == i));
        }
    }
}
