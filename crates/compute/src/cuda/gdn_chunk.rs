//! Launch wrappers for the chunked gated delta rule of `kernels/gdn_chunk.cu` (prefill on tensor
//! cores; the CPU twin is [`crate::cpu::gdn::gdn_chunked`]). Two launches: `gdn_chunk_prep`,
//! parallel over chunks and value heads, writes per-chunk matrices into a workspace;
//! `gdn_chunk_state*` walks the chunks in order and writes the outputs and the final state.
//!
//! Buffers (raw device addresses, as in [`super::ops`]): q, k bf16 `[T, Hk, Dk]`; v bf16
//! `[T, Hv, Dv]`; g (log decay ≤ 0) and beta f32 `[T, Hv]`; state f32 `[Hv, Dk, Dv]`, the initial
//! state on entry and the final one on return (the layout of the decode kernel `gdn_step`); out
//! f32 `[T, Hv, Dv]`; a workspace of [`workspace_bytes`]. With `norm_qk` the kernels l2-normalise
//! q and k (eps 1e-6) and scale q by 1/sqrt(Dk); without it q and k must arrive so.

use cudarc::driver::LaunchConfig;

use super::{driver_err, CudaError, Gpu, Result};

/// Tokens per chunk (`GC` in gdn_chunk.cu).
pub const GDN_CHUNK: usize = 64;
/// Largest key and value head dims (`GDK` in gdn_chunk.cu).
pub const GDN_CHUNK_DMAX: usize = 128;

/// Shared memory of `gdn_chunk_prep` (`GDN_PREP_SMEM` in gdn_chunk.cu).
const PREP_SMEM: usize = 2 * 64 * 136 * 2 + 4 * 64 * 4 + 32 * 33 * 4;
/// Threads per block of `gdn_chunk_state*` (16 warps; `GDN_STATE_THREADS` in gdn_chunk.cu).
const STATE_THREADS: u32 = 512;

/// Shared memory of `gdn_chunk_state{bv}` (`GDN_STATE_SMEM(BV, NS)` in gdn_chunk.cu, with
/// NS = 3 stages for 32 columns and 2 for 64).
const fn state_smem(bv: usize) -> usize {
    let stage = 2 * 64 * 136 * 2 + 64 * (bv + 8) * 2 + 2 * 64 * 72 * 2 + 64 * 16;
    let stages = if bv == 32 { 3 } else { 2 };
    stages * stage + 128 * (bv + 8) * 2 + 3 * 64 * (bv + 8) * 2
}

// Both kernels fit an sm_80/sm_90 multiprocessor's 227 KiB of shared memory per block.
const _: () = assert!(
    state_smem(32) <= 227 * 1024 && state_smem(64) <= 227 * 1024 && PREP_SMEM <= 227 * 1024
);

/// Geometry of one prefill call: `t` tokens, head counts and head dims.
#[derive(Clone, Copy, Debug)]
pub struct GdnChunkDims {
    pub t: usize,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnChunkDims {
    /// Number of chunks, the last one possibly short.
    pub fn chunks(&self) -> usize {
        self.t.div_ceil(GDN_CHUNK)
    }

    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(CudaError::Unsupported(format!("gdn_chunk: {why}")));
        if self.hk == 0 || self.hv == 0 || !self.hv.is_multiple_of(self.hk) {
            return bad(format!(
                "value heads {} must be a positive multiple of key heads {}",
                self.hv, self.hk
            ));
        }
        if !(1..=GDN_CHUNK_DMAX).contains(&self.dk) || !(1..=GDN_CHUNK_DMAX).contains(&self.dv) {
            return bad(format!(
                "head dims {}/{} must be in 1..={GDN_CHUNK_DMAX}",
                self.dk, self.dv
            ));
        }
        if self.chunks() > 65_535 {
            return bad(format!("{} tokens is more than 65535 chunks", self.t));
        }
        Ok(())
    }
}

/// Device addresses of one call's buffers (see the module doc for shapes).
#[derive(Clone, Copy, Debug)]
pub struct GdnChunkBufs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub g: u64,
    pub beta: u64,
    pub state: u64,
    pub out: u64,
    pub workspace: u64,
}

/// Byte offsets in the workspace: T and P (bf16 `[Hv, NC, 64, 64]` each), the per-token
/// coefficients (f32x4 `[Hv, NC·64]`) and the chunk decays (f32 `[Hv, NC]`), each 256-aligned.
struct Layout {
    tinv: usize,
    pmat: usize,
    coef: usize,
    decay: usize,
    total: usize,
}

fn layout(d: GdnChunkDims) -> Layout {
    let up = |n: usize| n.div_ceil(256) * 256;
    let hc = d.hv * d.chunks();
    let mats = up(hc * GDN_CHUNK * GDN_CHUNK * 2);
    let coef = up(hc * GDN_CHUNK * 16);
    Layout {
        tinv: 0,
        pmat: mats,
        coef: 2 * mats,
        decay: 2 * mats + coef,
        total: 2 * mats + coef + up(hc * 4),
    }
}

/// Workspace bytes a call with these dims needs.
pub fn workspace_bytes(d: GdnChunkDims) -> usize {
    layout(d).total
}

/// Value columns per block of the state kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateTile {
    V32,
    V64,
}

/// 32 columns when that still fits the blocks in one wave of one block per multiprocessor
/// (Hv = 32, Dv = 128: 128 blocks), else 64 (fewer, longer blocks rather than a second wave).
pub fn default_tile(g: &Gpu, d: GdnChunkDims) -> StateTile {
    if d.hv * d.dv.div_ceil(32) <= g.multiprocessors() {
        StateTile::V32
    } else {
        StateTile::V64
    }
}

/// First launch: T, P, coefficients and decays of every chunk into the workspace.
pub fn gdn_chunk_prep(g: &Gpu, b: GdnChunkBufs, d: GdnChunkDims, norm_qk: bool) -> Result<()> {
    d.check()?;
    if d.t == 0 {
        return Ok(());
    }
    let l = layout(d);
    let ws = |off: usize| b.workspace + off as u64;
    let (tinv, pmat, coef, decay) = (ws(l.tinv), ws(l.pmat), ws(l.coef), ws(l.decay));
    let (t, hk, hv, dk) = (d.t as i32, d.hk as i32, d.hv as i32, d.dk as i32);
    let norm = norm_qk as i32;
    g.raise_smem("gdn_chunk_prep", PREP_SMEM)?;
    let mut l = g.launch_builder(g.kernels().get("gdn_chunk_prep"));
    l.arg(&b.q)
        .arg(&b.k)
        .arg(&b.g)
        .arg(&b.beta)
        .arg(&tinv)
        .arg(&pmat)
        .arg(&coef)
        .arg(&decay);
    l.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&norm);
    let cfg = LaunchConfig {
        grid_dim: (d.hv as u32, d.chunks() as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: PREP_SMEM as u32,
    };
    // SAFETY: dims checked (hv a multiple of hk, dk ≤ 128, chunks ≤ 65535); q and k hold
    // T·Hk·Dk bf16, g and beta T·Hv f32, the workspace workspace_bytes(d) bytes (offsets from
    // `layout`, 256-aligned); the kernel reads rows < T only and writes NC·64 rows per head.
    unsafe { l.launch(cfg) }.map_err(driver_err("gdn_chunk_prep"))?;
    Ok(())
}

/// Second launch: the chunk recurrence, writing out and the final state (reads the workspace
/// that [`gdn_chunk_prep`] wrote for the same dims).
pub fn gdn_chunk_state(g: &Gpu, b: GdnChunkBufs, d: GdnChunkDims, tile: StateTile) -> Result<()> {
    d.check()?;
    if d.t == 0 {
        return Ok(());
    }
    let l = layout(d);
    let ws = |off: usize| b.workspace + off as u64;
    let (tinv, pmat, coef, decay) = (ws(l.tinv), ws(l.pmat), ws(l.coef), ws(l.decay));
    let (t, hk, hv, dk, dv) = (
        d.t as i32,
        d.hk as i32,
        d.hv as i32,
        d.dk as i32,
        d.dv as i32,
    );
    let (name, bv) = match tile {
        StateTile::V32 => ("gdn_chunk_state32", 32),
        StateTile::V64 => ("gdn_chunk_state64", 64),
    };
    let smem = state_smem(bv);
    g.raise_smem(name, smem)?;
    let func = match tile {
        StateTile::V32 => g.kernels().get("gdn_chunk_state32"),
        StateTile::V64 => g.kernels().get("gdn_chunk_state64"),
    };
    let mut l = g.launch_builder(func);
    l.arg(&b.q)
        .arg(&b.k)
        .arg(&b.v)
        .arg(&tinv)
        .arg(&pmat)
        .arg(&coef)
        .arg(&decay)
        .arg(&b.state)
        .arg(&b.out);
    l.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&dv);
    let cfg = LaunchConfig {
        grid_dim: ((d.hv * d.dv.div_ceil(bv)) as u32, 1, 1),
        block_dim: (STATE_THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: dims checked as in gdn_chunk_prep; q, k hold T·Hk·Dk bf16, v T·Hv·Dv bf16, state
    // Hv·Dk·Dv f32, out T·Hv·Dv f32, the workspace as gdn_chunk_prep wrote it; every global
    // read and write is bounded by T, Dk and Dv.
    unsafe { l.launch(cfg) }.map_err(driver_err(name))?;
    Ok(())
}

/// Both launches with the [`default_tile`]: out and the final state for T tokens from the
/// initial state.
pub fn gdn_chunk_forward(g: &Gpu, b: GdnChunkBufs, d: GdnChunkDims, norm_qk: bool) -> Result<()> {
    gdn_chunk_prep(g, b, d, norm_qk)?;
    gdn_chunk_state(g, b, d, default_tile(g, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_parts_are_aligned_and_disjoint() {
        let d = GdnChunkDims {
            t: 65,
            hk: 1,
            hv: 3,
            dk: 40,
            dv: 24,
        };
        let l = layout(d);
        let hc = 3 * 2;
        assert_eq!(l.pmat, (hc * 64 * 64 * 2usize).div_ceil(256) * 256);
        assert!(l.coef >= 2 * hc * 64 * 64 * 2 && l.decay >= l.coef + hc * 64 * 16);
        assert!(l.total >= l.decay + hc * 4);
        for off in [l.pmat, l.coef, l.decay, l.total] {
            assert_eq!(off % 256, 0);
        }
    }
}
