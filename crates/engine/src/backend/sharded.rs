//! Several GPUs running one model in lock step (expert parallel: `deltamoe_model::gpu::Shard`).
//! The first GPU's backend runs on the engine's thread and gives the answers; each other GPU's
//! runs on a thread of its own and gets every call too (sequence slots, prefills, a step's
//! tokens, snapshots), so that all GPUs issue the same collectives in the same order. Sequence
//! state is the same on every GPU; each keeps its own copy, and its own snapshots. The lock step
//! is generic over the members' backend ([`Member`]); the CPU backend stands in for GPUs in its
//! tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use deltamoe_compute::cuda::comm::{Comm, CommId};
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{GdnPrefill, GpuModel, OffloadStats, PrefillGemm, Shard};
use deltamoe_model::Logits;

use super::cuda::{cuda_err, CudaBackend};
use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{EngineError, Result};
use crate::sampler::SamplingParams;
use crate::sequence::SeqId;

/// Makes GPU `shard.rank()`'s part of the model on that GPU.
pub type MakeShard =
    dyn Fn(Arc<Gpu>, Shard) -> deltamoe_compute::cuda::Result<GpuModel> + Send + Sync;

/// What the lock step needs of each member's backend beyond [`Backend`]: the first member
/// answers through `Backend`, the others only feed.
pub trait Member: Backend + 'static {
    /// Feeds each (sequence, token) as [`Backend::step`] does, without picking.
    fn feed_tokens(&mut self, rows: &[(SeqId, u32)]) -> Result<()>;
}

/// How a member other than the first is made, on its own thread: its model first, then, once
/// the first member has reserved its sequence slots, the backend with as many.
pub type Build<B> = Box<dyn FnOnce() -> Result<Reserve<B>> + Send>;

/// The second half of a [`Build`]: the backend with room for the given number of sequences.
pub type Reserve<B> = Box<dyn FnOnce(usize) -> Result<B>>;

/// What a member's thread holds: its backend and the snapshots it made, by key; `stop` ends it.
struct Slot<B> {
    backend: B,
    saved: HashMap<u64, SavedState>,
    stop: bool,
}

type Job<B> = Box<dyn FnOnce(&mut Slot<B>) + Send>;

/// A member other than the first: the thread that drives it, fed jobs in order.
struct Worker<B> {
    jobs: Sender<Job<B>>,
    thread: Option<JoinHandle<()>>,
}

/// The model on several GPUs of this process (members of backend `B`).
pub struct ShardedBackend<B: Member = CudaBackend> {
    lead: B,
    workers: Vec<Worker<B>>,
    next_key: AtomicU64,
}

impl ShardedBackend<CudaBackend> {
    /// Joins `gpus` (the first leads) in one communicator, has `make` build each GPU's part on
    /// its thread, and reserves state for `max_seqs` sequences of `max_ctx` tokens on each (0:
    /// as many as the first GPU's free memory holds; the others then reserve as many).
    pub fn new(
        gpus: Vec<Arc<Gpu>>,
        make: Arc<MakeShard>,
        max_ctx: usize,
        max_seqs: usize,
    ) -> Result<ShardedBackend> {
        let world = gpus.len();
        let id = CommId::new().map_err(cuda_err)?;
        let others = gpus
            .iter()
            .enumerate()
            .skip(1)
            .map(|(rank, gpu)| {
                let (gpu, make) = (gpu.clone(), make.clone());
                let build: Build<CudaBackend> = Box::new(move || {
                    let model = part(&gpu, id, (rank, world), &*make)?;
                    drop(make);
                    Ok(Box::new(move |slots| {
                        CudaBackend::with_model(model, max_ctx, slots)
                    }))
                });
                build
            })
            .collect();
        let lead = || {
            let model = part(&gpus[0], id, (0, world), &*make)?;
            CudaBackend::with_model(model, max_ctx, max_seqs)
        };
        ShardedBackend::start(lead, others)
    }
}

impl<B: Member> ShardedBackend<B> {
    /// Starts a thread for each of `others` (members 1, 2, …) and makes the first member with
    /// `lead` meanwhile; the others then reserve as many sequence slots as it did.
    pub fn start(lead: impl FnOnce() -> Result<B>, others: Vec<Build<B>>) -> Result<Self> {
        let mut workers = Vec::with_capacity(others.len());
        let mut made = Vec::with_capacity(others.len());
        let mut sizes = Vec::with_capacity(others.len());
        for (i, build) in others.into_iter().enumerate() {
            let (jobs, rx) = mpsc::channel::<Job<B>>();
            let (ready, ready_rx) = mpsc::channel::<Result<()>>();
            let (size, size_rx) = mpsc::channel::<usize>();
            let thread = std::thread::Builder::new()
                .name(format!("gpu {}", i + 1))
                .spawn(move || {
                    let Some(reserve) = send_ok(&ready, build()) else {
                        return;
                    };
                    let Ok(slots) = size_rx.recv() else {
                        return;
                    };
                    let Some(backend) = send_ok(&ready, reserve(slots)) else {
                        return;
                    };
                    let mut m = Slot {
                        backend,
                        saved: HashMap::new(),
                        stop: false,
                    };
                    for job in rx.iter() {
                        job(&mut m);
                        if m.stop {
                            break;
                        }
                    }
                })
                .map_err(|e| EngineError::Input(format!("starting a GPU thread: {e}")))?;
            workers.push(Worker {
                jobs,
                thread: Some(thread),
            });
            made.push(ready_rx);
            sizes.push(size);
        }
        let lead = lead().and_then(|b| wait_all(&made).map(|_| b))?;
        let slots = lead.free_sequences().unwrap_or(0);
        for s in &sizes {
            let _ = s.send(slots);
        }
        wait_all(&made)?;
        Ok(ShardedBackend {
            lead,
            workers,
            next_key: AtomicU64::new(0),
        })
    }

    /// Sends `each` to every other member's thread; their replies come back through the
    /// receivers.
    fn broadcast<R: Send + 'static>(
        &self,
        each: impl Fn(&mut Slot<B>) -> R + Send + Sync + 'static,
    ) -> Vec<Receiver<R>> {
        let each = Arc::new(each);
        self.workers
            .iter()
            .map(|w| {
                let (tx, rx) = mpsc::channel();
                let f = each.clone();
                // A thread that is gone drops the job, and its receiver then reports it.
                let _ = w.jobs.send(Box::new(move |m: &mut Slot<B>| {
                    let _ = tx.send(f(m));
                }));
                rx
            })
            .collect()
    }

    /// The first member's `lead` result once every other member has done its part (the first
    /// error of any).
    fn with_all<R>(
        &mut self,
        lead: impl FnOnce(&mut B) -> Result<R>,
        each: impl Fn(&mut B) -> Result<()> + Send + Sync + 'static,
    ) -> Result<R> {
        let replies = self.broadcast(move |m| each(&mut m.backend));
        let out = lead(&mut self.lead);
        wait_all(&replies)?;
        out
    }
}

/// GPU `rank`'s part: it joins communicator `id`, then `make` builds its model.
fn part(
    gpu: &Arc<Gpu>,
    id: CommId,
    (rank, world): (usize, usize),
    make: &MakeShard,
) -> Result<GpuModel> {
    let comm = Comm::join(gpu, id, rank, world).map_err(cuda_err)?;
    make(gpu.clone(), Shard::new(comm)).map_err(cuda_err)
}

/// Passes `r`'s outcome to the thread that waits on `to`, and its value on to the caller.
fn send_ok<T>(to: &Sender<Result<()>>, r: Result<T>) -> Option<T> {
    match r {
        Ok(v) => {
            let _ = to.send(Ok(()));
            Some(v)
        }
        Err(e) => {
            let _ = to.send(Err(e));
            None
        }
    }
}

/// One reply from each receiver: the first error, or a thread that went away.
fn wait_all(replies: &[Receiver<Result<()>>]) -> Result<()> {
    let mut first = Ok(());
    for rx in replies {
        let r = rx.recv().unwrap_or_else(|_| {
            Err(EngineError::Input(
                "a GPU's thread stopped: its model or state failed".into(),
            ))
        });
        if first.is_ok() {
            first = r;
        }
    }
    first
}

impl<B: Member> Drop for ShardedBackend<B> {
    fn drop(&mut self) {
        for w in &mut self.workers {
            // Snapshots still held elsewhere keep senders to the thread: it is told to stop.
            let _ = w.jobs.send(Box::new(|m: &mut Slot<B>| m.stop = true));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A snapshot on every GPU: the first GPU's here, the others' kept by their threads under
/// `key` until this is dropped.
struct Snapshots<B: Member> {
    lead: SavedState,
    key: u64,
    forget: Vec<Sender<Job<B>>>,
}

impl<B: Member> Drop for Snapshots<B> {
    fn drop(&mut self) {
        let key = self.key;
        for f in &self.forget {
            let _ = f.send(Box::new(move |m: &mut Slot<B>| {
                m.saved.remove(&key);
            }));
        }
    }
}

impl<B: Member> Backend for ShardedBackend<B> {
    fn name(&self) -> String {
        format!("{} × {}", self.lead.name(), self.workers.len() + 1)
    }

    fn free_sequences(&self) -> Option<usize> {
        self.lead.free_sequences()
    }

    fn sequence_bytes(&self, ctx: usize) -> usize {
        self.lead.sequence_bytes(ctx)
    }

    fn add(&mut self, id: SeqId) -> Result<()> {
        self.with_all(|b| b.add(id), move |b| b.add(id))
    }

    fn remove(&mut self, id: SeqId) {
        let removed = move |b: &mut B| {
            b.remove(id);
            Ok(())
        };
        let _ = self.with_all(removed, removed);
    }

    fn snapshot(&self, id: SeqId) -> Result<SavedState> {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let replies = self.broadcast(move |m| {
            let s = m.backend.snapshot(id)?;
            m.saved.insert(key, s);
            Ok(())
        });
        let lead = self.lead.snapshot(id);
        let forget = self.workers.iter().map(|w| w.jobs.clone()).collect();
        wait_all(&replies)?;
        let lead = lead?;
        Ok(SavedState {
            bytes: lead.bytes * (self.workers.len() + 1),
            state: Box::new(Snapshots { lead, key, forget }),
        })
    }

    fn restore(&mut self, id: SeqId, saved: &SavedState) -> Result<()> {
        let s = saved.state.downcast_ref::<Snapshots<B>>();
        let s = s.ok_or_else(wrong_backend)?;
        let key = s.key;
        let replies = self.broadcast(move |m| {
            let snap = m.saved.get(&key).ok_or_else(wrong_backend)?;
            m.backend.restore(id, snap)
        });
        let out = self.lead.restore(id, &s.lead);
        wait_all(&replies)?;
        out
    }

    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let fed = tokens.to_vec();
        self.with_all(
            |b| b.prefill(id, tokens, chunk, which),
            move |b| b.prefill(id, &fed, chunk, Logits::Last).map(|_| ()),
        )
    }

    fn set_sampling(&mut self, id: SeqId, p: &SamplingParams) -> Result<()> {
        let q = p.clone();
        self.with_all(|b| b.set_sampling(id, p), move |b| b.set_sampling(id, &q))
    }

    fn step(&mut self, rows: &mut [StepRow]) -> Result<Vec<u32>> {
        let fed: Vec<(SeqId, u32)> = rows.iter().map(|r| (r.id, r.token)).collect();
        self.with_all(|b| b.step(rows), move |b| b.feed_tokens(&fed))
    }

    fn set_speculative(&mut self, drafts: usize) -> Result<()> {
        match drafts {
            0 => Ok(()),
            _ => Err(EngineError::Input(
                "speculative decoding runs on one GPU: drop --speculative-tokens or --gpus".into(),
            )),
        }
    }

    fn force_acceptance(&mut self, _p: f64) -> Result<()> {
        self.set_speculative(1)
    }

    fn set_gdn_prefill(&mut self, mode: GdnPrefill) {
        let set = move |b: &mut B| {
            b.set_gdn_prefill(mode);
            Ok(())
        };
        let _ = self.with_all(set, set);
    }

    fn set_prefill_gemm(&mut self, mode: PrefillGemm) {
        let set = move |b: &mut B| {
            b.set_prefill_gemm(mode);
            Ok(())
        };
        let _ = self.with_all(set, set);
    }

    fn comm_seconds(&mut self, rows: usize) -> Result<Option<f64>> {
        self.with_all(
            |b| b.comm_seconds(rows),
            move |b| b.comm_seconds(rows).map(|_| ()),
        )
    }

    fn set_host_experts(&mut self, on: bool) -> Result<()> {
        match on {
            false => Ok(()),
            true => Err(EngineError::Input(
                "--cpu-experts runs on one GPU: drop it or --gpus".into(),
            )),
        }
    }

    /// Every GPU's expert offload together (see `OffloadStats::with`).
    fn offload_stats(&self) -> Option<OffloadStats> {
        let replies = self.broadcast(|m| m.backend.offload_stats());
        let lead = self.lead.offload_stats();
        replies
            .iter()
            .map(|rx| rx.recv().ok().flatten())
            .fold(lead, |a, b| match (a, b) {
                (Some(a), Some(b)) => Some(a.with(b)),
                (a, b) => a.or(b),
            })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;

    use deltamoe_model::{Logits, Qwen3Hybrid};

    use super::{Build, ShardedBackend};
    use crate::backend::cpu::CpuBackend;
    use crate::backend::Backend;
    use crate::error::EngineError;
    use crate::{Engine, SeqId};

    fn model() -> Qwen3Hybrid {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5_moe");
        Qwen3Hybrid::load(&dir).unwrap()
    }

    fn member() -> Build<CpuBackend> {
        Box::new(|| Ok(Box::new(|_| Ok(CpuBackend::new(model())))))
    }

    fn three() -> ShardedBackend<CpuBackend> {
        ShardedBackend::start(|| Ok(CpuBackend::new(model())), vec![member(), member()]).unwrap()
    }

    /// Each other member's logits for `tok` after sequence `id`'s history.
    fn members_next(b: &ShardedBackend<CpuBackend>, id: SeqId, tok: u32) -> Vec<Vec<f32>> {
        let (tx, rx) = mpsc::channel();
        let replies = b.broadcast(move |m| {
            let l = m.backend.prefill(id, &[tok], 1, Logits::Last)?;
            tx.send(l).map_err(|e| EngineError::Input(e.to_string()))
        });
        super::wait_all(&replies).unwrap();
        rx.iter().take(replies.len()).collect()
    }

    /// Three CPU members in lock step answer as one backend does, bit for bit: prefills, single
    /// and batched steps, a restored snapshot.
    #[test]
    fn members_in_lock_step_answer_as_one_backend() {
        let cfg = model().config().clone();
        let mut one = Engine::new(model());
        let mut many = Engine::with_backend(cfg, Box::new(three()), 4096);
        assert_eq!(many.backend_name(), "cpu × 3");
        let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % 500).collect();
        let mut ids = Vec::new();
        for e in [&mut one, &mut many] {
            let id = e.add_sequence().unwrap();
            let logits = e.prefill(id, &prompt, Some(7), Logits::All).unwrap();
            ids.push((id, logits));
        }
        assert_eq!(ids[0].1, ids[1].1, "prefill logits");
        let (a, b) = (ids[0].0, ids[1].0);
        let snap = (one.snapshot(a).unwrap(), many.snapshot(b).unwrap());
        let (mut ta, mut tb) = (vec![1u32], vec![1u32]);
        for _ in 0..6 {
            ta = one.step(&[(a, ta[0])]).unwrap();
            tb = many.step(&[(b, tb[0])]).unwrap();
            assert_eq!(ta, tb, "greedy steps");
        }
        let (ra, rb) = (
            one.restore(&snap.0).unwrap(),
            many.restore(&snap.1).unwrap(),
        );
        let batch = |e: &mut Engine, ids: [SeqId; 2]| e.step(&[(ids[0], 3), (ids[1], 4)]).unwrap();
        assert_eq!(
            batch(&mut one, [a, ra]),
            batch(&mut many, [b, rb]),
            "batched step"
        );
    }

    /// After a member's calls every member holds the lead's state: the next token's logits
    /// are the same on each.
    #[test]
    fn every_member_holds_the_same_state() {
        let mut b = three();
        let id = SeqId(1);
        b.add(id).unwrap();
        let prompt: Vec<u32> = (0..17).map(|i| (i * 11 + 2) % 500).collect();
        b.prefill(id, &prompt, 5, Logits::Last).unwrap();
        let want = b.lead.prefill(id, &[9], 1, Logits::Last).unwrap();
        let got = members_next(&b, id, 9);
        assert_eq!(got.len(), 2);
        for g in got {
            assert_eq!(g, want, "a member's state");
        }
    }

    /// A member that fails to start fails the start; a call a member refuses is refused; and
    /// dropping the backend while a snapshot it made is still held ends its threads.
    #[test]
    fn failures_reach_the_caller_and_dropping_ends_the_threads() {
        let failing: Build<CpuBackend> =
            Box::new(|| Err(EngineError::Input("member 2 failed".into())));
        let lead = || Ok(CpuBackend::new(model()));
        let e = ShardedBackend::start(lead, vec![member(), failing])
            .err()
            .unwrap();
        assert_eq!(e.to_string(), "member 2 failed");
        let mut b = three();
        let err = b.prefill(SeqId(7), &[1], 1, Logits::Last).unwrap_err();
        assert!(err.to_string().contains("sequence 7"), "{err}");
        b.add(SeqId(1)).unwrap();
        let snap = b.snapshot(SeqId(1)).unwrap();
        drop(b);
        drop(snap);
    }
}
