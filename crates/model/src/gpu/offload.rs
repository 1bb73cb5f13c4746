//! Expert offload: running a model whose routed experts do not fit on the GPU.
//!
//! Every routed expert of an offloaded MoE layer lives in pinned host memory mapped into the
//! device's address space (a "far" stack, same layout as the device stacks); `slots` of them are
//! cached in the layer's device stacks, which hold `[cache slots | shared expert (when stacked)]`.
//! A device table `loc[E]` says where each expert is: its cache slot, or `split + e` for host
//! expert e (`split` = slots + stacked shared). The router writes ids through `loc`, and the
//! expert kernels read ids ≥ split from the far stack over PCIe (see `ops::Far`): a decode step
//! stays one CUDA graph with no host sync, and the result does not depend on where a weight was
//! read from, so logits are bitwise those of the all-resident model.
//!
//! Between steps the routed ids of every layer (copied to pinned memory at the end of the step)
//! feed the residency policy ([`crate::residency`]); its swaps run in stream order before the next
//! step: point the evicted expert's `loc` at the host, copy the admitted expert into the slot,
//! point its `loc` at the slot. Prefill passes route many tokens to most experts, so they copy the
//! experts their tokens use (cached ones on the device, the others over PCIe) into a staging
//! stack of all experts and run the grouped kernels on it.

use std::cell::Cell;

use deltamoe_compute::cuda::host::HostBuf;
use deltamoe_compute::cuda::ops::{Far, Matvec};
use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::host_experts::HostExperts;
use super::upload::{array_bytes, StackData};
use super::{unsupported, DevMat, DevWeights, GpuFfn, GpuModel, Result, MAX_BATCH};
use crate::layers::LinearWeight;
use crate::residency::{Policy, Residency};

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

/// Device memory an offloaded model leaves free for sequence state and activations when it
/// sizes its caches.
pub const STATE_RESERVE: usize = 8 << 30;

/// Cache slots per layer for `bytes` of cache over `layers` layers of experts of `slot_bytes`.
pub fn slots_for_bytes(bytes: usize, layers: usize, slot_bytes: usize, experts: usize) -> usize {
    (bytes / (layers * slot_bytes).max(1)).min(experts)
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
    /// Bytes copied into the prefill staging stacks over PCIe / on the device.
    pub staged_host_bytes: u64,
    pub staged_device_bytes: u64,
}

impl OffloadStats {
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }

    /// Bytes over PCIe per decoded token (far reads and admissions).
    pub fn pcie_bytes_per_token(&self) -> f64 {
        (self.far_bytes + self.admit_bytes) as f64 / self.tokens.max(1) as f64
    }
}

/// Weights in pinned host memory, in the device layout of [`DevWeights`].
pub(crate) enum HostWeights {
    Bf16(HostBuf<u16>),
    Affine {
        words: HostBuf<u32>,
        scales: HostBuf<u16>,
        biases: HostBuf<u16>,
        bits: u32,
        group: usize,
    },
}

/// A stack of `count` same-shaped `[n, k]` matrices in pinned host memory.
pub(crate) struct HostMat {
    pub(super) w: HostWeights,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) count: usize,
}

impl HostMat {
    fn pin(g: &Gpu, data: StackData, n: usize, k: usize, count: usize) -> Result<HostMat> {
        let w = match data {
            StackData::Bf16(b) => HostWeights::Bf16(HostBuf::from_slice(g, &b)?),
            StackData::Affine {
                words,
                scales,
                biases,
                bits,
                group,
            } => HostWeights::Affine {
                words: HostBuf::from_slice(g, &words)?,
                scales: HostBuf::from_slice(g, &scales)?,
                biases: HostBuf::from_slice(g, &biases)?,
                bits,
                group,
            },
        };
        Ok(HostMat { w, n, k, count })
    }

    /// The far-stack arguments for ids from `split` on.
    fn far(&self, split: usize) -> Far {
        match &self.w {
            HostWeights::Bf16(b) => Far {
                w: b.ptr(),
                scales: 0,
                biases: 0,
                split,
            },
            HostWeights::Affine {
                words,
                scales,
                biases,
                ..
            } => Far {
                w: words.ptr(),
                scales: scales.ptr(),
                biases: biases.ptr(),
                split,
            },
        }
    }

    /// (bits, group) of affine weights.
    fn affine(&self) -> Option<(u32, usize)> {
        match &self.w {
            HostWeights::Bf16(_) => None,
            HostWeights::Affine { bits, group, .. } => Some((*bits, *group)),
        }
    }

    /// (base address, bytes per matrix) of each array.
    fn pieces(&self) -> Vec<(u64, usize)> {
        let ptrs = match &self.w {
            HostWeights::Bf16(b) => vec![b.ptr()],
            HostWeights::Affine {
                words,
                scales,
                biases,
                ..
            } => vec![words.ptr(), scales.ptr(), biases.ptr()],
        };
        ptrs.into_iter()
            .zip(array_bytes(self.n, self.k, self.affine()))
            .collect()
    }

    /// Bytes of one row of one matrix.
    pub(super) fn row_bytes(&self) -> usize {
        self.matrix_bytes() / self.n.max(1)
    }

    fn matrix_bytes(&self) -> usize {
        array_bytes(self.n, self.k, self.affine()).iter().sum()
    }

    /// A zeroed device stack of `count` matrices of this format.
    fn device_stack(&self, g: &Gpu, count: usize) -> Result<DevMat> {
        let nk = self.n * self.k;
        let w = match &self.w {
            HostWeights::Bf16(_) => DevWeights::Bf16(g.zeros(count * nk)?),
            HostWeights::Affine { bits, group, .. } => DevWeights::Affine {
                words: g.zeros(count * nk * *bits as usize / 32)?,
                scales: g.zeros(count * nk / group)?,
                biases: g.zeros(count * nk / group)?,
                bits: *bits,
                group: *group,
            },
        };
        Ok(DevMat {
            w,
            n: self.n,
            k: self.k,
            bias: None,
        })
    }
}

/// Copy matrix `from` of `src` to matrix `to` of `dst` (same format), in stream order.
fn copy_matrix(
    g: &Gpu,
    src: &[(u64, usize)],
    from: usize,
    dst: &[(u64, usize)],
    to: usize,
) -> Result<()> {
    for (&(s, bytes), &(d, _)) in src.iter().zip(dst) {
        // SAFETY: both stacks hold matrices `from` / `to` of `bytes` bytes per array (indices
        // checked by the callers against the stack counts) and outlive the stream's work.
        unsafe { g.copy_raw(d + (to * bytes) as u64, s + (from * bytes) as u64, bytes)? };
    }
    Ok(())
}

/// The offloaded experts of one MoE layer.
pub(crate) struct LayerExperts {
    /// `[gate | up]` and down of every routed expert (then the shared one, when stacked).
    pub(super) gu: HostMat,
    pub(super) down: HostMat,
    /// Where each routed expert is: its cache slot or split + e (outside the cache: read over
    /// PCIe, or handed to the host by the router); and the host's copy of that table.
    loc: DevBuf<i32>,
    loc_host: Vec<i32>,
    pub(super) res: Residency,
    pub(super) experts: usize,
    stacked: bool,
}

impl LayerExperts {
    /// From the stacked parts of a loaded model (`experts` routed ones, then the shared expert
    /// when `stacked`).
    pub(super) fn new(
        g: &Gpu,
        gu: &[&LinearWeight],
        down: &[&LinearWeight],
        inter: usize,
        hidden: usize,
        experts: usize,
        stacked: bool,
    ) -> Result<LayerExperts> {
        let count = experts + stacked as usize;
        let gu = HostMat::pin(g, StackData::of(gu), 2 * inter, hidden, count)?;
        let down = HostMat::pin(g, StackData::of(down), hidden, inter, count)?;
        LayerExperts::from_host(g, gu, down, experts, stacked)
    }

    pub(super) fn from_host(
        g: &Gpu,
        gu: HostMat,
        down: HostMat,
        experts: usize,
        stacked: bool,
    ) -> Result<LayerExperts> {
        Ok(LayerExperts {
            gu,
            down,
            loc: g.zeros(experts)?,
            loc_host: vec![0; experts],
            res: Residency::new(experts, 0, Policy::default()),
            experts,
            stacked,
        })
    }

    /// Device stacks with no cache slots (only the stacked shared expert), until
    /// [`GpuModel::set_expert_cache`] sizes them.
    pub(super) fn empty_cache(&self, g: &Gpu) -> Result<(DevMat, DevMat)> {
        let n = self.stacked as usize;
        Ok((self.gu.device_stack(g, n)?, self.down.device_stack(g, n)?))
    }

    pub(super) fn split(&self) -> usize {
        self.res.slots() + self.stacked as usize
    }

    /// Bytes of one expert (`[gate | up]` and down).
    fn expert_bytes(&self) -> usize {
        self.gu.matrix_bytes() + self.down.matrix_bytes()
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

    /// Copy host expert `e` into matrix `to` of the device stacks.
    fn load(&self, g: &Gpu, cache: (&DevMat, &DevMat), e: usize, to: usize) -> Result<()> {
        copy_matrix(g, &self.gu.pieces(), e, &cache.0.pieces(), to)?;
        copy_matrix(g, &self.down.pieces(), e, &cache.1.pieces(), to)
    }

    /// Where expert `e` is now, as the router's `loc` table says it.
    fn locate(&self, e: usize) -> i32 {
        match self.res.slot_of(e) {
            Some(c) => c as i32,
            None => (self.split() + e) as i32,
        }
    }

    /// Point `loc[e]` at where expert `e` is now (in stream order).
    fn relocate(&mut self, g: &Gpu, e: usize) -> Result<()> {
        let v = self.locate(e);
        if self.loc_host[e] != v {
            g.set_i32(&self.loc, e, v)?;
            self.loc_host[e] = v;
        }
        Ok(())
    }

    /// Size the cache to `slots` (experts 0..slots cached) and fill it.
    fn resize(&mut self, g: &Gpu, slots: usize, gu: &mut DevMat, down: &mut DevMat) -> Result<()> {
        let slots = slots.min(self.experts);
        // Free the old stacks before allocating the new ones.
        *gu = self.gu.device_stack(g, 0)?;
        *down = self.down.device_stack(g, 0)?;
        let n = slots + self.stacked as usize;
        *gu = self.gu.device_stack(g, n)?;
        *down = self.down.device_stack(g, n)?;
        self.res = Residency::new(self.experts, slots, Policy::default());
        for c in 0..n {
            // Slot `slots` holds the shared expert (host index `experts`).
            let e = if c < slots { c } else { self.experts };
            self.load(g, (gu, down), e, c)?;
        }
        self.loc_host = (0..self.experts).map(|e| self.locate(e)).collect();
        g.write(&mut self.loc, &self.loc_host)
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
        match &self.layers[i].ffn {
            GpuFfn::Moe { offload, .. } => offload.as_deref(),
            GpuFfn::Dense { .. } => None,
        }
    }

    /// Layer `i`'s offloaded experts and its device stacks (the cache).
    pub(super) fn offloaded(&self, i: usize) -> Result<(&LayerExperts, &DevMat, &DevMat)> {
        match &self.layers[i].ffn {
            GpuFfn::Moe {
                experts_gu,
                experts_down,
                offload: Some(lx),
                ..
            } => Ok((lx, experts_gu, experts_down)),
            _ => Err(unsupported(format!("layer {i} has no offloaded experts"))),
        }
    }

    /// Size the expert caches of an offloaded model (one built with offload; see
    /// [`ExpertCache`]) and fill them. Returns the cache slots per layer.
    pub fn set_expert_cache(&mut self, spec: ExpertCache) -> Result<usize> {
        let g = self.gpu.clone();
        let first = (0..self.layers.len()).find_map(|i| self.layer_experts(i));
        let Some(lx) = first else {
            return Ok(self.num_experts);
        };
        let (experts, slot_bytes) = (lx.experts, lx.expert_bytes());
        let count = lx.gu.count;
        let layers = (0..self.layers.len())
            .filter(|&i| self.layer_experts(i).is_some())
            .count();
        if self.offload.is_none() {
            let (gu, down) = (&lx.gu, &lx.down);
            let stage = (gu.device_stack(&g, count)?, down.device_stack(&g, count)?);
            let per_row = self.top_k + lx.stacked as usize;
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
        self.graphs.clear();
        let mut host_on = false;
        if let Some(o) = self.offload.as_mut() {
            o.pending = None;
            o.host = None;
            host_on = o.host_wanted;
        }
        let (free, total) = g.mem_info()?;
        // What the caches may take: the free memory less the state reserve (and within the
        // model's budget for GpuMemory).
        let room = free.saturating_sub(STATE_RESERVE);
        let slots = match spec {
            ExpertCache::All => experts,
            ExpertCache::Fraction(f) => ((f.clamp(0.0, 1.0) * experts as f64).round()) as usize,
            ExpertCache::Bytes(b) => slots_for_bytes(b, layers, slot_bytes, experts),
            ExpertCache::GpuMemory(budget) => {
                let used = total - free;
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
        for l in &mut self.layers {
            if let GpuFfn::Moe {
                experts_gu,
                experts_down,
                offload: Some(lx),
                ..
            } = &mut l.ffn
            {
                lx.resize(&g, slots, experts_gu, experts_down)?;
            }
        }
        g.sync()?;
        if host_on {
            self.set_host_experts(true)?;
        }
        Ok(slots)
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
            _ => self.scratch.ids.ptr(),
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
        for (i, l) in self.layers.iter_mut().enumerate() {
            let GpuFfn::Moe {
                experts_gu,
                experts_down,
                offload: Some(lx),
                ..
            } = &mut l.ffn
            else {
                continue;
            };
            let split = lx.split();
            let (mut used, mut missed, mut host) = (Vec::new(), Vec::new(), 0);
            for r in 0..b {
                for &id in &ids[i * len + r * per_row..][..top_k] {
                    if id < 0 {
                        let e = (-1 - id) as usize;
                        used.push(e);
                        missed.push(e);
                        host += 1;
                    } else if id as usize >= split {
                        used.push(id as usize - split);
                        missed.push(id as usize - split);
                    } else if let Some(e) = lx.res.expert_in(id as usize) {
                        used.push(e);
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
                lx.load(&g, (experts_gu, experts_down), s.expert, s.slot)?;
                lx.res.apply(s);
                if let Some(v) = s.evicted {
                    lx.relocate(&g, v)?;
                }
                lx.relocate(&g, s.expert)?;
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

    /// For a prefill pass of layer `i` whose `pairs` routed ids (expert indices; the shared
    /// expert at index E) are at `ids`: copy the experts they use into the staging stacks and
    /// return the stacks' products.
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
        let mut used = vec![false; lx.experts + 1];
        for id in g.read(ids, pairs)? {
            used[id as usize] = true;
        }
        let (stage_gu, stage_down) = (o.stage.0.pieces(), o.stage.1.pieces());
        let (cache_gu, cache_down) = (experts_gu.pieces(), experts_down.pieces());
        let bytes = lx.expert_bytes() as u64;
        let (mut host, mut dev) = (0, 0);
        for e in (0..lx.experts).filter(|&e| used[e]) {
            match lx.res.slot_of(e) {
                Some(c) => {
                    copy_matrix(g, &cache_gu, c, &stage_gu, e)?;
                    copy_matrix(g, &cache_down, c, &stage_down, e)?;
                    dev += bytes;
                }
                None => {
                    copy_matrix(g, &lx.gu.pieces(), e, &stage_gu, e)?;
                    copy_matrix(g, &lx.down.pieces(), e, &stage_down, e)?;
                    host += bytes;
                }
            }
        }
        if lx.stacked && used[lx.experts] {
            let c = lx.res.slots();
            copy_matrix(g, &cache_gu, c, &stage_gu, lx.experts)?;
            copy_matrix(g, &cache_down, c, &stage_down, lx.experts)?;
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
    use super::slots_for_bytes;

    #[test]
    fn cache_slots_from_bytes() {
        // 40 layers of 1 MiB experts, 256 per layer: 10 GiB hold 256 per layer, 5 GiB 128.
        let mib = 1 << 20;
        assert_eq!(slots_for_bytes(10 << 30, 40, mib, 256), 256);
        assert_eq!(slots_for_bytes(5 << 30, 40, mib, 256), 128);
        assert_eq!(slots_for_bytes(0, 40, mib, 256), 0);
        assert_eq!(slots_for_bytes(1 << 40, 40, mib, 256), 256);
    }
}
