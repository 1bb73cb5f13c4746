//! Where the routed experts of one offloaded MoE layer live: in one of the device cache slots,
//! or at a position of the layer's pinned host stacks; a cached expert may also keep a clean
//! copy at a host position.
//!
//! Placing `S` of `E` experts with `C` clean copies: experts 0..S go to device slots 0..S (a
//! stacked shared expert to slot S), experts S..E to host positions 0..E−S, copies of experts
//! 0..C to positions E−S.. . Admitting expert A (host position p) into slot s, which holds B,
//! copies A from p into the slot; A's data at p stays as its clean copy. B needs no copy back
//! when it has a clean copy; else it is written back, in stream order before A's copy, over
//! another cached expert's clean copy, or (none left) through a spare device matrix to p (the
//! tables: [`super::homes`]). With C = S (host memory for every expert) nothing is written back;
//! with C = 0 the host holds only the E−S experts outside the cache, so a model whose experts
//! fit neither in host memory nor on the GPU runs when the two together hold them. The expert
//! kernels read a far expert by its host position (`split + p`, see `ops::Far`), and the host's
//! kernels read the same position.
//!
//! Experts come from an [`ExpertSource`]: a loaded model's matrices, seeded random ones
//! (synthetic models), or host stacks of a whole layer ([`Gathered`], when the cache is resized).

use std::ops::Range;

use deltamoe_compute::cuda::host::HostBuf;
use deltamoe_compute::cuda::ops::Far;
use deltamoe_compute::cuda::{DevBuf, Gpu};

use deltamoe_compute::cuda::Result;

use super::format::{DevMat, Fmt};
use super::homes::{Homes, WriteBack};
use crate::residency::{Policy, Residency, Swap};

/// A stack of same-shaped `[n, k]` matrices in pinned host memory, in the device layout of its
/// format.
pub(crate) struct HostMat {
    pub(super) arrays: Vec<HostBuf<u8>>,
    fmt: Fmt,
}

impl HostMat {
    /// A zeroed pinned host stack of `count` matrices.
    pub(super) fn zeros(g: &Gpu, fmt: Fmt, count: usize) -> Result<HostMat> {
        let arrays = fmt.array_bytes().into_iter();
        let arrays = arrays
            .map(|b| HostBuf::zeros(g, count * b))
            .collect::<Result<_>>()?;
        Ok(HostMat { arrays, fmt })
    }

    fn ptrs(&self) -> Vec<u64> {
        self.arrays.iter().map(|a| a.ptr()).collect()
    }

    /// The far-stack arguments for ids from `split` on.
    fn far(&self, split: usize) -> Far {
        self.fmt.format.far(&self.ptrs(), split)
    }

    pub(super) fn fmt(&self) -> Fmt {
        self.fmt
    }

    /// (base address, bytes per matrix) of each array.
    pub(super) fn pieces(&self) -> Vec<(u64, usize)> {
        self.ptrs()
            .into_iter()
            .zip(self.fmt.array_bytes())
            .collect()
    }

    /// Bytes of one row of one matrix.
    pub(super) fn row_bytes(&self) -> usize {
        self.fmt.matrix_bytes() / self.fmt.n.max(1)
    }
}

/// Copy matrices `from..from + count` of `src` to matrices `to..` of `dst` (same format), in
/// stream order.
pub(super) fn copy_matrices(
    g: &Gpu,
    src: &[(u64, usize)],
    from: usize,
    dst: &[(u64, usize)],
    to: usize,
    count: usize,
) -> Result<()> {
    for (&(s, bytes), &(d, _)) in src.iter().zip(dst) {
        if count == 0 {
            break;
        }
        // SAFETY: both stacks hold the matrices named (`bytes` bytes per array each; indices
        // checked by the callers against the stack counts) and outlive the stream's work.
        unsafe {
            g.copy_raw(
                d + (to * bytes) as u64,
                s + (from * bytes) as u64,
                count * bytes,
            )?
        };
    }
    Ok(())
}

/// The routed experts of a layer that one GPU places: `own` of the layer's `total` (all of them,
/// or this GPU's share when several run the model, see `super::shard`). Index j of the placed
/// experts is the layer's expert `own.start + j`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Held {
    pub(crate) own: Range<usize>,
    pub(crate) total: usize,
}

impl Held {
    pub(crate) fn len(&self) -> usize {
        self.own.len()
    }

    /// Whether other GPUs hold some of the layer's experts.
    fn shared_out(&self) -> bool {
        self.own.len() < self.total
    }
}

/// A layer whose routed experts wait to be placed, and where they come from.
pub(crate) struct Pending<'a> {
    pub(crate) layer: usize,
    pub(crate) held: Held,
    pub(crate) stacked: bool,
    pub(crate) src: Box<dyn ExpertSource + 'a>,
}

impl<'a> Pending<'a> {
    /// Layer `layer`'s `held` routed experts (the shared one stacked after them when
    /// `stacked`), from `src`, which numbers them from 0.
    pub(crate) fn new(
        layer: usize,
        held: Held,
        stacked: bool,
        src: Box<dyn ExpertSource + 'a>,
    ) -> Pending<'a> {
        Pending {
            layer,
            held,
            stacked,
            src,
        }
    }
}

/// Matrices `at..` of a stack whose arrays ((base address, bytes per matrix) each) are `arrays`,
/// in device or pinned host memory.
#[derive(Clone, Copy)]
pub(crate) struct Dest<'a> {
    pub(super) arrays: &'a [(u64, usize)],
    pub(super) at: usize,
}

/// Where one layer's experts come from when they are placed. Expert index E (the number of
/// routed experts) is the shared expert when it is stacked with them.
pub(crate) trait ExpertSource {
    /// Formats of the `[gate | up]` and the down matrices.
    fn formats(&self) -> (Fmt, Fmt);

    /// Write `experts` of the down (`down`) or `[gate | up]` matrices to `to`, in stream order.
    fn write(&self, g: &Gpu, down: bool, experts: Range<usize>, to: Dest<'_>) -> Result<()>;
}

/// A whole layer's experts in pinned host stacks, each at its index (the stacked shared expert
/// last): what a cache resize places again.
pub(crate) struct Gathered {
    gu: HostMat,
    down: HostMat,
}

impl ExpertSource for Gathered {
    fn formats(&self) -> (Fmt, Fmt) {
        (self.gu.fmt(), self.down.fmt())
    }

    fn write(&self, g: &Gpu, down: bool, experts: Range<usize>, to: Dest<'_>) -> Result<()> {
        let src = if down { &self.down } else { &self.gu };
        let (first, count) = (experts.start, experts.len());
        copy_matrices(g, &src.pieces(), first, to.arrays, to.at, count)
    }
}

/// The offloaded experts of one MoE layer.
pub(crate) struct LayerExperts {
    /// `[gate | up]` and down of the experts outside the cache (and clean copies), by host
    /// position.
    pub(super) gu: HostMat,
    pub(super) down: HostMat,
    /// Which host position holds each expert's data (always, outside the cache; a clean copy,
    /// in it).
    homes: Homes,
    /// Where each of the layer's routed experts is: its cache slot or split + its host position
    /// (read over PCIe, or handed to the host by the router), −1 for other GPUs' experts; and
    /// the host's copy of that table.
    loc: DevBuf<i32>,
    loc_host: Vec<i32>,
    pub(super) res: Residency,
    /// The experts placed here (numbered from 0 in the tables above).
    pub(super) held: Held,
    pub(super) stacked: bool,
}

impl LayerExperts {
    /// Place the `held` routed experts of `src` (then its shared expert, when `stacked`):
    /// `slots` of them in new device stacks (returned: `[gate | up]`, down), the others in
    /// pinned host stacks, with clean copies of `copies` cached ones.
    pub(super) fn place(
        g: &Gpu,
        src: &dyn ExpertSource,
        (held, stacked): (Held, bool),
        slots: usize,
        copies: usize,
    ) -> Result<(LayerExperts, DevMat, DevMat)> {
        let experts = held.len();
        let s = slots.min(experts);
        let (c, out) = (copies.min(s), experts - s);
        let (fg, fd) = src.formats();
        let dev = (
            fg.device_stack(g, s + stacked as usize)?,
            fd.device_stack(g, s + stacked as usize)?,
        );
        let (gu, down) = (
            HostMat::zeros(g, fg, out + c)?,
            HostMat::zeros(g, fd, out + c)?,
        );
        for (is_down, d, h) in [(false, &dev.0, &gu), (true, &dev.1, &down)] {
            let (d, h) = (d.pieces(), h.pieces());
            let on_device = |at| Dest { arrays: &d, at };
            let on_host = |at| Dest { arrays: &h, at };
            src.write(g, is_down, 0..s, on_device(0))?;
            if stacked {
                src.write(g, is_down, experts..experts + 1, on_device(s))?;
            }
            src.write(g, is_down, s..experts, on_host(0))?;
            src.write(g, is_down, 0..c, on_host(out))?;
        }
        let mut lx = LayerExperts {
            gu,
            down,
            homes: Homes::new(experts, s, c),
            loc: g.zeros(held.total)?,
            loc_host: Vec::new(),
            res: Residency::new(experts, s, Policy::default()),
            held,
            stacked,
        };
        let own = lx.held.own.clone();
        lx.loc_host = (0..lx.held.total)
            .map(|e| match own.contains(&e) {
                true => lx.locate(e - own.start),
                false => -1,
            })
            .collect();
        g.write(&mut lx.loc, &lx.loc_host)?;
        Ok((lx, dev.0, dev.1))
    }

    /// Every expert of the layer (the device cache `cache` and the host stacks) copied to new
    /// host stacks at its index, for placing again.
    pub(super) fn gather(&self, g: &Gpu, cache: (&DevMat, &DevMat)) -> Result<Gathered> {
        let count = self.experts() + self.stacked as usize;
        let gu = HostMat::zeros(g, self.gu.fmt(), count)?;
        let down = HostMat::zeros(g, self.down.fmt(), count)?;
        let (to_gu, to_down) = (gu.pieces(), down.pieces());
        let (cache_gu, cache_down) = (cache.0.pieces(), cache.1.pieces());
        let slots = self.res.slots();
        let cached = (0..slots).filter_map(|c| Some((c, self.res.expert_in(c)?)));
        let shared = self.stacked.then_some((slots, self.experts()));
        for (c, e) in cached.chain(shared) {
            copy_matrices(g, &cache_gu, c, &to_gu, e, 1)?;
            copy_matrices(g, &cache_down, c, &to_down, e, 1)?;
        }
        let (host_gu, host_down) = (self.gu.pieces(), self.down.pieces());
        for p in 0..self.homes.positions() {
            match self.homes.lodger(p) {
                Some(e) if self.res.slot_of(e).is_none() => {
                    copy_matrices(g, &host_gu, p, &to_gu, e, 1)?;
                    copy_matrices(g, &host_down, p, &to_down, e, 1)?;
                }
                _ => {}
            }
        }
        g.sync()?;
        Ok(Gathered { gu, down })
    }

    /// Routed experts placed here.
    pub(super) fn experts(&self) -> usize {
        self.held.len()
    }

    pub(super) fn split(&self) -> usize {
        self.res.slots() + self.stacked as usize
    }

    /// Bytes of the host stacks.
    pub(super) fn host_bytes(&self) -> usize {
        self.homes.positions() * self.expert_bytes()
    }

    /// Bytes of one expert (`[gate | up]` and down).
    pub(super) fn expert_bytes(&self) -> usize {
        self.gu.fmt().matrix_bytes() + self.down.fmt().matrix_bytes()
    }

    pub(super) fn far_gu(&self) -> Far {
        self.gu.far(self.split())
    }

    pub(super) fn far_down(&self) -> Far {
        self.down.far(self.split())
    }

    /// The stacked index of the shared expert for decode routing.
    pub(super) fn shared_slot(&self) -> Option<usize> {
        self.stacked.then_some(self.res.slots())
    }

    pub(super) fn loc(&self) -> u64 {
        self.loc.ptr()
    }

    /// Positions of the host stacks (each holds an expert's data).
    pub(super) fn host_positions(&self) -> usize {
        self.homes.positions()
    }

    /// The expert a routed id of the last step names: a cache slot (below split), a host
    /// position (split + p), or a host position handed to the host (−1 − p); none for −1 when
    /// other GPUs hold some experts (theirs; the host takes none then).
    pub(super) fn expert_of(&self, id: i32) -> Option<usize> {
        let split = self.split() as i64;
        match id as i64 {
            id if id < 0 && self.held.shared_out() => None,
            id if id < 0 => self.homes.lodger((-1 - id) as usize),
            id if id >= split => self.homes.lodger((id - split) as usize),
            id => self.res.expert_in(id as usize),
        }
    }

    /// Host position of expert `e`'s data (outside the cache: always there).
    pub(super) fn home_of(&self, e: usize) -> Option<usize> {
        self.homes.home_of(e)
    }

    /// Where expert `e` is now, as the router's `loc` table says it.
    fn locate(&self, e: usize) -> i32 {
        match (self.res.slot_of(e), self.homes.home_of(e)) {
            (Some(c), _) => c as i32,
            (None, Some(p)) => (self.split() + p) as i32,
            // Unreachable: an expert outside the cache always has its data at a position.
            (None, None) => -1,
        }
    }

    /// Point the `loc` entry of expert `e` (of those placed here) at where it is now (in stream
    /// order).
    fn relocate(&mut self, g: &Gpu, e: usize) -> Result<()> {
        let (v, at) = (self.locate(e), self.held.own.start + e);
        if self.loc_host[at] != v {
            g.set_i32(&self.loc, at, v)?;
            self.loc_host[at] = v;
        }
        Ok(())
    }

    /// Carry out swap `s` in stream order (see [`super::homes`]; matrix 0 of `spare` carries
    /// an evicted expert written back to the admitted one's position). Returns whether the
    /// evicted expert was written back to host memory.
    pub(super) fn admit(
        &mut self,
        g: &Gpu,
        cache: (&DevMat, &DevMat),
        spare: (&DevMat, &DevMat),
        s: Swap,
    ) -> Result<bool> {
        let p = self.homes.home_of(s.expert);
        let res = &self.res;
        let back = self
            .homes
            .swap(s.expert, s.evicted, |x| res.slot_of(x).is_some());
        let (Some(p), Some(back)) = (p, back) else {
            return Err(super::unsupported(format!(
                "expert {} is outside the cache with no host copy",
                s.expert
            )));
        };
        let stacks = [(&self.gu, cache.0, spare.0), (&self.down, cache.1, spare.1)];
        for (host, dev, tmp) in stacks {
            let (host, dev, tmp) = (host.pieces(), dev.pieces(), tmp.pieces());
            match back {
                WriteBack::Exchange => {
                    copy_matrices(g, &dev, s.slot, &tmp, 0, 1)?;
                    copy_matrices(g, &host, p, &dev, s.slot, 1)?;
                    copy_matrices(g, &tmp, 0, &host, p, 1)?;
                }
                WriteBack::To(q) => {
                    copy_matrices(g, &dev, s.slot, &host, q, 1)?;
                    copy_matrices(g, &host, p, &dev, s.slot, 1)?;
                }
                WriteBack::None => copy_matrices(g, &host, p, &dev, s.slot, 1)?,
            }
        }
        self.res.apply(s);
        if let Some(v) = s.evicted {
            self.relocate(g, v)?;
        }
        self.relocate(g, s.expert)?;
        Ok(back != WriteBack::None)
    }
}

/// The seed with which a fill of `fill.cu` writes, from element 0, the values that a fill with
/// `seed` writes from element `index` (its counter-based generator hashes seed + (i + 1)·φ).
pub(super) fn seed_at(seed: u64, index: usize) -> u64 {
    seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

#[cfg(test)]
mod tests {
    use super::seed_at;

    #[test]
    fn a_seed_at_an_index_shifts_the_counter() {
        // fill.cu hashes z = seed + (i + 1)·φ: element i of a fill from seed_at(s, j) is
        // element i + j of a fill from s.
        let phi = 0x9E37_79B9_7F4A_7C15u64;
        let z = |seed: u64, i: u64| seed.wrapping_add((i + 1).wrapping_mul(phi));
        for (s, j, i) in [(7u64, 0usize, 0u64), (123, 5, 9), (u64::MAX, 1 << 40, 3)] {
            assert_eq!(z(seed_at(s, j), i), z(s, i + j as u64));
        }
    }
}
