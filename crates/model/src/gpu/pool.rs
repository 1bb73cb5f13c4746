//! Sequence state on the device: a pool of slots, each holding one sequence's state of every
//! layer (GDN conv and recurrent states, attention KV caches: two arrays a layer, sized by the
//! layer's [`StateSpec`]), position and sampling parameters. Per layer the slots are one array
//! (`[slots, …]`), so a batched step addresses a row's state by its slot index; a sequence owns one slot from [`GpuModel::new_seq`] until
//! [`GpuModel::release`]. Snapshots copy a slot's state (the KV caches up to the position) into
//! buffers of their own, and restore copies them into a free slot.

use deltamoe_compute::cuda::ops::{self, SampleParams};
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu};

use super::layers::{State, StateSpec};
use super::{GpuModel, Result};

/// The state arrays of every slot.
pub(crate) struct Pool {
    pub slots: usize,
    /// Context of each slot (rows of its KV caches).
    pub ctx: usize,
    /// Per layer: its two state arrays `[slots, per_slot]` (GDN conv and recurrent state,
    /// attention K and V caches) and their sizes.
    states: Vec<([DevBuf<f32>; 2], StateSpec)>,
    /// Position (tokens seen) per slot.
    pub pos: DevBuf<i32>,
    /// Sampling words per slot, `[slots, SampleParams::WORDS]` (see `ops::SampleParams::words`).
    pub sampling: DevBuf<u32>,
    /// With speculative decoding: per layer, where a verify pass keeps its states after each
    /// token but the last (one sequence's, `Mixer::saved_floats` per token and array).
    saved: Vec<[DevBuf<f32>; 2]>,
    /// With speculative decoding: the MTP layer's K and V caches (`[slots, ctx, row]`) and
    /// positions per slot (the pairs each holds, set by the host before every MTP pass).
    mtp: Option<([DevBuf<f32>; 2], StateSpec)>,
    pub mtp_pos: DevBuf<i32>,
    /// With speculative decoding: per slot, the final hidden state a prefill's last token left
    /// for the MTP layer's next pair (`[slots, H]`).
    pub mtp_carry: DevBuf<f32>,
    /// [`Pool::roll_back`]'s table of copies: (dst, src, floats) per GDN state array.
    spans: DevBuf<u64>,
    free: Vec<usize>,
}

/// A sequence's slot in the pool and its position (mirroring the device counter); with
/// speculative decoding, the pairs its MTP cache holds, whether the final hidden state of its
/// last prompt token waits in the pool's `mtp_carry` for the token after it, and that token
/// once a verify pass has fed it.
#[derive(Debug)]
pub struct GpuSeq {
    pub(crate) slot: usize,
    pub(crate) pos: usize,
    pub(crate) mtp_pos: usize,
    pub(crate) mtp_carry: bool,
    pub(crate) carry_token: Option<u32>,
}

impl GpuSeq {
    fn at(slot: usize, pos: usize) -> GpuSeq {
        GpuSeq {
            slot,
            pos,
            mtp_pos: 0,
            mtp_carry: false,
            carry_token: None,
        }
    }
}

impl GpuSeq {
    /// Tokens the sequence has seen.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Pairs (final hidden state, next token) its MTP cache holds.
    pub fn mtp_pairs(&self) -> usize {
        self.mtp_pos
    }
}

/// A copy of one sequence's device state.
pub struct GpuSnapshot {
    pos: usize,
    /// Per layer: the part of its two state arrays a snapshot copies (see [`StateSpec`]).
    layers: Vec<[DevBuf<f32>; 2]>,
}

impl GpuSnapshot {
    /// Device bytes the snapshot holds.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|[a, b]| a.len() + b.len())
            .sum::<usize>()
            * 4
    }
}

/// Each layer's state at context `ctx`.
fn layer_specs(m: &GpuModel, ctx: usize) -> Vec<StateSpec> {
    m.layers.iter().map(|l| l.mixer.state(ctx)).collect()
}

/// The MTP layer's state at context `ctx` when speculative decoding is on.
fn mtp_spec(m: &GpuModel, ctx: usize) -> Option<StateSpec> {
    let mtp = m.mtp.as_ref().filter(|_| m.drafts > 0)?;
    Some(mtp.layer.mixer.state(ctx))
}

impl Pool {
    pub fn new(m: &GpuModel, slots: usize, ctx: usize) -> Result<Pool> {
        let g = &*m.gpu;
        let arrays = |[a, b]: [usize; 2], n: usize| Ok([g.zeros(n * a)?, g.zeros(n * b)?]);
        let states = layer_specs(m, ctx)
            .into_iter()
            .map(|spec| Ok((arrays(spec.per_slot, slots)?, spec)))
            .collect::<Result<_>>()?;
        let saved = m
            .layers
            .iter()
            .map(|l| arrays(l.mixer.saved_floats(ctx), m.drafts))
            .collect::<Result<_>>()?;
        let spec = mtp_spec(m, ctx);
        let carry = if spec.is_some() { slots * m.hidden } else { 1 };
        let mtp = match spec {
            Some(spec) => Some((arrays(spec.per_slot, slots)?, spec)),
            None => None,
        };
        Ok(Pool {
            slots,
            ctx,
            states,
            pos: g.zeros(slots)?,
            sampling: g.zeros(slots * SampleParams::WORDS)?,
            saved,
            mtp,
            mtp_pos: g.zeros(slots)?,
            mtp_carry: g.zeros(carry)?,
            spans: g.zeros(3 * 2 * m.layers.len())?,
            free: (0..slots).rev().collect(),
        })
    }

    /// Layer `i`'s state arrays (base addresses).
    pub fn state(&self, i: usize) -> State {
        let [a, b] = &self.states[i].0;
        [a.ptr(), b.ptr()]
    }

    /// Layer `i`'s arrays of a verify pass's kept states (base addresses).
    pub fn saved(&self, i: usize) -> State {
        let [a, b] = &self.saved[i];
        [a.ptr(), b.ptr()]
    }

    /// The MTP layer's KV caches (base addresses), with speculative decoding on.
    pub fn mtp_state(&self) -> Option<State> {
        self.mtp.as_ref().map(|([a, b], _)| [a.ptr(), b.ptr()])
    }

    /// Copies the states a verify pass kept after its token `t` (not its last) into `slot`, in
    /// one launch.
    pub fn roll_back(&mut self, g: &Gpu, slot: usize, t: usize) -> Result<()> {
        let mut table = Vec::new();
        for ((arrays, spec), saved) in self.states.iter().zip(&self.saved) {
            for j in 0..2 {
                let per = spec.per_slot[j];
                if spec.row.is_none() && saved[j].len() >= (t + 1) * per {
                    let (dst, src) = (arrays[j].at(slot * per), saved[j].at(t * per));
                    table.extend([dst, src, per as u64]);
                }
            }
        }
        g.write_at(&mut self.spans, 0, &table)?;
        // SAFETY: each span is one slot's state array of a layer (dst) and one token's kept copy
        // of it (src, within the saved array: checked above), of the same length.
        unsafe { ops::gdn_restore(g, self.spans.ptr(), table.len() / 3) }
    }
}

/// Device memory [`GpuModel::reserve`] leaves free for scratch, prefill activations, graphs
/// and prompt snapshots.
pub const RESERVE_HEADROOM: usize = 4 << 30;

/// Most slots an automatic reservation takes.
pub const AUTO_MAX_SLOTS: usize = 256;

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
        // A verify pass runs a token and its drafts as rows.
        self.set_rows(slots.min(super::MAX_BATCH).max(self.drafts + 1))
    }

    pub(crate) fn pool(&self) -> Result<&Pool> {
        self.pool
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("no sequence state reserved".into()))
    }

    pub(crate) fn pool_mut(&mut self) -> Result<&mut Pool> {
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
        let g = self.gpu.clone();
        let pool = self.pool_mut()?;
        let slot = pool.free.pop().ok_or_else(|| full(pool.slots))?;
        for (arrays, spec) in &mut pool.states {
            for (a, &n) in arrays.iter_mut().zip(&spec.per_slot) {
                g.zero_range(a, slot * n, n)?;
            }
        }
        g.write_at(&mut pool.pos, slot, &[0])?;
        g.write_at(
            &mut pool.sampling,
            slot * SampleParams::WORDS,
            &SampleParams::default().words(0),
        )?;
        Ok(GpuSeq::at(slot, 0))
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
        let mut layers = Vec::with_capacity(pool.states.len());
        for (arrays, spec) in &pool.states {
            let lens = spec.snapshot(seq.pos);
            let mut copy = [g.zeros(lens[0])?, g.zeros(lens[1])?];
            for j in 0..2 {
                let from = seq.slot * spec.per_slot[j];
                g.copy(&arrays[j], from, &mut copy[j], 0, lens[j])?;
            }
            layers.push(copy);
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
        for ((arrays, spec), copy) in pool.states.iter_mut().zip(&snap.layers) {
            for j in 0..2 {
                let to = slot * spec.per_slot[j];
                g.copy(&copy[j], 0, &mut arrays[j], to, copy[j].len())?;
            }
        }
        g.write_at(&mut pool.pos, slot, &[snap.pos as i32])?;
        g.write_at(
            &mut pool.sampling,
            slot * SampleParams::WORDS,
            &SampleParams::default().words(0),
        )?;
        Ok(GpuSeq::at(slot, snap.pos))
    }

    /// How the step picks the sequence's next token (the draw counter restarts at 0).
    pub fn set_sampling(&mut self, seq: &GpuSeq, p: SampleParams) -> Result<()> {
        let g = self.gpu.clone();
        g.write_at(
            &mut self.pool_mut()?.sampling,
            seq.slot * SampleParams::WORDS,
            &p.words(0),
        )
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

    /// Bytes of device state per sequence at `ctx` tokens (with speculative decoding, the MTP
    /// layer's KV caches included).
    pub fn seq_bytes(&self, ctx: usize) -> usize {
        let mtp = mtp_spec(self, ctx);
        layer_specs(self, ctx)
            .iter()
            .chain(&mtp)
            .map(|s| s.per_slot[0] + s.per_slot[1])
            .sum::<usize>()
            * 4
            + mtp.map_or(0, |_| 4 * self.hidden)
            + 8 * 4
    }
}
