//! Launch wrappers of the gated full attention at decode (`kernels/attention.cu`): q/k norm,
//! RoPE and the cache append, then the split-K partials and their gated combine.

use cudarc::driver::LaunchConfig;

use super::ops::{cfg, Batch};
use super::{driver_err, Gpu, Result};

/// Attention geometry for the attention kernels.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub rotary: usize,
}

/// Most split-K partitions `attn_combine` merges (`ATTN_MAX_SPLITS` in attention.cu).
pub const ATTN_MAX_SPLITS: usize = 256;

/// Largest head dim the attention kernels support (`ATTN_DMAX` in attention.cu).
pub const ATTN_DMAX: usize = 256;

/// Most q heads one `attn_partial` block serves (ATTN_GQA in attention.cu).
pub(crate) const ATTN_GQA: usize = 8;

/// Positions per run of an `attn_partial` warp and runs it keeps in flight (ATTN_POS and
/// ATTN_STAGES in attention.cu).
pub(crate) const ATTN_POS: usize = 2;
pub(crate) const ATTN_STAGES: usize = 4;

/// Dynamic shared memory of `attn_partial`: its 8 warps' staged runs, 32 lanes × 4 float4s (K
/// and V, two halves each) per position (the warps' accumulators reuse it for the merge).
const ATTN_PARTIAL_SMEM: usize = 8 * ATTN_STAGES * ATTN_POS * 32 * 4 * 16;

/// `attn_partial` blocks per split and row: each kv head's q heads in groups of ATTN_GQA, so that
/// a block reads each K/V row once for its group.
fn attn_head_blocks(a: AttnDims) -> u32 {
    (a.hkv * (a.hq / a.hkv).div_ceil(ATTN_GQA)) as u32
}

/// Per row b of `bt`: q/k norm + RoPE, q out, k and v appended to the slot's caches (of `ctx`
/// positions) at `pos[slot]`, or with `row_advances` at `pos[slot] + b` (consecutive tokens of
/// one sequence, a prefill pass: every entry of `bt.slots` names its slot).
#[allow(clippy::too_many_arguments)]
pub fn attn_prep(
    g: &Gpu,
    proj: u64,
    proj_stride: usize,
    qn: u64,
    kn: u64,
    inv_freq: u64,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    pos: u64,
    a: AttnDims,
    eps: f32,
    bt: Batch,
    ctx: usize,
    row_advances: bool,
) -> Result<()> {
    let (hq, hkv, d, r) = (a.hq as i32, a.hkv as i32, a.d as i32, a.rotary as i32);
    let (ps, t, row_pos) = (proj_stride as i64, ctx as i64, row_advances as i32);
    let mut b = g.launch_builder(g.kernels().get("attn_prep"));
    b.arg(&proj).arg(&qn).arg(&kn).arg(&inv_freq);
    b.arg(&q).arg(&k_cache).arg(&v_cache).arg(&pos);
    b.arg(&hq).arg(&hkv).arg(&d).arg(&r).arg(&eps);
    b.arg(&bt.slots).arg(&ps).arg(&t).arg(&row_pos);
    let threads = (a.d.div_ceil(32) * 32) as u32;
    let grid = ((a.hq + 2 * a.hkv) as u32, bt.rows as u32);
    // SAFETY: caches hold (max slot + 1)·ctx·hkv·d floats and every row's position is < ctx
    // (the engine checks the context before each step or prefill); q holds rows·hq·d floats;
    // dynamic shared memory holds d floats.
    unsafe { b.launch(cfg(grid, threads, (a.d * 4) as u32)) }.map_err(driver_err("attn_prep"))?;
    Ok(())
}

/// Per row of `bt`: split-K attention over positions 0..=pos[slot] of the slot's caches into
/// `splits` partials, then the gated combine (gates from the row's projection). With
/// `row_advances` row r of one sequence is at pos + r, as in [`attn_prep`].
#[allow(clippy::too_many_arguments)]
pub fn attn_decode(
    g: &Gpu,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    pos: u64,
    part_o: u64,
    part_ml: u64,
    proj: u64,
    proj_stride: usize,
    out: u64,
    a: AttnDims,
    splits: usize,
    bt: Batch,
    ctx: usize,
    row_advances: bool,
) -> Result<()> {
    if splits > ATTN_MAX_SPLITS {
        return Err(super::CudaError::Unsupported(format!(
            "{splits} attention splits exceed {ATTN_MAX_SPLITS}"
        )));
    }
    if !a.d.is_multiple_of(4) || a.d > ATTN_DMAX || !a.hq.is_multiple_of(a.hkv) {
        return Err(super::CudaError::Unsupported(format!(
            "attention decode needs head_dim a multiple of 4 up to {ATTN_DMAX} and q heads a \
             multiple of kv heads (head_dim {}, {} q heads, {} kv heads)",
            a.d, a.hq, a.hkv
        )));
    }
    let (hq, hkv, d, s) = (a.hq as i32, a.hkv as i32, a.d as i32, splits as i32);
    let scale = 1.0f32 / (a.d as f32).sqrt();
    let (ps, t, row_pos) = (proj_stride as i64, ctx as i64, row_advances as i32);
    let mut b = g.launch_builder(g.kernels().get("attn_partial"));
    b.arg(&q)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&pos)
        .arg(&part_o)
        .arg(&part_ml);
    b.arg(&hq).arg(&hkv).arg(&d).arg(&s).arg(&scale);
    b.arg(&bt.slots).arg(&t).arg(&row_pos);
    let launch = LaunchConfig {
        grid_dim: (attn_head_blocks(a), splits as u32, bt.rows as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: ATTN_PARTIAL_SMEM as u32,
    };
    g.raise_smem("attn_partial", ATTN_PARTIAL_SMEM)?;
    // SAFETY: part_o holds rows·hq·splits·d floats, part_ml rows·hq·splits·2; d ≤ ATTN_DMAX and
    // d % 4 == 0, hq % hkv == 0 (checked above: the kernel copies float4s of 16-byte aligned
    // cache rows); the dynamic shared memory is the kernel's staging (ATTN_PARTIAL_SMEM, raised
    // above the default); caches and positions as in `attn_prep`.
    unsafe { b.launch(launch) }.map_err(driver_err("attn_partial"))?;
    let mut b = g.launch_builder(g.kernels().get("attn_combine"));
    b.arg(&part_o)
        .arg(&part_ml)
        .arg(&proj)
        .arg(&out)
        .arg(&d)
        .arg(&s)
        .arg(&hq)
        .arg(&ps)
        .arg(&pos)
        .arg(&bt.slots)
        .arg(&row_pos);
    let threads = (a.d.div_ceil(32) * 32) as u32;
    // SAFETY: out holds rows·hq·d floats; proj holds rows fused projections with the gates;
    // positions and slots as for attn_partial.
    unsafe { b.launch(cfg((a.hq as u32, bt.rows as u32), threads, 0)) }
        .map_err(driver_err("attn_combine"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{attn_head_blocks, AttnDims};

    fn dims(hq: usize, hkv: usize) -> AttnDims {
        AttnDims {
            hq,
            hkv,
            d: 256,
            rotary: 64,
        }
    }

    #[test]
    fn a_block_serves_up_to_eight_q_heads_of_one_kv_head() {
        // Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B: 16 q heads on 2 kv heads.
        assert_eq!(attn_head_blocks(dims(16, 2)), 2);
        // Qwen3.5-397B-A17B: 32 on 2, two blocks per kv head.
        assert_eq!(attn_head_blocks(dims(32, 2)), 4);
        assert_eq!(attn_head_blocks(dims(3, 1)), 1);
        assert_eq!(attn_head_blocks(dims(4, 4)), 4);
        assert_eq!(attn_head_blocks(dims(24, 2)), 4);
    }
}
