//! The wide form of the batched products (`mma_wide.cu`): decode batches of rows through one
//! matrix (`matvec`, from `ops::matvec_rows`) and a decode batch's expert pairs grouped by
//! expert (`grouped`). 128 weight rows a block, streamed through shared memory in stages; see the
//! kernel file's header.

use super::dispatch::{self, MMA_ROWS_INPUTS};
use super::ops::{blocks, cfg, cfg3, matrix_args, Matvec, Slots, WeightFormat};
use super::prefill::{Grouped, GroupedArgs};
use super::{driver_err, CudaError, Gpu, Result};

/// The wide form's stage (mma_wide.cu): `WIDE_ROWB` bytes of each weight row, in `WIDE_STAGES`
/// buffers of 128 rows `WIDE_WLD` bytes apart, with `WIDE_SBB` bytes of each row's scales and of
/// its biases.
pub(super) const WIDE_STAGES: usize = 4;
pub(super) const WIDE_ROWB: usize = 64;
pub(super) const WIDE_WLD: usize = 80;
pub(super) const WIDE_SBB: usize = 16;

/// Inputs one stage of the wide form covers for `bits`-bit weights (16: bf16).
fn stage_inputs(bits: usize) -> usize {
    8 * WIDE_ROWB / bits
}

/// The wide form's dynamic shared memory (`Wide<BITS>` in mma_wide.cu): the weight buffers and,
/// for affine weights, their scales and biases; the inputs as bf16 hi and lo, two buffers of 32
/// rows of `32·chunks + 4` words; their group sums.
fn smem(bits: usize) -> usize {
    let chunks = stage_inputs(bits) / 32;
    let weights = 128 * WIDE_WLD;
    let scales = if bits == 16 { 0 } else { 2 * 128 * WIDE_SBB };
    WIDE_STAGES * (weights + scales) + 2 * 32 * (32 * chunks + 4) * 4 + 2 * chunks * 32 * 4
}

/// The weights' bits (16: bf16).
fn bits(m: &Matvec) -> usize {
    match m.format {
        WeightFormat::Affine { bits, .. } => bits as usize,
        WeightFormat::Bf16 => 16,
    }
}

/// Lets entry point `name` take the wide form's shared memory, enough for both affine widths so
/// that a graph holding launches of either stays valid; the bytes a launch for `bits` takes.
fn allow_smem(g: &Gpu, name: &str, bits: usize) -> Result<u32> {
    let allow = match bits {
        16 => smem(16),
        _ => smem(4).max(smem(8)),
    };
    g.raise_smem(name, allow)?;
    Ok(smem(bits) as u32)
}

/// A batch of rows on the wide form (`mma_wide_*`), K split over blocks as
/// `dispatch::wide_splits` says, the partial sums in `sl.ws` added by `wide_sum`.
pub(crate) fn matvec(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    sl: Slots,
    name: &str,
    swiglu: bool,
) -> Result<()> {
    let (sets, out_rows) = if swiglu { (2, m.n / 2) } else { (1, m.n) };
    let bits = bits(&m);
    let kst = stage_inputs(bits);
    let stages = m.k / kst;
    let (ws, ws_floats) = sl.ws;
    let splits = dispatch::wide_splits(out_rows, m.k, sl.n, sets, g.multiprocessors(), ws_floats);
    // A block's stages hold whole groups (a group spans stages for 8-bit weights in groups of 128).
    let group_stages = match m.format {
        WeightFormat::Affine { group, .. } => group.div_ceil(kst),
        WeightFormat::Bf16 => 1,
    };
    let spb = stages
        .div_ceil(splits)
        .next_multiple_of(group_stages)
        .min(stages);
    let splits = stages.div_ceil(spb);
    let part = if splits > 1 { ws } else { 0 };
    let (nk, b32, xs, spb32) = (
        [out_rows as i32, m.k as i32],
        sl.n as i32,
        sl.x_stride as i64,
        spb as i32,
    );
    let (affine, io) = (m.format.affine_args(), [x, y, part]);
    let mut b = g.launch_builder(g.kernels().get(name));
    matrix_args(&mut b, &m.w, &affine, &io, &nk);
    b.arg(&b32).arg(&xs);
    if !swiglu {
        b.arg(&m.bias);
    }
    b.arg(&spb32);
    let grid = (
        blocks(sl.n, MMA_ROWS_INPUTS),
        blocks(out_rows * sets, 128),
        splits as u32,
    );
    let smem = allow_smem(g, name, bits)?;
    // SAFETY: W holds N·K weights of its format (N = 2I for SwiGLU; K % 256 == 0 and the
    // format is one the tensor-core kernels take: dispatch), x holds n rows of x_stride ≥ K
    // floats (16-byte aligned, checked by the caller), y n·N floats (n·I); with splits > 1
    // the partial sums take splits·n·sets·N ≤ ws_floats floats (wide_splits); the block has the
    // kernel's 256 threads and `wide_smem` bytes of shared memory, allowed just above.
    unsafe { b.launch(cfg3(grid, 256, smem)) }.map_err(driver_err(name))?;
    if splits > 1 {
        let (s32, sets32) = (splits as i32, sets as i32);
        let bias = if swiglu { 0 } else { m.bias };
        let mut b = g.launch_builder(g.kernels().get("wide_sum"));
        b.arg(&ws)
            .arg(&y)
            .arg(&nk[0])
            .arg(&b32)
            .arg(&s32)
            .arg(&sets32)
            .arg(&bias);
        // SAFETY: the partial sums above (splits·n·sets·N floats), y n·N floats; the grid
        // covers N × n.
        unsafe { b.launch(cfg((blocks(out_rows, 256), sl.n as u32), 256, 0)) }
            .map_err(driver_err("wide_sum"))?;
    }
    Ok(())
}

/// `y[p] = W_{e(p)} x_{p / x_div}` (or with `swiglu` `h[p] = silu(G_e x) ⊙ U_e x`) for every pair
/// p of a decode batch's grouping on the grouped wide kernels (`mma_gwide_*`): `blocks` blocks
/// (at most `gr.max_tiles`) a row block, looping over the tiles; size it for the tiles expected.
pub fn grouped(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    gr: Grouped,
    swiglu: bool,
    blocks_x: usize,
) -> Result<()> {
    if !dispatch::wide_takes(&m)
        || !gr.x_stride.is_multiple_of(4)
        || gr.x_div == 0
        || gr.tile > MMA_ROWS_INPUTS
    {
        return Err(CudaError::Unsupported(format!(
            "grouped wide product: K {} / stride {} / tiles of {} not supported",
            m.k, gr.x_stride, gr.tile
        )));
    }
    let (sets, out_rows) = if swiglu { (2, m.n / 2) } else { (1, m.n) };
    let name = match (matches!(m.format, WeightFormat::Affine { .. }), swiglu) {
        (false, false) => "mma_gwide_rows_bf16",
        (false, true) => "mma_gwide_swiglu_bf16",
        (true, false) => "mma_gwide_rows_affine",
        (true, true) => "mma_gwide_swiglu_affine",
    };
    let smem = allow_smem(g, name, bits(&m))?;
    let args = GroupedArgs::new(&m, [x, y], out_rows, &gr);
    let mut b = g.launch_builder(g.kernels().get(name));
    args.push(&mut b);
    let grid = (
        blocks_x.clamp(1, gr.max_tiles.max(1)) as u32,
        blocks(out_rows * sets, 128),
    );
    // SAFETY: the tiles come from moe_group over the same pairs (counts ≤ gr.tile ≤ 32, experts
    // < the stack's count); x holds (max pair / x_div + 1) rows of x_stride ≥ K floats (16-byte
    // aligned: checked), y pairs·N floats (pairs·I for SwiGLU); W the stacked experts of a format
    // the wide kernels take (K % 256 == 0: checked); the block has 256 threads and the shared
    // memory allowed just above.
    unsafe { b.launch(cfg(grid, 256, smem)) }.map_err(driver_err(name))?;
    Ok(())
}
