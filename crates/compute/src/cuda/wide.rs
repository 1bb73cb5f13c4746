//! The wide form of the batched products (`mma_wide.cu`): decode batches of rows through one
//! matrix (`matvec`, from `ops::matvec_rows`) and a decode batch's expert pairs grouped by
//! expert (`grouped`). The inputs are staged once per product (`wide_stage_rows`) into the
//! caller's workspace; 128 weight rows a block, weights and staged inputs streamed through shared
//! memory in stages; see the kernel file's header.

use super::dispatch::{self, weight_bits, wide_stage_inputs, wide_staged_words, MMA_ROWS_INPUTS};
use super::ops::{blocks, cfg, cfg3, matrix_args, Matvec, Slots, WeightFormat};
use super::prefill::{Grouped, GroupedArgs};
use super::{driver_err, raise_smem_of, CudaError, Gpu, Result};
use cudarc::driver::CudaFunction;

/// The wide form's stage (mma_wide.cu): `dispatch::WIDE_ROWB` bytes of each weight row, in `WIDE_STAGES`
/// buffers (one fewer for blocks of 4 tiles) of 128 rows `WIDE_WLD` bytes apart, with
/// `WIDE_SBB` bytes of each row's scales and of its biases.
pub(super) const WIDE_STAGES: usize = 4;
pub(super) const WIDE_WLD: usize = 80;
pub(super) const WIDE_SBB: usize = 16;
/// Tiles of 8 input rows a block takes at most (`8·MT ≤ MMA_ROWS_INPUTS`).
const WIDE_TILES: usize = MMA_ROWS_INPUTS / 8;

/// Shared buffers of blocks of `mt` tiles (`Wide::P`).
fn stages(mt: usize) -> usize {
    if mt == WIDE_TILES {
        WIDE_STAGES - 1
    } else {
        WIDE_STAGES
    }
}

/// One stage's shared memory (`Wide<BITS, MT>::STAGE`): weights; for affine weights their
/// scales and biases; `8·mt` rows of staged inputs, `32·chunks + 4` words each; for affine
/// weights 4 group sums a row.
fn stage_bytes(bits: usize, mt: usize) -> usize {
    let chunks = wide_stage_inputs(bits) / 32;
    let affine = bits != 16;
    let scales = if affine { 2 * 128 * WIDE_SBB } else { 0 };
    let sums = if affine { 8 * mt * 16 } else { 0 };
    128 * WIDE_WLD + scales + 8 * mt * (32 * chunks + 4) * 4 + sums
}

/// The dynamic shared memory of a launch whose blocks take up to `mt` tiles: the largest of
/// those tile counts' layouts.
fn smem(bits: usize, mt: usize) -> usize {
    (1..=mt)
        .map(|t| stages(t) * stage_bytes(bits, t))
        .max()
        .unwrap_or(0)
}

/// Lets entry point `name` (`f`, of the build the launch takes), compiled for up to `mt_max`
/// tiles, take the most shared memory any launch of it can ask for (both affine widths, every
/// tile count it takes), so that a graph holding launches of either stays valid; the bytes a
/// launch for `bits` and up to `mt` tiles takes.
fn allow_smem(
    f: &CudaFunction,
    name: &str,
    bits: usize,
    (mt, mt_max): (usize, usize),
) -> Result<u32> {
    let allow = match bits {
        16 => smem(16, mt_max),
        _ => smem(4, mt_max).max(smem(8, mt_max)),
    };
    raise_smem_of(f, name, allow)?;
    Ok(smem(bits, mt) as u32)
}

/// The entry points of mma_wide.cu: the dense and grouped products (bf16 and affine; `_t1`, tiles
/// of up to 8 pairs), the staging and the partial sums' add; then the affine ones for 8-bit codes
/// in groups of 16 (`_g16`, the f32-parameter build's, which `Kernels::for_format` takes for such
/// weights).
pub(super) const ENTRIES: [&str; 20] = [
    "mma_wide_rows_bf16",
    "mma_wide_rows_affine",
    "mma_wide_swiglu_bf16",
    "mma_wide_swiglu_affine",
    "mma_gwide_rows_bf16",
    "mma_gwide_swiglu_bf16",
    "mma_gwide_rows_affine",
    "mma_gwide_swiglu_affine",
    "mma_gwide_rows_bf16_t1",
    "mma_gwide_swiglu_bf16_t1",
    "mma_gwide_rows_affine_t1",
    "mma_gwide_swiglu_affine_t1",
    "wide_stage_rows",
    "wide_sum",
    "mma_wide_rows_affine_g16",
    "mma_wide_swiglu_affine_g16",
    "mma_gwide_rows_affine_g16",
    "mma_gwide_swiglu_affine_g16",
    "mma_gwide_rows_affine_t1_g16",
    "mma_gwide_swiglu_affine_t1_g16",
];

/// The grouped wide kernel for tiles of `tile` pairs: the one-tile build (three blocks a
/// multiprocessor) for tiles of at most 8, else the full one; its tile count.
fn grouped_kernel(affine: bool, swiglu: bool, tile: usize) -> (&'static str, usize) {
    let one = tile <= 8;
    let name = match (affine, swiglu, one) {
        (false, false, false) => "mma_gwide_rows_bf16",
        (false, true, false) => "mma_gwide_swiglu_bf16",
        (true, false, false) => "mma_gwide_rows_affine",
        (true, true, false) => "mma_gwide_swiglu_affine",
        (false, false, true) => "mma_gwide_rows_bf16_t1",
        (false, true, true) => "mma_gwide_swiglu_bf16_t1",
        (true, false, true) => "mma_gwide_rows_affine_t1",
        (true, true, true) => "mma_gwide_swiglu_affine_t1",
    };
    (name, if one { 1 } else { WIDE_TILES })
}

/// Stages `rows` input rows of `m`'s product (x_stride floats apart from `x`) at `ws`, which
/// holds `wide_staged_words(m, rows)` words: the hi/lo words, then (affine) the group sums,
/// whose address it returns.
fn stage(g: &Gpu, m: &Matvec, (x, x_stride): (u64, usize), rows: usize, ws: u64) -> Result<u64> {
    let bits = weight_bits(m);
    let (group, affine) = match m.format {
        WeightFormat::Affine { group, .. } => (group as i32, 1i32),
        WeightFormat::Bf16 | WeightFormat::Fp8 { .. } => (32, 0),
    };
    let sums = ws + 4 * (rows * m.k) as u64;
    let (xs, k, kst) = (x_stride as i64, m.k as i32, wide_stage_inputs(bits) as i32);
    let name = "wide_stage_rows";
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&x)
        .arg(&xs)
        .arg(&ws)
        .arg(&sums)
        .arg(&k)
        .arg(&kst)
        .arg(&group)
        .arg(&affine);
    // SAFETY: x holds `rows` rows of x_stride ≥ K floats (x_stride % 4 == 0: 16-byte aligned
    // rows, checked by the callers), ws rows·K words and then rows·(K / kst)·4 floats
    // (wide_staged_words, checked by the callers); K % 256 == 0 (wide_takes); the grid covers
    // K / 4 threads a row.
    unsafe { b.launch(cfg((blocks(m.k, 1024), rows as u32), 256, 0)) }.map_err(driver_err(name))?;
    Ok(sums)
}

/// A batch of rows on the wide form (`mma_wide_*`): inputs staged at the front of `sl.ws`, K
/// split over blocks as `dispatch::wide_splits` says with the partial sums in the rest, added by
/// `wide_sum`.
pub(crate) fn matvec(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    sl: Slots,
    name: &str,
    swiglu: bool,
) -> Result<()> {
    let (sets, out_rows) = if swiglu { (2, m.n / 2) } else { (1, m.n) };
    let bits = weight_bits(&m);
    let kst = wide_stage_inputs(bits);
    let stages = m.k / kst;
    let (ws, ws_words) = sl.ws;
    let staged = wide_staged_words(&m, sl.n);
    if !dispatch::wide_room(&m, sl.n, sl.ws) {
        return Err(CudaError::Unsupported(format!(
            "wide product: {staged} words to stage {} rows, workspace {ws_words}",
            sl.n
        )));
    }
    let sums = stage(g, &m, (x, sl.x_stride), sl.n, ws)?;
    let (ws, ws_floats) = (ws + 4 * staged as u64, ws_words - staged);
    let splits = dispatch::wide_splits(out_rows, m.k, sl.n, sets, g.multiprocessors(), ws_floats);
    // A block's stages hold whole groups (a group spans stages for 8-bit weights in groups of 128).
    let group_stages = match m.format {
        WeightFormat::Affine { group, .. } => group.div_ceil(kst),
        WeightFormat::Bf16 | WeightFormat::Fp8 { .. } => 1,
    };
    let spb = stages
        .div_ceil(splits)
        .next_multiple_of(group_stages)
        .min(stages);
    let splits = stages.div_ceil(spb);
    let part = if splits > 1 { ws } else { 0 };
    let (nk, b32, spb32) = ([out_rows as i32, m.k as i32], sl.n as i32, spb as i32);
    let (affine, io) = (m.format.quant_args(), [sl.ws.0, sums, y, part]);
    let f = g.kernels().for_format(name, &m.format)?;
    let mut b = g.launch_builder(f);
    matrix_args(&mut b, &m.w, &affine, &io, &nk);
    b.arg(&b32);
    if !swiglu {
        b.arg(&m.bias);
    }
    b.arg(&spb32);
    let grid = (
        blocks(sl.n, MMA_ROWS_INPUTS),
        blocks(out_rows * sets, 128),
        splits as u32,
    );
    let mt = sl.n.min(MMA_ROWS_INPUTS).div_ceil(8);
    let smem = allow_smem(f, name, bits, (mt, WIDE_TILES))?;
    // SAFETY: W holds N·K weights of its format (N = 2I for SwiGLU; K % 256 == 0 and the
    // format is one the tensor-core kernels take: dispatch), the staged inputs of n rows are at
    // the front of the workspace (checked above), y holds n·N floats (n·I); with splits > 1 the
    // partial sums take splits·n·sets·N ≤ the workspace's remaining floats (wide_splits); the
    // block has the kernel's 256 threads and the shared memory its tiles need, allowed above.
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
/// p of a decode batch's grouping on the grouped wide kernels (`mma_gwide_*`): the `x_rows`
/// input rows staged into `ws` (device address, words; `dispatch::wide_staged_words`), then
/// `blocks` blocks (at most `gr.max_tiles`) a row block, looping over the tiles; size it for the
/// tiles expected.
pub fn grouped(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    gr: Grouped,
    swiglu: bool,
    blocks_x: usize,
    (x_rows, ws): (usize, (u64, usize)),
) -> Result<()> {
    let staged = wide_staged_words(&m, x_rows);
    if !dispatch::wide_takes(&m)
        || !gr.x_stride.is_multiple_of(4)
        || gr.x_div == 0
        || gr.tile > MMA_ROWS_INPUTS
        || !dispatch::wide_room(&m, x_rows, ws)
    {
        return Err(CudaError::Unsupported(format!(
            "grouped wide product: K {} / stride {} / tiles of {} / workspace {} of {staged} words not supported",
            m.k, gr.x_stride, gr.tile, ws.1
        )));
    }
    let sums = stage(g, &m, (x, gr.x_stride), x_rows, ws.0)?;
    let (sets, out_rows) = if swiglu { (2, m.n / 2) } else { (1, m.n) };
    let affine = matches!(m.format, WeightFormat::Affine { .. });
    let (name, mt_max) = grouped_kernel(affine, swiglu, gr.tile);
    let f = g.kernels().for_format(name, &m.format)?;
    let smem = allow_smem(f, name, weight_bits(&m), (gr.tile.div_ceil(8), mt_max))?;
    let args = GroupedArgs::new(&m, vec![ws.0, sums, y], out_rows, &gr, false);
    let mut b = g.launch_builder(f);
    args.push(&mut b);
    let grid = (
        blocks_x.clamp(1, gr.max_tiles.max(1)) as u32,
        blocks(out_rows * sets, 128),
    );
    // SAFETY: the tiles come from moe_group over the same pairs (counts ≤ gr.tile ≤ 8·mt_max, experts
    // < the stack's count); the staged inputs hold x_rows ≥ max pair / x_div + 1 rows (the
    // caller's grouping), y pairs·N floats (pairs·I for SwiGLU); W the stacked experts of a
    // format the wide kernels take (K % 256 == 0: checked); the block has 256 threads and the
    // shared memory its tiles need, allowed just above.
    unsafe { b.launch(cfg(grid, 256, smem)) }.map_err(driver_err(name))?;
    Ok(())
}
