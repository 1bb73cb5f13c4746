//! The one place a matrix product on CUDA picks its kernel: [`plan`], a pure function of the
//! weight format, the matrix's shape and the product's slots (no device needed, tested below).
//! [`super::ops::matvec`] and [`super::ops::matvec_swiglu`] launch what it names. A new weight
//! format adds one arm to each match here (and its kernels' entry points to the registry).
//!
//! The families, in the order they are tried:
//! - one input row on the single-row tensor-core kernel (mma_vec.cu, 4/8-bit affine; plain
//!   products only): the decode step's dense projections; up to four rows on its several-row
//!   entries (a decode batch of 2-4 rows);
//! - a batch of rows through one matrix, each weight load serving several rows: tensor cores
//!   (mma_rows.cu, mma_wide.cu; a GEMM form from [`GEMM_MIN_ROWS`] rows on) or CUDA cores
//!   (matvec_rows.cu);
//! - slots that pick their matrices by id (experts, far stacks over PCIe), CUDA cores
//!   (matvec.cu for bf16, qmatvec.cu for affine, fp8.cu for FP8).
//!
//! FP8 weights take the CUDA-core forms (fp8.cu: rows, grouped prefill tiles, slots) and, for
//! prefill's bf16 products, the dequantizing GEMMs (gemm.rs).
//!
//! Prefill's expert products grouped by expert take their tile from [`grouped_tile`].

use super::ops::{Matvec, Slots, WeightFormat};

/// How a product runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// One row on the single-row tensor-core kernel (`vec::matvec`).
    OneRow,
    /// 2 to `vec::VEC_MAX_ROWS` rows through one matrix on the single-row kernel's several-row
    /// entries (`vec::matvec_rows`): the weights read once, each row bitwise its one-row launch.
    VecRows,
    /// A batch of rows through one matrix: `kernel` in `form`.
    Rows {
        kernel: &'static str,
        form: RowsForm,
    },
    /// Slots picking matrices by id: `kernel`, computing `rows_per_warp` output rows a warp in
    /// blocks of `warps` warps.
    Slots {
        kernel: &'static str,
        rows_per_warp: usize,
        warps: u32,
    },
}

/// The form of a batch-of-rows product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsForm {
    /// Tensor cores, inputs staged once per block of 128 weight rows (mma_rows.cu).
    Gemm,
    /// Tensor cores, split-K, 16 weight rows a block (mma_rows.cu; small decode batches).
    SplitK,
    /// Tensor cores, 128 weight rows a block, weights and the inputs staged once per product
    /// streamed through shared memory, K split over blocks (mma_wide.cu; decode batches from
    /// [`WIDE_MIN_ROWS`] rows, K a multiple of [`WIDE_K_MULTIPLE`], the staged inputs in the
    /// slots' workspace).
    Wide,
    /// CUDA cores (matvec_rows.cu).
    Cores,
}

/// Input rows the `*_rows` kernels serve per weight load (`MV_VECS` in matvec_rows.cu).
pub(super) const MV_VECS: usize = 8;
/// Weight rows a warp of the `*_rows` kernels computes (`MV_ROWS` in matvec_rows.cu).
pub(super) const MV_ROWS: usize = 4;
/// Input rows one warp of the `mma_*` kernels takes (`8·MMA_TILES` in mma_frag.cuh).
pub(super) const MMA_ROWS_INPUTS: usize = 32;

/// From this many input rows on, the GEMM form of mma_rows.cu (inputs staged once per block of
/// 128 weight rows) runs instead of the split-K form (16 weight rows per block, made for decode
/// batches). Every decode batch (at most 256 rows) takes split-K: at 64 rows the GEMM form's few
/// blocks (two for a router of 257 rows) made a 35B step 2.4× slower than at 32 rows.
pub const GEMM_MIN_ROWS: usize = 512;

/// The kernel a product of `m` over `sl` runs (`swiglu`: `[gate | up]` rows with the SwiGLU
/// epilogue).
pub fn plan(m: &Matvec, sl: &Slots, swiglu: bool) -> Plan {
    if !swiglu && super::vec::takes(m, sl) {
        return Plan::OneRow;
    }
    if !swiglu && super::vec::takes_rows(m, sl) {
        return Plan::VecRows;
    }
    if batched_rows(m, sl) && !per_row_swiglu(m, sl, swiglu) {
        let form = match (tensor_core_rows(m), sl.n) {
            (true, n) if n >= GEMM_MIN_ROWS => RowsForm::Gemm,
            (true, n) if n >= WIDE_MIN_ROWS && wide_takes(m) && wide_room(m, sl.n, sl.ws) => {
                RowsForm::Wide
            }
            (true, _) => RowsForm::SplitK,
            (false, _) => RowsForm::Cores,
        };
        return Plan::Rows {
            kernel: rows_kernel(m.format, swiglu, form),
            form,
        };
    }
    let far = sl.far.is_some();
    match m.format {
        WeightFormat::Bf16 => Plan::Slots {
            kernel: if swiglu {
                "matvec_swiglu_bf16"
            } else {
                "matvec_bf16"
            },
            rows_per_warp: 1,
            warps: 8,
        },
        WeightFormat::Fp8 { .. } => Plan::Slots {
            kernel: if swiglu {
                "matvec_swiglu_fp8"
            } else {
                "matvec_fp8"
            },
            rows_per_warp: 1,
            warps: 8,
        },
        WeightFormat::Affine { bits, .. } => {
            let rpw = affine_rows_per_warp(m.n * sl.n);
            Plan::Slots {
                kernel: affine_kernel(swiglu, bits, rpw, far),
                rows_per_warp: rpw,
                warps: if swiglu {
                    swiglu_warps_per_block(rpw, far)
                } else {
                    8
                },
            }
        }
    }
}

/// Whether the rows of `sl` through an affine SwiGLU matrix run per slot as one row does: up to
/// `vec::VEC_MAX_ROWS` rows, so that a step of that many rows gives each row its one-row result
/// (the single-row kernel takes no SwiGLU; a shared expert's or dense MLP's rows read the same
/// small matrix, mostly from L2).
fn per_row_swiglu(m: &Matvec, sl: &Slots, swiglu: bool) -> bool {
    swiglu && sl.n <= super::vec::VEC_MAX_ROWS && matches!(m.format, WeightFormat::Affine { .. })
}

/// Whether a decode step of `rows` rows runs its fused form: at most `vec::VEC_MAX_ROWS` rows and
/// every mixer input and output projection (`mats`) taken by the single-row kernel for them
/// (inputs `m.k` floats apart).
pub fn fused_decode(rows: usize, mut mats: impl Iterator<Item = Matvec>) -> bool {
    let taken = |m: &Matvec| match rows {
        1 => plan(m, &Slots::one(), false) == Plan::OneRow,
        _ => plan(m, &Slots::rows(rows, m.k), false) == Plan::VecRows,
    };
    (1..=super::vec::VEC_MAX_ROWS).contains(&rows) && mats.all(|m| taken(&m))
}

/// The tile of the grouped expert products of prefill (prefill.rs) for `[gate | up]` and down
/// matrices whose inputs are `x_stride` and `inter` floats apart: with `bf16` (bf16 products
/// allowed) the bf16 grouped GEMM's tiles when it takes both matrices (`gemm.rs`); else the
/// exact tensor-core tiles when both take them, else CUDA-core tiles; None when no grouped
/// kernel takes them (the products then run per slot).
pub fn grouped_tile(
    gate_up: &Matvec,
    down: &Matvec,
    x_stride: usize,
    inter: usize,
    bf16: bool,
) -> Option<usize> {
    use super::gemm::{self, TILE_GEMM};
    use super::prefill::{grouped_supported, TILE_CORES, TILE_MMA};
    let rows16 = x_stride.is_multiple_of(8) && inter.is_multiple_of(8);
    if bf16 && rows16 && gemm::supported(gate_up) && gemm::supported(down) {
        return Some(TILE_GEMM);
    }
    if !grouped_supported(gate_up, x_stride) || !grouped_supported(down, inter) {
        return None;
    }
    match tensor_core_rows(gate_up) && tensor_core_rows(down) {
        true => Some(TILE_MMA),
        false => Some(TILE_CORES),
    }
}

/// Pairs an expert expects, at most, for a prefill pass's expert products to run on the
/// streamed wide kernels ([`prefill_wide_tile`]) rather than the grouped GEMMs, whose tiles of
/// 64 pairs such passes leave mostly empty
/// (35B 4-bit on an H100: 512 tokens, 16 pairs an expert, 15,700 against 13,700 tok/s; 1,024
/// tokens 19,400 against 20,900).
pub const PREFILL_WIDE_PER_EXPERT: usize = 16;

/// Tokens of the longest prefill pass whose expert products take the wide kernels, for
/// `top_k` of `experts` experts a token ([`PREFILL_WIDE_PER_EXPERT`] pairs an expert).
pub fn prefill_wide_max_tokens(top_k: usize, experts: usize) -> usize {
    PREFILL_WIDE_PER_EXPERT * experts / top_k.max(1)
}

/// The tile of a prefill pass's expert products on the wide kernels (`wide::grouped`, each
/// expert's weights streamed once per 32 of its pairs, exact): for `tokens` tokens picking
/// `top_k` of `experts` experts that expect at most [`PREFILL_WIDE_PER_EXPERT`] pairs each, when
/// the wide kernels take both matrices (`x_stride`, `inter` as in [`grouped_tile`]); None (the
/// grouped GEMMs of [`grouped_tile`]) otherwise.
pub fn prefill_wide_tile(
    gate_up: &Matvec,
    down: &Matvec,
    (x_stride, inter): (usize, usize),
    (tokens, top_k, experts): (usize, usize, usize),
) -> Option<usize> {
    let takes = |m: &Matvec, stride: usize| wide_takes(m) && stride.is_multiple_of(4);
    let few = tokens <= prefill_wide_max_tokens(top_k, experts);
    (few && takes(gate_up, x_stride) && takes(down, inter)).then_some(MMA_ROWS_INPUTS)
}

/// From this many rows on, a decode step's expert products run grouped by expert
/// ([`grouped_decode_tile`]); below it per slot, as one row does, so that steps of up to
/// `vec::VEC_MAX_ROWS` rows give each row its one-row result (35B 4-bit, H100, before the
/// several-row single-row kernel: 2 rows 437 tok/s per slot against 388 grouped, 4 rows 742
/// against 756).
pub const GROUPED_DECODE_MIN_ROWS: usize = super::vec::VEC_MAX_ROWS + 1;

/// The tile of a decode batch's expert products grouped by expert on the tensor-core kernels
/// (`wide::grouped` where [`wide_takes`] the matrix, else `prefill::grouped_split`: each picked
/// expert's weights read once for all the rows routed to it), for `rows` rows picking `top_k` of `experts` experts: 8 pairs while an
/// expert expects at most 4 of them, else 16. None (the products run per slot) below
/// [`GROUPED_DECODE_MIN_ROWS`] rows or for matrices the tensor-core kernels do not take; `x_stride`
/// and `inter` are the inputs' strides as in [`grouped_tile`].
pub fn grouped_decode_tile(
    gate_up: &Matvec,
    down: &Matvec,
    (x_stride, inter): (usize, usize),
    (rows, top_k, experts): (usize, usize, usize),
) -> Option<usize> {
    use super::prefill::TILES_SPLIT;
    let takes = |m: &Matvec, stride: usize| tensor_core_rows(m) && stride.is_multiple_of(4);
    if rows < GROUPED_DECODE_MIN_ROWS || !takes(gate_up, x_stride) || !takes(down, inter) {
        return None;
    }
    let per_expert = (rows * top_k) as f64 / experts.max(1) as f64;
    Some(match per_expert > 4.0 {
        false => TILES_SPLIT[0],
        true => TILES_SPLIT[1],
    })
}

/// Whether the kernels read x as float4s (bf16 rows only when K is a multiple of 8; FP8 rows
/// always are).
pub(super) fn vector_x(m: &Matvec) -> bool {
    matches!(m.format, WeightFormat::Affine { .. }) || m.k.is_multiple_of(8)
}

/// Whether `sl` is a batch of rows through one matrix that the `*_rows` kernels (each weight
/// load serving several rows) take.
fn batched_rows(m: &Matvec, sl: &Slots) -> bool {
    sl.n > 1
        && sl.ids == 0
        && sl.far.is_none()
        && sl.x_div == 1
        && sl.x_stride >= m.k
        && vector_x(m)
}

/// Whether the tensor-core kernels of mma_rows.cu and mma_wide.cu take this matrix: K a multiple
/// of 32 and bf16 or 4/8-bit affine weights with groups of 32, 64 or 128, or 8-bit ones in groups
/// of 16 with f32 parameters (GGUF's Q6_K; a k16 step a group).
pub fn tensor_core_rows(m: &Matvec) -> bool {
    m.k.is_multiple_of(32)
        && match m.format {
            WeightFormat::Bf16 => true,
            WeightFormat::Affine { bits, group, .. } => {
                matches!((bits, group), (4 | 8, 32 | 64 | 128)) || m.format.group16()
            }
            WeightFormat::Fp8 { .. } => false,
        }
}

/// From this many input rows on, a batch takes the wide form: split-K's 16 weight rows a block
/// read each block's inputs again from L2 (at 32 rows 8× the bytes of 4-bit weights).
pub const WIDE_MIN_ROWS: usize = 8;

/// The wide form takes K in whole stages with its scale slices starting on even offsets
/// (mma_wide.cu); other matrices stay on split-K.
pub const WIDE_K_MULTIPLE: usize = 256;

/// Whether the wide kernels (`mma_wide.cu`, dense and grouped) take matrix `m`.
pub fn wide_takes(m: &Matvec) -> bool {
    tensor_core_rows(m) && m.k.is_multiple_of(WIDE_K_MULTIPLE)
}

/// Bytes of each weight row a stage of the wide form covers (`WIDE_ROWB` in mma_wide.cu).
pub const WIDE_ROWB: usize = 64;

/// Inputs one stage of the wide form covers for `bits`-bit weights (16: bf16).
pub fn wide_stage_inputs(bits: usize) -> usize {
    8 * WIDE_ROWB / bits
}

/// The weights' bits (16: bf16).
pub fn weight_bits(m: &Matvec) -> usize {
    match m.format {
        WeightFormat::Affine { bits, .. } => bits as usize,
        WeightFormat::Fp8 { .. } => 8,
        WeightFormat::Bf16 => 16,
    }
}

/// Words (4 bytes) the staged inputs of a wide-form product over `m` take for `rows` input
/// rows (`wide_stage_rows`): K a row as bf16 hi/lo pairs and, for affine weights, 4 group
/// sums a stage.
pub fn wide_staged_words(m: &Matvec, rows: usize) -> usize {
    let bits = weight_bits(m);
    let sums = match m.format {
        WeightFormat::Affine { .. } => 4 * m.k / wide_stage_inputs(bits),
        WeightFormat::Bf16 | WeightFormat::Fp8 { .. } => 0,
    };
    rows * (m.k + sums)
}

/// Whether a workspace `ws` (address, words) holds the staged inputs of `rows` input rows of a
/// wide-form product over `m`.
pub fn wide_room(m: &Matvec, rows: usize, ws: (u64, usize)) -> bool {
    ws.0 != 0 && ws.1 >= wide_staged_words(m, rows)
}

/// Blocks along K of a wide-form product (`mma_wide_*`) of `n` outputs (`sets` rows each: 2
/// for SwiGLU) over `k` inputs for `rows` rows on `sms` multiprocessors, with room for
/// `ws_floats` floats of partial sums: as many blocks as fit two a multiprocessor in one wave
/// (a second, part-filled wave costs as much as the first), each with at least 8 chunks of 32
/// when K is split; 1 (no partial sums) without room.
pub fn wide_splits(
    n: usize,
    k: usize,
    rows: usize,
    sets: usize,
    sms: usize,
    ws_floats: usize,
) -> usize {
    let blocks = rows.div_ceil(32) * (n * sets).div_ceil(128);
    let want = (2 * sms) / blocks.max(1);
    let by_k = (k / 32 / 8).max(1);
    let by_ws = ws_floats / (rows * sets * n).max(1);
    want.min(by_k).min(by_ws).max(1)
}

/// The entry point of a batch-of-rows product in `form`.
fn rows_kernel(format: WeightFormat, swiglu: bool, form: RowsForm) -> &'static str {
    if let WeightFormat::Fp8 { .. } = format {
        return if swiglu {
            "swiglu_rows_fp8"
        } else {
            "matvec_rows_fp8"
        };
    }
    let affine = matches!(format, WeightFormat::Affine { .. });
    match (form, affine, swiglu) {
        (RowsForm::Gemm, false, false) => "mma_gemm_rows_bf16",
        (RowsForm::Gemm, false, true) => "mma_gemm_swiglu_bf16",
        (RowsForm::Gemm, true, false) => "mma_gemm_rows_affine",
        (RowsForm::Gemm, true, true) => "mma_gemm_swiglu_affine",
        (RowsForm::SplitK, false, false) => "mma_rows_bf16",
        (RowsForm::SplitK, false, true) => "mma_swiglu_bf16",
        (RowsForm::SplitK, true, false) => "mma_rows_affine",
        (RowsForm::SplitK, true, true) => "mma_swiglu_affine",
        (RowsForm::Wide, false, false) => "mma_wide_rows_bf16",
        (RowsForm::Wide, false, true) => "mma_wide_swiglu_bf16",
        (RowsForm::Wide, true, false) => "mma_wide_rows_affine",
        (RowsForm::Wide, true, true) => "mma_wide_swiglu_affine",
        (RowsForm::Cores, false, false) => "matvec_rows_bf16",
        (RowsForm::Cores, false, true) => "swiglu_rows_bf16",
        (RowsForm::Cores, true, false) => "matvec_rows_affine",
        (RowsForm::Cores, true, true) => "swiglu_rows_affine",
    }
}

/// Rows one warp of the affine kernels computes for `rows` output rows in one launch: 4 (each
/// input value loaded serves four rows) when there are enough rows to keep every SM busy, else 2
/// (more warps in flight for the small expert matrices of decode).
pub fn affine_rows_per_warp(rows: usize) -> usize {
    if rows >= 16_384 {
        4
    } else {
        2
    }
}

/// Warps per block of the CUDA-core affine SwiGLU for `rows_per_warp` (from
/// [`affine_rows_per_warp`]): 4 for the near one-row entries, whose 9 blocks an SM at 56
/// registers hold a decode step's experts in one wave; 8 for the others.
pub fn swiglu_warps_per_block(rows_per_warp: usize, far: bool) -> u32 {
    if rows_per_warp == 2 && !far {
        4
    } else {
        8
    }
}

/// The CUDA-core affine kernel (qmatvec.cu) for `bits` and `rows` per warp (2 or 4, from
/// [`affine_rows_per_warp`]), `swiglu` or plain: one entry point per form, each with the
/// registers it needs; with 2 rows a warp, launches that read a `far` stack (experts over PCIe)
/// take the `_far` entries, which keep more blocks resident.
pub fn affine_kernel(swiglu: bool, bits: u32, rows: usize, far: bool) -> &'static str {
    match (swiglu, bits, rows) {
        (false, 2, 2) if far => "matvec_affine2_r2_far",
        (false, 4, 2) if far => "matvec_affine4_r2_far",
        (false, 8, 2) if far => "matvec_affine8_r2_far",
        (true, 2, 2) if far => "matvec_swiglu_affine2_r2_far",
        (true, 4, 2) if far => "matvec_swiglu_affine4_r2_far",
        (true, 8, 2) if far => "matvec_swiglu_affine8_r2_far",
        (false, 2, 2) => "matvec_affine2_r2",
        (false, 4, 2) => "matvec_affine4_r2",
        (false, 8, 2) => "matvec_affine8_r2",
        (false, 2, _) => "matvec_affine2_r4",
        (false, 4, _) => "matvec_affine4_r4",
        (false, _, _) => "matvec_affine8_r4",
        (true, 2, 2) => "matvec_swiglu_affine2_r2",
        (true, 4, 2) => "matvec_swiglu_affine4_r2",
        (true, 8, 2) => "matvec_swiglu_affine8_r2",
        (true, 2, _) => "matvec_swiglu_affine2_r4",
        (true, 4, _) => "matvec_swiglu_affine4_r4",
        (true, _, _) => "matvec_swiglu_affine8_r4",
    }
}

#[cfg(test)]
mod tests {
    use super::{plan, Plan, RowsForm};
    use crate::cuda::ops::{AffineParams, Far, Matvec, Slots, WeightFormat};

    fn mat(n: usize, k: usize, bits: u32) -> Matvec {
        let format = match bits {
            16 => WeightFormat::Bf16,
            _ => WeightFormat::Affine {
                bits,
                group: 64,
                scales: 0,
                biases: 0,
                params: AffineParams::Bf16,
            },
        };
        Matvec {
            w: 0,
            n,
            k,
            bias: 0,
            format,
        }
    }

    fn rows(p: Plan) -> Option<(&'static str, RowsForm)> {
        match p {
            Plan::Rows { kernel, form } => Some((kernel, form)),
            _ => None,
        }
    }

    #[test]
    fn one_row_of_4_bit_weights_takes_the_single_row_kernel_unless_swiglu() {
        let m = mat(2048, 2048, 4);
        assert_eq!(plan(&m, &Slots::one(), false), Plan::OneRow);
        assert!(matches!(plan(&m, &Slots::one(), true), Plan::Slots { .. }));
        // bf16 has no single-row tensor-core kernel.
        let b = plan(&mat(2048, 2048, 16), &Slots::one(), false);
        assert!(matches!(
            b,
            Plan::Slots {
                kernel: "matvec_bf16",
                ..
            }
        ));
    }

    #[test]
    fn eight_bit_groups_of_16_take_tensor_cores_with_f32_parameters_only() {
        let g16 = |params| Matvec {
            format: WeightFormat::Affine {
                bits: 8,
                group: 16,
                scales: 0,
                biases: 0,
                params,
            },
            ..mat(4096, 2048, 8)
        };
        let (m, mlx) = (g16(AffineParams::F32), g16(AffineParams::Bf16));
        assert_eq!(plan(&m, &Slots::one(), false), Plan::OneRow);
        assert_eq!(plan(&m, &Slots::rows(3, 2048), false), Plan::VecRows);
        let split = rows(plan(&m, &Slots::rows(5, 2048), false));
        assert_eq!(split, Some(("mma_rows_affine", RowsForm::SplitK)));
        let ws = Slots::rows(32, 2048).with_ws(256, 1 << 24);
        assert_eq!(
            rows(plan(&m, &ws, true)),
            Some(("mma_wide_swiglu_affine", RowsForm::Wide))
        );
        let gemm = rows(plan(&m, &Slots::rows(600, 2048), false));
        assert_eq!(gemm, Some(("mma_gemm_rows_affine", RowsForm::Gemm)));
        // Other parameter forms (and 4-bit codes) in groups of 16 stay on CUDA cores.
        assert!(matches!(
            plan(&mlx, &Slots::one(), false),
            Plan::Slots { .. }
        ));
        let cores = rows(plan(&mlx, &Slots::rows(5, 2048), false));
        assert_eq!(cores, Some(("matvec_rows_affine", RowsForm::Cores)));
    }

    #[test]
    fn batches_of_rows_take_tensor_cores_then_the_gemm_form() {
        let m = mat(4096, 2048, 4);
        let split = rows(plan(&m, &Slots::rows(5, 2048), false));
        assert_eq!(split, Some(("mma_rows_affine", RowsForm::SplitK)));
        // Up to four rows share the single-row kernel (a SwiGLU product does not).
        for n in 2..=4 {
            assert_eq!(plan(&m, &Slots::rows(n, 2048), false), Plan::VecRows);
        }
        let unaligned = rows(plan(&m, &Slots::rows(2, 2050), false));
        assert_eq!(unaligned, Some(("mma_rows_affine", RowsForm::SplitK)));
        // Up to four rows of an affine SwiGLU run per slot, as one row does.
        let gate_up = plan(&m, &Slots::rows(4, 2048), true);
        assert!(matches!(gate_up, Plan::Slots { .. }), "{gate_up:?}");
        let gate_up = rows(plan(&m, &Slots::rows(5, 2048), true));
        assert_eq!(gate_up, Some(("mma_swiglu_affine", RowsForm::SplitK)));
        // The wide form stages its inputs in the slots' workspace; without room, split-K.
        let staged = super::wide_staged_words(&m, 32);
        assert_eq!(staged, 32 * (2048 + 4 * 16));
        let room = Slots::rows(32, 2048).with_ws(1, staged);
        let wide = rows(plan(&m, &room, false));
        assert_eq!(wide, Some(("mma_wide_rows_affine", RowsForm::Wide)));
        let short = Slots::rows(32, 2048).with_ws(1, staged - 1);
        let split_k = rows(plan(&m, &short, false));
        assert_eq!(split_k, Some(("mma_rows_affine", RowsForm::SplitK)));
        // The wide form takes K in stages of 256 inputs; K = 2080 stays on split-K.
        let odd = Slots::rows(32, 2080).with_ws(1, 1 << 20);
        let k_odd = rows(plan(&mat(4096, 2080, 4), &odd, false));
        assert_eq!(k_odd, Some(("mma_rows_affine", RowsForm::SplitK)));
        let gemm = rows(plan(&m, &Slots::rows(512, 2048), true));
        assert_eq!(gemm, Some(("mma_gemm_swiglu_affine", RowsForm::Gemm)));
        let b = rows(plan(&mat(4096, 2048, 16), &Slots::rows(4, 2048), false));
        assert_eq!(b, Some(("mma_rows_bf16", RowsForm::SplitK)));
        // 2-bit and K not a multiple of 32 stay on CUDA cores.
        let c = rows(plan(&mat(4096, 2048, 2), &Slots::rows(8, 2048), false));
        assert_eq!(c, Some(("matvec_rows_affine", RowsForm::Cores)));
        let odd = rows(plan(&mat(100, 40, 16), &Slots::rows(8, 40), true));
        assert_eq!(odd, Some(("swiglu_rows_bf16", RowsForm::Cores)));
    }

    #[test]
    fn expert_slots_pick_the_cuda_core_kernels_by_rows_and_far_stacks() {
        let m = mat(1024, 2048, 4);
        let sl = Slots::experts(9, 0x1000, 2048, 9);
        let near = plan(&m, &sl, true);
        let want = Plan::Slots {
            kernel: "matvec_swiglu_affine4_r2",
            rows_per_warp: 2,
            warps: 4,
        };
        assert_eq!(near, want);
        let far = Far {
            w: 1,
            scales: 2,
            biases: 3,
            split: 4,
        };
        let p = plan(&m, &sl.with_far(Some(far)), true);
        assert!(matches!(
            p,
            Plan::Slots {
                kernel: "matvec_swiglu_affine4_r2_far",
                warps: 8,
                ..
            }
        ));
        // Enough rows for every SM: four rows a warp.
        let big = plan(
            &mat(16_384, 2048, 8),
            &Slots::experts(2, 0x1000, 2048, 1),
            false,
        );
        assert!(matches!(
            big,
            Plan::Slots {
                kernel: "matvec_affine8_r4",
                rows_per_warp: 4,
                ..
            }
        ));
    }

    #[test]
    fn fp8_weights_take_the_cuda_core_kernels_in_every_form() {
        use super::{grouped_decode_tile, grouped_tile, prefill_wide_tile};
        let m = Matvec {
            format: WeightFormat::Fp8 {
                group: 128,
                scales: 0x2000,
            },
            ..mat(1024, 2048, 16)
        };
        let slots = |sl: Slots, swiglu| match plan(&m, &sl, swiglu) {
            Plan::Slots { kernel, .. } => kernel,
            p => panic!("{p:?}"),
        };
        assert_eq!(slots(Slots::one(), false), "matvec_fp8");
        assert_eq!(
            slots(Slots::experts(8, 0x1000, 0, 8), true),
            "matvec_swiglu_fp8"
        );
        for n in [2, 32, 256, 4096] {
            let sl = Slots::rows(n, 2048).with_ws(0x3000, 1 << 30);
            assert_eq!(
                rows(plan(&m, &sl, false)),
                Some(("matvec_rows_fp8", RowsForm::Cores))
            );
            assert_eq!(
                rows(plan(&m, &sl, true)),
                Some(("swiglu_rows_fp8", RowsForm::Cores))
            );
        }
        assert_eq!(
            grouped_decode_tile(&m, &m, (2048, 1024), (64, 8, 256)),
            None
        );
        assert_eq!(prefill_wide_tile(&m, &m, (2048, 1024), (64, 8, 256)), None);
        let cores = Some(crate::cuda::prefill::TILE_CORES);
        assert_eq!(grouped_tile(&m, &m, 2048, 1024, false), cores);
        let gemm = Some(crate::cuda::gemm::TILE_GEMM);
        assert_eq!(grouped_tile(&m, &m, 2048, 1024, true), gemm);
        assert!(!super::fused_decode(1, [m].into_iter()));
    }

    #[test]
    fn fused_decode_takes_one_row_of_4_and_8_bit_mixer_projections() {
        use super::fused_decode;
        let layer = |bits| [mat(12_352, 2048, bits), mat(2048, 4096, bits)];
        assert!(fused_decode(1, layer(4).into_iter()));
        assert!(fused_decode(1, layer(8).into_iter()));
        // Batches, bf16 or 2-bit weights, or inputs past the staging limit (an 8-bit input
        // counts as two digits) do not.
        assert!(fused_decode(2, layer(4).into_iter()));
        assert!(fused_decode(4, layer(8).into_iter()));
        assert!(!fused_decode(5, layer(4).into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 16)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 2)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 16_384, 4)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 8192, 8)].into_iter()));
    }

    #[test]
    fn grouped_products_take_tensor_core_tiles_when_both_matrices_do() {
        use super::grouped_tile;
        use crate::cuda::prefill::{TILE_CORES, TILE_MMA};
        let (gu, down) = (mat(1024, 2048, 4), mat(2048, 512, 4));
        assert_eq!(grouped_tile(&gu, &down, 2048, 512, false), Some(TILE_MMA));
        let down2 = mat(2048, 512, 2);
        assert_eq!(
            grouped_tile(&gu, &down2, 2048, 512, false),
            Some(TILE_CORES)
        );
        // bf16 inputs must be float4-aligned.
        let odd = mat(100, 42, 16);
        assert_eq!(grouped_tile(&odd, &odd, 42, 42, false), None);
        // bf16 products: the grouped GEMM for 4/8-bit and bf16 stacks with 16-byte rows, the
        // exact kernels for 2-bit and odd rows.
        use crate::cuda::gemm::TILE_GEMM;
        assert_eq!(grouped_tile(&gu, &down, 2048, 512, true), Some(TILE_GEMM));
        let bf = (mat(1024, 2048, 16), mat(2048, 512, 16));
        assert_eq!(grouped_tile(&bf.0, &bf.1, 2048, 512, true), Some(TILE_GEMM));
        assert_eq!(grouped_tile(&gu, &down2, 2048, 512, true), Some(TILE_CORES));
        assert_eq!(grouped_tile(&gu, &down, 2048, 516, true), Some(TILE_MMA));
    }

    #[test]
    fn wide_products_split_k_until_every_multiprocessor_has_two_blocks() {
        use super::wide_splits;
        let ws = 256 * 65_536;
        // GDN input projection of the 35B shape, 32 rows: 97 blocks, split 2 ways (3 would
        // take 291 blocks, a wave and a tenth); at 64 rows 194 blocks, not split.
        assert_eq!(wide_splits(12_352, 2048, 32, 1, 132, ws), 2);
        assert_eq!(wide_splits(12_352, 2048, 64, 1, 132, ws), 1);
        // Its output projection: 16 blocks; K 4096 is 128 chunks, 8 a block at least.
        assert_eq!(wide_splits(2048, 4096, 32, 1, 132, ws), 16);
        // An lm_head has blocks enough; no room for partial sums means no split.
        assert_eq!(wide_splits(248_320, 2048, 32, 1, 132, ws), 1);
        assert_eq!(wide_splits(2048, 4096, 32, 1, 132, 0), 1);
        // Short K: at least 8 chunks a block.
        assert_eq!(wide_splits(257, 256, 32, 1, 132, ws), 1);
    }

    #[test]
    fn short_prefill_passes_stream_the_experts_on_the_wide_kernels() {
        use super::prefill_wide_tile;
        let (gu, down) = (mat(1024, 2048, 4), mat(2048, 512, 4));
        let strides = (2048, 512);
        // 35B shape: 512 tokens of top-8 over 256 experts, 16 pairs an expert.
        assert_eq!(
            prefill_wide_tile(&gu, &down, strides, (512, 8, 256)),
            Some(32)
        );
        assert_eq!(prefill_wide_tile(&gu, &down, strides, (1024, 8, 256)), None);
        // K not in whole stages of the wide kernels, or 2-bit weights: the grouped GEMMs.
        let odd = mat(1024, 2080, 4);
        assert_eq!(
            prefill_wide_tile(&odd, &down, (2080, 512), (512, 8, 256)),
            None
        );
        let two = mat(2048, 512, 2);
        assert_eq!(prefill_wide_tile(&gu, &two, strides, (512, 8, 256)), None);
    }

    #[test]
    fn decode_batches_group_experts_in_tiles_their_pairs_fill() {
        use super::grouped_decode_tile;
        let (gu, down) = (mat(1024, 2048, 4), mat(2048, 512, 4));
        let strides = (2048, 512);
        // One row keeps its per-slot (fused) products, and so do batches below 4 rows.
        assert_eq!(grouped_decode_tile(&gu, &down, strides, (1, 8, 256)), None);
        assert_eq!(grouped_decode_tile(&gu, &down, strides, (3, 8, 256)), None);
        // 32 rows of top-8 over 256 experts: one pair an expert on average.
        assert_eq!(
            grouped_decode_tile(&gu, &down, strides, (32, 8, 256)),
            Some(8)
        );
        assert_eq!(
            grouped_decode_tile(&gu, &down, strides, (256, 8, 256)),
            Some(16)
        );
        // 2-bit weights have no tensor-core kernel.
        let down2 = mat(2048, 512, 2);
        assert_eq!(
            grouped_decode_tile(&gu, &down2, strides, (32, 8, 256)),
            None
        );
    }
}
