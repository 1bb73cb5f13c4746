//! Expert offload's CPU fallback: the host computes some of the experts outside the device
//! cache instead of the GPU reading their weights over PCIe.
//!
//! How many is the pure policy of [`crate::host_split`], fed with costs measured when the host
//! is enabled: the GPU's time to read one far expert, the host's to compute one and its fixed
//! cost per layer. Per row and layer, the router hands the host that many of the picks outside
//! the cache (its table, [`Route::host_take`](deltamoe_compute::cuda::ops::Route)) by writing
//! id `−1 − e` for expert e, the expert kernels skip those slots,
//! and per MoE layer the step hands the host its inputs through a mailbox of mapped pinned
//! memory (`host_experts_publish`, moe.cu) and waits for the outputs
//! (`host_experts_wait`) just before the combine. The host answers layer after layer while the
//! step's graph runs ([`GpuModel::serve_host_experts`], threads of [`super::host_team`]), with
//! the twins of the GPU's expert kernels ([`deltamoe_compute::cpu::gpu_twin`]): the same
//! operations in the same order, so the logits stay bitwise those of the all-resident model.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::format::DevFormat;
use super::host_store::{HostMat, LayerExperts};
use super::host_team::{run_rounds, Job, Out};
use super::{unsupported, GpuModel, Result, MAX_BATCH};
use crate::host_split::{self, Costs};
use deltamoe_compute::cpu::gpu_twin::{self, TwinMat};
use deltamoe_compute::cuda::host::HostBuf;
use deltamoe_compute::cuda::ops::{self, Mailbox, Slots};
use deltamoe_compute::cuda::{DevBuf, Gpu};

/// The GPU's cost per layer of handing a layer to the host and awaiting its answer even when
/// the host has nothing to compute: 4.2 µs on an H200 (0.168 ms per token over 40 layers, every
/// expert of Qwen3.6-35B-A3B cached). The host takes part only while it saves more.
const HANDOFF: f64 = 4.2e-6;

/// Decode steps between two checks of whether the host should take part.
const CHECK_EVERY: u64 = 16;

/// How long the host waits for the GPU to publish a layer before it reports the step failed.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// The mailbox and the host's side of the hand-off.
pub(crate) struct HostExperts {
    x: HostBuf<f32>,
    ids: HostBuf<i32>,
    y: HostBuf<f32>,
    flags: HostBuf<u32>,
    state: DevBuf<u32>,
    /// The router's table: of c picks outside the cache, the host takes `take[c]`.
    take: DevBuf<i32>,
    /// The sequence number of the last layer the host answered.
    served: Cell<u32>,
    costs: Costs,
    top_k: usize,
    /// Whether the host takes part (the step then has the hand-off kernels).
    pub(super) active: bool,
    /// Picks outside the cache and all picks since the last check, and the steps.
    window: (u64, u64, u64),
}

impl HostExperts {
    /// `miss`: the expected share of picks outside the cache, until one is observed.
    fn new(
        g: &Gpu,
        hidden: usize,
        (per_row, top_k): (usize, usize),
        costs: Costs,
        miss: f64,
    ) -> Result<HostExperts> {
        let table = host_split::table(top_k, costs);
        Ok(HostExperts {
            x: HostBuf::zeros(g, MAX_BATCH * hidden)?,
            ids: HostBuf::zeros(g, MAX_BATCH * per_row)?,
            y: HostBuf::zeros(g, MAX_BATCH * per_row * hidden)?,
            flags: HostBuf::zeros(g, 3)?,
            state: g.zeros(2)?,
            take: g.upload(&table)?,
            served: Cell::new(0),
            costs,
            top_k,
            active: worth_it(top_k, miss, costs),
            window: (0, 0, 0),
        })
    }

    pub(super) fn mailbox(&self) -> Mailbox {
        Mailbox {
            x: self.x.ptr(),
            ids: self.ids.ptr(),
            y: self.y.ptr(),
            flags: self.flags.ptr(),
            state: self.state.ptr(),
            take: self.take.ptr(),
        }
    }

    fn flag(&self, i: usize) -> &AtomicU32 {
        // SAFETY: flags holds 3 u32 words of pinned host memory that live as long as self; the
        // GPU writes words 0 and 2 and reads word 1, all through aligned 32-bit accesses.
        unsafe { AtomicU32::from_ptr(self.flags.as_slice().as_ptr().add(i) as *mut u32) }
    }

    pub(super) fn costs(&self) -> Costs {
        self.costs
    }
}

impl HostMat {
    /// Matrix `e` of the stack, for the host's kernels (which have no FP8 form).
    pub(super) fn twin(&self, e: usize) -> std::result::Result<TwinMat<'_>, gpu_twin::TwinError> {
        let (a, f) = (&self.arrays, self.fmt());
        let stack = match f.format {
            DevFormat::Fp8 { .. } => return Err(gpu_twin::TwinError::Shape(FP8_HOST.into())),
            DevFormat::Bf16 => TwinMat::Bf16(view(&a[0])),
            DevFormat::Affine {
                bits,
                group,
                params,
            } => TwinMat::Affine {
                words: view(&a[0]),
                scales: view(&a[1]),
                biases: view(&a[2]),
                bits,
                group,
                params,
            },
        };
        Ok(stack.row_range(f.k, e * f.n..(e + 1) * f.n))
    }
}

const FP8_HOST: &str = "--cpu-experts: the host computes bf16 and MLX affine experts, not FP8 \
     ones (leave the flag off; far FP8 experts are read by the GPU)";

/// A pinned array as `T`s (pinned allocations are page-aligned and each array of a format holds
/// whole `T`s, so the cast does not fail).
fn view<T: bytemuck::Pod>(a: &HostBuf<u8>) -> &[T] {
    bytemuck::try_cast_slice(a.as_slice()).unwrap_or_default()
}

/// Seconds the host takes to compute `n` experts of `lx` (at positions of its host stacks):
/// the median of 7 rounds after a warm-up, each on other experts (as at decode, their weights
/// are not in the CPU's caches).
fn time_host(lx: &LayerExperts, n: usize) -> Result<f64> {
    let positions = lx.host_positions();
    let x: Vec<f32> = (0..lx.gu.fmt().k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let mut out = vec![0f32; n * lx.gu.fmt().k];
    let sink = Out {
        ptr: out.as_mut_ptr(),
        len: out.len(),
    };
    let job = |r: usize| {
        Some(Job {
            lx,
            experts: (0..n).map(|i| (r * n + i) * 7 % positions).collect(),
            xs: vec![x.as_slice(); n],
            slots: (0..n).collect(),
        })
    };
    let mut times = run_rounds(8, sink, job, |_| {}).map_err(twin_err)?;
    times.remove(0);
    times.sort_by(f64::total_cmp);
    Ok(times.get(times.len() / 2).copied().unwrap_or(f64::INFINITY))
}

/// Whether handing experts to the host saves more than the hand-off costs at miss rate `miss`.
fn worth_it(top_k: usize, miss: f64, costs: Costs) -> bool {
    host_split::expected_gain(top_k, miss, costs) > HANDOFF
}

fn twin_err(e: gpu_twin::TwinError) -> deltamoe_compute::cuda::CudaError {
    unsupported(format!("host experts: {e}"))
}

impl GpuModel {
    /// Let the host compute experts outside the caches when the split policy finds that faster
    /// (`on`), or keep every far expert on the GPU (the default). Measures
    /// the costs the policy weighs: a far expert's read by the GPU and the host's time for one
    /// and two experts. A model that offloads nothing ignores it.
    pub fn set_host_experts(&mut self, on: bool) -> Result<()> {
        self.graphs.clear();
        let Some(o) = self.offload.as_mut() else {
            return Ok(());
        };
        o.host = None;
        o.host_wanted = on;
        let first = (0..self.layers.len()).find(|&i| self.layer_experts(i).is_some());
        let (true, Some(first)) = (on, first) else {
            return Ok(());
        };
        let (lx, ..) = self.offloaded(first)?;
        // Every expert cached: nothing to hand to the host.
        if lx.host_positions() == 0 {
            return Ok(());
        }
        let (one, two) = (time_host(lx, 1)?, time_host(lx, 2)?);
        let each = (two - one).max(one / 4.0);
        let link = self.time_far_expert(first)?;
        self.set_host_costs(Costs {
            link,
            fixed: (one - each).max(0.0),
            each,
        })
    }

    /// Let the host compute experts, the split policy weighing `costs` instead of measured ones
    /// (tests, reproducible runs). A model that offloads nothing ignores it.
    pub fn set_host_costs(&mut self, costs: Costs) -> Result<()> {
        self.graphs.clear();
        let (hidden, top_k) = (self.hidden, self.top_k);
        // Until misses are observed: each pick outside the cache as often as the cache is short.
        let short: Vec<f64> = (0..self.layers.len())
            .filter_map(|i| self.layer_experts(i))
            .map(|lx| 1.0 - lx.res.slots() as f64 / lx.experts().max(1) as f64)
            .collect();
        let miss = short.iter().sum::<f64>() / short.len().max(1) as f64;
        let fp8 = (0..self.layers.len())
            .filter_map(|i| self.layer_experts(i))
            .any(|lx| matches!(lx.gu.fmt().format, DevFormat::Fp8 { .. }));
        if fp8 {
            return Err(unsupported(FP8_HOST.into()));
        }
        let Some(o) = self.offload.as_mut() else {
            return Ok(());
        };
        o.host_wanted = true;
        let shape = (o.per_row, top_k);
        o.host = Some(HostExperts::new(&self.gpu, hidden, shape, costs, miss)?);
        Ok(())
    }

    /// After a step's uses were counted (`outside` of `picks` routed picks were outside the
    /// caches): every [`CHECK_EVERY`] steps, let the host take part or not by the miss rate seen.
    pub(super) fn check_host_experts(&mut self, outside: u64, picks: u64) {
        let Some(hx) = self.offload.as_mut().and_then(|o| o.host.as_mut()) else {
            return;
        };
        let w = &mut hx.window;
        *w = (w.0 + outside, w.1 + picks, w.2 + 1);
        if w.2 < CHECK_EVERY || w.1 == 0 {
            return;
        }
        let on = worth_it(hx.top_k, w.0 as f64 / w.1 as f64, hx.costs);
        hx.window = (0, 0, 0);
        if on != hx.active {
            hx.active = on;
            self.graphs.clear();
        }
    }

    /// The split policy's costs when the host computes experts.
    pub fn host_expert_costs(&self) -> Option<Costs> {
        Some(self.offload.as_ref()?.host.as_ref()?.costs())
    }

    /// Seconds the GPU takes to read and apply one far expert of layer `i` (gate/up and down of
    /// four experts read from the host stacks at once, per expert; the best of 3 rounds).
    fn time_far_expert(&self, i: usize) -> Result<f64> {
        let (lx, experts_gu, experts_down) = self.offloaded(i)?;
        let (g, s, inter) = (&*self.gpu, &self.scratch, experts_gu.n / 2);
        let positions = lx.host_positions();
        if positions == 0 {
            return Ok(f64::INFINITY);
        }
        let mut best = f64::INFINITY;
        let (a, b) = (g.timer()?, g.timer()?);
        for round in 0..4 {
            let ids: Vec<i32> = (0..4)
                .map(|j| (lx.split() + (round * 4 + j) % positions) as i32)
                .collect();
            let ids = g.upload(&ids)?;
            g.mark(&a)?;
            let gu = Slots::experts(4, ids.ptr(), 0, 1).with_far(Some(lx.far_gu()));
            ops::matvec_swiglu(g, experts_gu.mv(), s.normed.ptr(), s.ffn.h.ptr(), gu)?;
            let dn = Slots::experts(4, ids.ptr(), inter, 1).with_far(Some(lx.far_down()));
            ops::matvec(g, experts_down.mv(), s.ffn.h.ptr(), s.ffn.y.ptr(), dn)?;
            g.mark(&b)?;
            g.sync()?;
            // The first round warms the kernels up.
            if round > 0 {
                best = best.min(g.elapsed_ms(&a, &b)? as f64 / 1e3 / 4.0);
            }
        }
        Ok(best)
    }

    /// The mailbox, when this step hands experts to the host.
    pub(super) fn active_mailbox(&self) -> Option<Mailbox> {
        let hx = self.offload.as_ref()?.host.as_ref()?;
        hx.active.then(|| hx.mailbox())
    }

    /// While a `b`-row step runs: answer each offloaded layer's hand-off in turn, computing the
    /// experts its router sent to the host. Returns the seconds spent computing.
    pub(super) fn serve_host_experts(&self, b: usize) -> Result<f64> {
        let Some(o) = self.offload.as_ref() else {
            return Ok(0.0);
        };
        let Some(hx) = o.host.as_ref().filter(|h| h.active) else {
            return Ok(0.0);
        };
        let (per_row, hidden) = (o.per_row, self.hidden);
        let layers: Vec<&LayerExperts> = (0..self.layers.len())
            .filter_map(|i| self.layer_experts(i))
            .collect();
        let base = hx.served.get();
        let (published, answered) = (hx.flag(0), hx.flag(1));
        let (ids, x) = (hx.ids.as_slice(), hx.x.as_slice());
        let timeout = Mutex::new(None);
        let next = |r: usize| {
            let seq = base.wrapping_add(r as u32 + 1);
            let t0 = Instant::now();
            loop {
                let p = published.load(Ordering::Acquire);
                if p == seq {
                    break;
                }
                // The GPU waits for every layer's answer, so it can never be ahead.
                if p.wrapping_sub(seq) as i32 > 0 || t0.elapsed() > PUBLISH_TIMEOUT {
                    if let Ok(mut t) = timeout.lock() {
                        *t = Some(r);
                    }
                    return None;
                }
                std::hint::spin_loop();
            }
            let mut job = Job {
                lx: layers[r],
                experts: Vec::new(),
                xs: Vec::new(),
                slots: Vec::new(),
            };
            for (s, &id) in ids[..b * per_row].iter().enumerate() {
                if id < 0 {
                    let row = s / per_row;
                    job.experts.push((-1 - id) as usize);
                    job.xs.push(&x[row * hidden..(row + 1) * hidden]);
                    job.slots.push(s);
                }
            }
            Some(job)
        };
        let finish = |r: usize| answered.store(base.wrapping_add(r as u32 + 1), Ordering::Release);
        let out = Out {
            ptr: hx.y.as_slice().as_ptr() as *mut f32,
            len: hx.y.len(),
        };
        let done = run_rounds(layers.len(), out, next, finish);
        let times = match done {
            Ok(t) if t.len() == layers.len() => t,
            // The GPU must not wait for answers that will not come: the failure flag stops
            // its waits; the step is reported failed and the counters resynchronized.
            _ => {
                hx.flag(2).store(1, Ordering::Release);
                done.map_err(twin_err)?
            }
        };
        hx.served.set(base.wrapping_add(times.len() as u32));
        if let Some(r) = timeout.into_inner().ok().flatten() {
            return Err(unsupported(format!(
                "the GPU did not hand offloaded layer {r}'s experts to the host in step (waited up to {} s)",
                PUBLISH_TIMEOUT.as_secs()
            )));
        }
        Ok(times.iter().sum())
    }

    /// After a step completed: whether the GPU gave up waiting for the host.
    pub(super) fn host_experts_failed(&self) -> Result<()> {
        let Some(hx) = self.offload.as_ref().and_then(|o| o.host.as_ref()) else {
            return Ok(());
        };
        if hx.flag(2).load(Ordering::Acquire) != 0 {
            // Start the next step in step with the GPU's counter.
            let counter = self.gpu.read(&hx.state, 1)?;
            hx.served.set(counter[0]);
            hx.flag(2).store(0, Ordering::Release);
            return Err(unsupported(
                "the GPU stopped waiting for experts computed on the host; the step's results are void"
                    .into(),
            ));
        }
        Ok(())
    }
}
