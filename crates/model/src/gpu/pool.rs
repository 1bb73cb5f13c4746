//! Sequence state on the device: a pool of slots, each holding one sequence's conv and
//! recurrent states (GDN layers), KV caches (attention layers), position and sampling
//! parameters. Per layer the slots are one array (`[slots, …]`), so a batched step addresses a
//! row's state by its slot index; a sequence owns one slot from [`GpuModel::new_seq`] until
//! [`GpuModel::release`]. Snapshots copy a slot's state (the KV caches up to the position) into
//! buffers of their own, and restore copies them into a free slot.

use deltamoe_compute::cuda::ops::SampleParams;
use deltamoe_compute::cuda::{CudaError, DevBuf};

use super::{GpuMixer, GpuModel, Result};

/// The state arrays of every slot.
pub(crate) struct Pool {
    pub slots: usize,
    /// Context of each slot (rows of its KV caches).
    pub ctx: usize,
    /// Per layer: GDN conv state `[slots, K−1, C]` (None for attention layers).
    pub conv: Vec<Option<DevBuf<f32>>>,
    /// Per layer: GDN recurrent state `[slots, Hv, Dk, Dv]`.
    pub rec: Vec<Option<DevBuf<f32>>>,
    /// Per layer: KV caches `[slots, ctx, Hkv, D]` (None for GDN layers).
    pub k_cache: Vec<Option<DevBuf<f32>>>,
    pub v_cache: Vec<Option<DevBuf<f32>>>,
    /// Position (tokens seen) per slot.
    pub pos: DevBuf<i32>,
    /// Sampling words per slot, `[slots, 7]` (see `ops::SampleParams::words`).
    pub sampling: DevBuf<u32>,
    free: Vec<usize>,
}

/// A sequence's slot in the pool and its position (mirroring the device counter).
#[derive(Debug)]
pub struct GpuSeq {
    pub(crate) slot: usize,
    pub(crate) pos: usize,
}

impl GpuSeq {
    /// Tokens the sequence has seen.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

/// A copy of one sequence's device state.
pub struct GpuSnapshot {
    pos: usize,
    /// Per layer: conv and recurrent state, or the first `pos` rows of the K and V caches.
    layers: Vec<(DevBuf<f32>, DevBuf<f32>)>,
}

impl GpuSnapshot {
    /// Device bytes the snapshot holds.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(a, b)| a.len() + b.len())
            .sum::<usize>()
            * 4
    }
}

/// Floats per slot of each per-layer state array: (conv or K, recurrent or V).
fn layer_sizes(m: &GpuModel, ctx: usize) -> Vec<(usize, usize)> {
    let a = m.attn;
    m.layers
        .iter()
        .map(|l| match &l.mixer {
            GpuMixer::Linear {
                dims,
                conv_dim,
                kernel,
                ..
            } => ((kernel - 1) * conv_dim, dims.hv * dims.dk * dims.dv),
            GpuMixer::Full { .. } => (ctx * a.hkv * a.d, ctx * a.hkv * a.d),
        })
        .collect()
}

impl Pool {
    pub fn new(m: &GpuModel, slots: usize, ctx: usize) -> Result<Pool> {
        let g = &*m.gpu;
        let (mut conv, mut rec, mut k_cache, mut v_cache) = (vec![], vec![], vec![], vec![]);
        for (l, (a, b)) in m.layers.iter().zip(layer_sizes(m, ctx)) {
            let (x, y) = (Some(g.zeros(slots * a)?), Some(g.zeros(slots * b)?));
            match l.mixer {
                GpuMixer::Linear { .. } => {
                    conv.push(x);
                    rec.push(y);
                    k_cache.push(None);
                    v_cache.push(None);
                }
                GpuMixer::Full { .. } => {
                    conv.push(None);
                    rec.push(None);
                    k_cache.push(x);
                    v_cache.push(y);
                }
            }
        }
        Ok(Pool {
            slots,
            ctx,
            conv,
            rec,
            k_cache,
            v_cache,
            pos: g.zeros(slots)?,
            sampling: g.zeros(slots * 7)?,
            free: (0..slots).rev().collect(),
        })
    }

    /// Per layer, the two state arrays (conv/rec or K/V).
    fn arrays_mut(&mut self) -> impl Iterator<Item = (&mut DevBuf<f32>, &mut DevBuf<f32>)> {
        self.conv
            .iter_mut()
            .zip(self.rec.iter_mut())
            .zip(self.k_cache.iter_mut().zip(self.v_cache.iter_mut()))
            .filter_map(|((c, r), (k, v))| match (c, r, k, v) {
                (Some(c), Some(r), _, _) => Some((c, r)),
                (_, _, Some(k), Some(v)) => Some((k, v)),
                _ => None,
            })
    }
}

/// Device memory [`GpuModel::reserve`] leaves free for scratch, prefill activations, graphs
/// and prompt snapshots.
pub const RESERVE_HEADROOM: usize = 4 << 30;

/// Most slots an automatic reservation takes.
pub const AUTO_MAX_SLOTS: usize = 64;

const GIB: f64 = (1u64 << 30) as f64;

fn full(slots: usize) -> CudaError {
    CudaError::Full(format!(
        "all {slots} sequence slots are in use; release a sequence or reserve more"
    ))
}

impl GpuModel {
    /// Reserve device state for `slots` sequences of `ctx` tokens each (`slots` 0: as many as
    /// the free device memory holds, leaving [`RESERVE_HEADROOM`] for activations and
    /// snapshots, at most [`AUTO_MAX_SLOTS`]), and scratch for batches of up to
    /// `min(slots, MAX_BATCH)` rows. Drops any earlier reservation (and the sequences in it).
    /// Fails with a message naming the fitting count when the slots do not fit.
    pub fn reserve(&mut self, slots: usize, ctx: usize) -> Result<()> {
        if ctx == 0 {
            return Err(CudaError::Unsupported(
                "reserve sequences of at least one token".into(),
            ));
        }
        self.graphs.clear();
        self.pool = None;
        let (free, _) = self.gpu.mem_info()?;
        let per = self.seq_bytes(ctx);
        let fit = free.saturating_sub(RESERVE_HEADROOM) / per.max(1);
        let slots = if slots == 0 {
            fit.min(AUTO_MAX_SLOTS)
        } else {
            slots
        };
        if slots == 0 || slots > fit {
            return Err(CudaError::Unsupported(format!(
                "{} sequences of {ctx} tokens need {:.2} GiB of device state ({:.3} GiB each) \
                 but {:.2} GiB are free (less {} GiB kept for activations): {fit} fit; lower \
                 --max-seqs or --ctx",
                slots.max(1),
                (slots.max(1) * per) as f64 / GIB,
                per as f64 / GIB,
                free as f64 / GIB,
                RESERVE_HEADROOM >> 30
            )));
        }
        self.pool = Some(Pool::new(self, slots, ctx)?);
        self.set_rows(slots.min(super::MAX_BATCH))
    }

    pub(crate) fn pool(&self) -> Result<&Pool> {
        self.pool
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("no sequence state reserved".into()))
    }

    fn pool_mut(&mut self) -> Result<&mut Pool> {
        self.pool
            .as_mut()
            .ok_or_else(|| CudaError::Unsupported("no sequence state reserved".into()))
    }

    /// Free sequence slots.
    pub fn free_slots(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.free.len())
    }

    /// Tokens each slot holds.
    pub fn context(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.ctx)
    }

    /// A fresh sequence (zero state, greedy sampling) in a free slot.
    pub fn new_seq(&mut self) -> Result<GpuSeq> {
        let sizes = layer_sizes(self, self.context());
        let g = self.gpu.clone();
        let pool = self.pool_mut()?;
        let slot = pool.free.pop().ok_or_else(|| full(pool.slots))?;
        for ((a, b), &(na, nb)) in pool.arrays_mut().zip(&sizes) {
            g.zero_range(a, slot * na, na)?;
            g.zero_range(b, slot * nb, nb)?;
        }
        g.write_at(&mut pool.pos, slot, &[0])?;
        g.write_at(
            &mut pool.sampling,
            slot * 7,
            &SampleParams::default().words(0),
        )?;
        Ok(GpuSeq { slot, pos: 0 })
    }

    /// Give the sequence's slot back.
    pub fn release(&mut self, seq: GpuSeq) {
        if let Some(p) = self.pool.as_mut() {
            if seq.slot < p.slots && !p.free.contains(&seq.slot) {
                p.free.push(seq.slot);
            }
        }
    }

    /// Copy the sequence's state (KV caches up to its position).
    pub fn snapshot(&self, seq: &GpuSeq) -> Result<GpuSnapshot> {
        let pool = self.pool()?;
        let g = &*self.gpu;
        let rows = seq.pos * self.attn.hkv * self.attn.d;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, (na, nb)) in layer_sizes(self, pool.ctx).into_iter().enumerate() {
            let (src_a, src_b, na, nb) = match (&pool.conv[i], &pool.rec[i]) {
                (Some(c), Some(r)) => (c, r, na, nb),
                _ => match (&pool.k_cache[i], &pool.v_cache[i]) {
                    (Some(k), Some(v)) => (k, v, rows, rows),
                    _ => return Err(CudaError::Unsupported("a layer without state".into())),
                },
            };
            let (mut a, mut b) = (g.zeros(na)?, g.zeros(nb)?);
            let (sa, sb) = (
                seq.slot * src_a.len() / pool.slots,
                seq.slot * src_b.len() / pool.slots,
            );
            g.copy(src_a, sa, &mut a, 0, na)?;
            g.copy(src_b, sb, &mut b, 0, nb)?;
            layers.push((a, b));
        }
        Ok(GpuSnapshot {
            pos: seq.pos,
            layers,
        })
    }

    /// A sequence in a free slot whose state is a copy of `snap` (greedy sampling).
    pub fn restore(&mut self, snap: &GpuSnapshot) -> Result<GpuSeq> {
        if snap.pos > self.context() {
            return Err(CudaError::Unsupported(format!(
                "a snapshot of {} tokens does not fit slots of {}",
                snap.pos,
                self.context()
            )));
        }
        let g = self.gpu.clone();
        let pool = self.pool_mut()?;
        let slot = pool.free.pop().ok_or_else(|| full(pool.slots))?;
        let slots = pool.slots;
        for ((a, b), (sa, sb)) in pool.arrays_mut().zip(&snap.layers) {
            let (oa, ob) = (slot * a.len() / slots, slot * b.len() / slots);
            g.copy(sa, 0, a, oa, sa.len())?;
            g.copy(sb, 0, b, ob, sb.len())?;
        }
        g.write_at(&mut pool.pos, slot, &[snap.pos as i32])?;
        g.write_at(
            &mut pool.sampling,
            slot * 7,
            &SampleParams::default().words(0),
        )?;
        Ok(GpuSeq {
            slot,
            pos: snap.pos,
        })
    }

    /// How the step picks the sequence's next token (the draw counter restarts at 0).
    pub fn set_sampling(&mut self, seq: &GpuSeq, p: SampleParams) -> Result<()> {
        let g = self.gpu.clone();
        g.write_at(&mut self.pool_mut()?.sampling, seq.slot * 7, &p.words(0))
    }

    /// Move the sequence to position `pos` without running tokens (benchmarks measure decode
    /// at a context length this way; the skipped KV entries hold whatever the slot held).
    pub fn set_position(&mut self, seq: &mut GpuSeq, pos: usize) -> Result<()> {
        if pos >= self.context() {
            return Err(CudaError::Unsupported(format!(
                "position {pos} is past the sequence's context {}",
                self.context()
            )));
        }
        let g = self.gpu.clone();
        g.write_at(&mut self.pool_mut()?.pos, seq.slot, &[pos as i32])?;
        seq.pos = pos;
        Ok(())
    }

    /// Bytes of device state per sequence at `ctx` tokens.
    pub fn seq_bytes(&self, ctx: usize) -> usize {
        layer_sizes(self, ctx)
            .iter()
            .map(|(a, b)| a + b)
            .sum::<usize>()
            * 4
            + 8 * 4
    }
}
