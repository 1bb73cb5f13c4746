//! Expert offload: running a model whose routed experts do not fit on the GPU.
//!
//! Each routed expert of an offloaded MoE layer is in one place ([`super::host_store`]): one of
//! `slots` cache slots of the layer's device stacks, which hold `[cache slots | shared expert
//! (when stacked)]`, or a position p of pinned host stacks mapped into the device's address
//! space (the "far" stacks, same layout). A device table `loc[E]` says where each expert is: its
//! cache slot, or `split + p` (`split` = slots + stacked shared). The router writes ids through
//! `loc`, and the expert kernels read ids ≥ split from the far stacks over PCIe (see `ops::Far`):
//! a decode step stays one CUDA graph with no host sync, and the result does not depend on where
//! a weight was read from, so logits are bitwise those of the all-resident model.
//!
//! Between steps the routed ids of every layer (copied to pinned memory at the end of the step)
//! feed the residency policy ([`crate::residency`]); its swaps run in stream order before the next
//! step (the admitted expert into the slot, the evicted one to the admitted one's host position,
//! then both `loc` entries). Prefill passes route many tokens to most experts, so they copy the
//! experts their tokens use (cached ones on the device, the others over PCIe) into a staging
//! stack of all experts and run the grouped kernels on it; between passes its matrix 0 is the
//! spare through which swaps move an evicted expert.

use std::cell::Cell;

use deltamoe_compute::cuda::host::HostBuf;
use deltamoe_compute::cuda::ops::Matvec;
use deltamoe_compute::cuda::DevBuf;

use super::format::DevMat;
use super::host_experts::HostExperts;
use super::host_store::{copy_matrices, LayerExperts, Pending};
use super::layers::moe::MoeFfn;
use super::{unsupported, GpuModel, Result, MAX_BATCH};
pub use crate::residency::slots_for_bytes;

/// How many routed experts of each MoE layer the GPU keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertCache {
    /// Every expert resident: no offload.
    All,
    /// This fraction of each layer's experts (0 to 1).
    Fraction(f64),
    /// This many bytes of device memory for the caches of all layers together.
    Bytes(usize),
    /// The whole model may use this many bytes of device memory: the caches get what the other
    /// weights leave (less [`STATE_RESERVE`]).
    GpuMemory(usize),
}

impl ExpertCache {
    /// The cache of each of `gpus` GPUs that hold a share of the experts each: a byte budget
    /// divided among them, the other forms as they are.
    pub fn per_gpu(self, gpus: usize) -> ExpertCache {
        match self {
            ExpertCache::Bytes(b) => ExpertCache::Bytes(b / gpus.max(1)),
            other => other,
        }
    }
}

/// Device memory an offloaded model leaves free for sequence state and activations when it
/// sizes its caches.
pub const STATE_RESERVE: usize = 8 << 30;

/// Host memory an offloaded model leaves to the rest of the system when it sizes its clean
/// copies of cached experts (unless [`GpuModel::set_host_memory`] caps the host stacks).
pub const HOST_RESERVE: usize = 16 << 30;

/// Clean host copies of cached experts per layer (see [`super::host_store`]): as many of the
/// `slots` cached ones as `room` bytes of host memory hold after the `experts − slots` outside
/// the cache, over `layers` layers of experts of `slot_bytes`.
pub fn clean_copies(
    room: usize,
    layers: usize,
    slot_bytes: usize,
    experts: usize,
    slots: usize,
) -> usize {
    let outside = layers * experts.saturating_sub(slots) * slot_bytes;
    (room.saturating_sub(outside) / (layers * slot_bytes).max(1)).min(slots)
}

/// Bytes of host memory available to new allocations; none known elsewhere than Linux, which
/// keeps no clean copies.
fn host_available() -> usize {
    crate::host_memory::available().unwrap_or(0)
}

/// What offload did, summed over steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadStats {
    /// Decode steps and the rows (tokens) they ran.
    pub steps: u64,
    pub tokens: u64,
    /// Routed expert uses served from the cache / read over PCIe.
    pub hits: u64,
    pub misses: u64,
    /// Bytes the expert kernels read from host memory.
    pub far_bytes: u64,
    /// Misses the host computed (CPU fallback; not read over PCIe), and the seconds it spent.
    pub host: u64,
    pub host_seconds: f64,
    /// Experts copied into the cache, and their bytes.
    pub admitted: u64,
    pub admit_bytes: u64,
    /// Evicted experts copied back to host memory (they had no clean copy there).
    pub written_back: u64,
    /// Bytes copied into the prefill staging stacks over PCIe / on the device.
    pub staged_host_bytes: u64,
    pub staged_device_bytes: u64,
}

impl OffloadStats {
    /// The statistics of two GPUs' shares of the experts together: counts and bytes summed,
    /// steps and tokens (which every GPU runs) as they are, the host's seconds the longer.
    pub fn with(self, o: OffloadStats) -> OffloadStats {
        OffloadStats {
            steps: self.steps.max(o.steps),
            tokens: self.tokens.max(o.tokens),
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            far_bytes: self.far_bytes + o.far_bytes,
            host: self.host + o.host,
            host_seconds: self.host_seconds.max(o.host_seconds),
            admitted: self.admitted + o.admitted,
            admit_bytes: self.admit_bytes + o.admit_bytes,
            written_back: self.written_back + o.written_back,
            staged_host_bytes: self.staged_host_bytes + o.staged_host_bytes,
            staged_device_bytes: self.staged_device_bytes + o.staged_device_bytes,
        }
    }

    /// What happened between `earlier` (a reading of the same statistics) and these.
    pub fn since(&self, earlier: &OffloadStats) -> OffloadStats {
        OffloadStats {
            steps: self.steps - earlier.steps,
            tokens: self.tokens - earlier.tokens,
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            far_bytes: self.far_bytes - earlier.far_bytes,
            host: self.host - earlier.host,
            host_seconds: self.host_seconds - earlier.host_seconds,
            admitted: self.admitted - earlier.admitted,
            admit_bytes: self.admit_bytes - earlier.admit_bytes,
            written_back: self.written_back - earlier.written_back,
            staged_host_bytes: self.staged_host_bytes - earlier.staged_host_bytes,
            staged_device_bytes: self.staged_device_bytes - earlier.staged_device_bytes,
        }
    }

    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// Bytes over PCIe per decoded token (far reads and admissions).
    pub fn pcie_bytes_per_token(&self) -> f64 {
        (self.far_bytes + self.admit_bytes) as f64 / self.tokens.max(1) as f64
    }
}

/// Model-wide offload state.
pub(crate) struct Offload {
    /// Routed ids of every layer's last step, `[layers, MAX_BATCH, per_row]` (per_row: top-k,
    /// plus the stacked shared expert's slot when there is one, as the router writes them), and
    /// their pinned host copy.
    ids: DevBuf<i32>,
    ids_host: HostBuf<i32>,
    pub(super) per_row: usize,
    /// Stacks of all experts of a layer, for prefill.
    stage: (DevMat, DevMat),
    stats: Cell<OffloadStats>,
    /// The routed ids and row count of the last completed step, until the policy has seen them.
    pending: Option<(Vec<i32>, usize)>,
    /// Whether the host may compute experts (the CPU fallback; off unless turned on), and its
    /// state when it is set up.
    pub(super) host_wanted: bool,
    pub(super) host: Option<HostExperts>,
}

impl Offload {
    fn layer_len(&self) -> usize {
        MAX_BATCH * self.per_row
    }

    pub(super) fn add(&self, f: impl FnOnce(&mut OffloadStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }
}

impl GpuModel {
    /// The offloaded experts of layer `i`, if any.
    pub(super) fn layer_experts(&self, i: usize) -> Option<&LayerExperts> {
        MoeFfn::of(&*self.layers[i].ffn)?.offload.as_deref()
    }

    /// Layer `i`'s offloaded experts and its device stacks (the cache).
    pub(super) fn offloaded(&self, i: usize) -> Result<(&LayerExperts, &DevMat, &DevMat)> {
        match MoeFfn::of(&*self.layers[i].ffn) {
            Some(MoeFfn {
                experts_gu,
                experts_down,
                offload: Some(lx),
                ..
            }) => Ok((lx, experts_gu, experts_down)),
            _ => Err(unsupported(format!("layer {i} has no offloaded experts"))),
        }
    }

    /// Size the expert caches of an offloaded model (one built with offload; see
    /// [`ExpertCache`]) and fill them. Layer by layer, its experts are gathered in host memory,
    /// its old cache and host stacks freed and the experts placed again, so a resize holds at
    /// most one layer twice. Returns the cache slots per layer.
    pub fn set_expert_cache(&mut self, spec: ExpertCache) -> Result<usize> {
        let g = self.gpu.clone();
        let moe: Vec<usize> = (0..self.layers.len())
            .filter(|&i| self.layer_experts(i).is_some())
            .collect();
        let Some(lx) = moe.first().and_then(|&i| self.layer_experts(i)) else {
            return Ok(self.num_experts);
        };
        let (held, stacked) = (lx.held.clone(), lx.stacked);
        let experts = held.len();
        let slot_bytes = lx.expert_bytes();
        // What the layers hold now counts as free: each layer's is freed before it is placed.
        let held_device = moe.len() * lx.res.slots() * slot_bytes;
        let held_host = self.offload_host_bytes().unwrap_or(0);
        let shape = (moe.len(), experts, slot_bytes);
        let (slots, copies) = self.placement(spec, shape, held_device, held_host)?;
        for i in moe {
            let Some(MoeFfn {
                experts_gu,
                experts_down,
                offload,
                ..
            }) = MoeFfn::of_mut(&mut *self.layers[i].ffn)
            else {
                continue;
            };
            let Some(lx) = offload.take() else { continue };
            let src = lx.gather(&g, (experts_gu, experts_down))?;
            drop(lx);
            *experts_gu = experts_gu.empty(&g)?;
            *experts_down = experts_down.empty(&g)?;
            let p = Pending::new(i, held.clone(), stacked, Box::new(src));
            self.place_layer(p, slots, copies)?;
        }
        self.placed(slots)
    }

    /// Place the routed experts of the `pending` layers (their device stacks still empty) with
    /// caches sized by `spec`. Returns the cache slots per layer.
    pub(super) fn place_experts(
        &mut self,
        spec: ExpertCache,
        pending: Vec<Pending<'_>>,
    ) -> Result<usize> {
        let g = self.gpu.clone();
        let Some(first) = pending.first() else {
            return Ok(self.num_experts);
        };
        let (experts, stacked) = (first.held.len(), first.stacked);
        let (fg, fd) = first.src.formats();
        let slot_bytes = fg.matrix_bytes() + fd.matrix_bytes();
        if self.offload.is_none() {
            let count = experts + stacked as usize;
            let stage = (fg.device_stack(&g, count)?, fd.device_stack(&g, count)?);
            let per_row = self.top_k + stacked as usize;
            let n = self.layers.len() * MAX_BATCH * per_row;
            self.offload = Some(Offload {
                ids: g.zeros(n)?,
                ids_host: HostBuf::zeros(&g, n)?,
                per_row,
                stage,
                stats: Cell::new(OffloadStats::default()),
                pending: None,
                host_wanted: false,
                host: None,
            });
        }
        let shape = (pending.len(), experts, slot_bytes);
        let (slots, copies) = self.placement(spec, shape, 0, 0)?;
        for p in pending {
            self.place_layer(p, slots, copies)?;
        }
        self.placed(slots)
    }

    /// Cache slots and clean host copies per layer for `spec` over `(layers, experts,
    /// slot_bytes)`, counting `held_device` / `held_host` bytes the placement frees as it goes;
    /// drops the captured graphs and the host experts' state (set up again by
    /// [`Self::placed`]).
    fn placement(
        &mut self,
        spec: ExpertCache,
        (layers, experts, slot_bytes): (usize, usize, usize),
        held_device: usize,
        held_host: usize,
    ) -> Result<(usize, usize)> {
        self.graphs.clear();
        if let Some(o) = self.offload.as_mut() {
            o.pending = None;
            o.host = None;
        }
        let (free, total) = self.gpu.mem_info()?;
        let free = free + held_device;
        // What the caches may take: the free memory less the state reserve (and within the
        // model's budget for GpuMemory).
        let room = free.saturating_sub(STATE_RESERVE);
        let slots = match spec {
            ExpertCache::All => experts,
            ExpertCache::Fraction(f) => ((f.clamp(0.0, 1.0) * experts as f64).round()) as usize,
            ExpertCache::Bytes(b) => slots_for_bytes(b, layers, slot_bytes, experts),
            ExpertCache::GpuMemory(budget) => {
                let used = total.saturating_sub(free);
                let b = budget.saturating_sub(used + STATE_RESERVE).min(room);
                slots_for_bytes(b, layers, slot_bytes, experts)
            }
        };
        if slots * layers * slot_bytes > room {
            return Err(unsupported(format!(
                "an expert cache of {slots} experts per layer needs {:.1} GiB but {:.1} GiB are \
                 free (less {} GiB kept for sequences); lower --expert-cache",
                (slots * layers * slot_bytes) as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64,
                STATE_RESERVE >> 30
            )));
        }
        // With several GPUs each takes its share of what the host has.
        let world = self.shard.as_ref().map_or(1, |s| s.world());
        let host_room = match self.host_memory {
            Some(b) => b,
            None => (host_available() + held_host).saturating_sub(HOST_RESERVE) / world,
        };
        let copies = clean_copies(host_room, layers, slot_bytes, experts, slots);
        Ok((slots, copies))
    }

    /// Place one layer's experts: `slots` cached, `copies` of them with clean host copies.
    fn place_layer(&mut self, p: Pending<'_>, slots: usize, copies: usize) -> Result<()> {
        let g = self.gpu.clone();
        let (lx, gu, down) = LayerExperts::place(&g, &*p.src, (p.held, p.stacked), slots, copies)?;
        // The source (a gathered layer: host memory) is freed before the next one is placed.
        drop(p.src);
        if let Some(MoeFfn {
            experts_gu,
            experts_down,
            offload,
            ..
        }) = MoeFfn::of_mut(&mut *self.layers[p.layer].ffn)
        {
            (*experts_gu, *experts_down) = (gu, down);
            *offload = Some(Box::new(lx));
        }
        Ok(())
    }

    /// After a placement of `slots` per layer: wait for its copies and set the host experts up
    /// again when they are wanted.
    fn placed(&mut self, slots: usize) -> Result<usize> {
        self.gpu.sync()?;
        if self.offload.as_ref().is_some_and(|o| o.host_wanted) {
            self.set_host_experts(true)?;
        }
        Ok(slots)
    }

    /// Cap the pinned host memory of the offloaded experts (outside the cache and clean copies)
    /// at `bytes` from the next placement on ([`Self::set_expert_cache`]); None: what the host
    /// has available, less [`HOST_RESERVE`]. The experts outside the cache are always pinned.
    pub fn set_host_memory(&mut self, bytes: Option<usize>) {
        self.host_memory = bytes;
    }

    /// Bytes of pinned host memory holding offloaded experts, when the model offloads them.
    pub fn offload_host_bytes(&self) -> Option<usize> {
        self.offload.as_ref()?;
        let layers = (0..self.layers.len()).filter_map(|i| self.layer_experts(i));
        Some(layers.map(|lx| lx.host_bytes()).sum())
    }

    /// Routed experts per MoE layer.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Cache slots per offloaded MoE layer (None: nothing offloaded).
    pub fn expert_cache_slots(&self) -> Option<usize> {
        self.offload.as_ref()?;
        (0..self.layers.len()).find_map(|i| self.layer_experts(i).map(|lx| lx.res.slots()))
    }

    /// Offload statistics since the caches were sized, when the model offloads experts.
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.offload.as_ref().map(|o| o.stats.get())
    }

    /// Where a step's routed ids of layer `i` go: the offload log, or the scratch.
    pub(super) fn moe_ids(&self, i: usize) -> u64 {
        match (&self.offload, self.layer_experts(i)) {
            (Some(o), Some(_)) => o.ids.at(i * o.layer_len()),
            _ => self.scratch.ffn.ids.ptr(),
        }
    }

    /// Enqueue the copy of every layer's routed ids to the host (the end of a step).
    pub(super) fn enqueue_ids_download(&self) -> Result<()> {
        match &self.offload {
            Some(o) => self.gpu.download_to(&o.ids, &o.ids_host, o.ids.len()),
            None => Ok(()),
        }
    }

    /// After a `b`-row step has completed (the host computed experts for `host_seconds`): keep
    /// its routed ids for [`Self::offload_policy`].
    pub(super) fn offload_record(&mut self, b: usize, host_seconds: f64) {
        if let Some(o) = self.offload.as_mut() {
            o.pending = Some((o.ids_host.as_slice().to_vec(), b));
            o.add(|s| s.host_seconds += host_seconds);
        }
    }

    /// Count the hits and misses of the last recorded step, let the policy pick swaps and
    /// enqueue them (in stream order after whatever is enqueued now).
    pub(super) fn offload_policy(&mut self) -> Result<()> {
        let Some(o) = self.offload.as_mut() else {
            return Ok(());
        };
        let Some((ids, b)) = o.pending.take() else {
            return Ok(());
        };
        let (per_row, len) = (o.per_row, o.layer_len());
        let (g, top_k) = (self.gpu.clone(), self.top_k);
        let mut st = o.stats.get();
        let (misses0, mut picks) = (st.misses, 0);
        st.steps += 1;
        st.tokens += b as u64;
        let spare = &o.stage;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let Some(MoeFfn {
                experts_gu,
                experts_down,
                offload: Some(lx),
                ..
            }) = MoeFfn::of_mut(&mut *l.ffn)
            else {
                continue;
            };
            let (mut used, mut missed, mut host) = (Vec::new(), Vec::new(), 0);
            for r in 0..b {
                for &id in &ids[i * len + r * per_row..][..top_k] {
                    let Some(e) = lx.expert_of(id) else { continue };
                    used.push(e);
                    if id < 0 || id as usize >= lx.split() {
                        missed.push(e);
                        host += (id < 0) as u64;
                    }
                }
            }
            let bytes = lx.expert_bytes() as u64;
            picks += (b * top_k) as u64;
            st.hits += (used.len() - missed.len()) as u64;
            st.misses += missed.len() as u64;
            st.host += host;
            st.far_bytes += (missed.len() as u64 - host) * bytes;
            lx.res.observe(&used);
            for s in lx.res.plan(&missed) {
                let back = lx.admit(&g, (experts_gu, experts_down), (&spare.0, &spare.1), s)?;
                st.written_back += back as u64;
                st.admitted += 1;
                st.admit_bytes += bytes;
            }
        }
        if let Some(o) = self.offload.as_ref() {
            o.stats.set(st);
        }
        self.check_host_experts(st.misses - misses0, picks);
        Ok(())
    }

    /// For a prefill pass of layer `i` whose `pairs` routed ids (indices of the experts held
    /// here; the shared expert after them; −1 for other GPUs' picks) are at `ids`: copy the
    /// experts they use into the staging stacks and return the stacks' products.
    pub(super) fn stage_experts(
        &self,
        i: usize,
        ids: &DevBuf<i32>,
        pairs: usize,
    ) -> Result<(Matvec, Matvec)> {
        let (lx, experts_gu, experts_down) = self.offloaded(i)?;
        let Some(o) = self.offload.as_ref() else {
            return Err(unsupported("the model offloads no experts".into()));
        };
        let g = &*self.gpu;
        let mut used = vec![false; lx.experts() + 1];
        for id in g.read(ids, pairs)? {
            if let Ok(e) = usize::try_from(id) {
                used[e] = true;
            }
        }
        let (stage_gu, stage_down) = (o.stage.0.pieces(), o.stage.1.pieces());
        let (cache_gu, cache_down) = (experts_gu.pieces(), experts_down.pieces());
        let bytes = lx.expert_bytes() as u64;
        let (mut host, mut dev) = (0, 0);
        let (host_gu, host_down) = (lx.gu.pieces(), lx.down.pieces());
        for e in (0..lx.experts()).filter(|&e| used[e]) {
            match lx.res.slot_of(e) {
                Some(c) => {
                    copy_matrices(g, &cache_gu, c, &stage_gu, e, 1)?;
                    copy_matrices(g, &cache_down, c, &stage_down, e, 1)?;
                    dev += bytes;
                }
                None => {
                    let Some(p) = lx.home_of(e) else {
                        return Err(unsupported(format!(
                            "expert {e} of layer {i} has no host copy"
                        )));
                    };
                    copy_matrices(g, &host_gu, p, &stage_gu, e, 1)?;
                    copy_matrices(g, &host_down, p, &stage_down, e, 1)?;
                    host += bytes;
                }
            }
        }
        if lx.stacked && used[lx.experts()] {
            let c = lx.res.slots();
            copy_matrices(g, &cache_gu, c, &stage_gu, lx.experts(), 1)?;
            copy_matrices(g, &cache_down, c, &stage_down, lx.experts(), 1)?;
        }
        o.add(|s| {
            s.staged_host_bytes += host;
            s.staged_device_bytes += dev;
        });
        Ok((o.stage.0.mv(), o.stage.1.mv()))
    }
}

#[cfg(test)]
mod tests {
    use super::{clean_copies, slots_for_bytes};

    #[test]
    fn cache_slots_from_bytes() {
        // 40 layers of 1 MiB experts, 256 per layer: 10 GiB hold 256 per layer, 5 GiB 128.
        let mib = 1 << 20;
        assert_eq!(slots_for_bytes(10 << 30, 40, mib, 256), 256);
        assert_eq!(slots_for_bytes(5 << 30, 40, mib, 256), 128);
        assert_eq!(slots_for_bytes(0, 40, mib, 256), 0);
        assert_eq!(slots_for_bytes(1 << 40, 40, mib, 256), 256);
    }

    #[test]
    fn clean_copies_take_the_host_memory_left() {
        // 40 layers of 1 MiB experts, 256 per layer, 128 cached: 5 GiB are outside the cache.
        let (mib, gib) = (1usize << 20, 1usize << 30);
        let copies = |room: usize| clean_copies(room, 40, mib, 256, 128);
        assert_eq!(copies(20 * gib), 128);
        assert_eq!(copies(5 * gib + 40 * 10 * mib), 10);
        assert_eq!(copies(5 * gib), 0);
        assert_eq!(copies(gib), 0);
        assert_eq!(clean_copies(1 << 40, 40, mib, 256, 0), 0);
    }
}
