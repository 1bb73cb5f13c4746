//! Several GPUs running one model in lock step (expert parallel: `deltamoe_model::gpu::Shard`).
//! The first GPU's [`CudaBackend`] runs on the engine's thread and gives the answers; each other
//! GPU's runs on a thread of its own and gets every call too (sequence slots, prefills, a step's
//! tokens, snapshots), so that all GPUs issue the same collectives in the same order. Sequence
//! state is the same on every GPU; each keeps its own copy, and its own snapshots.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use deltamoe_compute::cuda::comm::{Comm, CommId};
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{GdnPrefill, GpuModel, PrefillGemm, Shard};
use deltamoe_model::Logits;

use super::cuda::{cuda_err, CudaBackend};
use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{EngineError, Result};
use crate::sampler::SamplingParams;
use crate::sequence::SeqId;

/// Makes GPU `shard.rank()`'s part of the model on that GPU.
pub type MakeShard =
    dyn Fn(Arc<Gpu>, Shard) -> deltamoe_compute::cuda::Result<GpuModel> + Send + Sync;

/// What a GPU's thread holds: its backend and the snapshots it made, by key; `stop` ends it.
struct Member {
    backend: CudaBackend,
    saved: HashMap<u64, SavedState>,
    stop: bool,
}

type Job = Box<dyn FnOnce(&mut Member) + Send>;

/// A GPU other than the first: the thread that drives it, fed jobs in order.
struct Worker {
    jobs: Sender<Job>,
    thread: Option<JoinHandle<()>>,
}

/// The model on several GPUs of this process.
pub struct ShardedBackend {
    lead: CudaBackend,
    workers: Vec<Worker>,
    next_key: AtomicU64,
}

impl ShardedBackend {
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
        let mut workers = Vec::with_capacity(world - 1);
        let mut made = Vec::with_capacity(world - 1);
        let mut sizes = Vec::with_capacity(world - 1);
        for (rank, gpu) in gpus.iter().enumerate().skip(1) {
            let (jobs, rx) = mpsc::channel::<Job>();
            let (ready, ready_rx) = mpsc::channel::<Result<()>>();
            let (size, size_rx) = mpsc::channel::<usize>();
            let (gpu, make) = (gpu.clone(), make.clone());
            let thread = std::thread::Builder::new()
                .name(format!("gpu {rank}"))
                .spawn(move || {
                    let model = part(&gpu, id, (rank, world), &*make);
                    drop(make);
                    let Some(model) = send_ok(&ready, model) else {
                        return;
                    };
                    let Ok(slots) = size_rx.recv() else {
                        return;
                    };
                    let backend = CudaBackend::with_model(model, max_ctx, slots);
                    let Some(backend) = send_ok(&ready, backend) else {
                        return;
                    };
                    let mut m = Member {
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
        let lead = part(&gpus[0], id, (0, world), &*make);
        drop(make);
        let lead = lead.and_then(|m| {
            wait_all(&made)?;
            CudaBackend::with_model(m, max_ctx, max_seqs)
        })?;
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

    /// Sends `each` to every other GPU's thread; their replies come back through the receivers.
    fn broadcast(
        &self,
        each: impl Fn(&mut Member) -> Result<()> + Send + Sync + 'static,
    ) -> Vec<Receiver<Result<()>>> {
        let each = Arc::new(each);
        self.workers
            .iter()
            .map(|w| {
                let (tx, rx) = mpsc::channel();
                let f = each.clone();
                // A thread that is gone drops the job, and its receiver then reports it.
                let _ = w.jobs.send(Box::new(move |m: &mut Member| {
                    let _ = tx.send(f(m));
                }));
                rx
            })
            .collect()
    }

    /// The first GPU's `lead` result once every other GPU has done its part (the first error
    /// of any).
    fn with_all<R>(
        &mut self,
        lead: impl FnOnce(&mut CudaBackend) -> Result<R>,
        each: impl Fn(&mut CudaBackend) -> Result<()> + Send + Sync + 'static,
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

impl Drop for ShardedBackend {
    fn drop(&mut self) {
        for w in &mut self.workers {
            // Snapshots still held elsewhere keep senders to the thread: it is told to stop.
            let _ = w.jobs.send(Box::new(|m: &mut Member| m.stop = true));
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A snapshot on every GPU: the first GPU's here, the others' kept by their threads under
/// `key` until this is dropped.
struct Snapshots {
    lead: SavedState,
    key: u64,
    forget: Vec<Sender<Job>>,
}

impl Drop for Snapshots {
    fn drop(&mut self) {
        let key = self.key;
        for f in &self.forget {
            let _ = f.send(Box::new(move |m: &mut Member| {
                m.saved.remove(&key);
            }));
        }
    }
}

impl Backend for ShardedBackend {
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
        let removed = move |b: &mut CudaBackend| {
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
        let s = saved.state.downcast_ref::<Snapshots>();
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
        self.with_all(|b| b.step(rows), move |b| b.step_tokens(&fed))
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
        let set = move |b: &mut CudaBackend| {
            b.set_gdn_prefill(mode);
            Ok(())
        };
        let _ = self.with_all(set, set);
    }

    fn set_prefill_gemm(&mut self, mode: PrefillGemm) {
        let set = move |b: &mut CudaBackend| {
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
                "--cpu-experts needs offloaded experts, which run on one GPU: drop --gpus".into(),
            )),
        }
    }
}
