//! The Gated DeltaNet decode ops (gdn.cu): the conv step and the delta-rule step of one token
//! for each row of a batch, and their verify forms, which take the consecutive tokens of one
//! sequence in turn and keep the states after each (speculative decoding's exact rollback).

use cudarc::driver::LaunchConfig;

use super::ops::{blocks, cfg, Batch};
use super::{driver_err, Gpu, Result};

/// Conv1d step + SiLU over `c` channels with kernel `k` for each row of `bt`: input row b at
/// `proj + b·proj_stride` floats, output `mixed [rows, c]`, state `[slots, k−1, c]` updated.
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv_step(
    g: &Gpu,
    proj: u64,
    proj_stride: usize,
    state: u64,
    w: u64,
    mixed: u64,
    c: usize,
    k: usize,
    bt: Batch,
) -> Result<()> {
    check_conv_kernel(k)?;
    let (c32, k32, ps) = (c as i32, k as i32, proj_stride as i64);
    let mut b = g.launch_builder(g.kernels().get("gdn_conv_step"));
    b.arg(&proj)
        .arg(&state)
        .arg(&w)
        .arg(&mixed)
        .arg(&c32)
        .arg(&k32)
        .arg(&bt.slots)
        .arg(&ps);
    // SAFETY: proj holds rows·proj_stride floats (≥ c each), mixed rows·c, state (max slot + 1)
    // ·(k−1)·c, w c·k; slots holds rows ints.
    unsafe { b.launch(cfg((blocks(c, 256), bt.rows as u32), 256, 0)) }
        .map_err(driver_err("gdn_conv_step"))?;
    Ok(())
}

/// Largest conv kernel the GDN decode conv step supports, alone (`gdn_conv_step`) or fused into
/// the input projection (`CONV_KMAX` in common.cuh).
pub const GDN_CONV_KMAX: usize = 8;

/// A conv kernel size the decode conv kernels take (1 to [`GDN_CONV_KMAX`]).
fn check_conv_kernel(k: usize) -> Result<()> {
    if k == 0 || k > GDN_CONV_KMAX {
        return Err(super::CudaError::Unsupported(format!(
            "GDN conv kernel size {k}: the CUDA decode step supports 1 to {GDN_CONV_KMAX}"
        )));
    }
    Ok(())
}

/// Gated DeltaNet geometry for [`gdn_step`].
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Largest key head dim `gdn_step` supports (`GDN_DK_MAX` in gdn.cu).
pub const GDN_DK_MAX: usize = 128;
/// Largest value head dim `gdn_step` supports (`GDN_DV_MAX` in gdn.cu).
pub const GDN_DV_MAX: usize = 128;
/// Row groups per head in `gdn_step` (`GDN_ROW_GROUPS` in gdn.cu).
pub(crate) const GDN_ROW_GROUPS: u32 = 8;

/// CTAs per value head of [`gdn_step`] and the state columns each takes (threads along x): with
/// clusters (sm_90+), one CTA of 32 columns per 32 of the head's `dv`, a cluster per head, so a
/// CTA holds a quarter of a 128 × 128 state and is resident beside the kernels around it; before,
/// one CTA of all the columns.
pub(crate) fn gdn_step_split(dv: usize, clusters: bool) -> (u32, u32) {
    let cols = dv.div_ceil(32) as u32;
    if clusters {
        (cols, 32)
    } else {
        (1, cols * 32)
    }
}

/// The [`gdn_step`] entry for `dk` × `dv` heads in CTAs of `cols` columns: `gdn_step128`, built
/// for the 128 × 128 heads of every released model in 32-column CTAs, or the general one.
pub(crate) fn gdn_step_kernel(dk: usize, dv: usize, cols: u32) -> &'static str {
    if dk == 128 && dv == 128 && cols == 32 {
        "gdn_step128"
    } else {
        "gdn_step"
    }
}

/// Delta-rule step + gated RMSNorm for every value head of every row of `bt` (see gdn.cu).
#[allow(clippy::too_many_arguments)]
pub fn gdn_step(
    g: &Gpu,
    mixed: u64,
    proj: u64,
    proj_stride: usize,
    state: u64,
    neg_a: u64,
    dt_bias: u64,
    norm_w: u64,
    out: u64,
    d: GdnDims,
    eps: f32,
    bt: Batch,
) -> Result<()> {
    let (hk, hv, dk, dv) = (d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32);
    let ps = proj_stride as i64;
    let (nc, cols) = gdn_step_split(d.dv, g.compute_capability().0 >= 9);
    let name = gdn_step_kernel(d.dk, d.dv, cols);
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&mixed)
        .arg(&proj)
        .arg(&state)
        .arg(&neg_a)
        .arg(&dt_bias)
        .arg(&norm_w)
        .arg(&out);
    b.arg(&hk).arg(&hv).arg(&dk).arg(&dv).arg(&eps);
    let nc32 = nc as i32;
    b.arg(&bt.slots).arg(&ps).arg(&nc32);
    b.cluster(nc);
    let launch = LaunchConfig {
        grid_dim: (d.hv as u32 * nc, bt.rows as u32, 1),
        block_dim: (cols, GDN_ROW_GROUPS, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: dk ≤ GDN_DK_MAX and dv ≤ GDN_DV_MAX (checked at upload), so a cluster has at most
    // 4 CTAs (the portable limit is 8) and the grid's x is a multiple of it; state holds
    // (max slot + 1)·hv·dk·dv floats, out rows·hv·dv, proj rows fused projections (conv dim +
    // hv·dv + 2·hv floats each, proj_stride apart), mixed rows·conv dim.
    unsafe { b.launch(launch) }.map_err(driver_err(name))?;
    Ok(())
}

/// Most tokens one verify pass takes (`GDN_VERIFY_MAX` in gdn.cu): a token and four drafts.
pub const GDN_VERIFY_MAX: usize = 5;

/// The tokens of a verify pass: `bt.rows` consecutive tokens of the one sequence in slot
/// `bt.slots[0]` (rows of the inputs and outputs in order), and where the states after each
/// token but the last go.
fn verify_rows(bt: Batch, what: &str) -> Result<i32> {
    if bt.rows == 0 || bt.rows > GDN_VERIFY_MAX {
        return Err(super::CudaError::Unsupported(format!(
            "a verify pass takes 1 to {GDN_VERIFY_MAX} tokens, not {} ({what})",
            bt.rows
        )));
    }
    Ok(bt.rows as i32)
}

/// [`gdn_conv_step`] over the `bt.rows` consecutive tokens of the sequence in slot
/// `bt.slots[0]`, in turn: the window after token t < rows − 1 goes to `saved + t·(k−1)·c`
/// floats, the one after the last to the slot.
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv_verify(
    g: &Gpu,
    proj: u64,
    proj_stride: usize,
    state: u64,
    w: u64,
    mixed: u64,
    (c, k): (usize, usize),
    bt: Batch,
    saved: u64,
) -> Result<()> {
    let r = verify_rows(bt, "gdn_conv_verify")?;
    check_conv_kernel(k)?;
    let (c32, k32, ps) = (c as i32, k as i32, proj_stride as i64);
    let mut b = g.launch_builder(g.kernels().get("gdn_conv_verify"));
    b.arg(&proj).arg(&state).arg(&w).arg(&mixed);
    b.arg(&c32)
        .arg(&k32)
        .arg(&bt.slots)
        .arg(&ps)
        .arg(&r)
        .arg(&saved);
    // SAFETY: proj holds rows·proj_stride floats (≥ c each), mixed rows·c, state (slot + 1)
    // ·(k−1)·c, saved (rows − 1)·(k−1)·c, w c·k; slots holds one int.
    unsafe { b.launch(cfg((blocks(c, 256), 1), 256, 0)) }.map_err(driver_err("gdn_conv_verify"))?;
    Ok(())
}

/// [`gdn_step`] over the `bt.rows` consecutive tokens of the sequence in slot `bt.slots[0]`, in
/// turn: each token's arithmetic is its decode step's; the state after token t < rows − 1 goes
/// to `saved + t·hv·dk·dv` floats, the one after the last to the slot.
#[allow(clippy::too_many_arguments)]
pub fn gdn_verify(
    g: &Gpu,
    (mixed, proj, proj_stride): (u64, u64, usize),
    state: u64,
    (neg_a, dt_bias, norm_w): (u64, u64, u64),
    out: u64,
    d: GdnDims,
    eps: f32,
    bt: Batch,
    saved: u64,
) -> Result<()> {
    let r = verify_rows(bt, "gdn_verify")?;
    let (hk, hv, dk, dv) = (d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32);
    let ps = proj_stride as i64;
    let (nc, cols) = gdn_step_split(d.dv, g.compute_capability().0 >= 9);
    let name = match gdn_step_kernel(d.dk, d.dv, cols) {
        "gdn_step128" => "gdn_verify128",
        _ => "gdn_verify",
    };
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&mixed).arg(&proj).arg(&state).arg(&neg_a);
    b.arg(&dt_bias).arg(&norm_w).arg(&out);
    b.arg(&hk).arg(&hv).arg(&dk).arg(&dv).arg(&eps);
    let nc32 = nc as i32;
    b.arg(&bt.slots).arg(&ps).arg(&nc32).arg(&r).arg(&saved);
    b.cluster(nc);
    let launch = LaunchConfig {
        grid_dim: (d.hv as u32 * nc, 1, 1),
        block_dim: (cols, GDN_ROW_GROUPS, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as gdn_step with one row, the tokens' rows of mixed, proj and out consecutive;
    // saved holds (rows − 1)·hv·dk·dv floats; rows ≤ GDN_VERIFY_MAX (checked), the kernel's
    // barriers and sums a token.
    unsafe { b.launch(launch) }.map_err(driver_err(name))?;
    Ok(())
}

/// Copies `spans` spans of f32 described by the device table at `table` (`[spans, 3]` u64: dst,
/// src, floats) in one launch: the states a verify pass kept, back into the slot.
///
/// # Safety
/// Every span's src and dst must be valid device memory for its floats, not overlapping.
pub unsafe fn gdn_restore(g: &Gpu, table: u64, spans: usize) -> Result<()> {
    if spans == 0 {
        return Ok(());
    }
    let mut b = g.launch_builder(g.kernels().get("gdn_restore"));
    b.arg(&table);
    // SAFETY: the caller's; the table holds spans triples.
    unsafe { b.launch(cfg((256, spans as u32), 256, 0)) }.map_err(driver_err("gdn_restore"))?;
    Ok(())
}
