//! One input row through a 4- or 8-bit MLX affine matrix on tensor cores (`kernels/mma_vec.cu`):
//! the decode projections, routers and lm_head of quantized models. Dequantizing on CUDA cores
//! costs several instructions per weight, more than the issue rate allows at memory speed; here the
//! codes enter mma.sync exactly, two per instruction, with the FMA dequant form per group and the
//! input as bf16 hi + lo (see the kernel's header). An 8-bit code enters as two 4-bit digits, so
//! the kernel sees a matrix of twice the inputs and groups in digits ([`digits`]). Up to
//! [`VEC_MAX_ROWS`] input rows share one launch ([`matvec_rows`]): the rows fill the mma's unused
//! columns, so the weights are read once and each row comes out bitwise as its one-row launch.

use super::ops::{blocks, cfg, AffineParams, Matvec, Slots, WeightFormat, GDN_CONV_KMAX};
use super::{driver_err, raise_smem_of, CudaError, Gpu, Result};
use cudarc::driver::DeviceRepr;

/// What a single-row product does besides `y = W x` (`VecIo` in mma_vec.cu, passed by value):
/// an RMSNorm of its input, the residual add and the GDN conv step, so a decode layer needs no
/// launches of its own for them. The default does none of them. Pointers are device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct VecIo {
    /// RMSNorm scale `[K]`: x is a raw residual row, normalized (·scale) as it is staged.
    pub norm: u64,
    /// With `norm`: `[K]` that receives the normalized row (0: not written).
    pub normed: u64,
    pub eps: f32,
    /// 1: `y += W x` (the residual add) instead of `y = W x`.
    pub accumulate: i32,
    /// Conv step (when `conv_c` > 0): the row's sequence slot, device int[1].
    pub slots: u64,
    /// The layer's conv state `[slots, conv_k − 1, conv_c]`.
    pub conv_state: u64,
    /// Conv weights `[conv_c, conv_k]`.
    pub conv_w: u64,
    /// `[conv_c]`: silu of the conv of rows 0..conv_c of y.
    pub mixed: u64,
    pub conv_c: i32,
    pub conv_k: i32,
    /// `[blocks, 2]` f32 (0: none), for a launch of the ring kernel ([`ring_blocks`]): block b
    /// writes the largest of its outputs and that output's row (the lowest on ties; its bits as
    /// an i32), so the greedy pick after a one-row lm_head scans one pair a block instead of
    /// every logit.
    pub best: u64,
    /// Input rows (set by [`matvec_rows`]; the one-row entries ignore it).
    pub rows: i32,
    /// Floats between input rows (set by [`matvec_rows`]).
    pub x_stride: i32,
}

// SAFETY: plain old data of the kernel's parameter layout (8-byte pointers, then 4-byte fields in
// pairs: no padding, the struct a multiple of 8 bytes), read by value.
unsafe impl DeviceRepr for VecIo {}

/// Largest K the single-row tensor-core kernel stages in shared memory (5 bytes per input).
const VEC_MAX_K: usize = 8192;

/// The inputs and the group size the kernel works in for `bits`-bit codes with parameters
/// `params`: 4-bit digits, so an 8-bit code counts twice (mma_vec.cu's header); `None` for widths
/// and groups it does not take (4 bits with groups of 32, 64 or 128; 8 bits with groups of 32 or
/// 64, and of 16 with f32 parameters: GGUF's Q6_K).
pub fn digits(bits: u32, k: usize, group: usize, params: AffineParams) -> Option<(usize, usize)> {
    match (bits, group, params) {
        (4, 32 | 64 | 128, _) | (8, 32 | 64, _) | (8, 16, AffineParams::F32) => {
            Some((k * bits as usize / 4, group * bits as usize / 4))
        }
        _ => None,
    }
}

/// Input rows one launch of the several-row entries takes at most (VEC_MAX_ROWS in mma_vec.cu:
/// two columns of the mma's eight a row).
pub const VEC_MAX_ROWS: usize = 4;

/// Whether one input row through `m` goes to the single-row tensor-core kernel (mma_vec.cu):
/// 4- or 8-bit affine weights whose groups [`digits`] takes.
pub fn takes(m: &Matvec, sl: &Slots) -> bool {
    sl.n == 1 && sl.ids == 0 && sl.far.is_none() && takes_matrix(m)
}

/// Whether the `sl.n` rows (2 to [`VEC_MAX_ROWS`]) through `m` go to the several-row entries
/// ([`matvec_rows`]): a matrix [`takes`] would take, rows starting 16-byte aligned.
pub fn takes_rows(m: &Matvec, sl: &Slots) -> bool {
    (2..=VEC_MAX_ROWS).contains(&sl.n)
        && sl.ids == 0
        && sl.far.is_none()
        && sl.x_div == 1
        && sl.x_stride.is_multiple_of(4)
        && takes_matrix(m)
}

fn takes_matrix(m: &Matvec) -> bool {
    let WeightFormat::Affine {
        bits,
        group,
        params,
        ..
    } = m.format
    else {
        return false;
    };
    let Some((k, _)) = digits(bits, m.k, group, params) else {
        return false;
    };
    m.k.is_multiple_of(group) && k <= VEC_MAX_K
}

/// Blocks of the single-row kernel resident at once per multiprocessor (two: 128 registers ×
/// 256 threads each).
const BLOCKS_PER_SM: usize = 2;

/// Row tiles of 16 per block of the single-row kernel (1 to 4) for N rows when `resident`
/// blocks run at once. The time of a launch goes as waves × tiles (a wave: the blocks resident
/// at once, each working through its tiles), so the choice minimizes that, preferring more tiles
/// per block (x staged fewer times, all rows asked of L2 before the wait) within 5%: on 132 SMs,
/// N = 12,352 (a GDN input projection, 772 tiles) takes one wave of 3 tiles where 2 tiles per
/// block would take two waves.
pub fn tiles(n: usize, resident: usize) -> usize {
    let row_tiles = n.div_ceil(16).max(1);
    let cost = |t: usize| row_tiles.div_ceil(t).div_ceil(resident.max(1)) * t;
    let best = (1..=4).map(cost).min().unwrap_or(1);
    (1..=4)
        .rev()
        .find(|&t| cost(t) * 100 <= best * 105)
        .unwrap_or(1)
}

/// The entries of mma_vec.cu's parts, which the registry compiles apart and in parallel
/// (`kernels.rs`; the file's tail says why): 4-bit codes, then 8-bit codes, then the 8-bit ones
/// for groups of 16 (`_g16`, the f32-parameter build's, which `Kernels::for_format` takes for such
/// weights); each as one row streamed, staged, ring and staged in 16-warp blocks ([`Form`]), then
/// the several-row entries of those forms and streamed in 16-warp blocks.
pub(super) const PARTS: [&[&str]; 6] = [
    &[
        "mma_vec_affine4",
        "mma_vec_affine4_staged",
        "mma_vec_affine4_ring",
        "mma_vec_affine4_staged16",
    ],
    &[
        "mma_vec_rows_affine4",
        "mma_vec_rows_affine4_staged",
        "mma_vec_rows_affine4_ring",
        "mma_vec_rows_affine4_staged16",
        "mma_vec_rows_affine4_streamed16",
    ],
    &[
        "mma_vec_affine8",
        "mma_vec_affine8_staged",
        "mma_vec_affine8_ring",
        "mma_vec_affine8_staged16",
    ],
    &[
        "mma_vec_rows_affine8",
        "mma_vec_rows_affine8_staged",
        "mma_vec_rows_affine8_ring",
        "mma_vec_rows_affine8_staged16",
        "mma_vec_rows_affine8_streamed16",
    ],
    &[
        "mma_vec_affine8_g16",
        "mma_vec_affine8_staged_g16",
        "mma_vec_affine8_ring_g16",
        "mma_vec_affine8_staged16_g16",
    ],
    &[
        "mma_vec_rows_affine8_g16",
        "mma_vec_rows_affine8_staged_g16",
        "mma_vec_rows_affine8_ring_g16",
        "mma_vec_rows_affine8_staged16_g16",
        "mma_vec_rows_affine8_streamed16_g16",
    ],
];

/// The entry of `form` for 8-bit codes or 4-bit ones, one row or several.
fn entry(bits8: bool, form: Form, rows: bool) -> &'static str {
    PARTS[2 * usize::from(bits8) + usize::from(rows)][form as usize]
}

/// Where a launch reads its weights (mma_vec.cu's VEC_GLOBAL, VEC_STAGED, VEC_RING) and in how
/// many warps a block, in the order of each part's entries ([`PARTS`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    Streamed,
    Staged,
    Ring,
    /// Staged in blocks of 16 warps.
    Staged16,
    /// Streamed in blocks of 16 warps (several rows only).
    Streamed16,
}

impl Form {
    /// The form of a launch of `blocks` blocks on `sms` multiprocessors, given whether its tiles
    /// can be staged (one wave of two 8-warp blocks an SM, whole copy units) or streamed through
    /// a ring: a staged launch of at most one block per SM takes blocks of 16 warps, each warp
    /// half the groups (a shorter chain of products per block, the SMs' warps otherwise idle).
    fn choose(blocks: usize, sms: usize, staged: bool, ring: bool) -> Form {
        match (staged, ring) {
            (true, _) if blocks <= sms => Form::Staged16,
            (true, _) => Form::Staged,
            (false, true) => Form::Ring,
            (false, false) => Form::Streamed,
        }
    }

    /// The form of a several-row launch whose one-row form is `one`, given whether its rows
    /// fit the staged or ring form's shared memory: the same warps a block (each row's warps
    /// then meet in the one-row order), streamed where the rows do not fit.
    fn for_rows(one: Form, staged: bool, ring: bool) -> Form {
        match one {
            Form::Staged16 if !staged => Form::Streamed16,
            Form::Staged if !staged => Form::Streamed,
            Form::Ring if !ring => Form::Streamed,
            f => f,
        }
    }

    fn threads(self) -> u32 {
        match self {
            Form::Staged16 | Form::Streamed16 => 512,
            _ => 256,
        }
    }
}

/// How a single-row product launches: the form, its dynamic shared memory, grid and ring buffers,
/// with the matrix's inputs and group in digits ([`digits`]) and its scales and biases.
struct Plan {
    name: &'static str,
    form: Form,
    smem: usize,
    grid: u32,
    tiles: usize,
    nbuf: Option<i32>,
    k: usize,
    group: usize,
    scales: u64,
    biases: u64,
}

fn plan(g: &Gpu, m: &Matvec, conv: bool, rows: usize) -> Result<Plan> {
    let unsupported = || {
        CudaError::Unsupported(
            "the single-row kernel takes 4-bit (groups 32-128) or 8-bit (groups 32, 64; 16 with f32 parameters) affine weights"
                .into(),
        )
    };
    let WeightFormat::Affine {
        bits,
        group,
        scales,
        biases,
        params,
    } = m.format
    else {
        return Err(unsupported());
    };
    let (k, group) = digits(bits, m.k, group, params).ok_or_else(unsupported)?;
    let resident = BLOCKS_PER_SM * g.multiprocessors();
    let tiles = tiles(m.n, resident);
    // Bulk copies need sm_90 and 16-byte aligned matrices.
    let bulk = g.compute_capability().0 >= 9 && [m.w, scales, biases].iter().all(|p| p % 16 == 0);
    let n_blocks = blocks(m.n, 16 * tiles);
    let one_wave = n_blocks as usize <= resident;
    let staged = staged_smem(k, group, params, tiles, 1).filter(|_| bulk && one_wave);
    let ring = ring_plan(k, group, params, RING_TILES, 1).filter(|_| bulk && !one_wave && !conv);
    let one = Form::choose(
        n_blocks as usize,
        g.multiprocessors(),
        staged.is_some(),
        ring.is_some(),
    );
    // The rows' launch keeps the one-row form where its staging still fits (one row: the same).
    let staged = staged.and_then(|_| staged_smem(k, group, params, tiles, rows));
    let ring = ring.and_then(|_| ring_plan(k, group, params, RING_TILES, rows));
    let form = Form::for_rows(one, staged.is_some(), ring.is_some());
    let (smem, grid, nbuf) = match (form, staged, ring) {
        (Form::Staged | Form::Staged16, Some(bytes), _) => (bytes, n_blocks, None),
        (Form::Ring, _, Some((nbuf, bytes))) => {
            let grid = blocks(m.n, 16 * RING_TILES).min(resident as u32);
            (bytes, grid, Some(nbuf as i32))
        }
        _ => (stage_smem(k, group, rows), n_blocks, None),
    };
    Ok(Plan {
        name: entry(bits == 8, form, rows > 1),
        form,
        smem,
        grid,
        tiles,
        nbuf,
        k,
        group,
        scales,
        biases,
    })
}

/// The blocks of a single-row product through `m` (without a conv step) when it runs as the ring
/// kernel, the one that writes [`VecIo::best`] (one pair a block); `None` for the other forms.
pub fn ring_blocks(g: &Gpu, m: &Matvec) -> Result<Option<u32>> {
    let p = plan(g, m, false, 1)?;
    Ok((p.form == Form::Ring).then_some(p.grid))
}

/// `y = W x (+ bias)` for one input row of a 4- or 8-bit affine matrix on tensor cores, with what `io`
/// adds (see [`VecIo`]; the caller checked [`takes`]).
pub fn matvec(g: &Gpu, m: Matvec, x: u64, y: u64, io: VecIo) -> Result<()> {
    launch(g, m, x, y, 1, io)
}

/// `y[r] = W x[r] (+ bias)` for `rows` input rows (1 to [`VEC_MAX_ROWS`]) `x_stride` floats
/// apart (a multiple of 4, at least the matrix's inputs), y `[rows, N]`, in one launch: each row
/// bitwise its one-row [`matvec`]. `io`'s norm, normed (`[rows, K]`) and accumulate apply per row;
/// its conv step and `best` take one row.
pub fn matvec_rows(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    rows: usize,
    x_stride: usize,
    io: VecIo,
) -> Result<()> {
    if !(1..=VEC_MAX_ROWS).contains(&rows) {
        return Err(CudaError::Unsupported(format!(
            "{rows} rows in one single-row kernel launch (it takes 1 to {VEC_MAX_ROWS})"
        )));
    }
    if rows > 1 && (io.conv_c > 0 || io.best != 0) {
        return Err(CudaError::Unsupported(
            "the fused conv step and the greedy pairs take one row".into(),
        ));
    }
    if rows > 1 && (!x_stride.is_multiple_of(4) || x_stride < m.k) {
        return Err(CudaError::Unsupported(format!(
            "input rows {x_stride} floats apart for a matrix of {} inputs (the kernel needs a multiple of 4, at least the inputs)",
            m.k
        )));
    }
    let io = VecIo {
        rows: rows as i32,
        x_stride: x_stride as i32,
        ..io
    };
    launch(g, m, x, y, rows, io)
}

fn launch(g: &Gpu, m: Matvec, x: u64, y: u64, rows: usize, io: VecIo) -> Result<()> {
    let Plan {
        name,
        form,
        smem,
        grid,
        tiles,
        nbuf,
        k,
        group,
        scales,
        biases,
    } = plan(g, &m, io.conv_c > 0, rows)?;
    if io.conv_c as usize > m.n {
        return Err(CudaError::Unsupported(format!(
            "a conv step over {} channels after a product of {} rows",
            io.conv_c, m.n
        )));
    }
    if io.conv_c > 0 && !(1..=GDN_CONV_KMAX as i32).contains(&io.conv_k) {
        return Err(CudaError::Unsupported(format!(
            "a conv of {} taps (the fused conv step takes 1 to {GDN_CONV_KMAX})",
            io.conv_k
        )));
    }
    let (n32, k32, g32, t32) = (m.n as i32, k as i32, group as i32, tiles as i32);
    let f = g.kernels().for_format(name, &m.format)?;
    if form != Form::Streamed || smem > SMEM_DEFAULT {
        raise_smem_of(f, name, smem)?;
    }
    let mut b = g.launch_builder(f);
    b.arg(&m.w)
        .arg(&scales)
        .arg(&biases)
        .arg(&x)
        .arg(&y)
        .arg(&n32)
        .arg(&k32)
        .arg(&g32);
    if nbuf.is_none() {
        b.arg(&t32);
    }
    b.arg(&m.bias).arg(&io);
    if let Some(n) = &nbuf {
        b.arg(n);
    }
    // SAFETY: W holds N·K/8 words and scales, biases N·K/G values of `params.bytes()` each (as
    // the build of `params` reads them) with K and G in digits (G | K, G ∈ {32, 64, 128},
    // checked by `digits` and `takes`); x holds `rows` rows of the matrix's
    // m.k floats (K for 4-bit codes, K/2 for 8-bit ones; 16-byte aligned device buffer), rows
    // io.x_stride floats apart (a multiple of 4, at least m.k: checked by `matvec_rows`), y
    // rows·N floats; the dynamic shared memory holds the rows' staged x and group sums (at most
    // 4 · 33 KB for K ≤ VEC_MAX_K, raised past the default 48 KB above) and, for the staged kernel, the block's tile and barrier (`staged_smem`),
    // for the ring kernel its `nbuf` tiles and barriers (`ring_plan`; both check the copies'
    // 16-byte units, the device's sm_90 and the matrices' alignment are checked above); the
    // ring's blocks walk its tiles with a stride of the grid, each tile bounds-checked against
    // N. With `io`: norm, normed hold m.k floats (16-byte aligned), the conv's
    // weights conv_c·conv_k floats, its state a slot's (conv_k − 1)·conv_c floats at slots[0]
    // (conv_c ≤ N, conv_k ≤ GDN_CONV_KMAX, checked above) and mixed conv_c floats; best, when
    // given to the ring kernel, 2·grid floats (the caller sized it by `ring_blocks`).
    unsafe { b.launch(cfg((grid, 1), form.threads(), smem as u32)) }.map_err(driver_err(name))?;
    Ok(())
}

/// Dynamic shared memory of the single-row kernel for `rows` input rows: x as bf16 hi/lo pairs
/// and the group sums (K·4 + K/G·8 bytes a row, rounded up to 16).
fn stage_smem(k: usize, group: usize, rows: usize) -> usize {
    (rows * (k * 4 + k / group * 8)).next_multiple_of(16)
}

/// Dynamic shared memory a launch may take without opting in.
const SMEM_DEFAULT: usize = 48 * 1024;

/// Most dynamic shared memory a staged block may take: two blocks per SM within the 227 KB an
/// sm_90 multiprocessor gives (with each block's 2 KB of static memory and 1 KB reserved).
const STAGED_MAX_SMEM: usize = 110 * 1024;

/// The same for the several-row entries, whose partial sums (static) take four times the room:
/// 9.3 KB for 8 warps, 16 KB for the ring's two sets.
const ROWS_STAGED_MAX_SMEM: usize = 102 * 1024;
const ROWS_RING_MAX_SMEM: usize = 96 * 1024;

/// Whether a row's scales (K/G of [`AffineParams::bytes`] each) are whole 16-byte units, as the
/// bulk copies of the staged and ring kernels move them (K/G % 8 == 0 for 2-byte parameters,
/// K/G % 4 == 0 for f32 ones).
fn whole_units(k: usize, group: usize, params: AffineParams) -> bool {
    (k / group * params.bytes()).is_multiple_of(16)
}

/// Dynamic shared memory of the staged single-row kernel (`mma_vec_affine{4,8}_staged`) with
/// `tiles` row tiles of 16 per block (K and the group in digits, scales and biases as `params`
/// says) for `rows` input rows: the input staging, then 16·T rows of words, scales and biases in
/// 8 runs ([`tile_smem`]) and an 8-byte barrier; `None` when the scale rows are not whole 16-byte
/// units ([`whole_units`]: the bulk copies move 16-byte units) or the tile does not fit two
/// blocks per SM.
pub fn staged_smem(
    k: usize,
    group: usize,
    params: AffineParams,
    tiles: usize,
    rows: usize,
) -> Option<usize> {
    let bytes = stage_smem(k, group, rows) + tile_smem(k, group, params, tiles) + 16;
    let max = if rows == 1 {
        STAGED_MAX_SMEM
    } else {
        ROWS_STAGED_MAX_SMEM
    };
    (whole_units(k, group, params) && bytes <= max).then_some(bytes)
}

/// Bytes of one staged tile of `tiles` row tiles of 16 (`vec_tile_bytes` in mma_vec.cu with
/// `runs`): the rows of words in 8 runs each padded by `group` / 2 bytes, then the rows' scales
/// and their biases in 8 runs each padded by 16 bytes (VEC_SCALE_PAD values of whatever size
/// `params` gives them; the padding puts a load's rows on distinct banks, `vec_run_words`).
fn tile_smem(k: usize, group: usize, params: AffineParams, tiles: usize) -> usize {
    ring_tile_smem(k, group, params, tiles) + 8 * (group / 2) + 2 * 8 * 16
}

/// Bytes of one tile of the ring kernel: its rows of words, scales and biases
/// ([`AffineParams::bytes`] each) whole.
fn ring_tile_smem(k: usize, group: usize, params: AffineParams, tiles: usize) -> usize {
    let rows = 16 * tiles;
    rows * k / 2 + rows * (k / group) * 2 * params.bytes()
}

/// Row tiles of 16 per block of the ring kernel (`mma_vec_affine4_ring`, VEC_RING_TILES there).
const RING_TILES: usize = 2;

/// Most tiles the ring kernel keeps staged per block.
const RING_MAX_BUFFERS: usize = 4;

/// Staged tiles per block of the ring kernel with `tiles` row tiles of 16 each, and its dynamic
/// shared memory, for `rows` input rows (scales and biases as `params` says): the input staging,
/// then as many tiles ([`ring_tile_smem`]) and 8-byte barriers as fit two blocks per SM, at most
/// RING_MAX_BUFFERS; `None` under two (one tile computing while the next fills) or when the scale
/// rows are not whole 16-byte units ([`whole_units`]).
pub fn ring_plan(
    k: usize,
    group: usize,
    params: AffineParams,
    tiles: usize,
    rows: usize,
) -> Option<(usize, usize)> {
    let (tile, fixed) = (
        ring_tile_smem(k, group, params, tiles),
        stage_smem(k, group, rows),
    );
    let max = if rows == 1 {
        STAGED_MAX_SMEM
    } else {
        ROWS_RING_MAX_SMEM
    };
    let nbuf = (max.saturating_sub(fixed) / (tile + 8)).min(RING_MAX_BUFFERS);
    (whole_units(k, group, params) && nbuf >= 2)
        .then(|| (nbuf, (fixed + nbuf * (tile + 8)).next_multiple_of(16)))
}

#[cfg(test)]
mod tests {
    use super::AffineParams::{Bf16, F16Zero, F32};
    use super::{ring_plan, staged_smem};

    #[test]
    fn single_row_tiles_minimize_waves_times_tiles() {
        assert_eq!(super::tiles(2048, 264), 1);
        assert_eq!(super::tiles(12_352, 264), 3);
        assert_eq!(super::tiles(9216, 264), 3);
        assert_eq!(super::tiles(20_608, 264), 1);
        assert_eq!(super::tiles(248_320, 264), 4);
        assert_eq!(super::tiles(1, 264), 1);
        // 108 SMs (A100): 772 tiles in one wave of 4 rather than two of 3.
        assert_eq!(super::tiles(12_352, 216), 4);
    }

    #[test]
    fn launches_of_one_block_an_sm_take_16_warp_blocks() {
        use super::Form;
        // The 35B router (17 blocks) and output projections (128) on 132 SMs.
        assert_eq!(Form::choose(17, 132, true, false), Form::Staged16);
        assert_eq!(Form::choose(132, 132, true, false), Form::Staged16);
        // A GDN input projection: 258 blocks, two an SM.
        assert_eq!(Form::choose(258, 132, true, false), Form::Staged);
        assert_eq!(Form::choose(1251, 132, false, true), Form::Ring);
        assert_eq!(Form::choose(17, 132, false, false), Form::Streamed);
        assert_eq!(Form::Staged16.threads(), 512);
        assert_eq!(Form::Staged.threads(), 256);
    }

    #[test]
    fn several_rows_keep_the_one_row_forms_warps() {
        use super::{entry, Form};
        // Rows that fit keep the form; those that do not are streamed in blocks of as many warps.
        assert_eq!(Form::for_rows(Form::Staged16, true, false), Form::Staged16);
        assert_eq!(
            Form::for_rows(Form::Staged16, false, false),
            Form::Streamed16
        );
        assert_eq!(Form::for_rows(Form::Staged, false, false), Form::Streamed);
        assert_eq!(Form::for_rows(Form::Staged, true, false), Form::Staged);
        assert_eq!(Form::for_rows(Form::Ring, false, true), Form::Ring);
        assert_eq!(Form::for_rows(Form::Ring, false, false), Form::Streamed);
        assert_eq!(Form::Streamed16.threads(), 512);
        assert_eq!(entry(false, Form::Ring, false), "mma_vec_affine4_ring");
        assert_eq!(
            entry(true, Form::Streamed16, true),
            "mma_vec_rows_affine8_streamed16"
        );
        assert_eq!(
            entry(false, Form::Staged, true),
            "mma_vec_rows_affine4_staged"
        );
        // A GDN input projection of the 35B shape stages four rows (4 · 8448 bytes of input);
        // an attention output projection (8192 inputs) not even two.
        assert_eq!(
            staged_smem(2048, 64, Bf16, 3, 4),
            Some(4 * 8448 + 48 * 1024 + 8 * 32 + 48 * 32 * 4 + 256 + 16)
        );
        assert_eq!(staged_smem(8192, 64, Bf16, 1, 2), None);
        // The lm_head's ring keeps two tiles with two rows; four are streamed.
        assert_eq!(ring_plan(2048, 64, Bf16, 2, 2).map(|p| p.0), Some(2));
        assert_eq!(ring_plan(2048, 64, Bf16, 2, 4), None);
    }

    #[test]
    fn eight_bit_codes_count_as_two_digits() {
        use super::digits;
        let (mlx, f32p) = (Bf16, F32);
        assert_eq!(digits(4, 2048, 64, mlx), Some((2048, 64)));
        assert_eq!(digits(8, 2048, 64, mlx), Some((4096, 128)));
        assert_eq!(digits(8, 2048, 32, mlx), Some((4096, 64)));
        assert_eq!(digits(8, 2048, 16, f32p), Some((4096, 32)));
        assert_eq!(digits(8, 2048, 16, mlx), None);
        assert_eq!(digits(4, 2048, 16, f32p), None);
        assert_eq!(digits(8, 2048, 128, mlx), None);
        assert_eq!(digits(2, 2048, 64, mlx), None);
        // An 8-bit router of the 35B shape (257 rows of 2048 inputs, groups of 64) is staged:
        // x' of 4096 digits, then 16 rows of 2048 bytes in 8 runs with 64 of padding each and
        // their scales and biases in runs with 16 each.
        assert_eq!(
            staged_smem(4096, 128, Bf16, 1, 1),
            Some(16_640 + 16 * 2048 + 8 * 64 + 16 * 32 * 4 + 256 + 16)
        );
    }

    #[test]
    fn staged_tiles_fit_two_blocks_per_sm_in_whole_copy_units() {
        // GDN input projection of the 35B shape: 48 rows of 2048 inputs, groups of 64.
        let b = staged_smem(2048, 64, Bf16, 3, 1).unwrap();
        assert_eq!(b, 8448 + 48 * 1024 + 8 * 32 + 48 * 32 * 4 + 256 + 16);
        assert!(staged_smem(4096, 64, Bf16, 1, 1).is_some());
        // An attention output projection of the 35B shape (8192 inputs): 106 KB with one tile.
        assert_eq!(staged_smem(8192, 64, Bf16, 1, 1), Some(108_048));
        // Groups of 32: 8 runs of 16 bytes of padding, scales of 128 groups a row.
        assert_eq!(
            staged_smem(2048, 32, Bf16, 1, 1),
            Some(8704 + 16 * 1024 + 8 * 16 + 16 * 64 * 4 + 256 + 16)
        );
        // 8192 inputs with 4 tiles: 324 KB, over the limit; 4 groups a row: not 16-byte units.
        assert_eq!(staged_smem(8192, 64, Bf16, 4, 1), None);
        assert_eq!(staged_smem(128, 32, Bf16, 1, 1), None);
    }

    #[test]
    fn ring_keeps_two_to_four_tiles_within_two_blocks_per_sm() {
        // lm_head of the 35B shape: 2048 inputs, groups of 64, tiles of 32 rows (36,864 bytes).
        assert_eq!(
            ring_plan(2048, 64, Bf16, 2, 1),
            Some((2, 8448 + 2 * (36_864 + 8)))
        );
        assert_eq!(ring_plan(2048, 64, Bf16, 1, 1).map(|p| p.0), Some(4));
        // 8192 inputs: one tile of 32 rows is 139 KB.
        assert_eq!(ring_plan(8192, 64, Bf16, 2, 1), None);
        assert_eq!(ring_plan(256, 64, Bf16, 2, 1), None);
    }

    #[test]
    fn f32_parameters_take_four_bytes_in_staged_and_ring_tiles() {
        // f16 scales and zero points take the room of bf16 ones.
        assert_eq!(
            staged_smem(2048, 64, F16Zero, 3, 1),
            staged_smem(2048, 64, Bf16, 3, 1)
        );
        // The GDN input projection's tile with f32 scales and biases: 48 rows of 32 groups, 8
        // bytes a group; the runs' padding stays 16 bytes (4 values).
        assert_eq!(
            staged_smem(2048, 64, F32, 3, 1),
            Some(8448 + 48 * 1024 + 8 * 32 + 48 * 32 * 8 + 256 + 16)
        );
        // The attention output projection (8192 inputs) no longer fits two blocks an SM.
        assert_eq!(staged_smem(8192, 64, F32, 1, 1), None);
        // Whole 16-byte units: 4 groups a row are 16 bytes of f32, 2 are not.
        assert_eq!(
            staged_smem(128, 32, F32, 1, 1),
            Some(544 + 16 * 64 + 8 * 16 + 16 * 4 * 8 + 256 + 16)
        );
        assert_eq!(staged_smem(128, 64, F32, 1, 1), None);
        // The lm_head's ring: tiles of 32 rows of 1024 bytes of words and 256 of parameters.
        assert_eq!(
            ring_plan(2048, 64, F32, 2, 1),
            Some((2, 8448 + 2 * (40_960 + 8)))
        );
        assert_eq!(ring_plan(2048, 64, F32, 1, 1).map(|p| p.0), Some(4));
        assert_eq!(ring_plan(256, 128, F32, 2, 1), None);
    }
}
