//! Launch wrappers of `kernels/moe.cu`: the router's softmax + top-k and the weighted combine of
//! the experts' outputs (alone, or with the residual add and the next RMSNorm fused in), and of
//! the expert down projections with that combine (`qmatvec.cu`).

use super::host::far_args;
use super::ops::{blocks, cfg, AffineParams, Matvec, Slots, WeightFormat, NORM_THREADS};
use super::{driver_err, CudaError, Gpu, Result};

/// Output rows a block of the fused expert down + combine computes (`DOWN_ROWS` in qmatvec.cu),
/// or of its `_r8` entries (`DOWN_ROWS_WIDE`).
pub(crate) const DOWN_ROWS: usize = 4;
pub(crate) const DOWN_ROWS_WIDE: usize = 8;

/// Rows a block of the fused expert down + combine computes for `n` outputs and `rows` input
/// rows on `sms` SMs, where `resident` gives the blocks (of one warp a slot) an SM holds of the
/// 4-row and of the 8-row entries, 0 where a block cannot run (the 8-row entries' 72 registers
/// allow 28 warps): 4, unless those blocks would not fit one wave and 8-row ones would (the 80B
/// shape's 11 slots: 512 blocks against 396 resident, 256 against 264), since a second wave
/// costs more than each warp's longer chain.
pub fn down_rows(n: usize, rows: usize, sms: usize, resident: [usize; 2]) -> usize {
    let fits = |r: usize, res: usize| n.div_ceil(r) * rows <= sms * res;
    if fits(DOWN_ROWS, resident[0]) || n < DOWN_ROWS_WIDE || !fits(DOWN_ROWS_WIDE, resident[1]) {
        DOWN_ROWS
    } else {
        DOWN_ROWS_WIDE
    }
}

/// Whether [`moe_down_combine`] takes expert down projections `m` with `per_row` slots a row:
/// 2/4/8-bit affine weights (the CUDA-core kernels the host's twin matches), at most 32 slots
/// and at least `DOWN_ROWS` rows.
pub fn down_combine_takes(m: &Matvec, per_row: usize) -> bool {
    matches!(
        m.format,
        WeightFormat::Affine {
            bits: 2 | 4 | 8,
            ..
        }
    ) && (1..=32).contains(&per_row)
        && m.n >= DOWN_ROWS
}

/// The rows a block and the kernel of [`moe_down_combine`] for `bits`-bit weights with `params`,
/// `n` outputs, `per_row` slots and `rows` input rows on this device ([`down_rows`] with the
/// entries' resident blocks in that build; 2-bit weights take 4 rows, their 8-row form would
/// spill).
pub fn down_combine_form(
    g: &Gpu,
    (bits, params): (u32, AffineParams),
    n: usize,
    per_row: usize,
    rows: usize,
) -> Result<(usize, &'static str)> {
    let names = match bits {
        2 => return Ok((DOWN_ROWS, "moe_down_combine_affine2")),
        4 => ["moe_down_combine_affine4", "moe_down_combine_affine4_r8"],
        _ => ["moe_down_combine_affine8", "moe_down_combine_affine8_r8"],
    };
    let mut resident = [0usize; 2];
    for (r, name) in resident.iter_mut().zip(names) {
        *r = g
            .kernels()
            .affine(name, params)?
            .occupancy_max_active_blocks_per_multiprocessor(32 * per_row as u32, 0, None)
            .map_err(driver_err(name))? as usize;
    }
    let down = down_rows(n, rows, g.multiprocessors, resident);
    Ok((down, names[usize::from(down == DOWN_ROWS_WIDE)]))
}

/// One MoE layer's expert down projections and their weighted sum added to the residual, in one
/// launch: for each row b of `rows`, `x_b += Σ_k w[b, k] · D_{ids[b, k]} h[b·per_row + k]` over
/// `per_row` slots (`sl`: the down projection's expert slots, far stack included; no host
/// slots). The same values as [`super::ops::matvec`] into y then [`moe_combine`] with
/// `accumulate`.
#[allow(clippy::too_many_arguments)]
pub fn moe_down_combine(
    g: &Gpu,
    m: Matvec,
    h: u64,
    x: u64,
    w: u64,
    sl: Slots,
    per_row: usize,
    rows: usize,
) -> Result<()> {
    let WeightFormat::Affine {
        bits,
        group,
        scales,
        biases,
        params,
    } = m.format
    else {
        return Err(CudaError::Unsupported(
            "the fused expert down + combine takes affine weights".into(),
        ));
    };
    if !down_combine_takes(&m, per_row) || sl.n != rows * per_row {
        return Err(CudaError::Unsupported(format!(
            "the fused expert down + combine takes 2/4/8-bit weights, 1 to 32 slots a row and at \
             least {DOWN_ROWS} output rows ({bits}-bit, {per_row} slots, {} of {rows} rows, {} \
             outputs)",
            sl.n, m.n
        )));
    }
    let (down, name) = down_combine_form(g, (bits, params), m.n, per_row, rows)?;
    let threads = 32 * per_row as u32;
    let (n32, k32, g32, ks32) = (m.n as i32, m.k as i32, group as i32, per_row as i32);
    let (fw, fs, fb, split) = far_args(&sl);
    let mut b = g.launch_builder(g.kernels().affine(name, params)?);
    b.arg(&m.w)
        .arg(&scales)
        .arg(&biases)
        .arg(&h)
        .arg(&x)
        .arg(&w)
        .arg(&sl.ids)
        .arg(&n32)
        .arg(&k32)
        .arg(&g32)
        .arg(&ks32);
    b.arg(&fw).arg(&fs).arg(&fb).arg(&split);
    // SAFETY: W holds (max id + 1)·N·K·bits/32 words and scales, biases (max id + 1)·N·K/group
    // bf16 (group | K, checked at upload), the far stack the ids ≥ split; h holds rows·per_row
    // rows of K floats (16-byte aligned: K is a multiple of the group, ≥ 32), x rows·N,
    // w and ids rows·per_row; per_row ≤ 32 warps a block (checked above); the 8-row entries
    // only where N ≥ 8 and the device holds a block of per_row warps of them (down_rows).
    let grid = (blocks(m.n, down), rows as u32);
    unsafe { b.launch(cfg(grid, threads, 0)) }.map_err(driver_err(name))?;
    Ok(())
}

/// Routing of one token for [`router_topk`].
#[derive(Clone, Copy, Debug)]
pub struct Route {
    /// Routed experts.
    pub experts: usize,
    pub top_k: usize,
    /// Divide the top-k weights by their sum.
    pub renorm: bool,
    /// The logits hold the shared-expert gate logit at index `experts`.
    pub shared_gate: bool,
    /// Index of the shared expert in the stacked expert weights, when it is stacked there.
    pub shared_slot: Option<usize>,
    /// Device int[experts]: the stacked index each routed expert's weights are at (see
    /// [`super::Far`]), negative for another GPU's expert; 0 when expert e is at index e.
    pub loc: u64,
    /// Device int[top_k + 1] (0 for none): of a row's c picks at stacked indices ≥ `far_from`
    /// (outside the device cache), the first `host_take[c]` go to the host, their ids written
    /// as −1 − (index − far_from) ([`crate::cuda::ops::host_experts_publish`]).
    pub host_take: u64,
    pub far_from: usize,
    /// Whether the shared slot runs on this GPU (else its id is −1 and weight 0, as for the
    /// routed experts whose `loc` is negative: other GPUs', expert parallel).
    pub shared_here: bool,
}

/// Per row (of `rows`, logits `logit_stride` floats apart): softmax + top-k over the router
/// logits: ids [k], weights [k], sg [1] = sigmoid(shared gate logit); with a shared slot also
/// ids[k] = slot, weights[k] = sg. Row b's ids and weights start at b·(k + shared slot).
#[allow(clippy::too_many_arguments)]
pub fn router_topk(
    g: &Gpu,
    logits: u64,
    logit_stride: usize,
    r: Route,
    ids: u64,
    w: u64,
    sg: u64,
    rows: usize,
) -> Result<()> {
    let (e32, k32, rn, hs) = (
        r.experts as i32,
        r.top_k as i32,
        r.renorm as i32,
        r.shared_gate as i32,
    );
    let slot = r.shared_slot.map_or(-1, |s| s as i32);
    let ls = logit_stride as i64;
    let far_from = i32::try_from(r.far_from).unwrap_or(i32::MAX);
    let shared_here = r.shared_here as i32;
    let mut b = g.launch_builder(g.kernels().get("router_topk"));
    b.arg(&logits)
        .arg(&e32)
        .arg(&k32)
        .arg(&rn)
        .arg(&hs)
        .arg(&slot)
        .arg(&ids)
        .arg(&w)
        .arg(&sg)
        .arg(&ls)
        .arg(&r.loc)
        .arg(&far_from)
        .arg(&r.host_take)
        .arg(&shared_here);
    // SAFETY: experts ≤ 1024 and top_k ≤ 32 (checked at upload); logits hold rows rows of
    // experts (+1) floats; ids and w hold rows·(top_k (+1 with a shared slot)) entries, sg rows;
    // loc, when given, holds `experts` ints, host_take top_k + 1.
    unsafe { b.launch(cfg((rows as u32, 1), 32, 0)) }.map_err(driver_err("router_topk"))?;
    Ok(())
}

/// Per row (of `rows`): `delta = Σ_k w_k y_k (+ sg · ys)` over width `h`, or `delta +=` that
/// sum when `accumulate` (the residual add, equal to [`moe_combine_norm`]'s).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    g: &Gpu,
    y: u64,
    w: u64,
    ys: u64,
    sg: u64,
    delta: u64,
    k: usize,
    h: usize,
    rows: usize,
    accumulate: bool,
) -> Result<()> {
    let (k32, h32, acc) = (k as i32, h as i32, accumulate as i32);
    let mut b = g.launch_builder(g.kernels().get("moe_combine"));
    b.arg(&y)
        .arg(&w)
        .arg(&ys)
        .arg(&sg)
        .arg(&delta)
        .arg(&k32)
        .arg(&h32)
        .arg(&acc);
    // SAFETY: y holds rows·k·h floats, w rows·k, delta and ys rows·h floats, sg rows.
    unsafe { b.launch(cfg((blocks(h, 256), rows as u32), 256, 0)) }
        .map_err(driver_err("moe_combine"))?;
    Ok(())
}

/// The residual stream after an MoE layer, and the norm that follows it, in one launch: per row
/// (of `rows`, width `h`) `x += Σ_k w_k y_k (+ sg · ys)`, then `out = rmsnorm(x)·scale` — the
/// same values as [`moe_combine`] then [`super::ops::add_rmsnorm`].
#[allow(clippy::too_many_arguments)]
pub fn moe_combine_norm(
    g: &Gpu,
    y: u64,
    w: u64,
    ys: u64,
    sg: u64,
    x: u64,
    scale: u64,
    out: u64,
    k: usize,
    h: usize,
    rows: usize,
    eps: f32,
) -> Result<()> {
    let (k32, h32) = (k as i32, h as i32);
    let mut b = g.launch_builder(g.kernels().get("moe_combine_norm"));
    b.arg(&y)
        .arg(&w)
        .arg(&ys)
        .arg(&sg)
        .arg(&x)
        .arg(&scale)
        .arg(&out)
        .arg(&k32)
        .arg(&h32)
        .arg(&eps);
    // SAFETY: y holds rows·k·h floats, w rows·k, x, out and ys rows·h floats, sg rows, scale h.
    unsafe { b.launch(cfg((rows as u32, 1), NORM_THREADS, 0)) }
        .map_err(driver_err("moe_combine_norm"))?;
    Ok(())
}

/// The device side of the host-expert mailbox (`host_experts_*` in moe.cu): pinned host buffers
/// mapped into the device, and the device's own counter.
#[derive(Clone, Copy, Debug)]
pub struct Mailbox {
    /// Host f32 [rows, h]: inputs of rows with a host expert.
    pub x: u64,
    /// Host i32 [rows, per_row]: the routed ids of every row.
    pub ids: u64,
    /// Host f32 [rows · per_row, h]: the host's expert outputs, by slot.
    pub y: u64,
    /// Host u32 [published, answered, failed].
    pub flags: u64,
    /// Device u32 [counter, blocks arrived], zeroed before first use.
    pub state: u64,
    /// Device i32 [top_k + 1]: how many of a row's picks outside the cache the router hands
    /// the host ([`Route::host_take`]).
    pub take: u64,
}

/// Hand the host the inputs of a layer whose router sent experts to it: `ids` (device,
/// `rows·per_row`) and the rows of `x` (device, `rows·h`) that have an id < 0, then a new
/// sequence number in `flags[0]`.
pub fn host_experts_publish(
    g: &Gpu,
    m: Mailbox,
    x: u64,
    ids: u64,
    per_row: usize,
    h: usize,
    rows: usize,
) -> Result<()> {
    let (ks, h32) = (per_row as i32, h as i32);
    let mut b = g.launch_builder(g.kernels().get("host_experts_publish"));
    b.arg(&x)
        .arg(&ids)
        .arg(&ks)
        .arg(&h32)
        .arg(&m.x)
        .arg(&m.ids)
        .arg(&m.state)
        .arg(&m.flags);
    // SAFETY: x holds rows·h floats and ids rows·per_row ints on the device; the mailbox's host
    // buffers hold at least as many, flags 3 words, state 2 device words.
    unsafe { b.launch(cfg((rows as u32, 1), 256, 0)) }
        .map_err(driver_err("host_experts_publish"))?;
    Ok(())
}

/// Wait for the host's answer to the last publish (always, so that host and GPU go layer by
/// layer) and copy its outputs into `y` (device, `slots·h`) at the slots whose id is < 0.
pub fn host_experts_wait(
    g: &Gpu,
    m: Mailbox,
    ids: u64,
    y: u64,
    h: usize,
    slots: usize,
) -> Result<()> {
    let h32 = h as i32;
    let mut b = g.launch_builder(g.kernels().get("host_experts_wait"));
    b.arg(&ids)
        .arg(&m.y)
        .arg(&y)
        .arg(&h32)
        .arg(&m.state)
        .arg(&m.flags);
    // SAFETY: ids holds `slots` ints, y and the mailbox's y slots·h floats; flags 3 host words,
    // state 2 device words.
    unsafe { b.launch(cfg((slots as u32, 1), 256, 0)) }.map_err(driver_err("host_experts_wait"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::down_rows;

    #[test]
    fn down_takes_8_rows_a_block_only_where_4_would_not_fit_one_wave() {
        // The 35B shape (9 slots, 4 blocks of 9 warps an SM) fits one wave at 4 rows.
        assert_eq!(down_rows(2048, 1, 132, [4, 3]), 4);
        // The 80B shape (11 slots): 512 blocks against 3 · 132, 256 against 2 · 132.
        assert_eq!(down_rows(2048, 1, 132, [3, 2]), 8);
        // Batches fit neither way: 4 rows.
        assert_eq!(down_rows(2048, 8, 132, [3, 2]), 4);
        // A block too large for the 8-row entry's registers, too few rows, no room for 8 rows.
        assert_eq!(down_rows(2048, 1, 132, [1, 0]), 4);
        assert_eq!(down_rows(7, 200, 1, [0, 1]), 4);
        assert_eq!(down_rows(2048, 1, 100, [3, 2]), 4);
    }
}
